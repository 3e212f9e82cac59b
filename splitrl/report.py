"""Figures and tables from run directories: ``splitrl report`` (the paper's two figures and a table of final
numbers for any set of runs) and ``splitrl curve`` (one run's learning curve).

Figures (PNG, matplotlib): the EMA(0.9) episodic return against env steps, with a
dashed line where a run's warm start ends, and the cumulative bytes on the link
against env steps (log scale: codecs differ by orders of magnitude). One line per
run, labelled by its directory and codec settings. Optionally TensorBoard event
files, written with PyTorch's standard `SummaryWriter`.

matplotlib and tensorboard are optional extras (``pip install 'splitrl[report]'``);
the import of each happens only when it is needed, with a clear error if missing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from .errors import SettingsError
from .runs import link_bytes, metric_scalars, newest_evals, run_settings, summary_writer
from .summary import run_history, summarise_run

__all__ = ["RunSeries", "load_run", "pyplot", "return_figure", "bytes_figure", "report_table", "write_tensorboard",
           "make_report", "curve_table"]

_EXTRA_HINT = "install the report extra: pip install -c constraints.txt -e '.[report]'"


def pyplot() -> Any:
    """matplotlib.pyplot on the file-only Agg backend (no display needed)."""
    try:
        import matplotlib
    except ImportError:
        raise ImportError(f"figures need matplotlib: {_EXTRA_HINT}") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


@dataclass
class RunSeries:
    """One run directory, ready to plot."""

    name: str
    label: str
    steps: list[int]
    ema: list[float | None]
    cumulative_bytes: list[int]
    warm_start: int | None
    """Env steps of full-precision gradients before a codec's accumulation starts (None: no warm start)."""
    summary: dict[str, Any]
    records: list[dict[str, Any]]
    evaluations: dict[bool, dict[str, Any]] = field(default_factory=dict)
    """The newest line of the run's eval.jsonl (`splitrl eval`) of each mode, keyed by ``deterministic``."""


def _warm_start(settings: dict[str, Any]) -> int | None:
    """The largest ``warm`` of the run's codecs, if any is set (the paper's 30,000 env steps)."""
    from .codecs import parse_codec

    warm = 0
    for stream, spec in (settings.get("codecs") or {}).items():
        try:
            codec = parse_codec(spec, stream.removeprefix("codec_"))
        except ValueError:
            continue  # a spec from another version: nothing to mark
        codec = getattr(codec, "inner", codec)  # +zstd wraps the codec that warms up
        warm = max(warm, int(getattr(codec, "warm", 0) or 0))
    return warm or None


def load_run(run_dir: str | Path) -> RunSeries:
    run_dir = Path(run_dir)
    history = run_history(run_dir)  # a fleet's merged: every edge's link and episodes
    records = history.records
    summary = summarise_run(run_dir)
    settings = run_settings(history.settings_dir)
    cut = "" if summary["cut"] in ("cnn", "?") else f" (cut {summary['cut']})"
    return RunSeries(
        name=run_dir.name,
        label=f"{run_dir.name}: {summary['codecs']}{cut}",
        steps=[r["global_step"] for r in records],
        ema=[r.get("charts/episodic_return_ema") for r in records],
        cumulative_bytes=[link_bytes(r) for r in records],
        warm_start=_warm_start(settings),
        summary=summary,
        records=records,
        evaluations=newest_evals(run_dir),
    )


def _eval_cell(evaluations: dict[bool, dict[str, Any]]) -> str:
    """Deterministic / sampled: "mean ± std (n episodes, iteration i)" each, "n/a" for a mode not evaluated."""
    return " / ".join(
        f"{e['return_mean']:.1f} ± {e['return_std']:.1f} ({e['episodes']} episodes, "
        f"iteration {e.get('iteration', '?')})"
        if (e := evaluations.get(mode)) else "n/a" for mode in (True, False))


def return_figure(runs: Sequence[RunSeries], path: str | Path) -> Path:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for run in runs:
        points = [(s, e) for s, e in zip(run.steps, run.ema) if e is not None]
        (line,) = ax.plot([p[0] for p in points], [p[1] for p in points], marker=".", label=run.label)
        if run.warm_start is not None:
            ax.axvline(run.warm_start, linestyle="--", linewidth=1, color=line.get_color())
    ax.set_xlabel("env steps")
    ax.set_ylabel("episodic return, EMA(0.9)")
    ax.set_title("return (dashed: end of a warm start)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    return _save(plt, fig, path)


def bytes_figure(runs: Sequence[RunSeries], path: str | Path) -> Path:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for run in runs:
        ax.plot(run.steps, run.cumulative_bytes, marker=".", label=run.label)
    ax.set_yscale("log")
    ax.set_xlabel("env steps")
    ax.set_ylabel("bytes on the link, cumulative (both directions)")
    ax.set_title("traffic")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, loc="best")
    return _save(plt, fig, path)


