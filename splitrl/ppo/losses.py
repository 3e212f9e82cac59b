"""Clipped PPO objective (CleanRL ppo_continuous_action) and diagnostics."""

from __future__ import annotations

import torch

__all__ = ["LOSS_STATS", "ppo_loss", "explained_variance"]

LOSS_STATS = ("losses/policy_loss", "losses/value_loss", "losses/entropy", "losses/approx_kl", "losses/old_approx_kl",
              "losses/clipfrac")
"""The statistics `ppo_loss` returns, in its order."""


def ppo_loss(
    new_logprob: torch.Tensor,
    old_logprob: torch.Tensor,
    advantages: torch.Tensor,
    new_values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    entropy: torch.Tensor,
    clip_coef: float = 0.2,
    vf_coef: float = 0.5,
    ent_coef: float = 0.0,
    clip_vloss: bool = True,
    norm_adv: bool = True,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Return ``(loss, stats)`` for one minibatch; all inputs are (M,).

    ``stats`` holds python floats under the keys of `LOSS_STATS`.
    With ``norm_adv`` the minibatch needs M >= 2 (std of one sample is NaN).
    """
    new_values = new_values.reshape(-1)
    logratio = new_logprob - old_logprob
    ratio = logratio.exp()

    with torch.no_grad():
        old_approx_kl = (-logratio).mean()
        # http://joschu.net/blog/kl-approx.html: unbiased and always >= 0
        approx_kl = ((ratio - 1) - logratio).mean()
        clipfrac = ((ratio - 1.0).abs() > clip_coef).float().mean()

    mb_advantages = advantages
    if norm_adv:
        mb_advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-8)

    pg_loss1 = -mb_advantages * ratio
    pg_loss2 = -mb_advantages * torch.clamp(ratio, 1 - clip_coef, 1 + clip_coef)
    pg_loss = torch.max(pg_loss1, pg_loss2).mean()

    if clip_vloss:
        v_loss_unclipped = (new_values - returns) ** 2
        v_clipped = old_values + torch.clamp(new_values - old_values, -clip_coef, clip_coef)
        v_loss_clipped = (v_clipped - returns) ** 2
        v_loss = 0.5 * torch.max(v_loss_unclipped, v_loss_clipped).mean()
    else:
        v_loss = 0.5 * ((new_values - returns) ** 2).mean()

    entropy_loss = entropy.mean()
    loss = pg_loss - ent_coef * entropy_loss + v_loss * vf_coef

    stats = dict(zip(LOSS_STATS, (pg_loss.item(), v_loss.item(), entropy_loss.item(), approx_kl.item(),
                                  old_approx_kl.item(), clipfrac.item())))
    return loss, stats


def explained_variance(values: torch.Tensor, returns: torch.Tensor) -> float:
    """1 - Var(returns - values) / Var(returns); nan if Var(returns) == 0."""
    values = values.detach().reshape(-1).double()
    returns = returns.detach().reshape(-1).double()
    var_y = returns.var(correction=0)
    if var_y == 0:
        return float("nan")
    return float(1.0 - (returns - values).var(correction=0) / var_y)


def anneal(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Set every parameter group's learning rate to ``lr`` (CleanRL's ``--anneal-lr`` sets it each iteration)."""
    for group in optimizer.param_groups:
        group["lr"] = lr
