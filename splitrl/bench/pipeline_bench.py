"""Pipeline benchmark: the paper configuration under each schedule, side by side, with and without latency.

Every mode is a fresh split run (stage1 and stage0 as processes, the paper's
4096 steps per iteration, 10 epochs of 32 minibatches of 128), each adding one
mechanism to the row before (`MODES`), and a row may carry training arguments
of its own (`parse_row`); ``twin`` is the synchronous schedule in one process
(`splitrl train`). At 0 ms they run over loopback
(`splitrl run`); at a given round trip they run in the lab (`splitrl.lab`:
two network namespaces, a shaped veth pair, the delay from netem or, where the
kernel has none, the TCP delay relay), at ``rate``. The figures come from each
run's metrics.jsonl, over the iterations between the first (start-up; in the
asynchronous mode a rollout with no training beside it) and the last (there a
training with no rollout beside it): seconds per iteration, steps/s, each
stage's busy fraction (its process CPU seconds over wall seconds: 1.0 is one
core's worth) and the env worker processes' together, the CPU seconds an
iteration costs in all (the stages and the workers: over the machine's cores,
the least time any schedule of the same work can take), stage0's wait on the
link beyond stage1's compute, bytes per iteration and the asynchronous mode's
staleness.
"""

from __future__ import annotations

import logging
import re
import shlex
import tempfile
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any, Callable, ContextManager, Hashable, Iterator, Sequence

from ..launch import progress, run_local
from ..netem.tc import Shaping
from ..runs import is_twin, iteration_cpu, measured_records, read_metrics
from ..summary import summarise_run

__all__ = ["MODES", "parse_row", "run_pipeline_bench", "pipeline_rows", "pipeline_table", "PartsBeside"]

log = logging.getLogger(__name__)

QUAD = ["--num-envs", "4", "--num-steps", "1024"]
"""4096 samples an iteration, as the paper's 1 x 4096, from four envs: enough groups to hide a 20 ms
round trip (K >= 1 + RTT / env step, about 12 ms a CarRacing step here)."""
OVERLAP = ["--threads", "1"]
"""Once both stages compute at the same time, one intra-op thread each: with torch's default (two on this
2-core machine) the two processes' threads fight for the cores (measured: micro-batches slower, not faster)."""
TWIN = "twin"
"""The synchronous schedule in one process (`splitrl train`): no link, no second process; the split's own cost is
the synchronous row's CPU above this one's. At 0 ms only."""
MODES: dict[str, list[str]] = {
    TWIN: [],
    "sync": [],
    "+ async envs": ["--vector", "async"],
    "+ 4 envs": ["--vector", "async", *QUAD],
    "+ pipelined rollout": ["--vector", "async", *QUAD, "--rollout-groups", "4", *OVERLAP],
    "+ micro-batches": ["--vector", "async", *QUAD, "--rollout-groups", "4", "--microbatches", "2", *OVERLAP,
                        "--part-workers", "1"],
    "+ micro-batches at once": ["--vector", "async", *QUAD, "--rollout-groups", "4", "--microbatches", "2", *OVERLAP],
    "+ async": ["--vector", "async", *QUAD, "--rollout-groups", "4", "--microbatches", "2", *OVERLAP, "--async"],
}
"""Each row after 'sync' adds one mechanism to the one before; 'sync' is the synchronous schedule (1 env x 4096
steps), 'twin' the same in one process."""


def parse_row(entry: str) -> tuple[str, list[str]]:
    """A row as ``--modes`` names it: one of `MODES`, then the row's own training arguments if any, which come after
    the mode's (``"sync --threads 1"``, ``"+ async --rollout-groups 2 --channels-last"``): (mode, its arguments)."""
    mode, dashes, rest = entry.strip().partition(" --")
    mode = mode.strip()
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r} in {entry.strip()!r}; choose from {', '.join(MODES)}")
    return mode, shlex.split(dashes.strip() + rest) if dashes else []


def row_label(entry: str) -> str:
    """A row's name in the tables and the JSON: its mode and its own arguments, spaced as `parse_row` reads them."""
    mode, args = parse_row(entry)
    return " ".join([mode, *args])


def row_arguments(entry: str) -> list[str]:
    """The training arguments of a row (`parse_row`): its mode's, then its own."""
    mode, args = parse_row(entry)
    return [*MODES[mode], *args]


