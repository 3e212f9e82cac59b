"""Lab benchmark: at each link rate, the achieved throughput and a short PPO run's iteration time.

For every rate (5, 20 and 100 Mbit/s by default) one lab (`splitrl.netem.lab.Lab`:
two network namespaces joined by a veth pair shaped alike in both directions)
is brought up. In it, `measure_throughput` first sends 1 MiB messages stage0 ->
stage1 through the project's own `ZmqTransport` (target: goodput within 15 % of
the set rate; tc's rate counts Ethernet/IP/TCP headers, so goodput can reach at
most 1448/1514 = 95.6 % of it). Then the same short PPO configuration runs twice,
as the real ``splitrl stage1`` / ``splitrl stage0`` processes in the two
namespaces: once with fp32 on every stream, once with the best codec combination
of the codecs benchmark (`BEST_CODECS`). The figures come from stage0's
metrics.jsonl: seconds per iteration (``time/iteration``, the first iteration
left out when there are two or more: it includes the processes' start-up), and
bytes per iteration (every ``net/*_bytes`` key: stage0's meters see both
directions), averaged over the same iterations.

Needs root (``ip netns``, ``tc``). Each lab is removed on every exit path, by `Lab`.
"""

from __future__ import annotations

import contextlib
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from ..netem.lab import DEFAULT_PORT, Lab, LabNames, measure_throughput, stage_commands
from ..netem.tc import Shaping, format_rate, parse_rate
from ..runs import read_metrics

__all__ = [
    "DEFAULT_RATES",
    "PPO_ARGS",
    "QUICK_PPO_ARGS",
    "QUICK_RATES",
    "QUICK_MEASURE_BYTES",
    "BEST_CODECS",
    "CONFIGS",
    "auto_measure_bytes",
    "summarize_run",
    "run_lab_bench",
    "lab_bench_table",
]

_MIB = 1024 * 1024

DEFAULT_RATES = ("5mbit", "20mbit", "100mbit")
PPO_ARGS = (
    "--num-steps", "512", "--epochs", "2", "--minibatches", "4", "--total-steps", "1024",
    "--max-episode-steps", "1000", "--threads", "1",
)
"""Two iterations of 512 CarRacing steps, 2 epochs of 4 minibatches of 128 (the paper's minibatch size)."""
QUICK_RATES = ("20mbit",)
QUICK_PPO_ARGS = (
    "--total-steps", "64", "--num-steps", "32", "--epochs", "2", "--minibatches", "2",
    "--max-episode-steps", "20", "--threads", "1",
)
QUICK_MEASURE_BYTES = 2 * _MIB
BEST_CODECS = (
    "--codec-rollout", "relu:values=int8+zstd",
    "--codec-fwd", "delta:q=topk,density=0.02",
    "--codec-bwd", "ef:density=0.02,values=int8",
)
"""The codecs benchmark's best combination: int8 rollout features, top-2 % deltas forward, int8 error feedback back."""
CONFIGS: dict[str, tuple[str, ...]] = {"fp32": (), "codecs": BEST_CODECS}
MEASURE_SECONDS = 10.0
"""The automatic throughput payload lasts about this long at the set rate."""
RUN_TIMEOUT_S = 3600.0
"""Longest one training run may take before it is stopped and the benchmark fails."""
STOP_GRACE_S = 15.0


def auto_measure_bytes(rate_bits: int, seconds: float = MEASURE_SECONDS) -> int:
    """About ``seconds`` of the set rate in whole MiB, between 4 and 64 MiB."""
    mib = round(rate_bits / 8 * seconds / _MIB)
    return min(64, max(4, mib)) * _MIB


def summarize_run(run_dir: str | Path) -> dict[str, Any]:
    """s/iteration and bytes/iteration of one run, over its iterations after the first (all if only one)."""
    records = read_metrics(run_dir)
    if not records:
        raise ValueError(f"{run_dir}: metrics.jsonl has no iterations")
    used = records[1:] if len(records) >= 2 else records
    n = len(used)
    return {
        "iterations": len(records),
        "iterations_used": n,
        "seconds_per_iteration": sum(r["time/iteration"] for r in used) / n,
        "bytes_per_iteration": sum(
            v for r in used for k, v in r.items() if k.startswith("net/") and k.endswith("_bytes")
        ) / n,
        "link_wait_per_iteration": sum(r.get("time/link_wait", 0.0) for r in used) / n,
    }


def _tail(path: Path, chars: int = 2000) -> str:
    with contextlib.suppress(OSError):
        return path.read_text(errors="replace")[-chars:]
    return ""


