"""The pipelined schedule: both stages busy at once, the link's latency hidden behind work.

The synchronous schedule (`sync.py`) makes each side wait for the other at every
message. This one keeps several messages in flight, with the same messages and
the same learning maths (docs/PROTOCOL.md section 11; ``g`` and ``j`` join the
headers):

- rollout: stage0's envs are cut into K groups (``--rollout-groups``) that take
  turns, as in Sample Factory's double-buffered sampling: stage0 takes one
  group's action, steps that group and sends its next step, then goes on to the
  next group, so a group's round trip (and stage1's acting for it) runs while
  the other groups step. With ``--vector async`` a group's step is finished one
  turn later (`rollout_lag`), so two groups' worker envs step at once. The policy is
  fixed within a rollout and the order of the messages is fixed, so the twin with
  the same K computes the same numbers bit for bit.
- training: each minibatch goes in M micro-batches (``--microbatches``, GPipe):
  stage0 sends each micro-batch's forward as soon as it is computed, so stage1's
  heads work on micro-batch j while stage0 forwards j + 1; then stage0
  back-propagates each gradient as it arrives. Each stage takes its micro-batches
  at once on worker threads where its network allows (`workers`), with the
  numbers of one after another. Gradients add up; one optimizer
  step per minibatch on each side, so with lossless codecs the update is the
  unpipelined one up to the order of float sums (codecs that choose per message,
  such as ef's top-k, choose per micro-batch).

Before the first iteration stage0 measures the round trip (``ping``/``pong``)
and, with ``--rollout-groups auto``, picks K >= 1 + lag + RTT / (group step time) among
the divisors of the env count; ``plan`` tells stage1 the K it chose.

The rollout and training halves are functions of their own (each stage's training:
`training.stage0_train` and `training.stage1_train` with `training.microbatches`): the asynchronous schedule
(`asynchronous.py`) runs the same ones on two threads.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any, Callable

import numpy as np
import torch

from ..envs import make_single_env
from ..runs import RunLog
from ..stages import Edge, EdgeExchange, Learner, LearnerExchange
from ..stages.evaluate import Evaluation
from ..transport import ProtocolError, Transport
from ..transport.errors import peer_repr
from .common import (TIMELINE, IterationLog, PhaseClock, checkpoint_due, expect, stage0_after_rollout, stage0_finish,
                     stage1_finish)
from .training import microbatches, stage0_train, stage1_train

__all__ = ["stage0_open", "stage1_open", "stage0_loop", "stage1_loop", "agree_on_groups", "learn_groups",
           "stage0_rollout", "stage1_rollout", "choose_groups", "rollout_lag", "PINGS"]

log = logging.getLogger(__name__)

PINGS = 5
"""Round trips timed before the first iteration; the fastest counts (the others met start-up noise)."""


def rollout_lag(groups: int, vector: str) -> int:
    """Turns a group's step stays under way before stage0 waits for it: 1 with worker envs (so two groups
    step at once while stage0 takes the next action), 0 with in-process envs (the step happens in the
    wait); never so many that no group is left on the link (at most K - 1)."""
    return min(1 if vector == "async" else 0, groups - 1)


NEGLIGIBLE_RTT = 0.1
"""A round trip under this fraction of a group step is not worth more, smaller messages: one group."""


def choose_groups(num_envs: int, rtt: float, step_seconds: float, parallel: bool = True) -> int:
    """The fewest groups that hide the round trip, a divisor of ``num_envs``.

    stage0 serves the groups in turn, one group step each (``step_seconds`` when the group's envs step
    at once in worker processes, ``parallel``; group size x that in stage0's process). A group's next
    step goes out ``lag`` turns after its action came (`rollout_lag`) and its next action is needed K
    turns after that action, so K - 1 - lag turns must cover the round trip:
    K >= 1 + lag + RTT / group step."""
    divisors = [k for k in range(1, num_envs + 1) if num_envs % k == 0]
    for k in divisors:
        group_step = max(step_seconds, 1e-6) * (1 if parallel else num_envs // k)
        need = rtt / group_step
        if need < NEGLIGIBLE_RTT or k >= 1 + rollout_lag(k, "async" if parallel else "sync") + need:
            return k
    return divisors[-1]


def _env_step_seconds(edge: Edge, steps: int = 20) -> float:
    """Median time of one env step, on a throwaway env (the training envs' state is not touched)."""
    env = make_single_env(edge.settings.env)
    try:
        env.reset(seed=edge.settings.seed + 10_007)
        rng = np.random.default_rng(0)
        times = []
        for _ in range(steps):
            action = rng.uniform(edge.low, edge.high).astype(np.float32)
            start = time.perf_counter()
            _, _, terminated, truncated, _ = env.step(action)
            times.append(time.perf_counter() - start)
            if terminated or truncated:
                env.reset()
    finally:
        env.close()
    return float(np.median(times))


def agree_on_groups(edge: Edge, link: Transport) -> dict[str, Any]:
    """stage0: time the round trip, choose the env groups, tell stage1 (``plan``); returns what it measured."""
    rtts = []
    for i in range(PINGS):
        start = time.perf_counter()
        link.send("ping", header={"i": i})
        expect(link, "pong", i=i)
        rtts.append(time.perf_counter() - start)
    rtt = min(rtts)
    groups = edge.settings.schedule.groups(edge.settings.env.num_envs)
    step_seconds = None
    if groups is None:
        step_seconds = _env_step_seconds(edge)
        groups = choose_groups(edge.settings.env.num_envs, rtt, step_seconds, parallel=edge.envs.vector == "async")
    link.send("plan", header={"rollout_groups": groups})
    edge.set_groups(groups)
    log.info("[stage0] round trip %.2f ms; %d env group(s)%s", 1e3 * rtt, groups,
             "" if step_seconds is None else f" (auto: env step {1e3 * step_seconds:.1f} ms)")
    return {"link/rtt_ms": 1e3 * rtt, "schedule/rollout_groups": groups}


def learn_groups(learner: Learner, link: Transport) -> int:
    """stage1: answer the pings, take the ``plan``."""
    for i in range(PINGS):
        expect(link, "ping", i=i)
        link.send("pong", header={"i": i})
    groups = expect(link, "plan").header.get("rollout_groups")
    wanted = learner.settings.schedule.groups(learner.settings.env.num_envs)
    n = learner.settings.env.num_envs
    if not isinstance(groups, int) or groups < 1 or n % groups or wanted not in (None, groups):
        raise ProtocolError(f"plan: expected rollout_groups dividing {n}"
                            f"{'' if wanted is None else f' (the settings say {wanted})'}, got {peer_repr(groups)}")
    learner.set_groups(groups)
    return groups


# -- the halves ---------------------------------------------------------------------------


def stage0_rollout(edge: Edge, link: Transport, clock: PhaseClock, iteration: int, *,
                   versions: Callable[[int], int] | None = None) -> None:
    """One rollout with the env groups taking turns. ``versions(t)``: the acting weights' version for the message
    of step t (T - 1 for ``rollout_end``), having adopted it, for the asynchronous schedule: each message is
    tagged with it."""
    steps, groups = edge.settings.ppo.num_steps, range(len(edge.groups))

    def tags(step: int, **header: int) -> dict[str, int]:
        # Taken before the message's features (and the outcome before them) are encoded: one version a message.
        return {**header, "v": versions(step)} if versions is not None else header

    def send_step(t: int, g: int, header: dict[str, int]) -> None:
        with clock("encoder"):
            tensors, codec_header = edge.observe(t, g)
        with clock("link"):
            link.send("step", tensors, {**codec_header, **header})

    def finish(t: int, g: int) -> None:
        header = tags(t + 1, t=t + 1, g=g) if t + 1 < steps else tags(t, g=g)
        with clock("env"):
            edge.finish_step(g)
        if t + 1 < steps:
            send_step(t + 1, g, header)
            return
        with clock("encoder"):
            tensors, codec_header = edge.end_rollout(g)
        with clock("link"):
            link.send("rollout_end", tensors, {**codec_header, **header})

    # One group at a time, in a fixed order: take its action, step it, send its next step; the other
    # groups' steps are on the link (or in stage1) meanwhile. With worker envs a group's step is
    # finished one turn later (`rollout_lag`), so two groups' envs step at once.
    lag = rollout_lag(len(groups), edge.envs.vector)
    edge.begin_rollout(iteration)
    for g in groups:
        send_step(0, g, tags(0, t=0, g=g))
    stepping: deque[tuple[int, int]] = deque()
    for t in range(steps):
        for g in groups:
            with clock("link"):
                action = expect(link, "action", t=t, g=g)
            with clock("env"):
                edge.begin_step(action, g)
            stepping.append((t, g))
            if len(stepping) > lag:
                finish(*stepping.popleft())
    while stepping:
        finish(*stepping.popleft())


def stage1_rollout(learner: Learner, link: Transport, busy: PhaseClock, iteration: int, *,
                   adopt: Callable[[Any], None] | None = None, timeout: float | None = None) -> None:
    """One rollout, groups in the order stage0 sends them. ``adopt(version)``: called with each
    message's acting version before it is used (the asynchronous schedule); ``timeout``: each receive's
    (default: the link's)."""
    learner.begin_rollout(iteration)
    for t in range(learner.settings.ppo.num_steps):
        for g in range(len(learner.groups)):
            msg = expect(link, "step", timeout=timeout, t=t, g=g)
            if adopt is not None:
                adopt(msg.header.get("v"))
            with busy("heads"):
                tensors, header = learner.act(t, msg, g)
            link.send("action", tensors, {**header, "t": t, "g": g})
    for g in range(len(learner.groups)):
        msg = expect(link, "rollout_end", timeout=timeout, g=g)
        if adopt is not None:
            adopt(msg.header.get("v"))
        with busy("heads"):
            learner.end_rollout(msg, g)


stage0_open, stage1_open = agree_on_groups, learn_groups
"""The session's opening after the hellos: the round trip timed, the env groups agreed. The runner calls them
apart from the loops so that a resumed run sets this opening aside from its byte counters, as it does the hellos."""


# -- the loops -----------------------------------------------------------------------------


def stage0_loop(edge: Edge, exchange: EdgeExchange, link: Transport, *, measured: dict[str, Any],
                checkpoint_every: int = 10, evaluation: Evaluation | None = None) -> list[dict[str, Any]]:
    """Every iteration from stage0's side, rollout then training, each pipelined; returns the metrics records."""
    s = edge.settings
    edge.open_envs()
    metrics = IterationLog(edge, link, extra=measured)
    for iteration in range(edge.train_iteration + 1, s.num_iterations + 1):  # from a checkpoint's, if resumed
        clock = PhaseClock()
        metrics.start()
        with TIMELINE.stretch("rollout"):  # traced runs: each stretch's wall and CPU (benchmarks/timeline.py)
            stage0_rollout(edge, link, clock, iteration)
        rollout, order = stage0_after_rollout(edge, exchange, link, clock, iteration)
        if edge.trains:
            with TIMELINE.stretch("training"):
                stage0_train(edge, exchange, link, clock, order, parts=microbatches(s.schedule.microbatches))
        checkpoint = checkpoint_due(iteration, s.num_iterations, checkpoint_every)
        stats = stage0_finish(edge, exchange, link, clock, iteration, checkpoint, rollout, evaluation)
        metrics.end(iteration, clock, stats, rollout)
    return metrics.records


def stage1_loop(learner: Learner, exchange: LearnerExchange, link: Transport, run_log: RunLog | None = None) -> int:
    """Every iteration from stage1's side, until stage0 closes; returns the iterations served."""
    s = learner.settings
    for iteration in range(learner.train_iteration + 1, s.num_iterations + 1):
        busy = PhaseClock()
        cpu_start = time.process_time()
        with TIMELINE.stretch("rollout"):
            stage1_rollout(learner, link, busy, iteration)
        rollout = learner.rollout_summary()
        with busy("heads"):
            order = learner.begin_training(iteration)  # GAE
            update = exchange.update()
        if update is not None:
            link.send("heads", *update)
        if not learner.trains_alone:
            with TIMELINE.stretch("training"):
                stage1_train(learner, exchange, link, busy, order, parts=microbatches(s.schedule.microbatches))
        stage1_finish(learner, exchange, link, busy, iteration, order, run_log, cpu_start, rollout)
    expect(link, "close")
    return s.num_iterations
