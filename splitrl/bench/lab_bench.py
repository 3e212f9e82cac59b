"""Lab benchmark: at each link rate, the achieved throughput and a short PPO run's iteration time.

For every rate (5, 20 and 100 Mbit/s by default) one lab (`splitrl.netem.netns.Lab`:
two network namespaces joined by a veth pair shaped alike in both directions)
is brought up. In it, `measure_throughput` first sends 1 MiB messages stage0 ->
stage1 through the project's own `ZmqTransport` (target: goodput within 15 % of
the set rate; tc's rate counts Ethernet/IP/TCP headers, so goodput can reach at
most 1448/1514 = 95.6 % of it). Then the same short PPO configuration runs twice,
as the real ``splitrl stage1`` / ``splitrl stage0`` processes in the two
namespaces: once with fp32 on every stream, once with the best codec combination
of the codecs benchmark (`BEST_CODECS`). The figures come from stage0's
metrics.jsonl through `splitrl.summary.summarise_run`: seconds per iteration
(``time/iteration``, the first iteration left out when there are two or more:
it includes the processes' start-up), and bytes per iteration (every
``net/*_bytes`` key: stage0's meters see both directions), averaged over the
same iterations.

Needs root (``ip netns``, ``tc``). Each lab is removed on every exit path, by `Lab`.
"""

from __future__ import annotations

import logging
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from ..lab import DEFAULT_PORT, measure_throughput, train_in_lab
from ..netem.netns import Lab, LabNames
from ..netem.tc import Shaping, format_rate, parse_rate
from ..runs import read_metrics
from ..summary import summarise_run

__all__ = [
    "DEFAULT_RATES",
    "PPO_ARGS",
    "QUICK_PPO_ARGS",
    "QUICK_RATES",
    "QUICK_MEASURE_BYTES",
    "BEST_CODECS",
    "BUDGET_CODECS",
    "BUDGET_PPO_ARGS",
    "BUDGET_RATES",
    "CONFIGS",
    "budget_configs",
    "auto_measure_bytes",
    "run_lab_bench",
    "lab_bench_table",
]

log = logging.getLogger(__name__)

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
BUDGET_RATES = ("2mbit", "5mbit", "20mbit")
BUDGET_PPO_ARGS = tuple(v if k != "--total-steps" else "1536" for k, v in zip(("",) + PPO_ARGS, PPO_ARGS))
"""`PPO_ARGS` for three iterations: the budget chooses from the second on, from the iteration before."""
BUDGET_CODECS = ("--codec-rollout", "bf16", "--codec-fwd", "bf16", "--codec-bwd", "ef:density=0.5,values=bf16")
"""Rich codecs with somewhere to go: bf16 down to int8 each way, the gradients' density from 1/2 down to 1/64."""


def budget_configs(rate: str) -> dict[str, tuple[str, ...]]:
    """``splitrl bench lab --budget``: `BUDGET_CODECS` as given ('fixed'), and with ``--link-budget`` at the lab's
    own rate ('budget')."""
    return {"fixed": BUDGET_CODECS, "budget": (*BUDGET_CODECS, "--link-budget", rate)}
MEASURE_SECONDS = 10.0
"""The automatic throughput payload lasts about this long at the set rate."""
RUN_TIMEOUT_S = 3600.0
"""Longest one training run may take before it is stopped and the benchmark fails."""
SUMMARY_KEYS = ("iterations", "iterations_used", "seconds_per_iteration", "bytes_per_iteration",
                "link_wait_per_iteration")
"""What each row takes from `summarise_run`."""


def auto_measure_bytes(rate_bits: int, seconds: float = MEASURE_SECONDS) -> int:
    """About ``seconds`` of the set rate in whole MiB, between 4 and 64 MiB."""
    mib = round(rate_bits / 8 * seconds / _MIB)
    return min(64, max(4, mib)) * _MIB


