"""The fleet: several edges (stage0 processes, ``--edges N``), one stage1, one policy.

Each edge runs the synchronous session of `sync.py` over a link of its own (stage1's port
pair ``PORT + 2 x edge``, docs/PROTOCOL.md section 15); stage1 serves them all in lock step:

1. rollout: step ``t`` from every edge, then one forward of the heads for all of them
   (`Learner.act_groups`: dynamic batching, the batch is the fleet) and each edge its
   actions; then every edge's ``rollout_end``;
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

Stage1 learns as one edge with every edge's envs, each edge's envs a group
(`TrainSettings.fleet_view`): N edges x E envs compute what 1 edge x N*E envs in N
rollout groups computes, but for the order of float sums (each share's loss and each
edge's gradients are added up separately).
"""

from __future__ import annotations

import time
from typing import Any, Sequence

from ..runs import RunLog
from ..stages import Edge, EdgeExchange, Learner, LearnerExchange
from ..stages.evaluate import Evaluation
from ..transport import Transport
from .common import (IterationLog, PhaseClock, checkpoint_due, expect, stage0_after_rollout, stage0_finish,
                     stage1_finish, stops)
from .sync import stage0_rollout

__all__ = ["stage0_loop", "stage1_loop"]


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
        metrics.end(iteration, clock, stats, rollout)
    return metrics.records


def stage1_loop(learner: Learner, exchange: LearnerExchange, links: Sequence[Transport],
                run_log: RunLog | None = None) -> int:
    """Every iteration from stage1's side, serving every edge (``links[g]`` is edge g's), until all close;
    returns the iterations served. ``learner`` learns as the whole fleet (`TrainSettings.fleet_view`)."""
    s = learner.settings
    edges, per_edge = len(links), s.env.num_envs // len(links)
    learner.set_groups(edges)  # edge g's envs are group g
    sync = s.schedule.parsed_encoder_sync()
    for iteration in range(learner.train_iteration + 1, s.num_iterations + 1):
        busy = PhaseClock()
        cpu_start = time.process_time()

        # -- rollout: every edge's step t, one forward of the heads for all of them --------
        learner.begin_rollout(iteration)
        for t in range(s.ppo.num_steps):
            steps = [(g, expect(link, "step", t=t)) for g, link in enumerate(links)]
            with busy("heads"):
                replies = learner.act_groups(t, steps)
            for link, (tensors, header) in zip(links, replies):
                link.send("action", tensors, {**header, "t": t})
        for g, link in enumerate(links):
            msg = expect(link, "rollout_end")
            with busy("heads"):
                learner.end_rollout(msg, g)
        with busy("heads"):
            rollout = learner.rollout_summary()
            schedule = learner.begin_training(iteration)  # GAE over the fleet's samples
        learner.stats["fleet/act_batch_mean"].append(float(s.env.num_envs))

        # -- training: each edge's share of a minibatch, one step; the encoder's gradients summed --
        if not learner.trains_alone:
            for epoch, minibatches in enumerate(schedule):
                for mb, idx in enumerate(minibatches):
                    owner = idx % s.env.num_envs // per_edge
                    for g, link in enumerate(links):
                        share = idx[owner == g]
                        if not len(share):
                            continue
                        msg = expect(link, "train_fwd", epoch=epoch, mb=mb)
                        with busy("heads"):
                            tensors, header = exchange.learn(msg, share, idx)
                        link.send("train_bwd", tensors, {**header, "epoch": epoch, "mb": mb})
                    with busy("heads"):
                        learner.optimizer_step()
                    stop = mb == len(minibatches) - 1 and learner.stop_early()
                    said = {"epoch": epoch, "mb": mb, **({"stop": True} if stop else {})}
                    if sync.name == "grad":
                        grads = [expect(link, "encoder_grad", epoch=epoch, mb=mb) for link in links]
                        with busy("heads"):
                            summed = learner.sum_gradients(grads)
                        for link in links:
                            link.send("encoder_grad", summed, said)
                    elif sync.due(epoch, mb, len(minibatches)):
                        changes = [expect(link, "encoder_avg", epoch=epoch, mb=mb) for link in links]
                        with busy("heads"):
                            mean = learner.average_encoders(changes, sync.sync)
                        for link in links:
                            link.send("encoder_avg", mean, said)
                if stop:
                    break

        # -- iteration end (with the cut before the first layer, stage1 trains now) ------
        stage1_finish(learner, exchange, links, busy, iteration, schedule, run_log, cpu_start, rollout)
    for link in links:
        expect(link, "close")
    return s.num_iterations
