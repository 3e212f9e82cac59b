"""Fixed-size on-policy rollout storage."""

from __future__ import annotations

import torch

from .gae import compute_gae

__all__ = ["RolloutBuffer", "shuffled_minibatches", "minibatch_schedule"]


def _plain(x: torch.Tensor, shape: tuple[int, ...] | None = None) -> torch.Tensor:
    """``x`` without a graph and, with ``shape``, in that shape: ``x`` itself where it is so already."""
    if x.requires_grad:
        x = x.detach()
    return x if shape is None or x.shape == shape else x.reshape(shape)


class RolloutBuffer:
    """Per-step tensors shaped (num_steps, num_envs, ...), float32.

    ``actions`` are pre-tanh ``u`` (..., action_dim) so log-probs can be recomputed
    without atanh; with ``discrete`` they are action indices, int64 (num_steps, num_envs).
    After ``finish`` the ``b_*`` attributes are step-major flat views
    (index = t * num_envs + n), matching ``obs.reshape(-1, ...)``. ``envs`` (a slice,
    default all) lets env groups that step in turn write their own columns.
    """

    def __init__(self, num_steps: int, num_envs: int, action_dim: int, discrete: bool = False,
                 device: torch.device | str = "cpu") -> None:
        self.num_steps, self.num_envs, self.action_dim = num_steps, num_envs, action_dim
        self.device = torch.device(device)
        """Where the storage lives; what is added moves there (values from the wire come in host memory)."""
        shape = (num_steps, num_envs)
        self.action_shape = () if discrete else (action_dim,)
        zeros = dict(device=self.device)
        self.actions = torch.zeros(shape + self.action_shape, dtype=torch.int64 if discrete else torch.float32, **zeros)
        self.logprobs = torch.zeros(shape, **zeros)
        self.values = torch.zeros(shape, **zeros)
        self.rewards = torch.zeros(shape, **zeros)
        self.terminated = torch.zeros(shape, **zeros)
        self.truncated = torch.zeros(shape, **zeros)
        self.final_values = torch.zeros(shape, **zeros)

    @property
    def batch_size(self) -> int:
        return self.num_steps * self.num_envs

    def _vec(self, x, n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        # critics often emit (N, 1) and envs numpy arrays; normalise both to (N,) ``dtype``, on the storage's device.
        # A tensor that is so already is taken as it is: each step writes a few of these, and every detach or
        # reshape is one more call into torch (the values are the same either way).
        return _plain(torch.as_tensor(x, dtype=dtype, device=self.device), (n,))

    def _width(self, envs: slice) -> int:
        return len(range(*envs.indices(self.num_envs)))

    def add(self, step: int, *, actions, logprobs, values, envs: slice = slice(None)) -> None:
        """Record what the policy produced at step ``step``."""
        n = self._width(envs)
        self.actions[step, envs] = _plain(torch.as_tensor(actions, dtype=self.actions.dtype, device=self.device))
        self.logprobs[step, envs] = self._vec(logprobs, n)
        self.values[step, envs] = self._vec(values, n)

    def add_rows(self, steps: torch.Tensor, envs: torch.Tensor, *, actions, logprobs, values) -> None:
        """`add` for rows of different steps: row i is step ``steps[i]`` of env ``envs[i]``."""
        n = len(envs)
        self.actions[steps, envs] = _plain(torch.as_tensor(actions, dtype=self.actions.dtype, device=self.device))
        self.logprobs[steps, envs] = self._vec(logprobs, n)
        self.values[steps, envs] = self._vec(values, n)

    def add_outcome(self, step: int, *, rewards, terminated, truncated, final_values=None,
                    envs: slice = slice(None)) -> None:
        """Record what the env returned after acting at step ``step``.

        ``final_values`` (N,) = V(real last obs) is read only where truncated and
        not terminated; zeros are stored elsewhere. ``0.0``: no env needs one (the
        caller knows none was cut short), zeros stored with no mask to work out.
        """
        self._store_outcome((step, envs), self._width(envs), rewards, terminated, truncated, final_values)

    def add_outcome_rows(self, steps: torch.Tensor, envs: torch.Tensor, *, rewards, terminated, truncated,
                         final_values=None) -> None:
        """`add_outcome` for rows of different steps: row i is step ``steps[i]`` of env ``envs[i]``."""
        self._store_outcome((steps, envs), len(envs), rewards, terminated, truncated, final_values)

    def _store_outcome(self, where, n: int, rewards, terminated, truncated, final_values) -> None:
        # (the flags as bool, a float's 0 or not as its truth, stored as 0.0 / 1.0 by the copy into the float
        # storage, which converts as .float() would)
        term = self._vec(terminated, n, torch.bool)
        trunc = self._vec(truncated, n, torch.bool)
        rows = isinstance(where[0], torch.Tensor)
        if isinstance(final_values, float) and final_values == 0.0:
            fv = 0.0
        else:
            needs_bootstrap = trunc & ~term
            if final_values is None:
                if needs_bootstrap.any():
                    # silently bootstrapping 0 would bias every time-limited episode
                    raise ValueError("final_values is required when an env is truncated")
                fv = 0.0
            else:
                fv = torch.where(needs_bootstrap, self._vec(final_values, n), 0.0)
        if rows:  # rows by index tensors: index_put_ takes the storage's dtype only
            term, trunc = term.float(), trunc.float()
        self.rewards[where] = self._vec(rewards, n)
        self.terminated[where] = term
        self.truncated[where] = trunc
        if rows or not isinstance(fv, float):
            self.final_values[where] = fv
        else:  # (a view of the step's rows, filled in place: no tensor of the number)
            self.final_values[where].fill_(fv)

    def finish(self, last_value, gamma: float = 0.99, gae_lambda: float = 0.95,
               weights: torch.Tensor | None = None, values: torch.Tensor | None = None) -> None:
        """Compute advantages/returns (with ``weights``: importance-weighted, see `compute_gae`)
        and the flattened ``b_*`` batch views. ``values`` (T, N): the baseline, if not the stored
        ``values`` of the network that acted (they stay as stored)."""
        baseline = self.values if values is None else values
        self.advantages, self.returns = compute_gae(
            self.rewards, baseline, self.terminated, self.truncated,
            self.final_values, self._vec(last_value, self.num_envs), gamma, gae_lambda, weights,
        )
        self.b_actions = self.actions.reshape((-1,) + self.action_shape)
        self.b_logprobs = self.logprobs.reshape(-1)
        self.b_values = baseline.reshape(-1)
        self.b_advantages = self.advantages.reshape(-1)
        self.b_returns = self.returns.reshape(-1)


def shuffled_minibatches(
    batch_size: int, generator: torch.Generator | None, num_minibatches: int
) -> list[torch.Tensor]:
    """A random permutation of ``range(batch_size)`` cut into equal minibatches."""
    if num_minibatches <= 0 or batch_size % num_minibatches != 0:
        raise ValueError(f"batch size {batch_size} is not divisible by num_minibatches={num_minibatches}")
    perm = torch.randperm(batch_size, generator=generator)
    return list(perm.split(batch_size // num_minibatches))


def minibatch_schedule(
    seed: int, iteration: int, epochs: int, batch_size: int, num_minibatches: int
) -> list[list[torch.Tensor]]:
    """Every epoch's minibatches for one iteration, a pure function of (seed, iteration).

    Both stages of a split run call it, so the order never crosses the link.
    """
    generator = torch.Generator().manual_seed((seed * 1_000_003 + iteration) % (2**63))
    return [shuffled_minibatches(batch_size, generator, num_minibatches) for _ in range(epochs)]
