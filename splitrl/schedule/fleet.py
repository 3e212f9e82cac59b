"""The fleet: several edges (stage0 processes, ``--edges N``), one stage1, one policy.

Each edge runs the synchronous session of `sync.py` over a link of its own (stage1's port
pair ``PORT + 2 x edge``, docs/PROTOCOL.md section 15), its training `training.stage0_train`
with its share of each minibatch and the fleet's step; stage1 serves them all in lock step:

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

Edges come and go (`roster.Roster`): one whose link fails, or whose message does not fit what stage1 expects of
it (`splitrl.stages.door.Door`, checked as it arrives, before any batched code sees it), or whose values do not
hold once read on their own (rewards and features against the limits: `Learner.read_step`,
`LearnerExchange.features`; each encoder gradient or change: `EncoderSum.take`; the encoder it reports at
``iter_end``: `agreement.fleet_digests`), is dropped at once and the rest train on while ``--min-edges``
remain; a stage0 waiting at a free place joins at an iteration's end with a running edge's encoder and
optimizer state (``encoder_state``, relayed by stage1 once it is the fleet's: `agreement.StateCheck`).

Stage1 learns as one edge with every edge's envs, each edge's envs a group
(`TrainSettings.fleet_view`): N edges x E envs compute what 1 edge x N*E envs in N
rollout groups computes, but for the order of float sums (each share's loss and each
edge's gradients are added up separately).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from ..runs import RunLog
from ..stages import Edge, EdgeExchange, Learner, LearnerExchange
from ..stages.door import Door
from ..stages.evaluate import Evaluation
from ..stages.fleet_encoder import EncoderSum
from ..stages.learner import ReadStep
from ..transport import Message, Transport
from .common import (IterationLog, PhaseClock, checkpoint_due, expect, stage0_after_rollout, stage0_finish,
                     stage1_finish, stops)
from .agreement import StateCheck, fleet_digests
from .roster import Roster
from .sync import stage0_open, stage0_rollout
from .training import Part, Parts, Step, stage0_train

__all__ = ["stage0_open", "stage0_loop", "stage1_loop", "SOURCES"]

SOURCES = 2
"""Edges asked for their encoder when edges join (each sends it: the bytes of one more encoder state a join), so
that a joiner still starts from the fleet's encoder when the first one's is not (`agreement.StateCheck`)."""


def _own_share(edge: Edge) -> Parts:
    """A minibatch's part on this edge: the samples of it that it holds (`Edge.own`), sent with their indices
    in the fleet's; none when it holds no sample of it."""

    def parts(idx: torch.Tensor) -> list[Part]:
        fleet_idx, rows = edge.own(idx)
        return [(rows, fleet_idx, {})] if len(rows) else []

    return parts


def _fleet_step(edge: Edge, link: Transport, clock: PhaseClock) -> Step:
    """The end of a minibatch on an edge: with ``--encoder-sync grad`` a step with the fleet's summed gradient
    (``encoder_grad``); with ``avg`` a step with its own share's, and now and then the fleet's average
    (``encoder_avg``). Stage1 says with either reply whether the epochs stop."""
    sync = edge.settings.schedule.parsed_encoder_sync()

    def step(epoch: int, mb: int, minibatches: int, forwarded: bool, stop: bool) -> bool:
        last = mb == minibatches - 1
        if sync.name == "grad":  # every edge steps with the fleet's gradient
            with clock("link"):
                link.send("encoder_grad", edge.gradients(), {"epoch": epoch, "mb": mb})
                summed = expect(link, "encoder_grad", epoch=epoch, mb=mb)
            stop = stops(summed, last)
            with clock("encoder"):
                edge.set_gradients(summed)
                edge.optimizer_step()
            return stop
        if forwarded:  # avg: each edge steps with its own share's gradient ...
            with clock("encoder"):
                edge.optimizer_step()
        if not sync.due(epoch, mb, minibatches):
            return False
        with clock("codec"):  # ... and now and then the edges average
            change = edge.encoder_change(sync.sync)
        with clock("link"):
            link.send("encoder_avg", change, {"epoch": epoch, "mb": mb})
            mean = expect(link, "encoder_avg", epoch=epoch, mb=mb)
        stop = stops(mean, last)
        with clock("codec"):
            edge.take_average(mean)
        return stop

    return step


