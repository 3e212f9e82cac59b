"""What every schedule needs around its loops: phase clocks, checked receives, the iteration record."""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from typing import Any

import torch

from ..runs import RunLog
from ..stages import STAGE0, STAGE1, Edge, EdgeExchange, Learner, LearnerExchange
from ..transport import Message, ProtocolError, Transport
from ..transport.errors import peer_repr

__all__ = ["PhaseClock", "expect", "iteration_stats", "IterationLog", "checkpoint_due", "stage0_finish",
           "stage1_finish"]

log = logging.getLogger(__name__)


class _Phase:
    __slots__ = ("clock", "name", "start")

    def __init__(self, clock: "PhaseClock", name: str) -> None:
        self.clock, self.name, self.start = clock, name, 0.0

    def __enter__(self) -> None:
        self.start = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self.clock.seconds[self.name] += time.perf_counter() - self.start


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


def expect(link: Transport, kind: str, **header: Any) -> Message:
    """The next message, which must be ``kind`` with these header values; `ProtocolError` otherwise."""
    msg = link.recv()
    if msg.kind != kind:
        wanted = f" ({', '.join(f'{k}={v}' for k, v in header.items())})" if header else ""
        raise ProtocolError(f"expected {kind!r}{wanted} from {link.peer}, got {msg.kind!r}")
    got = {key: msg.header.get(key) for key in header}
    if got != header:
        raise ProtocolError(f"{kind}: expected {', '.join(f'{k}={v}' for k, v in header.items())}, "
                            f"got {', '.join(f'{k}={peer_repr(v)}' for k, v in got.items())}")
    return msg


def iteration_stats(link: Transport) -> dict[str, Any]:
    """After ``iter_end``: stage1's ``iter_stats`` header (``progress`` messages while it trains alone come first)."""
    while True:
        msg = link.recv()
        if msg.kind == "iter_stats":
            return dict(msg.header)
        if msg.kind != "progress":
            raise ProtocolError(f"after 'iter_end' expected 'progress' or 'iter_stats' from {link.peer}, got {msg.kind!r}")


def stage0_finish(edge: Edge, exchange: EdgeExchange, link: Transport, clock: PhaseClock, iteration: int,
                  checkpoint: bool, rollout: dict[str, Any]) -> dict[str, Any]:
    """``iter_end`` -> stage1's statistics; stage0's checkpoint (with the end of ``rollout``, `Edge.rollout_summary`)."""
    with clock("link"):
        link.send("iter_end", header={"iteration": iteration, "checkpoint": checkpoint})
        stats = iteration_stats(link)
    if checkpoint and edge.run_log is not None:
        state = {**edge.state_dict(rollout), "exchange": exchange.state_dict(), "meter": link.meter.snapshot()}
        edge.run_log.checkpoint(STAGE0, iteration, state)
    return stats


def stage1_finish(learner: Learner, exchange: LearnerExchange, link: Transport, busy: PhaseClock, iteration: int,
                  schedule: list[list[torch.Tensor]], run_log: RunLog | None, cpu_start: float,
                  rollout: dict[str, Any]) -> None:
    """After ``iter_end``: train alone if the cut is before the first layer, checkpoint, send the statistics."""
    msg = expect(link, "iter_end", iteration=iteration)
    if learner.trains_alone:
        for epoch, minibatches in enumerate(schedule):
            with busy("heads"):
                learner.train_alone(minibatches)
            link.send("progress", header={"epoch": epoch})
    stats = learner.iteration_stats()
    stats["time/heads"] = busy.seconds["heads"]
    if msg.header.get("checkpoint") and run_log is not None:
        run_log.checkpoint(STAGE1, iteration, {**learner.state_dict(rollout), "exchange": exchange.state_dict()})
    stats["cpu/stage1"] = time.process_time() - cpu_start
    link.send("iter_stats", header=stats)


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

    def start(self) -> None:
        self.iter_start = time.perf_counter()
        self.cpu_start = time.process_time()

    def end(self, iteration: int, clock: PhaseClock, stats: dict[str, Any],
            rollout: dict[str, Any] | None = None) -> dict[str, Any]:
        """Build, write and log the record of ``iteration`` (stage1's ``stats`` included); ``rollout``:
        `Edge.rollout_summary` as taken when its rollout ended (default: now)."""
        edge, s = self.edge, self.edge.settings
        wall = time.perf_counter() - self.iter_start
        rollout = rollout or edge.rollout_summary()
        returns = rollout["returns"]
        record: dict[str, Any] = {
            "iteration": iteration,
            "global_step": rollout["global_step"],
            "charts/episodic_return": sum(returns) / len(returns) if returns else None,
            "charts/episodic_return_ema": rollout["ema_return"],
            "charts/episodes": len(returns),
            "charts/SPS": s.steps_per_iteration / wall,
            "time/iteration": wall,
            "time/total": time.perf_counter() - self.run_start,
        }
        record.update({k: v for k, v in stats.items() if k.startswith(("losses/", "cpu/", "async/"))})
        record.update(self.extra)
        # CPU seconds of this process in the iteration (in the twin, both stages share it).
        record["cpu/stage0"] = time.process_time() - self.cpu_start
        heads = float(stats.get("time/heads", 0.0))
        for phase in ("env", "encoder"):
            record[f"time/{phase}"] = clock.seconds.get(phase, 0.0)
        record["time/heads"] = heads
        record["time/codec"] = clock.seconds.get("codec", 0.0)
        # Time inside send/recv is stage1's compute plus the link; the stage1 report splits it.
        record["time/link_wait"] = max(0.0, clock.seconds.get("link", 0.0) - heads)
        net_now = self.link.meter.snapshot()
        for key, value in net_now.items():
            record[key] = value - self.bytes_before.get(key, 0)
            record[key.replace("net/", "net_total/", 1)] = value
        self.bytes_before = net_now
        self.records.append(record)
        if edge.run_log is not None:
            edge.run_log.metrics(record)
        ret = record["charts/episodic_return_ema"]
        log.info(
            "[stage0] iter %d/%d  step %d  %.0f steps/s  return(ema) %s  sent %.1f MB  recv %.1f MB",
            iteration, s.num_iterations, record["global_step"], record["charts/SPS"],
            "n/a" if ret is None else f"{ret:.1f}", self.link.meter.total("sent") / 1e6,
            self.link.meter.total("recv") / 1e6,
        )
        return record
