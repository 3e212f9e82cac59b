"""Where to cut, predicted and measured: `splitrl bench cuts`.

For each model, one split run per (cut, link rate) in the lab (`splitrl.lab`: two network namespaces and a
tbf-shaped veth pair; needs root), the same small workload for all (`WORKLOAD`). The planner is calibrated on one
of them, the model's default cut at the fastest rate (`splitrl.cutplan.plan_cuts`: its env steps, what each
stage spent beyond its networks, its bytes per value), and predicts every other row from its cut and its link
alone. A run's figure is its measured iteration of median length (`splitrl.plan.typical`), as the calibration
takes it. Per model and
rate, the cut the planner ranks first is checked against the best measured one: the planner's target is a
measured time within 10 % of the best, and every prediction within 20 % of its measured seconds per iteration.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Sequence

from ..launch import progress
from ..summary import summarise_run

__all__ = ["MODELS", "WORKLOAD", "run_cut_bench", "cut_rows", "check_cuts", "cut_table"]

log = logging.getLogger(__name__)

WORKLOAD = ["--num-steps", "256", "--epochs", "2", "--minibatches", "4", "--checkpoint-every", "0"]
"""256 CarRacing steps an iteration, 2 epochs of 4 minibatches of 64: a paper iteration's shape (rollout, then
epochs of minibatches), a sixteenth of its samples, so that a dozen runs take minutes."""

MODELS: dict[str, tuple[list[str], list[str]]] = {
    "nature": (["--model", "nature"], ["input", "relu2", "cnn"]),
    "impala": (["--model", "impala"], ["input", "stack3", "cnn"]),
}
"""Each model's options and the cuts measured: the observation, a feature map inside the encoder, the default."""


def _name(model: str, cut: str, rate: str) -> str:
    return f"{model}-{cut}-{rate}"


def run_cut_bench(models: Sequence[str] = tuple(MODELS), rates: Sequence[str] = ("10mbit", "100mbit"),
                  iterations: int = 3, extra_args: Sequence[str] = (), out_dir: str | None = None,
                  echo: Callable[[str], Any] | None = None) -> Path:
    """Every (model, cut, rate) run in the lab, kept in ``out_dir`` (runs already there with all their
    iterations are not run again); returns the directory."""
    from ..lab import run_lab  # needs root
    from ..netem.tc import Shaping

    echo = echo or log.info
    _known(models)
    if "--num-envs" in extra_args or "--num-steps" in extra_args:
        raise ValueError("the bench's workload is 1 env x 256 steps an iteration (WORKLOAD); its runs are that long")
    base = Path(out_dir or tempfile.mkdtemp(prefix="splitrl-cuts-"))
    base.mkdir(parents=True, exist_ok=True)
    for model in models:
        options, cuts = MODELS[model]
        for rate in rates:
            for cut in cuts:
                run_dir = base / _name(model, cut, rate)
                if _finished(run_dir, iterations):
                    continue
                args = ["--total-steps", str(256 * iterations), *WORKLOAD, *options, "--cut", cut, *extra_args,
                        "--run-dir", str(run_dir)]
                echo(f"{run_dir.name}: {' '.join(args)}")
                with progress(run_dir, iterations, run_dir.name):
                    result = run_lab(args, str(run_dir), Shaping.parse(rate, "0ms"), measure_bytes=0, echo=echo)
                if result.code != 0:
                    raise RuntimeError(f"{run_dir.name} failed in the lab (exits {result.codes}); logs in {run_dir}")
                shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)  # records are what the bench reads
    return base


def _known(models: Sequence[str]) -> None:
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        raise ValueError(f"unknown model(s) {', '.join(unknown)}; choose from {', '.join(MODELS)}")


def _finished(run_dir: Path, iterations: int) -> bool:
    try:
        return summarise_run(run_dir)["iterations"] >= iterations
    except (FileNotFoundError, ValueError, KeyError, IndexError):
        return False