def _summary(mode: str, rtt_ms: float, run_dir: Path) -> dict[str, Any]:
    summary = summarise_run(run_dir, skip_last=True)
    used = measured_records(read_metrics(run_dir), skip_last=True)

    def mean(f: Callable[[dict[str, Any]], float]) -> float:
        return sum(f(r) for r in used) / len(used)

    # The envs' worker processes (0 where the envs step in stage0; runs from before `cpu/envs` have no figure).
    workers = all("cpu/envs" in r for r in used)
    twin = is_twin(run_dir)  # one process: no stage1 of its own

    return {
        "mode": mode,
        "rtt_ms": rtt_ms,
        "seconds_per_iteration": summary["seconds_per_iteration"],
        "steps_per_second": summary["steps_per_second"],
        "busy_stage0": mean(lambda r: r["cpu/stage0"] / r["time/iteration"]),
        "busy_stage1": None if twin else mean(lambda r: r["cpu/stage1"] / r["time/iteration"]),
        "busy_envs": mean(lambda r: r["cpu/envs"] / r["time/iteration"]) if workers else None,
        "cpu_per_iteration": mean(lambda r: iteration_cpu(r, twin)) if workers else None,
        "link_wait": summary["link_wait_per_iteration"],
        "bytes_per_iteration": summary["bytes_per_iteration"],
        "staleness_mean": mean(lambda r: r.get("async/staleness_mean", 0.0)),
        "staleness_max": max(r.get("async/staleness_max", 0.0) for r in used),
        "measured_rtt_ms": used[-1].get("link/rtt_ms"),
        "iterations_used": len(used),
        "run_dir": str(run_dir),
    }


def _run_in_lab(args: Sequence[str], run_dir: Path, rtt_ms: float, rate: str, echo: Callable[[str], Any]) -> None:
    from ..lab import run_lab  # needs root; imported only when a round trip is asked for

    shaping = Shaping.parse(rate, f"{rtt_ms / 2:g}ms")  # the delay applies each way
    result = run_lab([*args, "--run-dir", str(run_dir)], str(run_dir), shaping, measure_bytes=0, echo=echo)
    if result.code != 0:
        raise RuntimeError(f"{run_dir.name} failed in the lab (stage1 exit {result.codes['stage1']}, "
                           f"stage0 exit {result.codes['stage0']}); logs beside {run_dir}")


def _name(rtt: float, label: str) -> str:
    return f"{rtt:g}ms-" + re.sub(r"[^\w.+]+", "-", label.lstrip("+ ")).strip("-")


def pipeline_rows(out_dir: str | Path, modes: Sequence[str] = tuple(MODES),
                  rtts_ms: Sequence[float] = (0.0, 20.0)) -> list[dict[str, Any]]:
    """The rows of the runs already in ``out_dir`` (those with metrics), in the order of the bench; ``modes`` as
    ``--modes`` names rows (`parse_row`)."""
    rows = []
    for rtt in rtts_ms:
        for label in dict.fromkeys(row_label(entry) for entry in modes):
            run_dir = Path(out_dir) / _name(rtt, label)
            if (run_dir / "metrics.jsonl").is_file():
                rows.append(_summary(label, rtt, run_dir))
    return rows


def run_pipeline_bench(modes: Sequence[str] = tuple(MODES), rtts_ms: Sequence[float] = (0.0, 20.0),
                       iterations: int = 3, rate: str = "100mbit", extra_args: Sequence[str] = (),
                       out_dir: str | None = None, timeout: float = 7200.0,
                       echo: Callable[[str], Any] | None = None,
                       around: Callable[[float, str], ContextManager[Any]] | None = None) -> list[dict[str, Any]]:
    """One row per (round trip, mode), modes in order (each a mode of `MODES` and its own arguments if any:
    `parse_row`); 0 ms over loopback, others in the lab. ``around(rtt, mode)``: entered right before each row runs
    and left right after (`PartsBeside.around`)."""
    echo = echo or log.info
    labels = list(dict.fromkeys(row_label(entry) for entry in modes))  # (and every row checked before any runs)
    if iterations < 1:
        raise ValueError(f"iterations must be >= 1, got {iterations}")
    base = Path(out_dir or tempfile.mkdtemp(prefix="splitrl-pipeline-"))
    base.mkdir(parents=True, exist_ok=True)
    rows = []
    for rtt in rtts_ms:
        for mode in labels:
            twin = parse_row(mode)[0] == TWIN
            if twin and rtt:
                continue  # no link to delay
            name = _name(rtt, mode)
            run_dir = base / name
            args = ["--total-steps", str(4096 * iterations), "--checkpoint-every", "0", *row_arguments(mode),
                    *extra_args]
            echo(f"{name}: {' '.join(args)}")
            with around(rtt, mode) if around is not None else nullcontext(), progress(run_dir, iterations, name):
                if rtt:
                    _run_in_lab(args, run_dir, rtt, rate, echo)
                else:
                    run_local(args, run_dir, timeout, "train" if twin else "run")
            rows.append(_summary(mode, rtt, run_dir))
            echo(f"  {rows[-1]['seconds_per_iteration']:.1f} s/iteration")
    return rows


