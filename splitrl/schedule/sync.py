"""The synchronous schedule: the two stages take turns, one message at a time.

Both loops are here, stage0's first. Read them side by side: every ``send`` on
one side is an ``expect`` on the other, in the same order (docs/PROTOCOL.md
section 11); stage0's training minibatches are `training.stage0_train`'s, each
in one part. Stage0 drives; stage1 reacts. Per iteration:

1. rollout: ``num_steps`` round trips (features -> action), then ``rollout_end``;
2. training: ``epochs x minibatches`` round trips (``train_fwd`` -> ``train_bwd``),
   each followed by a ``heads`` update when the replica exchange asks for one;
3. iteration end: ``iter_end`` -> ``iter_stats``, checkpoints, the metrics line.

The stages compute (`splitrl.stages`); this module only decides when, and
times each phase for the metrics (``time/env``, ``time/encoder``, ...).
"""

from __future__ import annotations

import time
from typing import Any

from ..runs import RunLog
from ..stages import Edge, EdgeExchange, Learner, LearnerExchange
from ..stages.evaluate import Evaluation
from ..transport import Transport
from .common import (TIMELINE, IterationLog, PhaseClock, checkpoint_due, expect, stage0_after_rollout,
                     stage0_finish, stage1_finish)
from .training import stage0_train, stage1_train

__all__ = ["stage0_open", "stage1_open", "stage0_loop", "stage1_loop", "stage0_rollout"]


def stage0_open(edge: Edge, link: Transport) -> dict[str, Any]:
    """The session's opening after the hellos: this schedule has nothing to agree on (the overlapping ones time
    the round trip and choose env groups); returns what it measured for every metrics line."""
    return {}


def stage1_open(learner: Learner, link: Transport) -> None:
    """stage1's side of `stage0_open`: nothing."""


def stage0_rollout(edge: Edge, link: Transport, clock: PhaseClock, iteration: int) -> None:
    """One rollout, one round trip per env step: features (with the last outcome) -> action, then
    ``rollout_end``."""
    edge.begin_rollout(iteration)
    for t in range(edge.settings.ppo.num_steps):
        with clock("encoder"):
            tensors, header = edge.observe(t)
        with clock("link"):
            link.send("step", tensors, {**header, "t": t})
            action = expect(link, "action", t=t)
        with clock("env"):
            edge.step(action)
    with clock("encoder"):
        end = edge.end_rollout()
    with clock("link"):
        link.send("rollout_end", *end)


def stage0_loop(edge: Edge, exchange: EdgeExchange, link: Transport, *, measured: dict[str, Any],
                checkpoint_every: int = 10, evaluation: Evaluation | None = None) -> list[dict[str, Any]]:
    """Every iteration from stage0's side; returns the metrics records."""
    s = edge.settings
    edge.open_envs()
    metrics = IterationLog(edge, link, extra=measured)
    for iteration in range(edge.train_iteration + 1, s.num_iterations + 1):  # from a checkpoint's, if resumed
        clock = PhaseClock()
        metrics.start()

        # -- rollout: one round trip per env step ------------------------------------
        with TIMELINE.stretch("rollout"):
            stage0_rollout(edge, link, clock, iteration)
        clock.seconds["link_rollout"] = clock.seconds["link"]  # the rollout's share: the planner splits them
        rollout, order = stage0_after_rollout(edge, exchange, link, clock, iteration)  # and the replica's update

        # -- training: one round trip per minibatch ------------------------------------
        if edge.trains:
            with TIMELINE.stretch("training"):
                stage0_train(edge, exchange, link, clock, order)

        # -- iteration end: iter_end -> stage1's statistics, checkpoints, the metrics line --
        checkpoint = checkpoint_due(iteration, s.num_iterations, checkpoint_every)
        stats = stage0_finish(edge, exchange, link, clock, iteration, checkpoint, rollout, evaluation)
        metrics.end(iteration, clock, stats, rollout)
    return metrics.records


def stage1_loop(learner: Learner, exchange: LearnerExchange, link: Transport, run_log: RunLog | None = None) -> int:
    """Every iteration from stage1's side, until stage0 closes; returns the iterations served."""
    s = learner.settings
    for iteration in range(learner.train_iteration + 1, s.num_iterations + 1):
        busy = PhaseClock()  # our own compute, not the time spent waiting for stage0
        cpu_start = time.process_time()

        # -- rollout: act on every step, then GAE --------------------------------------
        learner.begin_rollout(iteration)
        with TIMELINE.stretch("rollout"):
            for t in range(s.ppo.num_steps):
                msg = expect(link, "step", t=t)
                with busy("heads"):
                    tensors, header = learner.act(t, msg)
                link.send("action", tensors, {**header, "t": t})
        busy.seconds["heads_rollout"] = busy.seconds["heads"]
        msg = expect(link, "rollout_end")
        with busy("heads"):
            learner.end_rollout(msg)
            rollout = learner.rollout_summary()
            order = learner.begin_training(iteration)  # GAE
            update = exchange.update()
        if update is not None:
            link.send("heads", *update)

        # -- training: one PPO update per minibatch, on what stage0 sends --------------
        if not learner.trains_alone:
            with TIMELINE.stretch("training"):
                stage1_train(learner, exchange, link, busy, order)

        # -- iteration end (with the cut before the first layer, stage1 trains now) ----
        stage1_finish(learner, exchange, link, busy, iteration, order, run_log, cpu_start, rollout)
    expect(link, "close")
    return s.num_iterations
