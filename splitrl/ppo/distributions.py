"""Policy distributions: a tanh-squashed diagonal Gaussian (Box actions) and a categorical (Discrete)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

__all__ = ["LOG_STD_MIN", "LOG_STD_MAX", "clamp_log_std", "TanhGaussian", "Categorical"]

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

    def _noise(self, shape: tuple[int, ...], generator: torch.Generator | None) -> torch.Tensor:
        """Standard normal noise drawn where ``generator`` lives (a CPU generator's stream is the same whatever
        device the policy is on, and its state goes in a checkpoint as it is), then moved to the mean's device."""
        device = self.mean.device if generator is None else generator.device
        return torch.randn(shape, generator=generator, dtype=self.mean.dtype, device=device).to(self.mean.device)

    def sample(self, generator: torch.Generator | None = None) -> torch.Tensor:
        """Draw pre-tanh actions u, (B, A). Detached: PPO treats actions as data."""
        noise = self._noise(tuple(self.mean.shape), generator)
        return (self.mean + self.std * noise).detach()

    def sample_parts(self, parts: list[tuple[int, torch.Generator | None]]) -> torch.Tensor:
        """`sample` with the rows in consecutive parts (size, generator), each part's noise its own draw:
        the numbers that part would get sampled alone."""
        draws = [self._noise((size,) + tuple(self.mean.shape[1:]), generator) for size, generator in parts]
        noise = draws[0] if len(draws) == 1 else torch.cat(draws)
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


class Categorical:
    """a ~ Categorical(softmax(logits)), one draw per row: CleanRL's ``ppo_atari.py`` policy.

    Written out rather than wrapping `torch.distributions.Categorical` because sampling
    must take a `torch.Generator`: the learner's seeded generator is what keeps a split
    run and its twin drawing the same actions. Log-probs and entropy are computed as
    torch's are (normalised logits; entropy with logits clamped to the dtype's min so
    that a probability of 0 adds 0, not NaN).
    """

    def __init__(self, logits: torch.Tensor) -> None:
        """``logits`` is (B, K), unnormalised."""
        self.logits = logits - logits.logsumexp(-1, keepdim=True)
        self.probs = torch.softmax(logits, -1)

    def _draw(self, probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        """One index per row of ``probs``, drawn where ``generator`` lives (as `TanhGaussian`'s noise is), on the
        probabilities' device."""
        if generator is not None and generator.device != probs.device:
            return torch.multinomial(probs.to(generator.device), 1, generator=generator).squeeze(-1).to(probs.device)
        return torch.multinomial(probs, 1, generator=generator).squeeze(-1)

    def sample(self, generator: torch.Generator | None = None) -> torch.Tensor:
        """Draw action indices, (B,) int64 (integers carry no gradient: PPO treats actions as data)."""
        return self._draw(self.probs, generator)

    def sample_parts(self, parts: list[tuple[int, torch.Generator | None]]) -> torch.Tensor:
        """`sample` with the rows in consecutive parts (size, generator), each part drawn as it would be alone."""
        out, start = [], 0
        for size, generator in parts:
            out.append(self._draw(self.probs[start:start + size], generator))
            start += size
        return torch.cat(out)

    def log_prob(self, action: torch.Tensor) -> torch.Tensor:
        """log pi(a), (B,), for integer actions ``action`` (B,)."""
        return self.logits.gather(-1, action.long().unsqueeze(-1)).squeeze(-1)

    def entropy(self) -> torch.Tensor:
        """-sum p log p, (B,)."""
        logits = self.logits.clamp(min=torch.finfo(self.logits.dtype).min)
        return -(logits * self.probs).sum(-1)

    def mode(self) -> torch.Tensor:
        """The most likely action of each row, (B,) int64."""
        return self.logits.argmax(-1)