def cut_rows(out_dir: str | Path, models: Sequence[str] = tuple(MODELS),
             rates: Sequence[str] = ("10mbit", "100mbit")) -> list[dict[str, Any]]:
    """Each run's measured row and its prediction, calibrated per model on its default cut at the fastest rate
    (the networks timed here: run it on an idle machine)."""
    from ..cutplan import plan_cuts
    from ..plan import Link, Timings, load_run, typical
    from ..runs import measured_records, read_metrics
    from ..units import parse_rate

    _known(models)
    rows: list[dict[str, Any]] = []
    fastest = max(rates, key=parse_rate)
    for model in models:
        _, cuts = MODELS[model]
        reference = Path(out_dir) / _name(model, cuts[-1], fastest)  # the default cut, last in MODELS
        measured = load_run(reference)
        cache: dict[str, Timings] = {}

        def timed(settings, spec=measured.spec):
            return cache.setdefault(settings.cut, Timings(settings, spec))

        for rate in rates:
            link = Link.shaped(parse_rate(rate), _rtt(reference))
            plans = {p.cut: p for p in plan_cuts(measured.settings, reference, link, vector=measured.vector,
                                                 threads=measured.threads, only=cuts,
                                                 measured_link=Link.shaped(parse_rate(fastest), _rtt(reference)),
                                                 timings=timed)}
            ranked = list(plans)  # fastest predicted first
            for cut in cuts:
                run_dir = Path(out_dir) / _name(model, cut, rate)
                summary = summarise_run(run_dir, skip_last=True)
                seconds = typical(measured_records(read_metrics(run_dir), skip_last=True))[0]["time/iteration"]
                samples = measured.settings.ppo.num_steps * measured.settings.env.num_envs
                plan = plans[cut].plan
                rows.append({
                    "model": model, "cut": cut, "rate": rate, "values": plans[cut].values,
                    "measured_s": seconds, "mean_s": summary["seconds_per_iteration"], "predicted_s": plan.seconds,
                    "error": plan.seconds / seconds - 1,
                    "measured_bytes_per_step": summary["bytes_per_iteration"] / samples,
                    "predicted_bytes_per_step": plan.bytes_per_step,
                    "rank": ranked.index(cut) + 1, "reference": run_dir == reference, "run_dir": str(run_dir),
                })
    return rows


def _rtt(run_dir: Path) -> float:
    """The round trip in s the run's last record holds (``link/rtt_ms``: the pipelined schedule measures it; 0
    for the synchronous runs of this bench, over a link with no delay set)."""
    from ..runs import read_metrics

    records = read_metrics(run_dir)
    return float(records[-1].get("link/rtt_ms") or 0.0) / 1000


def check_cuts(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (model, rate): the cut ranked first, the best measured, and the first one's measured time over the
    best's; and the largest prediction error."""
    out = []
    for key in dict.fromkeys((r["model"], r["rate"]) for r in rows):
        group = [r for r in rows if (r["model"], r["rate"]) == key]
        chosen = min(group, key=lambda r: r["rank"])
        best = min(group, key=lambda r: r["measured_s"])
        out.append({"model": key[0], "rate": key[1], "recommended": chosen["cut"], "best_measured": best["cut"],
                    "recommended_over_best": chosen["measured_s"] / best["measured_s"],
                    "worst_error": max((r["error"] for r in group), key=abs)})
    return out


def cut_table(rows: Sequence[dict[str, Any]]) -> str:
    out = ["| model | rate | cut | values a sample | measured s/iteration | predicted | error | measured B/step "
           "| predicted B/step | rank |", "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        mark = " (calibration)" if r["reference"] else ""
        out.append(f"| {r['model']} | {r['rate']} | {r['cut']}{mark} | {r['values']:,} | {r['measured_s']:.1f} "
                   f"| {r['predicted_s']:.1f} | {r['error']:+.1%} | {r['measured_bytes_per_step']:,.0f} "
                   f"| {r['predicted_bytes_per_step']:,.0f} | {r['rank']} |")
    out += ["", "| model | rate | recommended | best measured | recommended's time over best | worst error |",
            "|---|---|---|---|---:|---:|"]
    for c in check_cuts(rows):
        out.append(f"| {c['model']} | {c['rate']} | {c['recommended']} | {c['best_measured']} "
                   f"| {c['recommended_over_best']:.2f} | {c['worst_error']:+.1%} |")
    return "\n".join(out)
