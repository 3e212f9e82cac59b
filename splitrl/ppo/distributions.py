"""Tanh-squashed diagonal Gaussian policy distribution."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

__all__ = ["LOG_STD_MIN", "LOG_STD_MAX", "clamp_log_std", "TanhGaussian"]

LOG_STD_MIN = -5.0
LOG_STD_MAX = 2.0

_LOG_2 = math.log(2.0)
_HALF_LOG_2PI = 0.5 * math.log(2.0 * math.pi)


def clamp_log_std(log_std: torch.Tensor) -> torch.Tensor:
    """Clamp ``log_std`` to [LOG_STD_MIN, LOG_STD_MAX]."""
    return log_std.clamp(LOG_STD_MIN, LOG_STD_MAX)


class TanhGaussian:
    """a = tanh(u), u ~ N(mean, exp(log_std)^2), diagonal.

    Everything is expressed in terms of the pre-tanh action ``u``: store ``u``
    in the rollout, never recover it with atanh(a), which is infinite once
    tanh(u) rounds to +-1 in float32 (the baseline's NaN at iteration 169).
    """

    def __init__(self, mean: torch.Tensor, log_std: torch.Tensor) -> None:
        """``mean`` is (B, A); ``log_std`` is (A,) or (B, A), already clamped."""
        self.mean = mean
        self.log_std = log_std.expand_as(mean)
        self.std = self.log_std.exp()

    def sample(self, generator: torch.Generator | None = None) -> torch.Tensor:
        """Draw pre-tanh actions u, (B, A). Detached: PPO treats actions as data."""
        noise = torch.randn(
            self.mean.shape, generator=generator, dtype=self.mean.dtype, device=self.mean.device
        )
        return (self.mean + self.std * noise).detach()

    def log_prob(self, u: torch.Tensor) -> torch.Tensor:
        """log pi(tanh(u)), (B,), from the pre-tanh action ``u``.

        Uses log(1 - tanh(u)^2) = 2 (log 2 - u - softplus(-2u)), which stays
        finite for any finite u, unlike log(1 - a^2) which is -inf at a = +-1.
        """
        z = (u - self.mean) / self.std
        normal_lp = -0.5 * z.pow(2) - self.log_std - _HALF_LOG_2PI
        log_det = 2.0 * (_LOG_2 - u - F.softplus(-2.0 * u))
        return (normal_lp - log_det).sum(-1)

    def entropy(self) -> torch.Tensor:
        """Entropy of the base Gaussian, (B,).

        The tanh-Gaussian's entropy has no closed form; the base entropy is the
        usual proxy. Only matters if ent_coef != 0 (default 0).
        """
        return (0.5 + _HALF_LOG_2PI + self.log_std).sum(-1)
