"""The fleet: several edges (stage0 processes, ``--edges N``), one stage1, one policy.

Each edge runs the synchronous session of `sync.py` over a link of its own (stage1's port
pair ``PORT + 2 x edge``, docs/PROTOCOL.md section 15); stage1 serves them all in lock step:

1. rollout: step ``t`` from every edge, then one forward of the heads for all of them
   (`Learner.act_groups`: dynamic batching, the batch is the fleet) and each edge its
   actions; then every edge's ``rollout_end``. With ``--act-wait MS`` the edges go at their own
   pace instead: stage1 answers the steps that have come, once all have or MS after the first
   (an inference server's bounded queue delay), each edge at its own step;
2. training: the minibatches are drawn from all edges' samples (the minibatch order is
   `minibatch_schedule` over the fleet's ``num_steps x num_envs x edges`` samples, which every
   side computes); each edge forwards and back-propagates its share of a minibatch
   (`Edge.own`; none when it holds no sample of it); stage1 takes the loss of each share,
   weighted by its size, and steps once; then every edge sends its encoder's gradients
   (``encoder_grad``), stage1 adds them up and sends the sum back, and every edge steps
   with it (``--encoder-sync grad``): the edges keep one encoder. With ``--encoder-sync avg``
   each edge steps with its own share's gradient instead, and after every K-th minibatch
   (and each epoch's last) the edges send their encoder's change since the last average
   (``encoder_avg``, through a dense codec), stage1 sends back their mean, and every edge
   adds it to the encoder they last agreed on: one encoder again, at a fraction of the bytes;
3. iteration end: ``iter_end`` from every edge, the same ``iter_stats`` to each.

Edges come and go (`Roster`): one whose link fails is dropped at once and the rest train on while
``--min-edges`` remain; a stage0 waiting at a free place joins at an iteration's end with a running
edge's encoder and optimizer state (``encoder_state``, relayed by stage1).

Stage1 learns as one edge with every edge's envs, each edge's envs a group
(`TrainSettings.fleet_view`): N edges x E envs compute what 1 edge x N*E envs in N
rollout groups computes, but for the order of float sums (each share's loss and each
edge's gradients are added up separately).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Sequence

import torch

from ..runs import RunLog
from ..stages import Edge, EdgeExchange, Learner, LearnerExchange
from ..stages.evaluate import Evaluation
from ..stages.learners import Learners
from ..stages.protocol import STAGE0, STAGE1
from ..transport import Message, PeerAbort, PeerGone, ProtocolError, Transport, TransportTimeout
from ..transport.base import Watch
from ..transport.errors import peer_repr
from ..transport.handshake import HandshakeError, answer_hello
from .common import (IterationLog, PhaseClock, checkpoint_due, expect, stage0_after_rollout, stage0_finish,
                     stage1_finish, stops)
from .sync import stage0_rollout

__all__ = ["Roster", "stage0_loop", "stage1_loop"]

log = logging.getLogger(__name__)

LINK_ERRORS = (PeerGone, PeerAbort, TransportTimeout, ProtocolError)
"""What an edge's link raises when the edge is gone, silent, stopping, or breaking the protocol."""

POLL = 0.05
"""Seconds a free place is listened at for a waiting stage0's hello at an iteration's end (the answer may take
the link's --timeout to leave: a stage0's receiving connection can come up after its hello arrived)."""

START_GRACE = 5.0
"""With ``--min-edges`` M < N, how long the start waits for more once M edges are in."""

KEEPALIVE = 5.0
"""While stage1 waits for edges, a ``progress`` to those there every this many seconds."""


