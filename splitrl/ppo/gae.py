"""Generalised Advantage Estimation with correct time-limit bootstrapping."""

from __future__ import annotations

import torch

__all__ = ["compute_gae"]


def compute_gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    terminated: torch.Tensor,
    truncated: torch.Tensor,
    final_values: torch.Tensor,
    last_value: torch.Tensor,
    gamma: float = 0.99,
    gae_lambda: float = 0.95,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(advantages, returns)``, both (T, N).

    ``rewards``, ``values``, ``terminated``, ``truncated``, ``final_values`` are
    (T, N); ``last_value`` is V(s_T), shape (N,). Transition t ends the episode
    if it is terminated or truncated, and the recursion never crosses that
    boundary. A terminated transition bootstraps nothing; a truncated one
    bootstraps ``final_values[t]`` = V(real last observation), because
    ``obs[t+1]`` already belongs to the next episode. If both flags are set,
    termination wins (no bootstrap). ``final_values`` entries are ignored
    wherever ``truncated`` is False or ``terminated`` is True (they may even be NaN).
    """
    num_steps = rewards.shape[0]
    terminated = terminated.bool()
    truncated = truncated.bool()
    nextnonterminal_all = 1.0 - (terminated | truncated).to(rewards.dtype)
    # torch.where rather than a multiply so garbage/NaN in unused slots cannot leak in.
    trunc_bootstrap = torch.where(truncated & ~terminated, final_values, torch.zeros_like(final_values))

    advantages = torch.zeros_like(rewards)
    lastgaelam = torch.zeros_like(last_value)
    for t in reversed(range(num_steps)):
        nextvalues = last_value if t == num_steps - 1 else values[t + 1]
        nextnonterminal = nextnonterminal_all[t]
        next_v = nextnonterminal * nextvalues + trunc_bootstrap[t]
        delta = rewards[t] + gamma * next_v - values[t]
        lastgaelam = delta + gamma * gae_lambda * nextnonterminal * lastgaelam
        advantages[t] = lastgaelam
    returns = advantages + values
    return advantages, returns