def stage0_loop(edge: Edge, exchange: EdgeExchange, link: Transport, *, measured: dict[str, Any],
                checkpoint_every: int = 10, evaluation: Evaluation | None = None) -> list[dict[str, Any]]:
    """Every iteration from one edge's side; returns its metrics records."""
    s = edge.settings
    sync = s.schedule.parsed_encoder_sync()
    edge.open_envs()
    metrics = IterationLog(edge, link, {**measured, "fleet/edge": edge.edge})
    for iteration in range(edge.train_iteration + 1, s.num_iterations + 1):
        clock = PhaseClock()
        metrics.start()

        # -- rollout: as the synchronous schedule's; stage1 answers every edge's step t together --
        stage0_rollout(edge, link, clock, iteration)
        rollout, order = stage0_after_rollout(edge, exchange, link, clock, iteration)

        # -- training: this edge's share of every minibatch, the fleet's gradient (or average) --
        if edge.trains:
            stage0_train(edge, exchange, link, clock, order, parts=_own_share(edge),
                         step=_fleet_step(edge, link, clock))

        # -- iteration end -------------------------------------------------------------
        checkpoint = checkpoint_due(iteration, s.num_iterations, checkpoint_every)
        stats = stage0_finish(edge, exchange, link, clock, iteration, checkpoint, rollout, evaluation,
                              extra={"encoder": edge.fleet.digests(moments=sync.name == "grad")})
        if stats.get("share_encoder") is True:  # an edge joins the fleet now: it starts from this one's encoder
            with clock("link"):
                link.send("encoder_state", *edge.encoder_state())
        metrics.end(iteration, clock, stats, rollout)
    return metrics.records


def _rollout_in_lock_step(learner: Learner, roster: Roster, busy: PhaseClock, per_edge: int) -> None:
    """Step t of every edge, one forward of the heads for all of them, each edge its actions; then t + 1. The
    actions are drawn in edge order from one generator: what 1 edge with every edge's envs in groups draws (of
    several learners, each edge's from its own step's generator, as `_rollout_as_they_come` draws)."""
    for t in range(learner.settings.ppo.num_steps):
        with busy("heads"):  # each edge's step read and checked on its own: one that fails is dropped here
            steps = [(g, read) for g, msg in roster.gather("step", t=t)
                     if (read := roster.judge(g, lambda msg=msg, g=g: learner.read_step(roster.first + g, t, msg)))
                     is not None]
            replies = learner.act_read([read for _, read in steps], order_free=not learner.learners.alone)
        learner.stats["fleet/act_batch_mean"].append(float(len(steps) * per_edge))
        for (g, _), (tensors, header) in zip(steps, replies):
            roster.send(g, "action", tensors, {**header, "t": t})
    for g, msg in roster.gather("rollout_end"):
        with busy("heads"):
            roster.judge(g, lambda msg=msg, g=g: learner.end_rollout(msg, roster.first + g))


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
    pending: dict[int, ReadStep] = {}  # edge -> its step, read, waiting for an action
    first = looked = now
    while todo:
        waiting = [g for g in todo if g not in pending]
        for g in roster.pending(waiting, max(0.0, first + wait - now) if pending else LIVENESS_EVERY):
            t, now = todo[g], time.monotonic()
            heard[g] = now
            if t < steps:
                msg = roster.expect(g, "step", t=t)
                with busy("heads"):
                    read = (roster.judge(g, lambda: learner.read_step(roster.first + g, t, msg))
                            if msg is not None else None)
                if read is not None:
                    first = now if not pending else first
                    pending[g] = read
            else:
                msg = roster.expect(g, "rollout_end")
                if msg is not None:
                    with busy("heads"):
                        roster.judge(g, lambda: learner.end_rollout(msg, roster.first + g))
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
                replies = learner.act_read([step for _, step in batch], order_free=True)
            learner.stats["fleet/act_batch_mean"].append(float(len(batch) * per_edge))
            now = time.monotonic()
            for (g, (_, t, _, _)), (tensors, header) in zip(batch, replies):
                roster.send(g, "action", tensors, {**header, "t": t})
                todo[g], heard[g] = t + 1, now
            pending.clear()


def _learn_shares(exchange: LearnerExchange, roster: Roster, busy: PhaseClock, idx: torch.Tensor, owner: torch.Tensor,
                  epoch: int, mb: int) -> None:
    """The loss of each edge's share of minibatch (epoch, mb) (``owner``: each sample's edge), its ``train_bwd``.
    Every share's features are read and checked first (an edge whose share fails is dropped), so that the
    minibatch's members are known before any loss. An edge that holds no sample of it sends nothing."""
    shares = []
    for g in roster.live():
        share = idx[owner == roster.first + g]
        msg = roster.expect(g, "train_fwd", rows=len(share), epoch=epoch, mb=mb) if len(share) else None
        if msg is not None:
            with busy("heads"):
                seen = roster.judge(g, lambda: exchange.features(msg, share))
            shares.append((g, share, msg, seen))
    members = roster.members(idx, owner)
    for g, share, msg, seen in shares:
        if seen is None or not roster.alive[g]:
            continue
        with busy("heads"):
            reply = roster.judge(g, lambda: exchange.learn(msg, share, members, seen=seen))
        if reply is not None:
            roster.send(g, "train_bwd", reply[0], {**reply[1], "epoch": epoch, "mb": mb})


