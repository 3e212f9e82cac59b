"""What every schedule needs around its loops: phase clocks, checked receives, the iteration record."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch

from ..devices import to_host
from ..runs import RunLog
from ..stages import STAGE0, STAGE1, Edge, EdgeExchange, Learner, LearnerExchange
from ..stages.evaluate import Evaluation
from ..transport import Message, ProtocolError, Transport
from ..transport.errors import peer_repr
from .progress import IterationBar, bar_wanted

__all__ = ["torch_thread", "PhaseClock", "TIMELINE", "TIMELINE_ENV", "Timeline", "expect", "after_progress", "stops",
           "stage0_after_rollout", "iteration_stats", "IterationLog", "checkpoint_due", "stage0_finish", "stage1_finish",
           "progress_line"]

log = logging.getLogger(__name__)


def torch_thread(target: Callable[[], None], name: str) -> threading.Thread:
    """A daemon thread for ``target`` whose torch ops run on as many intra-op threads as the calling thread's
    (``--threads``, set by `prepare`).

    `torch.set_num_threads` sets OpenMP's thread count for the thread that calls it; a thread started later
    begins with OpenMP's default (``OMP_NUM_THREADS``, else every core) and keeps it for the matrix products
    MKL runs until torch's own parallel code first sets it there. A product on such a thread after
    ``set_num_threads(1)`` in its parent gives the many-thread numbers, not the one-thread ones: the twin's
    stage1 thread would fold an autoencoder's decoder differently from stage1's own process, and an
    asynchronous schedule's rollout thread would run its products on every core. Each
    such thread has its threads of its own: while both compute, the process uses up to twice ``--threads`` (and
    each micro-batch worker, `splitrl.schedule.workers`, as many again)."""
    threads = torch.get_num_threads()

    def run() -> None:
        torch.set_num_threads(threads)
        target()

    return threading.Thread(target=run, name=name, daemon=True)


TIMELINE_ENV = "SPLITRL_TIMELINE"


class Timeline:
    """Every phase's span (`PhaseClock`) of this process, kept only where the environment variable
    ``SPLITRL_TIMELINE`` names a directory: each process then appends its spans to ``DIR/timeline-PID.jsonl``,
    a line at the end of each iteration (``flush``), with stage0's window of that iteration (its start and end,
    as `IterationLog` times it). The times are ``time.perf_counter``'s, CLOCK_MONOTONIC on Linux, which every
    process on a machine shares, so the stages' lines lie on one time axis; a reader takes an iteration's spans
    by that window, whichever line holds them (`benchmarks/timeline.py`). A process that never flushes (a
    benchmark's own loop) keeps its spans until it ends.

    CPU time goes with them: each span's thread CPU seconds, each line's process CPU seconds since the last one
    (the first: since the process started; the twin's: since either stage's last line), every thread's (ZeroMQ's
    I/O threads, torch's intra-op threads), and the stretches a loop marks (`stretch`: the synchronous and
    pipelined schedules' rollout and training) with the process CPU seconds in each, so a reader can set a
    stretch's CPU against the parts `splitrl bench floor` times alone."""

    def __init__(self) -> None:
        directory = os.environ.get(TIMELINE_ENV, "")
        self.directory = Path(directory) if directory else None
        self.spans: list[tuple[str, str, float, float, float]] = []
        """(thread, phase, start, end, thread CPU seconds), appended by any thread, since the last flush."""
        self.stretches: list[tuple[str, float, float, float]] = []
        """(name, start, end, process CPU seconds) of the stretches marked since the last flush."""
        self._flushed_cpu = 0.0

    @contextmanager
    def stretch(self, name: str) -> Iterator[None]:
        """Mark a stretch of a stage's loop (one thread's, the others idle or serving it), when tracing."""
        if self.directory is None:
            yield
            return
        start, cpu = time.perf_counter(), time.process_time()
        try:
            yield
        finally:
            self.stretches.append((name, start, time.perf_counter(), time.process_time() - cpu))

    def flush(self, role: str, iteration: int, window: tuple[float, float] | None = None) -> None:
        if self.directory is None:
            return
        n = len(self.spans)  # what another thread appends meanwhile stays for the next line
        spans = self.spans[:n]
        del self.spans[:n]
        stretches, self.stretches = self.stretches, []
        cpu, self._flushed_cpu = time.process_time() - self._flushed_cpu, time.process_time()
        self.directory.mkdir(parents=True, exist_ok=True)
        line = {"role": role, "pid": os.getpid(), "iteration": iteration, "window": window, "spans": spans,
                "stretches": stretches, "cpu": cpu}
        with open(self.directory / f"timeline-{os.getpid()}.jsonl", "a") as f:  # `splitrl run`'s stages fork
            f.write(json.dumps(line) + "\n")


TIMELINE = Timeline()


class _Phase:
    __slots__ = ("clock", "name", "start", "cpu")

    def __init__(self, clock: "PhaseClock", name: str) -> None:
        self.clock, self.name, self.start, self.cpu = clock, name, 0.0, 0.0

    def __enter__(self) -> None:
        if TIMELINE.directory is not None:
            self.cpu = time.thread_time()
        self.start = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        end = time.perf_counter()
        self.clock.seconds[self.name] += end - self.start
        if TIMELINE.directory is not None:
            TIMELINE.spans.append((threading.current_thread().name, self.name, self.start, end,
                                   time.thread_time() - self.cpu))


class PhaseClock:
    """Wall seconds per phase: ``with clock("env"): ...`` adds the block's time to ``seconds["env"]``."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self._phases: dict[str, _Phase] = {}

    def __call__(self, name: str) -> _Phase:
        phase = self._phases.get(name)
        if phase is None:
            phase = self._phases[name] = _Phase(self, name)
        return phase


def expect(link: Transport, kind: str, *, timeout: float | None = None, **header: Any) -> Message:
    """The next message, which must be ``kind`` with these header values; `ProtocolError` otherwise. ``timeout``:
    the receive's (default: the link's)."""
    return _checked(link, link.recv(timeout), kind, header)


def after_progress(link: Transport, kind: str, timeout: float | None = None, **header: Any) -> Message:
    """`expect` for the first message that is not a ``progress`` (stage1 telling it is busy: training alone,
    waiting for edges); ``timeout`` bounds the whole wait (default: each receive's own)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        msg = link.recv(None if deadline is None else max(0.001, deadline - time.monotonic()))
        if msg.kind != "progress":
            return _checked(link, msg, kind, header)


def _checked(link: Transport, msg: Message, kind: str, header: dict[str, Any]) -> Message:
    if msg.kind != kind:
        wanted = f" ({', '.join(f'{k}={v}' for k, v in header.items())})" if header else ""
        raise ProtocolError(f"expected {kind!r}{wanted} from {link.peer}, got {msg.kind!r}")
    got = {key: msg.header.get(key) for key in header}
    if got != header:
        raise ProtocolError(f"{kind}: expected {', '.join(f'{k}={v}' for k, v in header.items())}, "
                            f"got {', '.join(f'{k}={peer_repr(v)}' for k, v in got.items())}")
    return msg


def stops(reply: Message, last: bool) -> bool:
    """Whether stage1's ``train_bwd`` ``reply`` ends the epochs (``stop``: `Learner.stop_early`); only the
    epoch's last one may say so."""
    stop = reply.header.get("stop", False)
    if stop is not False and not (stop is True and last):
        raise ProtocolError(f"{reply.kind}: header 'stop': expected true on an epoch's last minibatch only, got "
                            f"{peer_repr(stop)} (epoch {peer_repr(reply.header.get('epoch'))}, minibatch "
                            f"{peer_repr(reply.header.get('mb'))})")
    return stop


def stage0_after_rollout(edge: Edge, exchange: EdgeExchange, link: Transport, clock: PhaseClock,
                         iteration: int) -> tuple[dict[str, Any], list[list[torch.Tensor]]]:
    """Between stage0's rollout and its training: the replica's update if the exchange has one, the rollout's
    summary, and training's minibatch order. Returns (`Edge.rollout_summary`, the order)."""
    with clock("link"):
        update = expect(link, "heads") if exchange.updates_after_rollout else None
    rollout = edge.rollout_summary()
    order = edge.begin_training(iteration)  # before the update: the replica reads this rollout's view
    if update is not None:
        with clock("codec"):
            exchange.apply_update(update, {"iteration": iteration})
    return rollout, order


def iteration_stats(link: Transport) -> dict[str, Any]:
    """After ``iter_end``: stage1's ``iter_stats`` header (``progress`` messages while it trains alone come first)."""
    return dict(after_progress(link, "iter_stats").header)


def stage0_finish(edge: Edge, exchange: EdgeExchange, link: Transport, clock: PhaseClock, iteration: int,
                  checkpoint: bool, rollout: dict[str, Any], evaluation: Evaluation | None = None,
                  extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """``iter_end`` (with ``extra`` in its header) -> stage1's statistics; the evaluation if one is due (stage1's
    heads, ``eval_heads``, scored here with the encoder); stage0's checkpoint (with the end of ``rollout``,
    `Edge.rollout_summary`)."""
    evaluating = evaluation is not None and evaluation.due(iteration)
    with clock("link"):
        link.send("iter_end", header={"iteration": iteration, "checkpoint": checkpoint, "eval": evaluating,
                                      **(extra or {})})
        stats = iteration_stats(link)
    if evaluating:
        assert evaluation is not None
        with clock("eval"):
            heads = expect(link, "eval_heads", iteration=iteration)
            stats.update(evaluation.run(edge.net, dict(heads.tensors), iteration))
    if checkpoint and edge.run_log is not None:
        state = {**edge.state_dict(rollout), "exchange": exchange.state_dict(), "meter": link.meter.snapshot()}
        if isinstance(link, Transport):  # one link of its own (not a thread's channel): where a resume numbers on
            state["link"] = link.sequence()
        edge.run_log.checkpoint(STAGE0, iteration, state)
    return stats


def stage1_finish(learner: Learner, exchange: LearnerExchange, link: Transport | Sequence[Transport], busy: PhaseClock,
                  iteration: int, order: list[list[torch.Tensor]], run_log: RunLog | None, cpu_start: float,
                  rollout: dict[str, Any], msgs: Sequence[Message] | None = None,
                  extras: Sequence[dict[str, Any]] | None = None, places: Sequence[int] | None = None) -> None:
    """After ``iter_end`` (from every edge of a fleet, ``link`` a list, ``places`` their edges' ids; ``msgs`` if
    already received): train alone if the cut is before the first layer, checkpoint, send the statistics (with
    ``extras[k]`` to ``link[k]``)."""
    links = list(link) if isinstance(link, (list, tuple)) else [link]
    if msgs is None:
        msgs = [expect(each, "iter_end", iteration=iteration) for each in links]
    if learner.trains_alone:
        for epoch, minibatches in enumerate(order):
            with busy("heads"):
                stop = learner.train_alone(minibatches)
            for each in links:
                each.send("progress", header={"epoch": epoch})
            if stop:  # the KL passed --target-kl
                break
    stats = learner.iteration_stats()
    stats["time/heads"] = busy.seconds["heads"]
    if "heads_rollout" in busy.seconds:  # the synchronous schedule: the rollout's steps apart
        stats["time/heads_rollout"] = busy.seconds["heads_rollout"]
    if msgs[0].header.get("checkpoint") and run_log is not None:  # every edge checkpoints on the same iterations
        state = {**learner.state_dict(rollout), "exchange": exchange.state_dict()}
        # Where a resume numbers on, once this iteration's iter_stats (and eval_heads) below are out, which is
        # where stage0's checkpoint has it: one stage0's link, or a fleet's by place (``places``)
        ahead = [1 + (msg.header.get("eval") is True) for msg in msgs]
        if isinstance(link, Transport):
            state["link"] = link.sequence(ahead=ahead[0])
        elif places is not None:
            state["links"] = {str(p): each.sequence(ahead=n) for p, each, n in zip(places, links, ahead)}
        run_log.checkpoint(STAGE1, iteration, state)
    stats["cpu/stage1"] = time.process_time() - cpu_start
    TIMELINE.flush(STAGE1, iteration)
    heads = None
    for each, msg, extra in zip(links, msgs, extras or [{}] * len(links)):
        each.send("iter_stats", header={**stats, **extra})
        if msg.header.get("eval") is True:  # stage0 scores the policy: it needs the heads
            heads = heads or {name: to_host(p.detach()) for name, p in learner.heads.state_dict().items()}
            each.send("eval_heads", heads, {"iteration": iteration})


def checkpoint_due(iteration: int, last: int, every: int) -> bool:
    """Checkpoints after every ``every``-th iteration (0: never) and after the last."""
    return iteration == last or (every > 0 and iteration % every == 0)


class IterationLog:
    """Stage0's metrics.jsonl lines: one per iteration, with the link's bytes since the last one."""

    def __init__(self, edge: Edge, link: Transport, extra: dict[str, Any] | None = None) -> None:
        self.edge, self.link = edge, link
        self.extra = dict(extra or {})
        """Keys every record carries (what the schedule measured at the start)."""
        self.records: list[dict[str, Any]] = []
        self.bytes_before = link.meter.snapshot()
        self.run_start = time.perf_counter()
        self.iter_start = self.run_start
        self.cpu_start = time.process_time()
        self.envs_cpu_start = edge.env_cpu_seconds()
        self.bar = IterationBar(edge.settings, link.meter) if bar_wanted() else None
        """A terminal's progress bar inside each iteration (`splitrl.schedule.progress`), told by the edge."""
        if self.bar is not None:
            edge.progress = self.bar

    def start(self) -> None:
        self.iter_start = time.perf_counter()
        self.cpu_start = time.process_time()
        self.envs_cpu_start = self.edge.env_cpu_seconds()
        if self.bar is not None:
            self.bar.begin()

    def end(self, iteration: int, clock: PhaseClock, stats: dict[str, Any],
            rollout: dict[str, Any] | None = None) -> dict[str, Any]:
        """Build, write and log the record of ``iteration`` (stage1's ``stats`` included); ``rollout``:
        `Edge.rollout_summary` as taken when its rollout ended (default: now)."""
        edge, s = self.edge, self.edge.settings
        wall = time.perf_counter() - self.iter_start
        scoring = clock.seconds.get("eval", 0.0)  # evaluation's episodes are not training's steps
        rollout = rollout or edge.rollout_summary()
        returns = rollout["returns"]
        record: dict[str, Any] = {
            "iteration": iteration,
            "global_step": rollout["global_step"],
            "charts/episodic_return": sum(returns) / len(returns) if returns else None,
            "charts/episodic_return_ema": rollout["ema_return"],
            "charts/episodes": len(returns),
            "charts/SPS": s.steps_per_iteration / (wall - scoring),
            "time/iteration": wall,
            "time/total": time.perf_counter() - self.run_start,
        }
        record.update({k: v for k, v in stats.items()
                       if k.startswith(("losses/", "cpu/", "async/", "eval/", "fleet/", "autoencoder/"))})
        record.update(self.extra)
        record.update(edge.tuning.metrics.pop(iteration, {}))
        # CPU seconds of this process in the iteration (in the twin, both stages share it).
        record["cpu/stage0"] = time.process_time() - self.cpu_start
        TIMELINE.flush(STAGE0, iteration, (self.iter_start, self.iter_start + wall))
        envs_cpu = self.edge.env_cpu_seconds()
        if envs_cpu is not None and self.envs_cpu_start is not None:  # 0 where the envs step in this process
            record["cpu/envs"] = envs_cpu - self.envs_cpu_start
        heads = float(stats.get("time/heads", 0.0))
        for phase in ("env", "encoder"):
            record[f"time/{phase}"] = clock.seconds.get(phase, 0.0)
        record["time/heads"] = heads
        record["time/codec"] = clock.seconds.get("codec", 0.0)
        if scoring:
            record["time/eval"] = scoring
        if "pace" in clock.seconds:  # --publish epoch: the rollout waiting for the epoch it is to act with
            record["time/pace_wait"] = clock.seconds["pace"]
        # Time inside send/recv is stage1's compute plus the link; the stage1 report splits it.
        record["time/link_wait"] = max(0.0, clock.seconds.get("link", 0.0) - heads)
        if "link_rollout" in clock.seconds and "time/heads_rollout" in stats:  # the synchronous schedule
            record["time/link_wait_rollout"] = max(0.0, clock.seconds["link_rollout"]
                                                   - float(stats["time/heads_rollout"]))
        net_now = self.link.meter.snapshot()
        for key, value in net_now.items():
            record[key] = value - self.bytes_before.get(key, 0)
            record[key.replace("net/", "net_total/", 1)] = value
        self.bytes_before = net_now
        self.records.append(record)
        edge.tuning.last_record = record
        if edge.run_log is not None:
            edge.run_log.metrics(record)
        if self.bar is not None:
            self.bar.end()  # off the terminal before the iteration's line
        log.info("[stage0] %s", progress_line(record, s.num_iterations, len(self.records)))
        return record


def progress_line(record: dict[str, Any], iterations: int, done_here: int) -> str:
    """One iteration at a glance: where the run is, how fast, its return and losses, the link's bytes, and
    when it ends (the mean iteration time of this process's ``done_here`` iterations, times those left)."""
    ret, it = record["charts/episodic_return_ema"], record["iteration"]
    losses = " ".join(f"{short} {record[key]:.3g}" for short, key in (("pg", "losses/policy_loss"),
                      ("v", "losses/value_loss"), ("kl", "losses/approx_kl")) if record.get(key) is not None)
    sent = sum(v for k, v in record.items() if k.startswith("net_total/") and k.endswith("/sent_bytes"))
    recv = sum(v for k, v in record.items() if k.startswith("net_total/") and k.endswith("/recv_bytes"))
    left = (iterations - it) * record["time/total"] / max(done_here, 1)
    evaluated = "" if "eval/return_mean" not in record else f"  eval {record['eval/return_mean']:.1f}"
    return (f"iter {it}/{iterations}  step {record['global_step']}  {record['charts/SPS']:.0f} steps/s  "
            f"return(ema) {'n/a' if ret is None else f'{ret:.1f}'}{evaluated}  {losses}  "
            f"sent {sent / 1e6:.1f} MB  recv {recv / 1e6:.1f} MB  ETA {_duration(left)}")


def _duration(seconds: float) -> str:
    minutes = round(seconds / 60)
    return f"{minutes // 60} h {minutes % 60:02d} min" if minutes >= 60 else f"{minutes} min" if minutes else \
        f"{seconds:.0f} s"
