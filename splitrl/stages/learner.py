"""Stage1's compute: the actor-critic heads and the PPO learner.

`Learner` owns no link (Sample Factory's learner/worker split): it acts on the
rollout messages stage0 sends, finishes the rollout with GAE, and takes one PPO
loss per minibatch from whatever the training exchange hands it
(`splitrl.stages.exchange`). A schedule (`splitrl.schedule`) decides when.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import Any

import torch
from torch import nn

from ..codecs import CodecSet, Context
from ..envs import EnvSpec
from ..models import build_agent
from ..ppo import RolloutBuffer, explained_variance, minibatch_schedule, ppo_loss
from ..settings import TrainSettings
from ..transport import Message, ProtocolError
from .protocol import Payload, tensor

__all__ = ["Learner"]

log = logging.getLogger(__name__)


class Learner:
    """Heads + PPO. With the cut before the first layer it also keeps the rollout's
    inputs and trains alone (`train_alone`); otherwise each minibatch's inputs arrive."""

    def __init__(self, settings: TrainSettings, spec: EnvSpec) -> None:
        self.settings, self.spec = settings, spec
        ppo = settings.ppo
        stage0_net, self.heads = build_agent(spec.obs_shape, spec.action_dim, settings.cut, settings.seed, ppo.init_log_std)
        self.params = list(self.heads.parameters())
        self.optimizer = torch.optim.Adam(self.params, lr=ppo.lr_heads, eps=1e-5)
        self.generator = torch.Generator().manual_seed(settings.seed)
        n, t = settings.env.num_envs, ppo.num_steps
        self.buffer = RolloutBuffer(t, n, spec.action_dim)
        self.trains_alone = not any(True for _ in stage0_net.parameters())
        self.inputs = torch.zeros((t, n) + spec.obs_shape, dtype=torch.uint8) if self.trains_alone else None
        self.feature_dim = self.heads.critic[0].in_features
        self.codecs = CodecSet(**settings.codecs.specs())
        self.all_envs = torch.arange(n)
        self.iteration = 0
        self.stats: dict[str, list[float]] = defaultdict(list)

    def global_step(self, t: int = 0) -> int:
        """stage0's env-step count when it sent rollout step ``t`` of this iteration."""
        return (self.iteration - 1) * self.settings.steps_per_iteration + t * self.settings.env.num_envs

    def _input(self, msg: Message, ctx: Context, name: str = "features") -> torch.Tensor:
        """Decode stage0's rollout features (pixels with the cut before the first layer) for ``ctx``'s rows."""
        rows = len(ctx.idx if ctx.idx is not None else ctx.envs)
        if self.trains_alone:
            shape, dtype = (rows,) + self.spec.obs_shape, torch.uint8
        else:
            shape, dtype = (rows, self.feature_dim), torch.float32
        return self.codecs.unpack("rollout", name, msg.tensors, msg.header, ctx, shape, dtype)

    # -- rollout ---------------------------------------------------------------------
    def begin_rollout(self, iteration: int) -> None:
        self.iteration = iteration
        self.codecs.new_iteration()

    def act(self, t: int, msg: Message) -> Payload:
        """Record the outcome that rides on step ``t``'s message, then sample the policy's action."""
        n = self.settings.env.num_envs
        with torch.no_grad():
            if t > 0:
                self._record_outcome(t - 1, msg)
            ctx = Context(idx=t * n + self.all_envs, envs=self.all_envs, global_step=self.global_step(t))
            x = self._input(msg, ctx)
            u, logprob, _, value = self.heads.get_action_and_value(x, generator=self.generator)
        self.buffer.add(t, actions=u, logprobs=logprob, values=value)
        if self.inputs is not None:
            self.inputs[t] = x
        return {"action": torch.tanh(u)}, {"t": t}

    def end_rollout(self, msg: Message) -> None:
        """The last outcome and the bootstrap value: advantages and returns for the whole rollout."""
        ppo = self.settings.ppo
        with torch.no_grad():
            self._record_outcome(ppo.num_steps - 1, msg)
            ctx = Context(envs=self.all_envs, global_step=self.global_step(ppo.num_steps))
            last_value = self.heads.get_value(self._input(msg, ctx))
        self.buffer.finish(last_value, ppo.gamma, ppo.gae_lambda)

    def _record_outcome(self, step: int, msg: Message) -> None:
        n = self.settings.env.num_envs
        reward = tensor(msg, "reward", (n,), torch.float32)
        terminated = tensor(msg, "terminated", (n,), torch.bool)
        truncated = tensor(msg, "truncated", (n,), torch.bool)
        final_values = torch.zeros(n)
        if "final_index" in msg.tensors:
            index = msg.tensors["final_index"]
            if index.dtype != torch.int64 or index.dim() != 1 or not bool(((index >= 0) & (index < n)).all()):
                raise ProtocolError(f"{msg.kind}: final_index: expected int64 env indices in [0, {n}), got {index}")
            ctx = Context(envs=index, global_step=self.global_step(step + 1))
            final_values[index] = self.heads.get_value(self._input(msg, ctx, "final_features"))
        self.buffer.add_outcome(step, rewards=reward, terminated=terminated, truncated=truncated, final_values=final_values)

    # -- training --------------------------------------------------------------------
    def minibatches(self) -> list[list[torch.Tensor]]:
        """This iteration's minibatch indices, per epoch: the same on both stages."""
        ppo = self.settings.ppo
        return minibatch_schedule(self.settings.seed, self.iteration, ppo.epochs, self.buffer.batch_size, ppo.minibatches)

    def loss(self, idx: torch.Tensor, mean: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """The PPO loss of samples ``idx`` given the heads' outputs on their inputs; its statistics are kept."""
        b, ppo = self.buffer, self.settings.ppo
        _, newlogprob, entropy, newvalue = self.heads.evaluate(mean, value, b.b_actions[idx])
        loss, stats = ppo_loss(
            newlogprob, b.b_logprobs[idx], b.b_advantages[idx], newvalue, b.b_values[idx], b.b_returns[idx], entropy,
            clip_coef=ppo.clip_coef, vf_coef=ppo.vf_coef, ent_coef=ppo.ent_coef,
            clip_vloss=ppo.clip_vloss, norm_adv=ppo.norm_adv,
        )
        for key, v in stats.items():
            self.stats[key].append(v)
        return loss

    def optimizer_step(self) -> None:
        nn.utils.clip_grad_norm_(self.params, self.settings.ppo.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def train_alone(self, minibatches: list[torch.Tensor]) -> None:
        """One epoch on the stored rollout inputs (the cut before the first layer: no traffic)."""
        flat = self.inputs.reshape((-1,) + self.spec.obs_shape)
        for idx in minibatches:
            self.loss(idx, *self.heads.outputs(flat[idx])).backward()
            self.optimizer_step()

    def iteration_stats(self) -> dict[str, Any]:
        """Mean losses over the iteration's minibatches and the explained variance; starts the next count."""
        stats: dict[str, Any] = {k: sum(v) / len(v) for k, v in self.stats.items() if v}
        stats["losses/explained_variance"] = explained_variance(self.buffer.b_values, self.buffer.b_returns)
        self.stats.clear()
        return stats

    def state_dict(self) -> dict[str, Any]:
        return {"iteration": self.iteration, "heads": self.heads.state_dict(), "optimizer": self.optimizer.state_dict()}
