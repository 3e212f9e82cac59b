"""Which of a fleet's places hold an edge: admission, dropping, joining, and where a resumed fleet goes on.

Stage1 of a fleet (`splitrl.schedule.fleet`) binds a port pair per edge (docs/PROTOCOL.md section 15); the
`Roster` answers the hellos that come there (the handshake, `Roster.admit`), drops an edge whose link fails,
whose message does not fit (`Roster.lose`; the fit is `splitrl.stages.door.Door`'s to judge) or whose values do
not hold once read (`Roster.judge`: `splitrl.stages.limits`, `splitrl.schedule.agreement`), lets a waiting
stage0 join at an iteration's end with a running edge's encoder (`Roster.welcome`), and says after which
iteration a resumed fleet goes on (`Roster.resume`). The fleet's loops send and receive through it, so a
failing edge is dropped wherever it fails.
"""

from __future__ import annotations

import logging
import time
from functools import partial
from typing import Any, Callable, Mapping, Sequence, TypeVar

import torch

from ..stages.door import Door
from ..stages.learners import Learners
from ..stages.protocol import STAGE0, STAGE1
from ..transport import Message, PeerAbort, PeerGone, ProtocolError, Transport, TransportTimeout
from ..transport.base import Watch
from ..transport.errors import peer_repr
from ..transport.handshake import HandshakeError, answer_hello
from .common import expect

__all__ = ["Roster", "LINK_ERRORS"]

log = logging.getLogger(__name__)

T = TypeVar("T")

LINK_ERRORS = (PeerGone, PeerAbort, TransportTimeout, ProtocolError)
"""What an edge's link raises when the edge is gone, silent, stopping, or breaking the protocol."""

POLL = 0.05
"""Seconds a free place is listened at for a waiting stage0's hello at an iteration's end (the answer may take
the link's --timeout to leave: a stage0's receiving connection can come up after its hello arrived)."""

START_GRACE = 5.0
"""With ``--min-edges`` M < N, how long the start waits for more once M edges are in."""

KEEPALIVE = 5.0
"""While stage1 waits for edges, a ``progress`` to those there every this many seconds."""