def stage0_loop(edge: Edge, exchange: EdgeExchange, link: Transport, *, checkpoint_every: int = 10,
                evaluation: Evaluation | None = None) -> list[dict[str, Any]]:
    """Every iteration from one edge's side; returns its metrics records."""
    s = edge.settings
    edge.open_envs()
    metrics = IterationLog(edge, link, {"fleet/edge": edge.edge})
    for iteration in range(edge.train_iteration + 1, s.num_iterations + 1):
        clock = PhaseClock()
        metrics.start()

        # -- rollout: as the synchronous schedule's; stage1 answers every edge's step t together --
        stage0_rollout(edge, link, clock, iteration)
        rollout, schedule = stage0_after_rollout(edge, exchange, link, clock, iteration)

        # -- training: this edge's share of every minibatch, the fleet's gradient (or average) --
        if edge.trains:
            sync = s.schedule.parsed_encoder_sync()
            for epoch, minibatches in enumerate(schedule):
                for mb, idx in enumerate(minibatches):
                    fleet_idx, rows = edge.own(idx)
                    if len(rows):
                        with clock("encoder"):
                            features = edge.forward(rows)
                        with clock("codec"):
                            sent, (tensors, header) = exchange.send(features, fleet_idx)
                        with clock("link"):
                            link.send("train_fwd", tensors, {**header, "epoch": epoch, "mb": mb})
                            reply = expect(link, "train_bwd", epoch=epoch, mb=mb)
                        with clock("codec"):
                            grad = exchange.grad(sent, reply)
                        with clock("encoder"):
                            edge.backward(sent.out, grad)
                    last = mb == len(minibatches) - 1
                    if sync.name == "grad":  # every edge steps with the fleet's gradient
                        with clock("link"):
                            link.send("encoder_grad", edge.gradients(), {"epoch": epoch, "mb": mb})
                            summed = expect(link, "encoder_grad", epoch=epoch, mb=mb)
                        stop = stops(summed, last)
                        with clock("encoder"):
                            edge.set_gradients(summed)
                            edge.optimizer_step()
                        continue
                    if len(rows):  # avg: each edge steps with its own share's gradient ...
                        with clock("encoder"):
                            edge.optimizer_step()
                    stop = False
                    if sync.due(epoch, mb, len(minibatches)):  # ... and now and then the edges average
                        with clock("codec"):
                            change = edge.encoder_change(sync.sync)
                        with clock("link"):
                            link.send("encoder_avg", change, {"epoch": epoch, "mb": mb})
                            mean = expect(link, "encoder_avg", epoch=epoch, mb=mb)
                        stop = stops(mean, last)
                        with clock("codec"):
                            edge.take_average(mean)
                if stop:  # stage1 saw the KL pass --target-kl
                    break

        # -- iteration end -------------------------------------------------------------
        checkpoint = checkpoint_due(iteration, s.num_iterations, checkpoint_every)
        stats = stage0_finish(edge, exchange, link, clock, iteration, checkpoint, rollout, evaluation)
        if stats.get("share_encoder") is True:  # an edge joins the fleet now: it starts from this one's encoder
            with clock("link"):
                link.send("encoder_state", *edge.encoder_state())
        metrics.end(iteration, clock, stats, rollout)
    return metrics.records


class Roster:
    """Which of stage1's places (edge g: ``links[g]``) hold an edge of the fleet.

    An edge whose link fails (gone: its process died or it was unplugged; silent past ``--timeout``; an
    ``abort``; a message that breaks the protocol) is dropped at once: told why if it can still hear, never
    waited for again in that session, its samples of the iteration it was lost in left out of training
    (`members`). Training goes on with the rest. At each iteration's end a stage0 waiting at a free place
    is answered (`admit`) and given another edge's encoder (`welcome`): it joins for the next iteration.
    With fewer than ``min_edges`` edges stage1 waits there up to ``rejoin`` seconds for edges to come,
    and without them (or with none left) the failure ends the run.

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

    def expect(self, g: int, kind: str, **header: Any) -> Message | None:
        """`expect` on edge ``g``'s link; None if the edge was dropped, before or by this."""
        if not self.alive[g]:
            return None
        try:
            return expect(self.links[g], kind, **header)
        except LINK_ERRORS as exc:
            self.lose(g, exc)
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

    def resume(self, ours: Sequence[int]) -> int:
        """A resumed fleet, once started: the iteration it goes on after, sent to each edge (``resume``).

        That is the newest of stage1's checkpoints (``ours``) that at least ``min_edges`` of the edges in hold
        (0 when stage1 has none); of several learners, the newest such that every learner has. Edges answer their
        hellos first and learn the point only now: an edge may lack the newest (interrupted while it wrote it) or
        hold only old ones (one dropped earlier in the run, whose directory stopped there). An edge without the
        point, or whose hello has no ``checkpoints`` (started without --resume), is dropped as `lose` does; no
        such point at all is a `HandshakeError` rather than a silent start from scratch."""
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
        for g in self.live():
            self.send(g, "resume", header={"iteration": iteration})
        return iteration

    def welcome(self, joiners: list[int], source: int, iteration: int) -> None:
        """Give edges answered at the end of ``iteration`` (`admit`) the encoder of edge ``source``, which
        was asked for it (``share_encoder``); they are edges of the fleet from the next iteration. If the
        source is gone by now, they are told to come again."""
        msg = self.expect(source, "encoder_state", iteration=iteration) if source >= 0 else None
        for g in joiners:
            try:
                if msg is None:
                    raise PeerGone(f"edge {self.first + source}, whose encoder it was to start from, is gone; "
                                   "start again")
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


