"""The action a trained policy takes when it does not sample: its greedy play, as a torch module.

A Box policy is a tanh-squashed Gaussian whose draws are then mapped onto the env's bounds (`splitrl.envs.
to_env_action`). The mean of the Gaussian, squashed and mapped, is a poor stand-in for that policy: with
CarRacing's ``clip`` map a brake whose mean is negative never brakes at all, though its draws brake part of the
time. Three principled choices are offered (`GREEDY_RULES`), each a function of the actor's output alone:

- ``expected``: the expected env action over the policy's draws, E[map(tanh(u))], u ~ N(mean, std^2), each
  dimension by the trapezoid rule on ``nodes`` evenly spaced points within 6 std of the mean, weighted by the
  normal density (the mass beyond is 2e-9). The clip's kink defeats Gauss-Hermite quadrature (its error falls as
  1 / nodes); evenly spaced points keep the trapezoid's 1 / nodes^2: within 1.2e-4 of the integral at 257 points
  for any std up to e (tests/models/test_greedy.py);
- ``mode``: the most likely action of the squashed distribution, tanh(u*), where u* solves
  u = mean + 2 std^2 tanh(u) (the zero of d/du [log N(u) + log (1 / (1 - tanh(u)^2))]), found by fixed-point
  iteration from the mean: a contraction while 2 std^2 < 1, which a policy whose log-std is under log(1/sqrt(2))
  satisfies; beyond it the iteration settles on the mode on the mean's side;
- ``mean``: tanh of the mean, mapped.

Discrete policies take the largest logit whatever the rule. The module is plain tensor maths, so TorchScript and
ONNX export it with the heads (`splitrl.export`).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from ..ppo import clamp_log_std
from ..settings.specs import DEFAULT_GREEDY, GREEDY_RULES
from .heads import ActorCriticHeads

__all__ = ["GREEDY_RULES", "DEFAULT_GREEDY", "GreedyAction", "GreedyPolicy"]

_MODE_STEPS = 64
"""Fixed-point steps of ``mode``: at 2 std^2 = 0.74 (the paper's initial log-std of -0.5) the error shrinks by
0.74 a step, to 1e-8 of the start after 64."""


class GreedyAction(nn.Module):
    """The env action (B, A) float32, or (B,) int64 for a Discrete space, from the actor's output (B, A).

    ``low``/``high``: the env's bounds (`splitrl.envs.EnvSpec`); ``action_map``: 'clip' or 'affine'
    (`splitrl.envs.to_env_action`); ``log_std``: the policy's (A,) log-std (None for a discrete policy).
    """

    def __init__(self, low: tuple[float, ...], high: tuple[float, ...], action_map: str, rule: str = DEFAULT_GREEDY,
                 log_std: torch.Tensor | None = None, discrete: bool = False, nodes: int = 257) -> None:
        super().__init__()
        if rule not in GREEDY_RULES:
            raise ValueError(f"unknown greedy rule {rule!r}: one of {', '.join(GREEDY_RULES)}")
        if action_map not in ("clip", "affine"):
            raise ValueError(f"unknown action map {action_map!r}")
        self.rule, self.action_map, self.discrete = rule, action_map, discrete
        self.start = int(low[0]) if discrete else 0
        low_t, high_t = torch.tensor(low, dtype=torch.float32), torch.tensor(high, dtype=torch.float32)
        self.register_buffer("low", low_t)
        self.register_buffer("high", high_t)
        self.register_buffer("scale", torch.maximum(low_t.abs(), high_t.abs()))
        std = torch.zeros(len(low)) if log_std is None else clamp_log_std(log_std.detach().float()).exp()
        self.register_buffer("std", std)
        z = np.linspace(-6.0, 6.0, nodes)
        density = np.exp(-0.5 * z * z)
        self.register_buffer("nodes", torch.tensor(z, dtype=torch.float32))
        self.register_buffer("weights", torch.tensor(density / density.sum(), dtype=torch.float32))

    def to_env(self, a: torch.Tensor, per_node: bool = False) -> torch.Tensor:
        """Policy actions in [-1, 1] (B, A), or (B, A, nodes) with ``per_node``, onto the env's bounds, as
        `splitrl.envs.to_env_action` does."""
        low, high, scale = ((t.unsqueeze(-1) for t in (self.low, self.high, self.scale)) if per_node
                            else (self.low, self.high, self.scale))
        a = a.clamp(-1.0, 1.0)
        if self.action_map == "affine":
            return low + (a + 1.0) * (high - low) / 2.0
        return torch.minimum(torch.maximum(a * scale, low), high)

    def forward(self, mean: torch.Tensor) -> torch.Tensor:
        if self.discrete:
            return mean.argmax(-1) + self.start
        if self.rule == "expected":
            u = mean.unsqueeze(-1) + self.std.unsqueeze(-1) * self.nodes  # (B, A, nodes)
            return (self.to_env(torch.tanh(u), per_node=True) * self.weights).sum(-1)
        if self.rule == "mode":
            u, pull = mean, 2.0 * self.std * self.std
            for _ in range(_MODE_STEPS):
                u = mean + pull * torch.tanh(u)
            return self.to_env(torch.tanh(u))
        return self.to_env(torch.tanh(mean))


class GreedyPolicy(nn.Module):
    """Features (stage1's input) to the greedy env action: the heads' trunk and actor, then `GreedyAction`."""

    def __init__(self, heads: ActorCriticHeads, greedy: GreedyAction) -> None:
        super().__init__()
        self.trunk, self.actor, self.greedy = heads.trunk, heads.actor_mean, greedy

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.greedy(self.actor(self.trunk(features)))

    @classmethod
    def of(cls, heads: ActorCriticHeads, low: tuple[float, ...], high: tuple[float, ...], action_map: str,
           rule: str = DEFAULT_GREEDY) -> "GreedyPolicy":
        log_std = None if heads.discrete else heads.actor_logstd
        return cls(heads, GreedyAction(low, high, action_map, rule, log_std, heads.discrete))