def run_lab_bench(
    rates: Sequence[str] = DEFAULT_RATES,
    ppo_args: Sequence[str] = PPO_ARGS,
    *,
    configs: dict[str, Sequence[str]] | Callable[[str], dict[str, Sequence[str]]] | None = None,
    measure_bytes: int | None = None,
    extra_args: Sequence[str] = (),
    out_dir: str | None = None,
    timeout: float = RUN_TIMEOUT_S,
    echo: Callable[[str], Any] | None = None,
) -> list[dict[str, Any]]:
    """One row per (rate, configuration), rates in the order given, the configurations in theirs (default
    `CONFIGS`; a callable gives each rate's).

    ``measure_bytes``: the throughput payload (None: `auto_measure_bytes` of each
    rate). ``extra_args`` go to both stages of every run after ``ppo_args`` and
    the configuration's codec options. Run directories (with each stage's log)
    are ``out_dir/<rate>-<config>``, in a new temporary directory by default.
    """
    echo = echo or log.info
    per_rate = configs if callable(configs) else (lambda rate: dict(CONFIGS if configs is None else configs))
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
            for i, (config, codec_args) in enumerate(per_rate(rate).items()):
                run_dir = base / f"{rate}-{config}"
                echo(f"  training with {config} -> {run_dir}")
                start = time.monotonic()
                train_in_lab(lab, [*ppo_args, *codec_args, *extra_args], run_dir, DEFAULT_PORT + 10 * i, timeout)
                summary = summarise_run(run_dir)
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
                    **{key: summary[key] for key in SUMMARY_KEYS},
                    "budget": _budget_choices(run_dir),
                })
    return _with_speedups(rows)


def _budget_choices(run_dir: Path) -> list[dict[str, Any]]:
    """Each iteration's ``--link-budget`` choice as its metrics logged it ([] without a budget)."""
    return [{k.removeprefix("budget/"): v for k, v in r.items() if k.startswith("budget/")} | {"iteration": r["iteration"]}
            for r in read_metrics(run_dir) if any(k.startswith("budget/") for k in r)]


def _with_speedups(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each row's reference (its rate's first configuration: fp32, or 'fixed' with ``--budget``) s/iteration over
    its own, as ``speedup_vs_<reference>``."""
    reference: dict[str, tuple[str, float]] = {}
    for r in rows:
        reference.setdefault(r["rate"], (r["config"], r["seconds_per_iteration"]))
    for r in rows:
        name, ref = reference[r["rate"]]
        r[f"speedup_vs_{name}"] = ref / r["seconds_per_iteration"] if ref and r["seconds_per_iteration"] else None
    return rows


def lab_bench_table(rows: list[dict[str, Any]], notes: bool = True) -> str:
    """The markdown table, and (``notes``) what each column means and the settings used."""
    reference = rows[0]["config"] if rows else "fp32"
    lines = [
        f"| rate | achieved Mbit/s | achieved/set | config | s/iteration | MB/iteration | x faster than {reference} |",
        "|---|---:|---:|---|---:|---:|---:|",
    ]
    for r in rows:
        speedup = "-" if r.get(f"speedup_vs_{reference}") is None else f"{r[f'speedup_vs_{reference}']:.2f}x"
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
        for r in rows:
            for choice in r.get("budget", []):
                specs = ", ".join(f"{k.removeprefix('spec/')} {v}" for k, v in choice.items() if k.startswith("spec/"))
                lines.append(f"- {format_rate(r['rate_bits'])} {r['config']}, iteration {choice['iteration']}: "
                             f"{specs} (allowed {choice['allowed_up_bytes'] / 1e6:.2f} MB up, "
                             f"{choice['allowed_down_bytes'] / 1e6:.2f} MB down; predicted "
                             f"{choice['predicted_up_bytes'] / 1e6:.2f} / {choice['predicted_down_bytes'] / 1e6:.2f})")
    return "\n".join(lines)