def _rollout_in_lock_step(learner: Learner, roster: Roster, busy: PhaseClock, per_edge: int) -> None:
    """Step t of every edge, one forward of the heads for all of them, each edge its actions; then t + 1. The
    actions are drawn in edge order from one generator: what 1 edge with every edge's envs in groups draws (of
    several learners, each edge's from its own step's generator, as `_rollout_as_they_come` draws)."""
    for t in range(learner.settings.ppo.num_steps):
        steps = roster.gather("step", t=t)
        with busy("heads"):
            replies = learner.act_groups([(roster.first + g, t, msg) for g, msg in steps],
                                         order_free=not learner.learners.alone)
        learner.stats["fleet/act_batch_mean"].append(float(len(steps) * per_edge))
        for (g, _), (tensors, header) in zip(steps, replies):
            roster.send(g, "action", tensors, {**header, "t": t})
    for g, msg in roster.gather("rollout_end"):
        with busy("heads"):
            learner.end_rollout(msg, roster.first + g)


LIVENESS_EVERY = 0.1
"""Seconds between looks at the liveness of edges whose next message has not come (``--act-wait``)."""


def _rollout_as_they_come(learner: Learner, roster: Roster, busy: PhaseClock, per_edge: int, wait: float) -> None:
    """Dynamic batching (``--act-wait`` seconds): the steps of the edges there, one forward of the heads for
    all of them once every edge still stepping has sent one or ``wait`` has passed since the first came; each
    edge at its own step. Actions are drawn per edge and step (`Learner.step_generator`), so the run is the
    same whoever comes first. An edge silent past its link's timeout, or gone, is dropped as in lock step."""
    steps = learner.settings.ppo.num_steps
    now = time.monotonic()
    todo = {g: 0 for g in roster.live()}  # each edge's next step; ``steps``: its rollout_end
    heard = dict.fromkeys(todo, now)  # when each edge last sent or was answered
    pending: dict[int, tuple[int, int, Message]] = {}  # edge -> its step waiting for an action
    first = looked = now
    while todo:
        waiting = [g for g in todo if g not in pending]
        for g in roster.pending(waiting, max(0.0, first + wait - now) if pending else LIVENESS_EVERY):
            t, now = todo[g], time.monotonic()
            heard[g] = now
            if t < steps:
                msg = roster.expect(g, "step", t=t)
                if msg is not None:
                    first = now if not pending else first
                    pending[g] = (roster.first + g, t, msg)
            else:
                msg = roster.expect(g, "rollout_end")
                if msg is not None:
                    with busy("heads"):
                        learner.end_rollout(msg, roster.first + g)
                    del todo[g]
        now = time.monotonic()
        if now >= looked + LIVENESS_EVERY:  # the edges that have not sent: gone, or silent too long?
            looked = now
            for g in [g for g in todo if g not in pending]:
                roster.check(g, silent=now - heard[g])
        for g in [g for g in todo if not roster.alive[g]]:
            del todo[g]
            pending.pop(g, None)
        if pending and (len(pending) == len(todo) or now >= first + wait):
            batch = list(pending.items())
            with busy("heads"):
                replies = learner.act_groups([step for _, step in batch], order_free=True)
            learner.stats["fleet/act_batch_mean"].append(float(len(batch) * per_edge))
            now = time.monotonic()
            for (g, (_, t, _)), (tensors, header) in zip(batch, replies):
                roster.send(g, "action", tensors, {**header, "t": t})
                todo[g], heard[g] = t + 1, now
            pending.clear()


