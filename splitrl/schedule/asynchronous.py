"""The asynchronous schedule: the rollout of iteration i + 1 runs while iteration i trains.

Each stage runs two loops at once, on two threads, over one link cut into two
channels (`splitrl.transport.channels`): the rollout thread runs
`pipelined.stage0_rollout` / `stage1_rollout` with its own copy of the layers it
acts with, the training thread `training.stage0_train` / `stage1_train` on the
layers it trains. When an iteration's training ends, both stages publish the
trained layers (`Edge.publish`, `Learner.publish`) and stage0's rollout thread
adopts them between two steps, tagging each step with the version it acted with
(``v``); stage1's rollout thread adopts the heads of that version before it acts
(PipelineRL's in-flight weight update: one rollout may span two versions). So
the encoder and the heads that act on a step are always of one version.

With ``--publish epoch`` both stages publish after every epoch and a version
counts epochs (P = E of them an iteration, `TrainSettings.versions_per_iteration`;
P = 1 otherwise). The rollout is then paced rather than free (`paced_version`):
step t of iteration i's rollout (T steps) acts with the weights after
floor(t * P / T) epochs of iteration i - 1's training, waiting for them if they
are not there yet, so the rollout spans that training, its samples lag P down to
1 epochs, and which weights act on a step does not depend on the machines' speed
(split and twin compute the same numbers).

A sample acted on by version v and trained on in iteration i lags by
``(i - 1) * P - v`` versions (reported in iterations). PPO's ratio is taken against the log-probability of the
policy that acted (stored with the sample); its value targets get truncated
importance weights where it lags (`Learner.begin_training`); ``async/staleness_mean``
and ``async/staleness_max`` go to the metrics. ``--max-staleness S`` bounds the
lag: the rollout of iteration i starts only once iteration i - 1 - S has trained
(S + 1 rollouts are stored), so the rollouts are produced no faster than training
consumes them. S = 0 takes turns, as the pipelined schedule does.

With ``--rescore`` each iteration's training begins with one more pass over its
rollout: stage0 sends the features its encoder gives the stored observations now
(``rescore``, `RESCORE_ROWS` samples a message, through the fwd codec), and
stage1 scores every sample with the heads that start training
(`Learner.rescore`), so the proximal policy, the importance weights and the
value baseline are all of the network that trains (`Learner.begin_training`).
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any, Callable, Iterator

import torch

from ..runs import RunLog
from ..stages import Edge, EdgeExchange, Learner, LearnerExchange
from ..stages.evaluate import Evaluation
from ..transport import ProtocolError, Transport
from ..transport.errors import peer_repr
from ..transport.channels import Channels
from .common import IterationLog, PhaseClock, checkpoint_due, expect, stage0_finish, stage1_finish, torch_thread
from .pipelined import stage0_open, stage0_rollout, stage1_open, stage1_rollout
from .training import microbatches, stage0_train, stage1_train

__all__ = ["stage0_open", "stage1_open", "stage0_loop", "stage1_loop", "STAGE0_ROUTES", "STAGE1_ROUTES"]

STAGE0_ROUTES = {"action": "rollout", "train_bwd": "train", "heads": "train", "progress": "train", "iter_stats": "train",
                 "eval_heads": "train"}
"""What stage0 receives, by channel."""
STAGE1_ROUTES = {"step": "rollout", "rollout_end": "rollout", "train_fwd": "train", "rescore": "train",
                 "iter_end": "train",
                 "close": "train"}
"""What stage1 receives, by channel."""

_WAIT_S = 0.5
"""How often a waiting thread looks up to see whether the other one failed."""

RESCORE_ROWS = 512
"""Samples per ``rescore`` message (``--rescore``): 4 MiB of bfloat16 features at the paper's width."""


def _rescore_chunks(samples: int) -> list[torch.Tensor]:
    return list(torch.arange(samples).split(RESCORE_ROWS))


