"""One PPO update of stage1's heads, in CleanRL's order (``ppo_continuous_action.py``) and names.

For every minibatch of every epoch:

1. `PPOUpdate.loss`: the heads' log-probabilities, entropy and values of the minibatch's actions; the
   advantages normalised over the minibatch (``norm_adv``); decoupled PPO's corrections where an older
   policy acted (`splitrl.stages.decoupled.DecoupledPPO.correct`); then CleanRL's clipped objective,
   ``loss = pg_loss - ent_coef * entropy_loss + vf_coef * v_loss``, with its diagnostics ``approx_kl``,
   ``old_approx_kl`` and ``clipfrac`` (`splitrl.ppo.ppo_loss`), kept per minibatch in `stats`
   (``losses/clipfrac`` is CleanRL's ``clipfracs``).
2. ``loss.backward()``: the training exchange (`splitrl.stages.exchange`) takes it through the heads and
   sends the gradient at the cut to stage0, whose encoder takes it on (stage1 alone, with the cut before
   the first layer: `splitrl.stages.learner.Learner.train_alone`).
3. `PPOUpdate.step`: the gradients summed over stage1's learners (`splitrl.stages.learners`), clipped to
   ``max_grad_norm``, and the optimizer's step; a log-std below ``--log-std-floor`` is set back to it.

After each epoch, `PPOUpdate.stop_early` is CleanRL's ``target_kl``. The advantages and returns come from
GAE when training begins (`splitrl.ppo.compute_gae`).

A minibatch may be taken in parts (micro-batches, a fleet edge's share): each part's loss and statistics are
weighted by its share of the minibatch, so that the parts' gradients and statistics add up to the whole
minibatch's; its statistics are kept once it is whole.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any, Callable

import torch
from torch import nn

from ..devices import update_threads
from ..models import ActorCriticHeads
from ..ppo import LOG_STD_MIN, LOSS_STATS, RolloutBuffer, adam, ppo_loss
from ..settings import PPOSettings
from .decoupled import DecoupledPPO
from .learners import Learners

__all__ = ["PPOUpdate"]


class PPOUpdate:
    """The optimizer of ``params`` (the heads' trainable ones), the decoupled-PPO state and the iteration's
    statistics. ``learners``: the learners this one steps in step with, as they are now."""

    def __init__(self, heads: ActorCriticHeads, params: list[nn.Parameter], ppo: PPOSettings,
                 learners: Callable[[], Learners]) -> None:
        self.heads, self.params, self.ppo, self.learners = heads, params, ppo, learners
        spread = getattr(heads, "actor_logstd", None)
        spread = spread if any(p is spread for p in params) else None  # a Box policy's, trained here
        groups: list[dict] = [{"params": [p for p in params if p is not spread or not ppo.lr_log_std]}]
        if spread is not None and ppo.lr_log_std:  # its own group only when its rate is its own
            groups.append({"params": [spread], "lr": ppo.lr_log_std})
        self.optimizer = adam(groups, lr=ppo.lr_heads, fused=ppo.fused_adam)
        self.floored = spread if ppo.log_std_floor > LOG_STD_MIN else None
        """The policy's log-std when it has a floor above the clamp's (``--log-std-floor``), else None."""
        self.decoupled = DecoupledPPO()
        self.stats: dict[str, list[float]] = defaultdict(list)
        """Each minibatch's statistics (and anything else the iteration logs as a mean), by key."""
        self._parts: dict[str, float] = {}
        """The statistics of the minibatch being taken in parts, weighted by each part's share so far."""

    def anneal(self, fraction: float) -> None:
        """Each parameter group's learning rate at ``fraction`` of its setting (CleanRL's ``--anneal-lr``)."""
        rates = [self.ppo.lr_heads, self.ppo.lr_log_std]
        for group, rate in zip(self.optimizer.param_groups, rates):
            group["lr"] = rate * fraction

    def loss(self, buffer: RolloutBuffer, idx: torch.Tensor, mean: torch.Tensor, value: torch.Tensor,
             minibatch: torch.Tensor | None = None) -> torch.Tensor:
        """The PPO loss of samples ``idx`` of ``buffer`` given the heads' outputs on their inputs (``mean``,
        ``value``); ``minibatch``: the whole minibatch when ``idx`` is a part of it. Its statistics are kept."""
        loss, stats = self.measure(buffer, idx, mean, value, minibatch)
        self.keep(stats, idx, minibatch)
        return loss

    def measure(self, buffer: RolloutBuffer, idx: torch.Tensor, mean: torch.Tensor, value: torch.Tensor,
                minibatch: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
        """`loss` without keeping its statistics: (the loss, weighted by the part's share of ``minibatch``; its
        statistics), for `keep` to keep in the parts' order (a part's loss taken on a worker thread)."""
        ppo = self.ppo
        whole = idx if minibatch is None else minibatch
        advantages = buffer.b_advantages[idx]
        if ppo.norm_adv and len(whole) > 1:  # (one sample has no spread: a fleet's minibatch after drops)
            everything = buffer.b_advantages[whole]
            advantages = (advantages - everything.mean()) / (everything.std() + 1e-8)
        _, newlogprob, entropy, newvalue = self.heads.evaluate(mean, value, buffer.b_actions[idx])
        advantages, behaviour, old_values = self.decoupled.correct(
            idx, newlogprob, newvalue, advantages, buffer.b_logprobs[idx], buffer.b_values[idx])
        loss, stats = ppo_loss(
            newlogprob, behaviour, advantages, newvalue, old_values, buffer.b_returns[idx], entropy,
            clip_coef=ppo.clip_coef, vf_coef=ppo.vf_coef, ent_coef=ppo.ent_coef,
            clip_vloss=ppo.clip_vloss, norm_adv=False,
        )
        total = float(loss.detach())  # (its statistics were read back already: no extra wait on a device)
        if not math.isfinite(total):  # refused before its statistics join the minibatch's
            raise FloatingPointError(f"the PPO loss of these {len(idx)} samples is {total}")
        return (loss if minibatch is None else loss * (len(idx) / len(minibatch))), stats

    def keep(self, stats: dict[str, float], idx: torch.Tensor, minibatch: torch.Tensor | None = None) -> None:
        """The statistics `measure` gave for samples ``idx``: the minibatch's, or a part's share of them."""
        if minibatch is None:
            for key, v in stats.items():
                self.stats[key].append(v)
            return
        share = len(idx) / len(minibatch)
        for key, v in stats.items():
            self._parts[key] = self._parts.get(key, 0.0) + v * share

    def _minibatch_done(self) -> None:
        """The statistics of a minibatch taken in parts, as one entry (each is linear in the samples; summed over
        the learners)."""
        for key, v in self.learners().sum_stats(self._parts, LOSS_STATS).items():
            self.stats[key].append(v)
        self._parts.clear()

    def step(self) -> None:
        """The minibatch's optimizer step, with the gradients its loss left (summed over the learners)."""
        self._minibatch_done()
        self.learners().sum_gradients(self.params)
        with update_threads(self.params[0].device):
            norm = float(nn.utils.clip_grad_norm_(self.params, self.ppo.max_grad_norm))
            if not math.isfinite(norm):  # clipping would zero every gradient: a run that learns nothing, silently
                raise FloatingPointError(f"the heads' gradient has an L2 norm of {norm} after a minibatch: the "
                                         f"losses of its samples overflowed (the last: {self._last_losses()})")
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            if self.floored is not None:  # a projected step: Adam's moments go on as they are
                with torch.no_grad():
                    self.floored.clamp_(min=self.ppo.log_std_floor)

    def _last_losses(self) -> str:
        keys = ("losses/policy_loss", "losses/value_loss")
        return ", ".join(f"{k} {self.stats[k][-1]:g}" for k in keys if self.stats.get(k)) or "none kept"

    def stop_early(self) -> bool:
        """CleanRL's ``--target-kl``: after an epoch, whether the approximate KL of its last minibatch exceeds the
        target, so that the iteration's epochs end here."""
        self._minibatch_done()
        target = self.ppo.target_kl
        kls = self.stats["losses/approx_kl"][-1:]
        stop = target > 0 and bool(kls) and kls[0] > target
        if stop:
            self.stats["losses/early_stop"].append(1.0)
        return stop

    def score(self, x: torch.Tensor, actions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The heads' log-probabilities of ``actions`` and values on inputs ``x``, without a graph."""
        with torch.no_grad():
            _, logprob, _, value = self.heads.evaluate(*self.heads.outputs(x), actions)
        return logprob, value.reshape(-1)

    def score_stored(self, inputs: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        """The heads' log-probability of ``actions`` on stored inputs shaped (T, N, ...), by rows."""
        t, n = inputs.shape[:2]
        flat = inputs.reshape((t * n,) + inputs.shape[2:])
        flat_actions = actions.reshape((t * n,) + actions.shape[2:])
        logprobs = [self.score(flat[rows], flat_actions[rows])[0] for rows in torch.arange(t * n).split(512)]
        return torch.cat(logprobs).reshape(t, n)

    def iteration_stats(self, rollout_stats: dict[str, float]) -> dict[str, Any]:
        """Mean statistics over the iteration's minibatches with ``rollout_stats``; starts the next count."""
        stats: dict[str, Any] = {k: sum(v) / len(v) for k, v in self.stats.items() if v}
        stats.update(rollout_stats)
        self.stats.clear()
        return stats