def stage1_loop(learner: Learner, exchange: LearnerExchange, roster: Roster, run_log: RunLog | None = None,
                act_wait: float | None = None) -> int:
    """Every iteration from stage1's side, serving the edges of ``roster`` (started: `Roster.start`) until
    they close; returns the iterations served. ``learner`` learns as the whole fleet
    (`TrainSettings.fleet_view`), edge g's envs its group g, whether or not edge g is there.
    ``act_wait``: None, the rollout in lock step; seconds, as the edges come (`_rollout_as_they_come`)."""
    s = learner.settings
    per_edge = s.env.num_envs // roster.total
    learner.set_groups(roster.total)
    ours = torch.cat([learner.group_rows[roster.first + g] for g in range(len(roster.links))])
    sync = s.schedule.parsed_encoder_sync()
    for iteration in range(learner.train_iteration + 1, s.num_iterations + 1):
        busy = PhaseClock()
        cpu_start = time.process_time()

        # -- rollout: the edges' steps, one forward of the heads for those there --------
        learner.begin_rollout(iteration)
        if act_wait is None:
            _rollout_in_lock_step(learner, roster, busy, per_edge)
        else:
            _rollout_as_they_come(learner, roster, busy, per_edge, act_wait)
        with busy("heads"):
            rollout = learner.rollout_summary()
            learner.learners.merge_rollout(learner, ours)  # several learners: every learner's samples
            schedule = learner.begin_training(iteration)  # GAE over the fleet's samples

        # -- training: each edge's share of a minibatch, one step; the encoder's gradients summed --
        # An edge lost in the rollout holds none of the samples trained on; one lost now, none from here on.
        if not learner.trains_alone:
            for epoch, minibatches in enumerate(schedule):
                for mb, idx in enumerate(minibatches):
                    owner = idx % s.env.num_envs // per_edge
                    # Every share's features first, so the minibatch's members are known before any loss.
                    shares = [(g, share, roster.expect(g, "train_fwd", epoch=epoch, mb=mb))
                              for g, share in ((g, idx[owner == roster.first + g]) for g in roster.live())
                              if len(share)]
                    members = roster.members(idx, owner)
                    for g, share, msg in shares:
                        if msg is None or not roster.alive[g]:
                            continue
                        with busy("heads"):
                            tensors, header = exchange.learn(msg, share, members)
                        roster.send(g, "train_bwd", tensors, {**header, "epoch": epoch, "mb": mb})
                    with busy("heads"):
                        learner.optimizer_step()
                    stop = mb == len(minibatches) - 1 and learner.stop_early()
                    said = {"epoch": epoch, "mb": mb, **({"stop": True} if stop else {})}
                    if sync.name == "grad":
                        grads = roster.gather("encoder_grad", epoch=epoch, mb=mb)
                        with busy("heads"):
                            summed = learner.sum_gradients([msg for _, msg in grads])
                        for g, _ in grads:
                            roster.send(g, "encoder_grad", summed, said)
                    elif sync.due(epoch, mb, len(minibatches)):
                        changes = roster.gather("encoder_avg", epoch=epoch, mb=mb)
                        with busy("heads"):
                            mean = learner.average_encoders([msg for _, msg in changes], sync.sync)
                        for g, _ in changes:
                            roster.send(g, "encoder_avg", mean, said)
                if stop:
                    break

        # -- iteration end; edges that wait at free places join (below --min-edges, stage1 waits for them) --
        learner.learners.same_weights(learner.heads, f"their heads after training iteration {iteration}")
        ends = roster.gather("iter_end", iteration=iteration)
        joiners, waited = [], 0.0
        if iteration < s.num_iterations and roster.free():
            waited = roster.rejoin if len(ends) < roster.min_edges else 0.0
            joiners = roster.admit(iteration, waited)
        learner.stats["fleet/edges"].append(float(learner.learners.sum_count(len(ends))))
        learner.stats["fleet/dropped"].append(float(roster.dropped))
        learner.stats["fleet/joined"].append(float(roster.joined))  # joins of this iteration's end count next
        source = next((g for g, _ in ends if roster.alive[g]), None)  # gives a joiner its encoder
        extras = [{"share_encoder": True} if joiners and g == source else {} for g, _ in ends]
        stage1_finish(learner, exchange, [roster.link(g) for g, _ in ends], busy, iteration, schedule, run_log,
                      cpu_start, rollout, msgs=[msg for _, msg in ends], extras=extras)
        if joiners:
            roster.welcome(joiners, source if source is not None else -1, iteration)
        if waited:  # stage1 waited --rejoin seconds; a fleet that fell short later waits at the next end
            roster.require(waited)
    roster.gather("close")
    return s.num_iterations
