"""Decoupled PPO for samples an older policy acted on, and the ``--rescore`` pass that feeds it.

The asynchronous schedule acts with the newest finished policy while the next one trains, so a
sample may have been acted on by an older policy mu than the one that trains on it. For such a
*lagging* sample (Hilton et al. 2021, "Batch size-invariance for policy optimization"):

- its value target is importance-weighted by min(1, pi / mu) (`splitrl.ppo.importance_weights`,
  V-trace style in `splitrl.ppo.compute_gae`), pi scored by the heads that start training;
- PPO's ratio is clipped against a *proximal* policy, the network that trains as it first sees the
  sample this iteration, and the advantage carries min(1, pi_prox / mu);
- the value clip is centred on the proximal network's value too: clipped against the acting
  network's values, a critic that moved more than clip_coef since then gets no gradient there.

Their values stay the acting network's: the heads that train paired with features of the older
encoder that the rollout sent are no network that ever was, and on CarRacing their values differed
from the acting ones by about a quarter of a normalised return, enough noise to stall learning
(docs/benchmarks/pipeline.md, "Learning"). Scoring with the current encoder needs another pass of
those samples across the link, which ``--rescore`` makes.

Without ``--rescore`` pi is scored on the features the rollout sent, and the proximal policy and
values are taken the first time a minibatch holds the sample (NaN until then). With ``--rescore``
stage0 sent every sample's features under its current encoder before training (`Rescore`): the
network that starts training scored them all, so its log-probabilities are the proximal policy from
the first minibatch on, and its values the baseline of the advantages, of the value targets and of
the value clip. The bootstrap values after the rollout's last step and at truncations stay the
acting network's either way.

`DecoupledPPO` holds this state for the rollout being trained on; `splitrl.stages.update.PPOUpdate`
asks it to `correct` each minibatch's loss inputs.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..ppo import RolloutBuffer, importance_weights
from ..transport import ProtocolError

__all__ = ["DecoupledPPO", "Rescore"]


class Rescore:
    """``--rescore``: one rollout's samples scored again by the network that starts its training (NaN until
    `set` fills them; flat, as the buffer's ``b_*``)."""

    def __init__(self, iteration: int, samples: int, device: torch.device | str = "cpu") -> None:
        self.iteration = iteration
        self.logprobs = torch.full((samples,), float("nan"), device=device)
        self.values = torch.full((samples,), float("nan"), device=device)

    def set(self, idx: torch.Tensor, logprobs: torch.Tensor, values: torch.Tensor) -> None:
        self.logprobs[idx], self.values[idx] = logprobs, values

    def check(self, iteration: int) -> None:
        """`ProtocolError` unless every sample of ``iteration``'s rollout was scored."""
        if self.iteration != iteration or bool(self.logprobs.isnan().any()):
            raise ProtocolError(f"iteration {iteration}: the rollout was not scored again before its training "
                                f"(--rescore; scored: iteration {self.iteration}, "
                                f"{int(self.logprobs.isnan().sum())} samples missing)")


class DecoupledPPO:
    """Which samples of the rollout being trained on lag, and their proximal policy and values."""

    def __init__(self) -> None:
        self.lagging = torch.zeros(0, dtype=torch.bool)
        """Which samples of the rollout being trained on an older policy acted on (flat, as ``b_*``)."""
        self.proximal: torch.Tensor | None = None
        """The proximal log-probabilities of those samples (NaN until a minibatch first holds one); None when
        none lags."""
        self.proximal_values: torch.Tensor | None = None
        """And the proximal network's values of them, the centre of their value clip."""
        self.rescored: Rescore | None = None
        """``--rescore``: the rollout being scored again, until its training begins."""

    def begin(self, iteration: int, lag: torch.Tensor, buffer: RolloutBuffer,
              score: Callable[[], torch.Tensor]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Start training on ``iteration``'s rollout whose samples lag ``lag`` versions (T, N): the importance
        weights of its value targets and the baseline of its advantages (None: plain GAE, the acting values).
        ``score``: the training heads' log-probabilities of the stored samples (T, N), asked for only when some
        lag and no rescore scored them."""
        self.proximal, self.proximal_values = None, None
        self.lagging = (lag > 0).reshape(-1)
        rescored, self.rescored = self.rescored, None
        weights, baseline = None, None
        if rescored is not None:
            rescored.check(iteration)
            baseline = rescored.values.reshape(lag.shape)
        if bool(self.lagging.any()):
            if rescored is not None:
                logprob = rescored.logprobs.reshape(lag.shape)
                self.proximal, self.proximal_values = rescored.logprobs.clone(), rescored.values.clone()
            else:
                logprob = score()
                self.proximal = torch.full_like(self.lagging, float("nan"), dtype=torch.float32)
                self.proximal_values = torch.full_like(self.lagging, float("nan"), dtype=torch.float32)
            weights = importance_weights(logprob, buffer.logprobs, lag > 0)
        return weights, baseline

    def correct(self, idx: torch.Tensor, newlogprob: torch.Tensor, newvalue: torch.Tensor,
                advantages: torch.Tensor, behaviour: torch.Tensor,
                old_values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Samples ``idx``'s (advantages, log-probabilities the ratio is taken against, centres of the value clip):
        as given where a sample does not lag, decoupled PPO's where it does."""
        if self.proximal is None:  # no sample lags
            return advantages, behaviour, old_values
        assert self.proximal_values is not None
        prox = torch.where(torch.isnan(self.proximal[idx]), newlogprob.detach(), self.proximal[idx])
        prox_v = torch.where(torch.isnan(self.proximal_values[idx]), newvalue.detach(), self.proximal_values[idx])
        self.proximal[idx], self.proximal_values[idx] = prox, prox_v
        lagging = self.lagging[idx]
        advantages = torch.where(lagging, advantages * (prox - behaviour).exp().clamp(max=1.0), advantages)
        behaviour = torch.where(lagging, prox, behaviour)
        old_values = torch.where(lagging, prox_v, old_values)
        return advantages, behaviour, old_values