def pipeline_table(rows: Sequence[dict[str, Any]], floor: dict[str, Any] | None = None,
                   parts: dict[str, Any] | None = None) -> str:
    """Markdown, one line per run; 'x sync' is steps/s over the synchronous run's at the same round trip; 'CPU s'
    the stages' and env workers' CPU seconds an iteration (blank for runs from before that was recorded). With a
    ``floor`` (`splitrl.bench.floor_bench.measure_floor`, measured in the same run): 'x floor', each row's
    seconds over the floor on the machine's cores, and 'CPU over parts' and 'x parts', its CPU seconds beyond and
    over the parts' as the row computes them: a row's own ``parts`` where it has them (its options and threads),
    else ``parts``, else ``floor``'s. A row's own ``floor`` (`PartsBeside`), where it has one, stands for ``floor``."""
    sync = {r["rtt_ms"]: r["steps_per_second"] for r in rows if r["mode"] == "sync"}
    zero = {r["mode"]: r["seconds_per_iteration"] for r in rows if r["rtt_ms"] == 0}
    lines = [
        "| round trip | mode | s/iteration | steps/s | x sync | vs its 0 ms | busy stage0 | busy stage1 | busy envs "
        "| CPU s | link wait s | MB/iteration | staleness mean / max | measured RTT ms |"
        + (" x floor | CPU over parts | x parts |" if floor else ""),
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|" + ("---:|---:|---:|" if floor else ""),
    ]
    for r in rows:
        ref = sync.get(r["rtt_ms"])
        ratio = f"{r['steps_per_second'] / ref:.2f}" if ref else ""
        same = zero.get(r["mode"])
        versus = f"{r['seconds_per_iteration'] / same:.2f}x" if same and r["rtt_ms"] else ""
        rtt = "" if r["measured_rtt_ms"] is None else f"{r['measured_rtt_ms']:.2f}"
        envs = "" if r.get("busy_envs") is None else f"{r['busy_envs']:.2f}"
        stage1 = "" if r["busy_stage1"] is None else f"{r['busy_stage1']:.2f}"
        cpu = "" if r.get("cpu_per_iteration") is None else f"{r['cpu_per_iteration']:.1f}"
        lines.append(
            f"| {r['rtt_ms']:g} ms | {r['mode']} | {r['seconds_per_iteration']:.1f} | {r['steps_per_second']:.1f} "
            f"| {ratio} | {versus} | {r['busy_stage0']:.2f} | {stage1} | {envs} | {cpu} | {r['link_wait']:.1f} "
            f"| {r['bytes_per_iteration'] / 1e6:.0f} | {r['staleness_mean']:.2f} / {r['staleness_max']:.0f} | {rtt} |"
            + (_against_floor(r, r.get("floor") or floor, r.get("parts") or parts or r.get("floor") or floor)
               if floor else "")
        )
    return "\n".join(lines)


def _against_floor(row: dict[str, Any], floor: dict[str, Any], parts: dict[str, Any]) -> str:
    cpu = row.get("cpu_per_iteration")
    over = "" if cpu is None else f"{cpu - parts['total']:+.1f}"
    times = "" if cpu is None else f"{cpu / parts['total']:.2f}x"
    return f" {row['seconds_per_iteration'] / floor['floor']:.2f}x | {over} | {times} |"


class PartsBeside:
    """The parts of an iteration timed beside each row of a bench rather than once before all rows and once after
    them: within one bench the machine's speed moved by 12 % (docs/benchmarks/floor.md, "Five iterations a row"),
    which sets an early row against parts faster than it ran with, a late one against slower ones.

    Each kind of parts a row needs (``needs(mode)``: the floor's, and the row's own where it computes them
    otherwise) is timed right before the row and right after it, and the row is set against their mean
    (`splitrl.bench.floor_bench.bracketed`). What was timed right after one row is right before the next: a kind
    both need is timed once between them. ``measure(kind)``: one timing (`measure_floor`)."""

    def __init__(self, measure: Callable[[Hashable], dict[str, Any]], needs: Callable[[str], Sequence[Hashable]]
                 ) -> None:
        self.measure, self.needs = measure, needs
        self.rows: dict[tuple[float, str], dict[Hashable, dict[str, Any]]] = {}
        """Each row's (round trip, mode) parts, by kind."""
        self.timings: list[tuple[str, Hashable, float]] = []
        """Every timing in order: (where: 'before ROW' or 'after ROW', kind, the parts' total CPU seconds)."""
        self._since_last_row: dict[Hashable, dict[str, Any]] = {}  # the timings taken right after the last row

    @contextmanager
    def around(self, rtt: float, mode: str) -> Iterator[None]:
        from .floor_bench import bracketed

        name = f"{rtt:g} ms {mode}"
        last = self._since_last_row
        before = {kind: last[kind] if kind in last else self._timed(f"before {name}", kind)
                  for kind in dict.fromkeys(self.needs(mode))}
        self._since_last_row = {}
        yield
        self._since_last_row = {kind: self._timed(f"after {name}", kind) for kind in before}
        self.rows[(rtt, mode)] = {kind: bracketed(before[kind], self._since_last_row[kind]) for kind in before}

    def _timed(self, where: str, kind: Hashable) -> dict[str, Any]:
        parts = self.measure(kind)
        self.timings.append((where, kind, parts["total"]))
        return parts