def stage0_rescore(edge: Edge, exchange: EdgeExchange, link: Transport, clock: PhaseClock, iteration: int) -> None:
    """``--rescore``: the rollout's observations through the encoder that starts training, to stage1."""
    for part, idx in enumerate(_rescore_chunks(edge.settings.steps_per_iteration)):
        with clock("encoder"):
            features = edge.features_now(idx)
        with clock("codec"):
            _, (tensors, header) = exchange.send(features, idx)
        with clock("link"):
            link.send("rescore", tensors, {**header, "iteration": iteration, "part": part})


def stage1_rescore(learner: Learner, exchange: LearnerExchange, link: Transport, busy: PhaseClock,
                   iteration: int) -> None:
    """``--rescore``: every sample of the rollout scored by the heads that start training (`stage0_rescore`'s
    features; the stored inputs when stage1 holds the whole network)."""
    learner.begin_rescore(iteration)
    chunks = _rescore_chunks(learner.settings.steps_per_iteration)
    if learner.trains_alone:
        with busy("heads"):
            learner.rescore_stored(chunks)
        return
    for part, idx in enumerate(chunks):
        msg = expect(link, "rescore", iteration=iteration, part=part)
        with busy("heads"):
            exchange.rescore(msg, idx)


def paced_version(iteration: int, t: int, steps: int, per_iteration: int, first: int) -> int:
    """``--publish epoch``: the version step ``t`` of ``iteration``'s rollout (``steps`` long) acts with: the weights
    after floor(t * P / T) epochs of iteration - 1's training, or those the run starts from (``first``: its first
    iteration) where that is earlier."""
    return max((first - 1) * per_iteration, (iteration - 2) * per_iteration + t * per_iteration // steps)


def epoch_versions(iteration: int, epoch: int, last: bool, per_iteration: int) -> list[int]:
    """The versions the weights after ``epoch`` of ``iteration``'s training are published as: one an epoch with
    --publish epoch (P = epochs), at the last epoch every number up to the iteration's end (an early stop,
    --target-kl, publishes the same weights under the epochs it skipped); with P = 1 only the last, as i."""
    if not last:
        return [(iteration - 1) * per_iteration + epoch + 1] if per_iteration > 1 else []
    return list(range((iteration - 1) * per_iteration + min(epoch + 1, per_iteration), iteration * per_iteration + 1))


class _Progress:
    """What the two threads of one stage tell each other: rollouts collected, versions published (P an iteration:
    `TrainSettings.versions_per_iteration`), a failure."""

    def __init__(self, per_iteration: int, first: int) -> None:
        self.cond = threading.Condition()
        self.per_iteration = per_iteration
        self.collected = first - 1
        self.published = (first - 1) * per_iteration
        self.error: BaseException | None = None

    @property
    def trained(self) -> int:
        """Iterations trained: an iteration's end is its last version, i * P (an epoch before it is below it)."""
        return self.published // self.per_iteration

    def publish(self, publish: Callable[[list[int]], Any], iteration: int, epoch: int, last: bool) -> None:
        """``publish`` the weights after ``epoch`` of ``iteration``'s training under their versions
        (`epoch_versions`, if it has any), then tell the other thread."""
        versions = epoch_versions(iteration, epoch, last, self.per_iteration)
        if versions:
            publish(versions)
            self.set(published=versions[-1])

    def wait(self, ready: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        with self.cond:
            while not ready():
                if self.error is not None:
                    raise RuntimeError(f"stopped waiting for {what}: the other thread failed") from self.error
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"waited {timeout:g} s for {what}")
                self.cond.wait(min(left, _WAIT_S))

    def set(self, **values: Any) -> None:
        with self.cond:
            for key, value in values.items():
                setattr(self, key, value)
            self.cond.notify_all()

    def fail(self, exc: BaseException, channels: Channels) -> None:
        """Stop both threads: the first failure is the one reported; waits and receives raise from now on."""
        with self.cond:
            if self.error is None:
                self.error = exc
            self.cond.notify_all()
        channels.fail(exc)


@contextlib.contextmanager
def _alongside(name: str, rollout: Callable[[], None], progress: _Progress, channels: Channels) -> Iterator[None]:
    """Run ``rollout`` on a thread while the body (the training) runs. Whichever fails first stops the
    other (`_Progress.fail`); on the way out the thread is joined and the first failure raised, except that a
    KeyboardInterrupt in the body is how the stage ends whatever came first: a terminal's Ctrl-C reaches both
    stages, and the peer's abort can reach the rollout thread while this thread sits in a torch call (a signal's
    handler runs only between bytecodes)."""

    def run() -> None:
        try:
            rollout()
        except BaseException as exc:
            progress.fail(exc, channels)  # wakes the training thread, whatever it waits on

    thread = torch_thread(run, name)
    thread.start()
    interrupted = False
    try:
        yield
    except BaseException as exc:  # Ctrl-C or a failure: the rollout thread stops too
        interrupted = isinstance(exc, KeyboardInterrupt)
        progress.fail(exc, channels)
        raise
    finally:
        thread.join(timeout=10 + channels.link.timeout)
        channels.close()
        if progress.error is not None and not interrupted:
            raise progress.error
        if thread.is_alive():
            raise RuntimeError(f"the {name} thread did not stop")


def stage0_loop(edge: Edge, exchange: EdgeExchange, link: Transport, *, measured: dict[str, Any],
                checkpoint_every: int = 10, evaluation: Evaluation | None = None) -> list[dict[str, Any]]:
    """stage0: the rollout thread collects ahead of training within the staleness bound; returns the records."""
    s = edge.settings
    edge.open_envs()
    channels = Channels(link, STAGE0_ROUTES)
    rollout_link, train_link = channels["rollout"], channels["train"]
    clocks: dict[int, PhaseClock] = {}
    rollouts: dict[int, dict[str, Any]] = {}
    bound, timeout = s.schedule.max_staleness, link.timeout

    first = edge.train_iteration + 1  # from a checkpoint's, if resumed
    per_iteration = s.versions_per_iteration
    progress = _Progress(per_iteration, first)

    def versions(iteration: int, clock: PhaseClock) -> Callable[[int], int]:
        if s.schedule.publish != "epoch":
            return lambda t: edge.adopt()  # the newest

        def paced(t: int) -> int:
            version = paced_version(iteration, t, s.ppo.num_steps, per_iteration, first)
            if progress.published < version:  # (read without the lock: it only grows)
                with clock("pace"):
                    progress.wait(lambda: progress.published >= version, timeout * s.num_iterations,
                                  f"policy version {version} to act with")
            return edge.adopt(version)
        return paced

    def collect() -> None:
        for iteration in range(first, s.num_iterations + 1):
            progress.wait(lambda: progress.trained >= iteration - 1 - bound, timeout * s.num_iterations,
                          f"iteration {iteration - 1 - bound} to train")
            clock = clocks[iteration] = PhaseClock()
            stage0_rollout(edge, rollout_link, clock, iteration, versions=versions(iteration, clock))
            rollouts[iteration] = edge.rollout_summary()
            progress.set(collected=iteration)

    def publish(iteration: int, epoch: int, last: bool) -> None:
        progress.publish(edge.publish, iteration, epoch, last)

    metrics = IterationLog(edge, train_link, extra=measured)
    with _alongside("stage0 rollout", collect, progress, channels):
        for iteration in range(first, s.num_iterations + 1):
            metrics.start()
            progress.wait(lambda: progress.collected >= iteration, timeout * s.num_iterations,
                          f"the rollout of iteration {iteration}")
            clock = clocks.pop(iteration)
            order = edge.begin_training(iteration)
            if edge.trains:
                if s.schedule.rescore:
                    stage0_rescore(edge, exchange, train_link, clock, iteration)
                stage0_train(edge, exchange, train_link, clock, order, parts=microbatches(s.schedule.microbatches),
                             on_epoch=lambda epoch, last: publish(iteration, epoch, last))
            checkpoint = checkpoint_due(iteration, s.num_iterations, checkpoint_every)
            rollout = rollouts.pop(iteration)
            stats = stage0_finish(edge, exchange, train_link, clock, iteration, checkpoint, rollout, evaluation)
            if not edge.trains:  # stage1 trained alone, and said so with its statistics
                publish(iteration, s.ppo.epochs - 1, True)
            metrics.end(iteration, clock, stats, rollout)
    return metrics.records


def stage1_loop(learner: Learner, exchange: LearnerExchange, link: Transport, run_log: RunLog | None = None) -> int:
    """stage1: acts with the version each step names while the previous iteration trains; returns the iterations."""
    s = learner.settings
    channels = Channels(link, STAGE1_ROUTES)
    rollout_link, train_link = channels["rollout"], channels["train"]
    acting_seconds: dict[int, float] = {}
    rollouts: dict[int, dict[str, Any]] = {}
    bound = s.schedule.max_staleness
    first = learner.train_iteration + 1  # from a checkpoint's, if resumed
    per_iteration = s.versions_per_iteration
    progress = _Progress(per_iteration, first)

    def adopt(version: Any) -> None:
        if not isinstance(version, int) or isinstance(version, bool) or version < 0:
            raise ProtocolError(f"step: expected the acting version v >= 0, got {peer_repr(version)}")
        # stage0 publishes after its optimizer step, which may come before ours: wait for it.
        progress.wait(lambda: progress.published >= version, link.timeout, f"policy version {version}")
        learner.adopt(version)

    def collect() -> None:
        for iteration in range(first, s.num_iterations + 1):
            # stage0 starts this rollout once it has trained iteration - 1 - bound (and it trains before we do)
            progress.wait(lambda: progress.trained >= iteration - 1 - bound, link.timeout * s.num_iterations,
                          f"iteration {iteration - 1 - bound} to train")
            busy = PhaseClock()
            # A paced rollout (--publish epoch) pauses mid-way for an epoch of training, which may take longer
            # than a receive's timeout (a slow link, an evaluation before it): waited for as the bound is.
            stage1_rollout(learner, rollout_link, busy, iteration, adopt=adopt,
                           timeout=link.timeout * s.num_iterations if per_iteration > 1 else None)
            rollouts[iteration] = learner.rollout_summary()
            acting_seconds[iteration] = busy.seconds["heads"]
            progress.set(collected=iteration)

    def publish(iteration: int, epoch: int, last: bool, busy: PhaseClock) -> None:
        def timed(versions: list[int]) -> None:
            with busy("heads"):
                learner.publish(versions)
        progress.publish(timed, iteration, epoch, last)

    with _alongside("stage1 rollout", collect, progress, channels):
        for iteration in range(first, s.num_iterations + 1):
            busy = PhaseClock()
            cpu_start = time.process_time()
            progress.wait(lambda: progress.collected >= iteration, link.timeout * s.num_iterations,
                          f"the rollout of iteration {iteration}")
            busy.seconds["heads"] += acting_seconds.pop(iteration)
            if s.schedule.rescore:
                stage1_rescore(learner, exchange, train_link, busy, iteration)
            with busy("heads"):
                order = learner.begin_training(iteration)  # GAE, importance-weighted where samples lag
            if not learner.trains_alone:
                stage1_train(learner, exchange, train_link, busy, order, parts=microbatches(s.schedule.microbatches),
                             on_epoch=lambda epoch, last: publish(iteration, epoch, last, busy))
            stage1_finish(learner, exchange, train_link, busy, iteration, order, run_log, cpu_start,
                          rollouts.pop(iteration))  # trains alone here
            if learner.trains_alone:
                publish(iteration, s.ppo.epochs - 1, True, busy)
        expect(train_link, "close")
    return s.num_iterations
