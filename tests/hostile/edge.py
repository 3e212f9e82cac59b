"""A real stage0 whose messages lie: an edge of a fleet that speaks the protocol to the letter and sends values
no honest edge sends.

``python -m tests.hostile.edge ATTACK [splitrl stage0 options ...]`` runs ``splitrl stage0`` with every message it
sends passed through ATTACK first (the tests fork ``splitrl stage0`` from their warm interpreter with `lie` as
its setup):

  rewards    every ``reward`` (from a step's t = 1 on, and the rollout_end's) is 1e30: finite, so the wire's
             finite check lets it through
  gradient   every ``encoder_grad`` it sends holds 3e38 everywhere (float32's largest is 3.4e38)
  negated    the ``encoder_state`` it shares with a joining edge has its weights negated
  huge       the ``encoder_state`` it shares has its weights at 1e30

Its own training is honest: only what leaves it is altered, so its ``iter_end`` reports its real encoder.
"""

from __future__ import annotations

import sys
from typing import Any, Callable

import torch

Tensors = dict[str, torch.Tensor]


def _rewards(kind: str, tensors: Tensors) -> Tensors:
    return {**tensors, "reward": torch.full_like(tensors["reward"], 1e30)} if "reward" in tensors else tensors


def _gradient(kind: str, tensors: Tensors) -> Tensors:
    return {name: torch.full_like(t, 3e38) for name, t in tensors.items()} if kind == "encoder_grad" else tensors


def _state(change: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[str, Tensors], Tensors]:
    def attack(kind: str, tensors: Tensors) -> Tensors:
        if kind != "encoder_state":
            return tensors
        return {name: change(t) if name.startswith("net.") else t for name, t in tensors.items()}
    return attack


ATTACKS: dict[str, Callable[[str, Tensors], Tensors]] = {
    "rewards": _rewards, "gradient": _gradient, "negated": _state(torch.neg),
    "huge": _state(lambda t: torch.full_like(t, 1e30))}


def lie(name: str) -> None:
    """From now on, pass every message this process's transports send through the attack ``name``."""
    attack = ATTACKS[name]
    from splitrl.transport.base import Transport

    send = Transport.send

    def lying_send(self: Transport, kind: str, tensors: Any = None, header: Any = None, **kwargs: Any) -> int:
        return send(self, kind, attack(kind, dict(tensors)) if tensors else tensors, header, **kwargs)

    Transport.send = lying_send  # type: ignore[method-assign]


def main() -> None:
    lie(sys.argv[1])
    sys.argv = ["splitrl", *sys.argv[2:]]
    from splitrl.__main__ import main as splitrl_main

    splitrl_main()


if __name__ == "__main__":
    main()
