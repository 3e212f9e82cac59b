"""Stage1's network: the actor-critic heads that every model ends with, after the layers past the cut."""

from __future__ import annotations

import torch
from torch import nn

from ..ppo import Categorical, TanhGaussian, clamp_log_std
from .layers import layer_init

__all__ = ["ActorCriticHeads", "SCORING_ROWS"]


SCORING_ROWS = 64
"""Acting for several groups at once scores a batch of a multiple of this many rows (`ActorCriticHeads.evaluate`'s
``parts``). torch's elementwise CPU loops take two SIMD vectors a step and leave the rest of a tensor (fewer than
two vectors' worth) to scalar code (aten/src/ATen/native/cpu/Loops.h, ``vectorized_loop``), and on AVX2 and
AVX-512 CPUs the two paths' ``softplus`` and ``log1p`` can differ in the last bits (docs/benchmarks/capacity.md), so
unpadded, a row's log-prob would depend on how many rows come with it. 64 rows of any action width fill whole
pairs of AVX-512 (and so AVX2) vectors: every element takes the SIMD path, whose lanes compute alike, and a row
gets one result in any batch. The padding costs a few elementwise ops on 64 rows, where scoring each group alone
would cost a call of the distribution's ops per group."""


class ActorCriticHeads(nn.Module):
    """Stage1's network: an optional trunk (the layers after the cut), actor and critic.

    Box actions: the actor is a tanh-squashed Gaussian with a state-independent
    log-std clamped to [-5, 2]; actions are handled pre-tanh (see `TanhGaussian`).
    Discrete actions (``discrete``): the actor's last layer gives ``action_dim``
    logits of a `Categorical` (CleanRL's ``ppo_atari.py``: std 0.01 init) and there
    is no log-std. Either way ``actor_mean`` names the actor and `outputs` returns
    its (B, action_dim) output, so the replica exchange and the checkpoints see the
    same layout; an action is a pre-tanh ``u`` (B, A) float32 or an index (B,) int64.
    """

    def __init__(self, trunk: nn.Module, feature_dim: int, action_dim: int, hidden: int = 512,
                 init_log_std: float = 0.0, discrete: bool = False, input_dim: int | None = None) -> None:
        super().__init__()
        self.trunk = trunk
        self.input_dim = feature_dim if input_dim is None else input_dim
        """The width of the features the heads are given at a cut after the first layer: the trunk's input (the
        layers past the cut, or an autoencoder's decoder, take it to ``feature_dim``)."""
        self.discrete = discrete
        self.critic = nn.Sequential(
            layer_init(nn.Linear(feature_dim, hidden)), nn.Tanh(), layer_init(nn.Linear(hidden, 1), std=1.0)
        )
        self.actor_mean = nn.Sequential(
            layer_init(nn.Linear(feature_dim, hidden)), nn.Tanh(), layer_init(nn.Linear(hidden, action_dim), std=0.01)
        )
        if not discrete:
            self.actor_logstd = nn.Parameter(torch.full((action_dim,), float(init_log_std)))

    def get_value(self, x: torch.Tensor) -> torch.Tensor:
        return self.critic(self.trunk(x)).squeeze(-1)

    def outputs(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Everything the loss takes from the features: (actor output (B, A): mean or logits, value (B,))."""
        hidden = self.trunk(x)
        return self.actor_mean(hidden), self.critic(hidden).squeeze(-1)

    def distribution(self, mean: torch.Tensor) -> TanhGaussian | Categorical:
        """The policy given the actor's output ``mean`` (`outputs`)."""
        if self.discrete:
            return Categorical(mean)
        return TanhGaussian(mean, clamp_log_std(self.actor_logstd))

    def evaluate(
        self, mean: torch.Tensor, value: torch.Tensor, action: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(action, log-prob, entropy, value) from `outputs`; samples the action when ``action`` is None.

        The action is the pre-tanh u (B, A) for Box actions, the index (B,) for discrete ones."""
        dist = self.distribution(mean)
        if action is None:
            action = dist.sample(generator)
        return action, dist.log_prob(action), dist.entropy(), value

    def act(self, mean: torch.Tensor, parts: list[tuple[int, torch.Generator | None]]
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """The rollout's (action, log-prob) from the actor's output ``mean`` (`outputs`), its rows in consecutive
        ``parts`` (size, generator: groups acted for together), each part's draw its own call (torch fills a large
        normal tensor block-wise, so a draw of the whole batch would give other numbers) and the scoring done on
        the rows padded to a multiple of `SCORING_ROWS`, which gives a row the numbers it gets in any batch: a
        group's numbers are those it gets acting alone. (No entropy: acting does not use it.)"""
        sizes = [size for size, _ in parts]
        if sum(sizes) != len(mean):
            raise ValueError(f"parts of {sizes} rows for a batch of {len(mean)}")
        action = self.distribution(mean).sample_parts(parts)
        rows = len(mean)
        padded = -(-rows // SCORING_ROWS) * SCORING_ROWS

        def pad(t: torch.Tensor) -> torch.Tensor:
            return torch.cat([t, t.new_zeros((padded - rows,) + tuple(t.shape[1:]))]) if padded > rows else t

        return action, self.distribution(pad(mean)).log_prob(pad(action))[:rows]

    def get_action_and_value(
        self, x: torch.Tensor, action: torch.Tensor | None = None, generator: torch.Generator | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """CleanRL's call: (action, log-prob, entropy, value) for features ``x`` (see `evaluate`)."""
        return self.evaluate(*self.outputs(x), action, generator)

    def wire_action(self, action: torch.Tensor) -> torch.Tensor:
        """What stage0 is sent for ``action``: tanh(u) in [-1, 1] (B, A) float32 for Box actions (stage0 maps
        it onto the Box), the index itself (B,) int64 for discrete ones."""
        return action.long() if self.discrete else torch.tanh(action)