def _sync_encoders(encoder: EncoderSum, roster: Roster, busy: PhaseClock, sync: str, said: dict[str, Any]) -> None:
    """Every edge's encoder gradient (``--encoder-sync grad``: ``encoder_grad``) or change (``avg``:
    ``encoder_avg``) after minibatch (epoch, mb) of ``said``, each taken on its own (held against
    --edge-grad-limit, clipped: `EncoderSum.take`; an edge whose one fails is dropped); their sum, or mean, to
    each edge, with ``said``."""
    kind, taken = f"encoder_{sync}", []
    for g, msg in roster.gather(kind, epoch=said["epoch"], mb=said["mb"]):
        with busy("heads"):
            part = roster.judge(g, lambda: encoder.take(msg))
        if part is not None:
            taken.append((g, part))
    with busy("heads"):
        parts = [part for _, part in taken]
        reply = encoder.sum_gradients(parts) if sync == "grad" else encoder.mean(parts)
    for g, _ in taken:
        roster.send(g, kind, reply, said)


def stage1_loop(learner: Learner, exchange: LearnerExchange, roster: Roster, run_log: RunLog | None = None,
                act_wait: float | None = None) -> int:
    """Every iteration from stage1's side, serving the edges of ``roster`` (started: `Roster.start`) until
    they close; returns the iterations served. ``learner`` learns as the whole fleet
    (`TrainSettings.fleet_view`), edge g's envs its group g, whether or not edge g is there.
    ``act_wait``: None, the rollout in lock step; seconds, as the edges come (`_rollout_as_they_come`)."""
    s = learner.settings
    per_edge = s.env.num_envs // roster.total
    learner.set_groups(roster.total)
    roster.door = Door(learner, per_edge)  # each edge's messages judged as they arrive
    ours = torch.cat([learner.groups.rows[roster.first + g] for g in range(len(roster.links))])
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
            order = learner.begin_training(iteration)  # GAE over the fleet's samples

        # -- training: each edge's share of a minibatch, one step; the encoder's gradients summed --
        # An edge lost in the rollout holds none of the samples trained on; one lost now, none from here on.
        if not learner.trains_alone:
            for epoch, minibatches in enumerate(order):
                for mb, idx in enumerate(minibatches):
                    _learn_shares(exchange, roster, busy, idx, idx % s.env.num_envs // per_edge, epoch, mb)
                    with busy("heads"):
                        learner.optimizer_step()
                    stop = mb == len(minibatches) - 1 and learner.stop_early()
                    said = {"epoch": epoch, "mb": mb, **({"stop": True} if stop else {})}
                    if sync.name == "grad" or sync.due(epoch, mb, len(minibatches)):
                        _sync_encoders(learner.encoder_sum, roster, busy, sync.name, said)
                if stop:
                    break

        # -- iteration end; edges that wait at free places join (below --min-edges, stage1 waits for them) --
        learner.learners.same_weights(learner.heads, f"their heads after training iteration {iteration}")
        ends = roster.gather("iter_end", iteration=iteration)
        fleet = fleet_digests(roster, ends, iteration)  # an edge whose encoder diverged is dropped, named
        ends = [(g, msg) for g, msg in ends if roster.alive[g]]
        joiners, waited = [], 0.0
        if iteration < s.num_iterations and roster.free():
            waited = roster.rejoin if len(ends) < roster.min_edges else 0.0
            joiners = roster.admit(iteration, waited)
        learner.stats["fleet/edges"].append(float(learner.learners.sum_count(len(ends))))
        learner.stats["fleet/dropped"].append(float(roster.dropped))
        learner.stats["fleet/joined"].append(float(roster.joined))  # joins of this iteration's end count next
        # Two edges give a joiner their encoder: if the first's is not the fleet's, the second's is taken.
        sources = [g for g, _ in ends if roster.alive[g]][:SOURCES] if joiners else []
        extras = [{"share_encoder": True} if g in sources else {} for g, _ in ends]
        stage1_finish(learner, exchange, [roster.link(g) for g, _ in ends], busy, iteration, order, run_log,
                      cpu_start, rollout, msgs=[msg for _, msg in ends], extras=extras,
                      places=[roster.first + g for g, _ in ends])
        if joiners:
            roster.welcome(joiners, sources, iteration, StateCheck(fleet or {}, learner.limits, iteration,
                                                                   iteration * s.steps_per_iteration))
        if waited:  # stage1 waited --rejoin seconds; a fleet that fell short later waits at the next end
            roster.require(waited)
    roster.gather("close")
    return s.num_iterations