def _train_in_lab(lab: Lab, args: Sequence[str], run_dir: Path, port: int, timeout: float) -> None:
    """Both stages in the lab's namespaces, output to stage0.log / stage1.log beside the run directory's files."""
    run_dir.mkdir(parents=True, exist_ok=True)
    cmds = stage_commands([*args, "--run-dir", str(run_dir)], port)
    procs: dict[str, subprocess.Popen] = {}
    logs = {side: run_dir / f"{side}.log" for side in ("stage1", "stage0")}
    with contextlib.ExitStack() as files:
        for side in ("stage1", "stage0"):
            out = files.enter_context(open(logs[side], "w"))
            procs[side] = lab.spawn(side, cmds[side], stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        failed_at = None
        while any(p.poll() is None for p in procs.values()):
            now = time.monotonic()
            if failed_at is None and any(p.poll() not in (None, 0) for p in procs.values()):
                failed_at = now  # the other should follow by the abort message
            if now > deadline or (failed_at is not None and now > failed_at + STOP_GRACE_S):
                lab.stop_processes(STOP_GRACE_S)
                break
            time.sleep(0.2)
    codes = {side: p.poll() for side, p in procs.items()}
    if any(c != 0 for c in codes.values()):
        why = "timed out" if time.monotonic() > deadline else "failed"
        details = "\n".join(f"--- {side} (exit {codes[side]}), {logs[side]}:\n{_tail(logs[side])}" for side in logs)
        raise RuntimeError(f"training in the lab {why} (stage1 exit {codes['stage1']}, stage0 exit "
                           f"{codes['stage0']}), run directory {run_dir}\n{details}")


def run_lab_bench(
    rates: Sequence[str] = DEFAULT_RATES,
    ppo_args: Sequence[str] = PPO_ARGS,
    *,
    configs: dict[str, Sequence[str]] | None = None,
    measure_bytes: int | None = None,
    extra_args: Sequence[str] = (),
    out_dir: str | None = None,
    timeout: float = RUN_TIMEOUT_S,
    echo: Callable[[str], Any] = print,
) -> list[dict[str, Any]]:
    """One row per (rate, configuration), rates in the order given, fp32 first.

    ``measure_bytes``: the throughput payload (None: `auto_measure_bytes` of each
    rate). ``extra_args`` go to both stages of every run after ``ppo_args`` and
    the configuration's codec options. Run directories (with each stage's log)
    are ``out_dir/<rate>-<config>``, in a new temporary directory by default.
    """
    configs = dict(CONFIGS if configs is None else configs)
    base = Path(out_dir or tempfile.mkdtemp(prefix="splitrl-lab-bench-"))
    shapings = [(rate, Shaping.parse(rate)) for rate in rates]  # every rate is checked before any lab
    rows: list[dict[str, Any]] = []
    for rate, shaping in shapings:
        rate_bits = parse_rate(rate)
        payload = measure_bytes if measure_bytes is not None else auto_measure_bytes(rate_bits)
        names = LabNames.random()
        with Lab(shaping, names=names) as lab:
            echo(f"lab {names.tag} at {format_rate(rate_bits)}: " + "; ".join(a.summary() for a in lab.applied))
            echo(f"  throughput stage0 -> stage1, {payload // _MIB} MiB in 1 MiB messages ...")
            tput = measure_throughput(lab, payload)
            echo(f"  {tput.text()}")
            for i, (config, codec_args) in enumerate(configs.items()):
                run_dir = base / f"{rate}-{config}"
                echo(f"  training with {config} -> {run_dir}")
                start = time.monotonic()
                _train_in_lab(lab, [*ppo_args, *codec_args, *extra_args], run_dir, DEFAULT_PORT + 10 * i, timeout)
                summary = summarize_run(run_dir)
                echo(f"    {summary['seconds_per_iteration']:.1f} s/iteration, "
                     f"{summary['bytes_per_iteration'] / 1e6:.2f} MB/iteration "
                     f"({time.monotonic() - start:.0f} s for the run)")
                rows.append({
                    "rate": rate,
                    "rate_bits": rate_bits,
                    "achieved_bits": tput.goodput_bits,
                    "achieved_ratio": tput.goodput_bits / rate_bits,
                    "wire_bits": tput.wire_bits,
                    "throughput_bytes": tput.app_bytes,
                    "throughput_seconds": tput.seconds,
                    "config": config,
                    "codec_args": list(codec_args),
                    "ppo_args": list(ppo_args) + list(extra_args),
                    "run_dir": str(run_dir),
                    **summary,
                })
    return _with_speedups(rows)


def _with_speedups(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each row's fp32 s/iteration at its rate over its own ("x faster than fp32"; None without an fp32 row)."""
    fp32 = {r["rate"]: r["seconds_per_iteration"] for r in rows if r["config"] == "fp32"}
    for r in rows:
        ref = fp32.get(r["rate"])
        r["speedup_vs_fp32"] = ref / r["seconds_per_iteration"] if ref and r["seconds_per_iteration"] else None
    return rows


def lab_bench_table(rows: list[dict[str, Any]], notes: bool = True) -> str:
    """The markdown table, and (``notes``) what each column means and the settings used."""
    lines = [
        "| rate | achieved Mbit/s | achieved/set | config | s/iteration | MB/iteration | x faster than fp32 |",
        "|---|---:|---:|---|---:|---:|---:|",
    ]
    for r in rows:
        speedup = "-" if r.get("speedup_vs_fp32") is None else f"{r['speedup_vs_fp32']:.2f}x"
        lines.append(
            f"| {format_rate(r['rate_bits'])} | {r['achieved_bits'] / 1e6:.2f} | {r['achieved_ratio']:.3f} "
            f"| {r['config']} | {r['seconds_per_iteration']:.1f} | {r['bytes_per_iteration'] / 1e6:.2f} | {speedup} |"
        )
    if notes and rows:
        first = rows[0]
        codec_rows = {r["config"]: " ".join(r["codec_args"]) or "fp32 on every stream" for r in rows}
        used = sorted({(r["iterations_used"], r["iterations"]) for r in rows})
        lines += [
            "",
            f"- training (both stages, every run): `{' '.join(first['ppo_args'])}`",
            *[f"- {name}: `{args}`" if name != "fp32" else f"- fp32: {args}" for name, args in codec_rows.items()],
            "- achieved: application bytes (goodput) of 1 MiB messages stage0 -> stage1 through ZmqTransport, "
            "before the training runs; tc's rate counts headers, so about 1448/1514 = 0.956 of it at most (a "
            "short payload gains a little from the full token bucket at the start); target >= 0.85",
            "- s/iteration: mean `time/iteration` of stage0's metrics.jsonl; MB/iteration: every `net/*_bytes` key "
            "(both directions), mean over the same iterations; iterations used/run: "
            + ", ".join(f"{u} of {n}" for u, n in used) + " (the first is left out when there are two or more)",
        ]
    return "\n".join(lines)
