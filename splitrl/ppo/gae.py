"""Generalised Advantage Estimation with correct time-limit bootstrapping."""

from __future__ import annotations

import torch

__all__ = ["compute_gae", "importance_weights"]


def compute_gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    terminated: torch.Tensor,
    truncated: torch.Tensor,
    final_values: torch.Tensor,
    last_value: torch.Tensor,
    gamma: float = 0.99,
    gae_lambda: float = 0.95,
    weights: torch.Tensor | None = None,
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

    ``weights`` (T, N), for samples an older policy mu acted on: truncated importance
    weights w = min(1, pi / mu), applied as V-trace does (Espeholt et al. 2018, with
    rho-bar = c-bar = 1 and GAE's lambda on the trace). The value targets are
    ``v_t = V_t + w_t delta_t + gamma lambda w_t (v_{t+1} - V_{t+1})`` (the returns) and
    the policy's advantage is ``delta_t + gamma lambda (v_{t+1} - V_{t+1})``: later
    errors arrive weighted by the trace, but step t's own is not weighted again,
    because PPO's ratio pi / mu already corrects for the action at t (IMPALA's
    ``rho_t (r_t + gamma v_{t+1} - V_t)`` would count it twice in a PPO loss).
    With every weight 1 both are plain GAE. None is plain GAE.
    """
    num_steps = rewards.shape[0]
    terminated = terminated.bool()
    truncated = truncated.bool()
    nextnonterminal_all = 1.0 - (terminated | truncated).to(rewards.dtype)
    # torch.where rather than a multiply so garbage/NaN in unused slots cannot leak in.
    trunc_bootstrap = torch.where(truncated & ~terminated, final_values, torch.zeros_like(final_values))

    advantages = torch.zeros_like(rewards)
    targets = torch.zeros_like(rewards) if weights is not None else advantages
    lastgaelam = torch.zeros_like(last_value)
    for t in reversed(range(num_steps)):
        nextvalues = last_value if t == num_steps - 1 else values[t + 1]
        nextnonterminal = nextnonterminal_all[t]
        next_v = nextnonterminal * nextvalues + trunc_bootstrap[t]
        delta = rewards[t] + gamma * next_v - values[t]
        # lastgaelam is v_{t+1} - V_{t+1} (the GAE advantage when there are no weights)
        advantages[t] = delta + gamma * gae_lambda * nextnonterminal * lastgaelam
        if weights is not None:
            lastgaelam = weights[t] * advantages[t]
            targets[t] = lastgaelam
        else:
            lastgaelam = advantages[t]
    returns = targets + values
    return advantages, returns


def importance_weights(logprob: torch.Tensor, behaviour: torch.Tensor, lagging: torch.Tensor) -> torch.Tensor:
    """`compute_gae`'s ``weights``: min(1, pi / mu) where ``lagging`` (an older policy mu acted, with log-probability
    ``behaviour``; pi's is ``logprob``), 1 elsewhere."""
    return torch.where(lagging, (logprob - behaviour).exp().clamp(max=1.0), torch.ones_like(logprob))