class Roster:
    """Which of stage1's places (edge g: ``links[g]``) hold an edge of the fleet.

    An edge whose link fails (gone: its process died or it was unplugged; silent past ``--timeout``; an
    ``abort``; a message that breaks the protocol, or that the `door` turns away) is dropped at once: told why
    if it can still hear, never waited for again in that session, its samples of the iteration it was lost in
    left out of training (`members`). Training goes on with the rest. At each iteration's end a stage0
    waiting at a free place is answered (`admit`) and given another edge's encoder (`welcome`): it joins for
    the next iteration. With fewer than ``min_edges`` edges stage1 waits there up to ``rejoin`` seconds for
    edges to come, and without them (or with none left) the failure ends the run.

    One of several learners (`splitrl.stages.learners`) serves a part of the fleet: edges ``first`` ..
    ``first + len(links) - 1`` of ``total`` (``links[g]`` is edge ``first + g``'s place).
    """

    def __init__(self, links: Sequence[Transport], shared: dict[str, Any], min_edges: int = 0,
                 rejoin: float = 0.0, first: int = 0, total: int = 0,
                 learners: Learners | None = None) -> None:
        self.links = list(links)
        self.first, self.total = first, total or len(self.links)
        self.learners = learners or Learners()
        self.shared = shared
        """The fleet's settings as the handshake compares them."""
        self.alive = [False] * len(self.links)
        self.min_edges = min_edges or len(self.links)
        self.rejoin = rejoin
        self.dropped = self.joined = 0
        self._watch: tuple[tuple[int, ...], Watch] | None = None
        self.hellos: dict[int, dict[str, Any]] = {}
        """Each place's last answered ``hello`` header (a resumed fleet reads the edges' checkpoints there)."""
        self.answer_extra: dict[str, Any] = {}
        """What every answer to a ``hello`` carries besides ``join_after`` (a resumed fleet: its checkpoints)."""
        self.door: Door | None = None
        """What every message from an edge is checked against as it arrives (`expect`), before any code that
        serves several edges at once sees it; the fleet's loop sets it (`splitrl.stages.door`)."""

    def live(self) -> list[int]:
        return [g for g, alive in enumerate(self.alive) if alive]

    def free(self) -> list[int]:
        return [g for g, alive in enumerate(self.alive) if not alive]

    def lose(self, g: int, exc: BaseException) -> None:
        """Drop edge ``g`` for ``exc``; raise ``exc`` instead when that leaves none, or fewer than ``min_edges``
        with no ``rejoin`` wait."""
        if not self.alive[g]:
            return
        left = sum(self.alive) - 1
        if left == 0 or (left < self.min_edges and not self.rejoin):
            if self.min_edges < len(self.links):
                raise type(exc)(f"{exc} (edge {self.first + g}; {left} of {len(self.links)} edges left, fewer "
                                f"than --min-edges {self.min_edges})") from exc
            raise exc
        self.alive[g] = False
        self.dropped += 1
        log.warning("[stage1] edge %d dropped (%s: %s); training goes on with %d of %d edges", self.first + g,
                    type(exc).__name__, exc, left, len(self.links))
        if not isinstance(exc, PeerGone):  # it may still hear; a gone one's successor must not
            self.links[g].abort(f"stage1 dropped edge {self.first + g} from the fleet: {type(exc).__name__}: {exc}")
        self.links[g].new_session()  # a stage0 that comes to this place next is a new edge

    def expect(self, g: int, kind: str, *, rows: int | None = None, **header: Any) -> Message | None:
        """`expect` on edge ``g``'s link, the message checked at the `door` (``rows``: a ``train_fwd``'s samples);
        None if the edge was dropped, before or by this."""
        if not self.alive[g]:
            return None
        try:
            msg = expect(self.links[g], kind, **header)
        except LINK_ERRORS as exc:
            self.lose(g, exc)
            return None
        if self.door is not None:
            try:
                self.door.check(msg, rows)
            except ProtocolError as exc:
                self.lose(g, ProtocolError(f"edge {self.first + g}: {exc}"))
                return None
        return msg

    def judge(self, g: int, read: Callable[[], T]) -> T | None:
        """``read()``, which reads what edge ``g`` sent (decodes it, holds its values against the limits:
        `splitrl.stages.limits`); None if it raises a `ProtocolError`, which drops the edge, named, as `expect`
        does (or was dropped already)."""
        if not self.alive[g]:
            return None
        try:
            return read()
        except ProtocolError as exc:
            self.lose(g, ProtocolError(f"edge {self.first + g}: {exc}"))
            return None

    def gather(self, kind: str, **header: Any) -> list[tuple[int, Message]]:
        """``kind`` from every live edge, in edge order: (edge, message) of those still there."""
        got = [(g, self.expect(g, kind, **header)) for g in self.live()]
        return [(g, msg) for g, msg in got if msg is not None]

    def pending(self, edges: list[int], timeout: float) -> list[int]:
        """Which of ``edges`` have a message waiting: at once those that have, else within ``timeout`` seconds
        (`Transport.watch`: one wait over every live edge's link, kept while the fleet stays the same)."""
        if not edges:
            return []
        live = tuple(self.live())
        if self._watch is None or self._watch[0] != live:
            self._watch = live, self.links[live[0]].watch([self.links[g] for g in live])
        wanted = set(edges)
        return [g for g in (live[i] for i in self._watch[1].wait(timeout)) if g in wanted]

    def check(self, g: int, silent: float) -> None:
        """Drop edge ``g`` if its liveness layer counts it gone, or if it has been silent ``silent`` seconds,
        past its link's timeout."""
        if not self.alive[g]:
            return
        link = self.links[g]
        try:
            link.check_alive()
            if silent > link.timeout:
                raise TransportTimeout(f"no message from {link.peer} within {link.timeout:g} s")
        except LINK_ERRORS as exc:
            self.lose(g, exc)

    def send(self, g: int, kind: str, tensors: Any = None, header: dict[str, Any] | None = None) -> None:
        """Send on edge ``g``'s link unless it was dropped; a failure drops it."""
        if not self.alive[g]:
            return
        try:
            self.links[g].send(kind, tensors, header)
        except LINK_ERRORS as exc:
            self.lose(g, exc)

    def members(self, idx: torch.Tensor, owner: torch.Tensor) -> torch.Tensor:
        """The samples ``idx`` (``owner``: each one's edge) of edges still in the fleet (another learner's edges
        are: one it loses ends the run)."""
        if all(self.alive):
            return idx
        alive = [True] * self.total
        alive[self.first:self.first + len(self.links)] = self.alive
        return idx[torch.tensor(alive)[owner]]

    def link(self, g: int) -> "_RosterLink":
        return _RosterLink(self, g)

    def admit(self, iteration: int, wait: float, want: int | None = None) -> list[int]:
        """Answer the ``hello`` of every stage0 waiting at a free place (``join_after``: ``iteration``); while
        fewer than ``want`` (default ``min_edges``) would be in, listen on up to ``wait`` seconds (at an
        iteration's end, a ``progress`` to the edges there every `KEEPALIVE` seconds, so that they wait too; at
        the start they wait for their first action). Returns the places answered."""
        answered: list[int] = []
        now = time.monotonic()
        deadline, keepalive = now + wait, now + KEEPALIVE
        while True:
            for g in self.free():
                if g not in answered and self._answer(g, iteration):
                    answered.append(g)
            now = time.monotonic()
            if sum(self.alive) + len(answered) >= (want or self.min_edges) or now >= deadline:
                return answered
            if iteration and now >= keepalive:
                for g in self.live():
                    self.send(g, "progress", header={"waiting": "edges"})
                for g in list(answered):  # joiners wait for their encoder_state too
                    try:
                        self.links[g].send("progress", header={"waiting": "edges"})
                    except LINK_ERRORS as exc:
                        self._refuse(g, f"could not keep it waiting: {exc}")
                        answered.remove(g)
                keepalive = now + KEEPALIVE

    def _refuse(self, g: int, why: str) -> None:
        log.warning("[stage1] edge %d's place: %s", self.first + g, why)
        self.links[g].abort(f"stage1 did not take this edge: {why}")
        self.links[g].new_session()

    def _answer(self, g: int, iteration: int) -> bool:
        """Whether a stage0's hello was waiting at place ``g`` and is answered (``join_after``: ``iteration``)."""
        link = self.links[g]
        try:
            hello = answer_hello(link, STAGE1, STAGE0, self.shared, timeout=POLL,
                                 extra={**self.answer_extra, "join_after": iteration}, reply_timeout=link.timeout)
            if hello.get("edge") != self.first + g:
                raise HandshakeError(f"{link.peer}: edge {self.first + g}'s place, taken by a stage0 that says it "
                                     f"is edge {peer_repr(hello.get('edge'))}")
        except TransportTimeout as exc:
            if link.session is not None:  # the hello came, the answer could not leave
                self._refuse(g, f"could not answer its hello: {exc}")
            return False
        except LINK_ERRORS as exc:
            self._refuse(g, f"refused a stage0: {exc}")
            return False
        self.hellos[g] = hello
        log.info("[stage1] edge %d of %d connected%s", self.first + g, self.total,
                 f" (joins after iteration {iteration})" if iteration else "")
        return True

    def start(self, timeout: float) -> None:
        """The first edges: every place's, or, within ``timeout``, ``min_edges`` of them and those that come in
        the `START_GRACE` seconds after (the rest may join at an iteration's end)."""
        for g in self.admit(0, timeout):
            self.alive[g] = True
        self.require(timeout)
        for g in self.admit(0, START_GRACE, want=len(self.links)):
            self.alive[g] = True

    def resume(self, ours: Sequence[int], load: Callable[[int], Mapping[str, Any]] | None = None) -> int:
        """A resumed fleet, once started: the iteration it goes on after, sent to each edge (``resume``).

        That is the newest of stage1's checkpoints (``ours``) that at least ``min_edges`` of the edges in hold
        (0 when stage1 has none); of several learners, the newest such that every learner has. Edges answer their
        hellos first and learn the point only now: an edge may lack the newest (interrupted while it wrote it) or
        hold only old ones (one dropped earlier in the run, whose directory stopped there). An edge without the
        point, or whose hello has no ``checkpoints`` (started without --resume), is dropped as `lose` does; no
        such point at all is a `HandshakeError` rather than a silent start from scratch.

        ``load(iteration)``, called once a point other than 0 is chosen, gives stage1's checkpoint of it: where its
        ``links`` holds a place's link position (`common.stage1_finish`), that place numbers on from it, and the
        edge's ``resume`` carries the edge's side of it (docs/PROTOCOL.md sections 6 and 15)."""
        held: dict[int, set[int]] = {}
        for g in self.live():
            theirs = self.hellos.get(g, {}).get("checkpoints")
            if theirs is None:
                self.lose(g, HandshakeError(f"edge {self.first + g} does not resume: the fleet continues a run, so "
                                            "start every edge with --resume RUN_DIR (its own run directory) too"))
            elif not isinstance(theirs, list) or not all(type(i) is int for i in theirs):
                self.lose(g, ProtocolError(f"hello: expected edge {self.first + g}'s checkpoint iterations as a "
                                           f"list of ints, got {peer_repr(theirs)}"))
            else:
                held[g] = set(theirs)
        iteration = self.learners.newest_common(
            (i for i in ours if sum(i in mine for mine in held.values()) >= self.min_edges))
        if not iteration and self.learners.sum_count(len(ours)):  # any learner's: none starts again from 0
            if not ours:
                raise HandshakeError("another learner holds checkpoints and this one none: resume every learner "
                                     "from its own directory of the same run (learner r > 0: RUN_DIR/learner-r)")
            raise HandshakeError(f"no iteration that stage1 (checkpoints of {sorted(ours)}) and at least "
                                 f"{self.min_edges} edges hold a checkpoint of (the edges': "
                                 + "; ".join(f"edge {self.first + g}: {sorted(mine) or 'none'}"
                                             for g, mine in held.items()) + ")")
        for g, mine in held.items():
            if iteration and iteration not in mine:
                self.lose(g, HandshakeError(f"edge {self.first + g} has no checkpoint of iteration {iteration}, where "
                                            f"the fleet resumes (it has {sorted(mine) or 'none'}): start it without "
                                            "--resume in a fresh run directory to join after an iteration"))
        positions = (load(iteration).get("links") or {}) if iteration and load is not None else {}
        for g in self.live():
            ours_at = positions.get(str(self.first + g))
            if ours_at is None:
                self.send(g, "resume", header={"iteration": iteration})
                continue
            theirs = {"sent": ours_at["received"], "received": ours_at["sent"]}
            self.send(g, "resume", header={"iteration": iteration, "link": theirs})
            if self.alive[g]:  # a place lost on the way starts its next session from 0
                self.links[g].go_on_from(ours_at)
        return iteration

    def welcome(self, joiners: list[int], sources: Sequence[int], iteration: int,
                verify: Callable[[Message], Message] | None = None) -> None:
        """Give edges answered at the end of ``iteration`` (`admit`) the encoder of the first of ``sources`` (each
        asked for it: ``share_encoder``) whose ``encoder_state`` passes ``verify`` (`splitrl.schedule.agreement`:
        the fleet's encoder, tensor by tensor); a source whose state fails is dropped, named (`judge`). They are
        edges of the fleet from the next iteration. With no such state, they are told to come again."""
        msg = None
        for source in sources:  # every source asked sends its state: each is taken off its link
            got = self.expect(source, "encoder_state", iteration=iteration)
            if got is not None and verify is not None:
                got = self.judge(source, partial(verify, got))
            if msg is None:
                msg = got
        for g in joiners:
            try:
                if msg is None:
                    raise PeerGone(f"no edge of the fleet could give its encoder (asked: "
                                   f"{', '.join(str(self.first + k) for k in sources) or 'none'}); start again")
                self.links[g].send("encoder_state", dict(msg.tensors), dict(msg.header))
            except LINK_ERRORS as exc:
                self._refuse(g, f"could not join: {exc}")
                continue
            self.alive[g] = True
            self.joined += 1

    def require(self, waited: float) -> None:
        """`TransportTimeout` when fewer than ``min_edges`` are in after waiting ``waited`` seconds."""
        if sum(self.alive) < self.min_edges:
            raise TransportTimeout(f"{sum(self.alive)} of {len(self.links)} edges in the fleet after waiting "
                                   f"{waited:g} s for more (--min-edges {self.min_edges})")


class _RosterLink:
    """Edge ``g``'s link as `stage1_finish` sends on it: a failure drops the edge (`Roster.lose`)."""

    def __init__(self, roster: Roster, g: int) -> None:
        self.roster, self.g = roster, g

    def send(self, kind: str, tensors: Any = None, header: dict[str, Any] | None = None) -> None:
        self.roster.send(self.g, kind, tensors, header)

    def sequence(self, ahead: int = 0) -> dict[str, int]:
        return self.roster.links[self.g].sequence(ahead)
