"""The replica exchange's plan, read by both of its halves and by the link budget.

Which weights stage0's replica of the heads holds (`replicated`), which two of them are the
feature-wide first layers (`FIRST_LAYERS`), and which weights' change follows which training
minibatch (`due`). Both stages derive the plan from the settings alone, so it never crosses the
link. The exchange itself is `splitrl.stages.replica`; the budget (`splitrl.stages.budget`) counts
its bytes from this plan.
"""

from __future__ import annotations

from typing import Iterable

from torch import nn

from ..models import ActorCriticHeads
from ..settings import Exchange
from .autoencoder import PROJECTION

__all__ = ["FIRST_LAYERS", "due", "replicated"]

FIRST_LAYERS = ("critic.0.weight", "actor_mean.0.weight")
"""The heads' two feature-wide weights (`splitrl.models.ActorCriticHeads`): 99.9 % of the
replica's values, sent by ``all_every`` but not by ``last_every``."""


def replicated(heads: ActorCriticHeads) -> list[tuple[str, nn.Parameter]]:
    """The weights `ActorCriticHeads.outputs` uses (all but the log-std): what stage0's replica holds."""
    return [(name, p) for name, p in heads.named_parameters() if name != "actor_logstd"]


def due(exchange: Exchange, epoch: int, mb: int, epochs: int, minibatches: int, names: Iterable[str]) -> list[str]:
    """The weights whose change follows the ``train_bwd`` of minibatch (epoch, mb); [] if none.

    Both stages call this with the same arguments, so each knows what comes. Never after
    the iteration's last minibatch: the next rollout's update follows it anyway.
    """
    done = epoch * minibatches + mb + 1
    if done >= epochs * minibatches:
        return []
    names = [name for name in names if name != PROJECTION]  # an autoencoder's projection: after the rollout only
    if exchange.all_every and done % exchange.all_every == 0:
        return list(names)
    if exchange.last_every and done % exchange.last_every == 0:
        return [name for name in names if name not in FIRST_LAYERS]
    return []