def _save(plt: Any, fig: Any, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def report_table(runs: Sequence[RunSeries]) -> str:
    """Markdown: final numbers per run; the ratio is the first run's bytes per env step over each run's
    (per step, so runs of different lengths compare fairly; for equal lengths it is the total's ratio)."""
    first = runs[0].summary["bytes_per_step"]
    evals = any(run.evaluations for run in runs)  # the column only where `splitrl eval` ran
    lines = [
        f"| run | codecs (rollout / fwd / bwd) | iterations | env steps | total bytes | bytes per env step "
        f"| x fewer than {runs[0].name} | final EMA return | steps/s |"
        + (" held-out eval return: deterministic / sampled |" if evals else ""),
        "|---|---|---:|---:|---:|---:|---:|---:|---:|" + ("---|" if evals else ""),
    ]
    for run in runs:
        s = run.summary
        ratio = f"{first / s['bytes_per_step']:.1f}" if s["bytes_per_step"] else "n/a"
        ema = "n/a" if s["final_ema"] is None else f"{s['final_ema']:.1f}"
        sps = f"{s['steps'] / s['wall_seconds']:.1f}" if s["wall_seconds"] else "n/a"
        lines.append(f"| {run.name} | `{s['codecs']}` | {s['iterations']} | {s['steps']:,} | {s['total_bytes']:,} "
                     f"| {s['bytes_per_step']:,.0f} | {ratio} | {ema} | {sps} |"
                     + (f" {_eval_cell(run.evaluations)} |" if evals else ""))
    return "\n".join(lines)


def write_tensorboard(runs: Sequence[RunSeries], out_dir: str | Path) -> list[Path]:
    """One event-file directory per run: every numeric metric, and the link's cumulative bytes, by env step."""
    dirs = []
    for run in runs:
        log_dir = Path(out_dir) / run.name
        for old in log_dir.glob("events.out.tfevents.*"):  # a new report replaces, rather than adds to, the old
            old.unlink()
        writer = summary_writer(log_dir)
        try:
            writer.add_text("settings", run.label)
            for record, cumulative in zip(run.records, run.cumulative_bytes):
                step = record["global_step"]
                writer.add_scalar("net/link_bytes_cumulative", cumulative, step)
                for key, value in metric_scalars(record):
                    writer.add_scalar(key, value, step)
        finally:
            writer.close()
        dirs.append(log_dir)
    return dirs


def make_report(run_dirs: Sequence[str | Path], out_dir: str | Path, tensorboard: bool = False) -> dict[str, Any]:
    """Write return.png, bytes.png and report.md (and tensorboard/) into ``out_dir``; returns their paths."""
    if not run_dirs:
        raise SettingsError("give at least one run directory")
    runs = [load_run(d) for d in run_dirs]
    names = [r.name for r in runs]
    if len(set(names)) != len(names):
        raise SettingsError(f"run directories must have distinct names (they label the lines): {names}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths: dict[str, Any] = {
        "return": return_figure(runs, out / "return.png"),
        "bytes": bytes_figure(runs, out / "bytes.png"),
    }
    table = report_table(runs)
    md = out / "report.md"
    md.write_text(
        "# Report\n\n"
        + "".join(f"- `{Path(d)}`\n" for d in run_dirs)
        + "\n![return](return.png)\n\n![bytes on the link](bytes.png)\n\n"
        + table + "\n"
    )
    paths["table"], paths["markdown"] = table, md
    if tensorboard:
        paths["tensorboard"] = write_tensorboard(runs, out / "tensorboard")
    return paths


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def curve_table(run_dir: str | Path) -> str:
    """Per iteration: steps, EMA(0.9) return, mean return of its episodes, steps/s, MB on the link."""
    rows = run_history(run_dir).records
    lines = [
        "| iteration | global_step | EMA(0.9) return | mean return | episodes | steps/s | MB on the link (cumulative) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['iteration']} | {r['global_step']} | {_fmt(r.get('charts/episodic_return_ema'), '.1f')} "
            f"| {_fmt(r.get('charts/episodic_return'), '.1f')} | {r.get('charts/episodes', 0)} "
            f"| {r['charts/SPS']:.1f} | {link_bytes(r) / 1e6:.0f} |"
        )
    return "\n".join(lines)
