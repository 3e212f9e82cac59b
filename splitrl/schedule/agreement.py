"""One encoder across a fleet, verified: the digests the edges report at each iteration's end, which encoder is
the fleet's, and a relayed ``encoder_state`` checked against it before a new edge starts from it.

Every edge's ``iter_end`` carries a digest of each tensor of its encoder that the fleet's edges hold alike
(`splitrl.stages.digest`; the door checks their names and form). `fleet_digests` takes the digests most of the
edges report as the fleet's and drops each edge that reports others, naming it and the first tensor that
differs: its encoder diverged (it stepped with other gradients, or joined with another encoder, or, with
``--encoder-sync grad``, it computes on another kind of device, torch build or thread count, which can round
its optimizer step otherwise: `ALIKE`). When no one encoder has more edges than every other (two edges that
disagree), stage1 cannot tell which is the fleet's: the run ends with an error naming them. A joining edge
starts from a running edge's ``encoder_state`` (`splitrl.schedule.roster.Roster.welcome`); `StateCheck` holds
it against the fleet's digests of that iteration tensor by tensor, what is each edge's own and so not
digested against the limits (Adam's moments with ``--encoder-sync avg``: ``--edge-grad-limit``; buffers, such
as a batch norm's statistics: ``--edge-feature-limit``), and the fleet's env-step count against stage1's, so
that a sharing edge cannot hand a new one another encoder, or one that gets it dropped and blamed.

Several learners: each checks its own edges (the learners' heads are compared after each iteration; their
edges' encoders are not compared across learners).
"""

from __future__ import annotations

from typing import Sequence

from ..stages.digest import tensor_digest
from ..stages.limits import EdgeLimits
from ..transport import Message, ProtocolError
from ..transport.errors import peer_repr
from .roster import Roster

__all__ = ["fleet_digests", "StateCheck", "ALIKE"]

ALIKE = ("with --encoder-sync grad honest edges agree bit for bit only where they compute alike: the same kind of "
         "device, torch build and --threads; avg does not need it")
"""Why two honest edges can report different encoders: each steps its own optimizer, and another device,
build or thread count can round its gradient clipping and Adam step in other last bits. ``avg`` edges take
the agreed weights from the view, which every edge computes in host memory with the same elementwise
operations."""


def _first_difference(mine: dict[str, str], fleet: dict[str, str]) -> str:
    """The first tensor (by name) whose digest in ``mine`` is not ``fleet``'s."""
    return next(n for n in sorted(fleet) if mine.get(n) != fleet[n])


def _edges(roster: Roster, camp: list[int]) -> str:
    return f"edge{'s' * (len(camp) > 1)} {', '.join(str(roster.first + g) for g in camp)}"


def fleet_digests(roster: Roster, ends: Sequence[tuple[int, Message]], iteration: int) -> dict[str, str] | None:
    """The fleet's encoder after ``iteration``: the digests (``iter_end``'s ``encoder``) most of the edges in
    ``ends`` report; each edge that reports others is dropped (`Roster.lose`); None when no edge is left.
    `ProtocolError` naming the edges when no one encoder has more edges than every other."""
    reports = {g: msg.header["encoder"] for g, msg in ends if roster.alive[g]}
    camps: dict[tuple[tuple[str, str], ...], list[int]] = {}
    for g, digests in reports.items():
        camps.setdefault(tuple(sorted(digests.items())), []).append(g)
    ranked = sorted(camps.values(), key=len, reverse=True)
    if not ranked:
        return None
    fleet = reports[ranked[0][0]]
    if len(ranked) > 1 and len(ranked[1]) == len(ranked[0]):
        name = _first_difference(reports[ranked[1][0]], fleet)
        raise ProtocolError(f"iter_end: header 'encoder': the edges hold different encoders after iteration "
                            f"{iteration}, none of them on more edges than the others; tensor {name!r}: " +
                            "; ".join(f"{_edges(roster, camp)}: {str(reports[camp[0]].get(name))[:12]}.."
                                      for camp in ranked) + f" ({ALIKE})")
    for camp in ranked[1:]:
        for g in camp:
            name = _first_difference(reports[g], fleet)
            roster.lose(g, ProtocolError(
                f"edge {roster.first + g}: iter_end: header 'encoder': tensor {name!r}: its encoder is not the "
                f"fleet's after iteration {iteration} (digest {str(reports[g].get(name))[:12]}.., "
                f"{_edges(roster, ranked[0])}: {fleet[name][:12]}..)"))
    return fleet


class StateCheck:
    """Holds an ``encoder_state`` relayed after ``iteration`` against the fleet's ``digests`` of that iteration
    (`fleet_digests`), the moments not digested against ``limits``, and its ``global_step`` against stage1's
    count, ``steps``. Called with the message, returns it; `ProtocolError` naming the tensor otherwise."""

    def __init__(self, digests: dict[str, str], limits: EdgeLimits, iteration: int, steps: int) -> None:
        self.digests, self.limits, self.iteration, self.steps = digests, limits, iteration, steps

    def __call__(self, msg: Message) -> Message:
        for name, want in self.digests.items():
            t = msg.tensors.get(name)
            got = tensor_digest(t) if t is not None else "none"
            if got != want:
                raise ProtocolError(f"{msg.kind}: tensor {name!r}: not the fleet's encoder after iteration "
                                    f"{self.iteration} (digest {got[:12]}.., the edges reported {want[:12]}..)")
        for name, t in msg.tensors.items():  # what is each edge's own: moments (avg), buffers
            if name not in self.digests:
                if name.startswith("net."):
                    self.limits.features(msg.kind, name, t)
                else:
                    bound = self.limits.grad ** 2 if name.startswith("exp_avg_sq.") else self.limits.grad
                    self.limits.bounded(msg.kind, name, t, bound, "--edge-grad-limit")
        if msg.header.get("global_step") != self.steps:
            raise ProtocolError(f"{msg.kind}: header 'global_step': expected the fleet's {self.steps} env steps "
                                f"after iteration {self.iteration}, got {peer_repr(msg.header.get('global_step'))}")
        return msg
