"""Where each stage's thread is busy within one iteration, drawn from the spans a traced run wrote.

    SPLITRL_TIMELINE=DIR splitrl run ...            # every process appends its phases' spans to DIR
    python benchmarks/timeline.py DIR [--iteration 2] [--out timeline.png] [--json FILE] [--spans FROM:TO]

A span is one phase of a `PhaseClock` (`splitrl/schedule/common.py`): stage0's ``env`` (stepping the envs, or
waiting for its worker processes), ``encoder`` (forwards, backwards and steps), ``codec``, ``link`` (sending,
and waiting for stage1's answer) and ``pace``; stage1's ``heads`` (everything it computes). The window is the
iteration as stage0 saw it (its first span's start to its last span's end). Prints, for each process's thread,
the seconds of each phase in the window and the seconds in no phase (the loops' own Python between phases, or
nothing to do); ``--out`` draws the rows (matplotlib). The env worker processes are not traced: stage0's
``env`` spans show when it waits for them. ``--spans FROM:TO`` also lists every span that starts between FROM and
TO seconds into the iteration, in order, in milliseconds from FROM: a few minibatches up close.

``--cpu`` prints where each stage process's CPU seconds went in the iteration instead: in each stretch its loop
marks (the schedules' ``rollout`` and ``training``), the process's CPU seconds (all its threads),
its phases' thread CPU seconds, and the rest (``around``: receiving and sending, ZeroMQ's I/O threads, the loop's
own Python between phases); the pipelined schedule marks the same two stretches. ``--floor FILE`` (`splitrl bench
floor --json FILE`, the same settings) sets each stretch of the synchronous schedule, and of the twin (both stages
in one process), against the parts it runs (`STRETCH_PARTS`), timed alone (stage0's rollout holds the env steps
only where they run in its process).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

Row = tuple[str, list[tuple[str, float, float]]]
COLOURS = {"env": "tab:green", "encoder": "tab:blue", "heads": "tab:orange", "codec": "tab:purple",
           "link": "lightgrey", "pace": "tab:brown"}


def load(directory: Path, iteration: int) -> tuple[tuple[float, float], list[Row]]:
    """The window of ``iteration`` (stage0's) and, for each (process, thread), its spans clipped to it, from
    whichever lines hold them."""
    lines = [json.loads(line) for path in sorted(directory.glob("timeline-*.jsonl"))
             for line in path.read_text().splitlines() if line.strip()]
    windows = [line["window"] for line in lines
               if line["role"] == "stage0" and line["iteration"] == iteration and line.get("window")]
    if not windows:
        raise SystemExit(f"{directory}: stage0 wrote no window of iteration {iteration}")
    window = (windows[0][0], windows[0][1])
    rows: dict[tuple[int, str], list[tuple[str, float, float]]] = {}
    roles: dict[int, set[str]] = {}
    for line in lines:
        roles.setdefault(line["pid"], set()).add(line["role"])
        for thread, phase, start, end, *_ in line["spans"]:  # (then the span's thread CPU seconds)
            start, end = max(start, window[0]), min(end, window[1])
            if end > start:
                rows.setdefault((line["pid"], thread), []).append((phase, start, end))
    named = []
    for (pid, thread), spans in sorted(rows.items(), key=lambda kv: (sorted(roles[kv[0][0]]), kv[0][1])):
        role = "twin" if len(roles[pid]) > 1 else next(iter(roles[pid]))  # the twin: both stages, one process
        named.append((role if thread == "MainThread" else f"{role}, thread {thread}", sorted(spans, key=lambda s: s[1])))
    return window, named


def account(window: tuple[float, float], rows: list[Row]) -> list[dict[str, Any]]:
    """Per row: seconds in each phase and in none (the window less the union of its spans)."""
    out = []
    for name, spans in rows:
        phases: dict[str, float] = {}
        covered, reach = 0.0, window[0]
        for phase, start, end in spans:
            phases[phase] = phases.get(phase, 0.0) + end - start
            if end > reach:
                covered += end - max(start, reach)
                reach = end
        out.append({"row": name, "phases": phases, "in no phase": window[1] - window[0] - covered})
    return out


STRETCH_PARTS = {("stage0", "rollout"): ("envs", "encoder acting"), ("stage0", "training"): ("encoder training",),
                 ("stage1", "rollout"): ("heads acting",), ("stage1", "training"): ("heads training",)}
"""The parts (`splitrl.bench.floor_bench.PARTS`) each stage's stretch runs."""


def cpu_account(directory: Path, iteration: int, floor: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Per stage process, its line of ``iteration``: the process's CPU seconds since its last line, and per
    stretch its process CPU seconds, wall seconds, each phase's thread CPU seconds (the spans that start in it),
    the rest (``around``) and, with ``floor`` (`splitrl bench floor`'s JSON), the parts' CPU seconds.

    The twin (`splitrl train`: both stages' loops in one process, its ``process`` here ``twin``) takes turns
    within its process: each stage's thread marks the same stretch with the process's CPU seconds, both threads'
    work. Its stretch of a name is then the longer of the two marks, set against both stages' parts, and its
    iteration is every line the process wrote for it."""
    out = []
    for path in sorted(directory.glob("timeline-*.jsonl")):
        lines = [line for line in map(json.loads, filter(str.strip, path.read_text().splitlines()))
                 if line["iteration"] == iteration and "cpu" in line]
        if not lines:
            continue
        roles = {line["role"] for line in lines}
        twin = len(roles) > 1
        spans = [span for line in lines for span in line["spans"] if len(span) > 4]
        marked = [tuple(st) for line in lines for st in line.get("stretches", [])]
        if twin:  # each name once: the longer mark
            marked = [max((st for st in marked if st[0] == name), key=lambda st: st[2] - st[1])
                      for name in dict.fromkeys(st[0] for st in marked)]
        stretches = []
        for name, start, end, cpu in marked:
            phases: dict[str, float] = {}
            for _, phase, begin, _, used in spans:
                if start <= begin < end:
                    phases[phase] = phases.get(phase, 0.0) + used
            row = {"stretch": name, "cpu": cpu, "wall": end - start, "phases": phases,
                   "around": cpu - sum(phases.values())}
            parts = [STRETCH_PARTS.get((role, name)) for role in sorted(roles)]
            if floor is not None and all(p is not None for p in parts):
                row["parts"] = sum(floor["parts"][p] for names in parts for p in names)
            stretches.append(row)
        out.append({"process": "twin" if twin else lines[0]["role"], "pid": lines[0]["pid"],
                    "cpu": sum(line["cpu"] for line in lines), "stretches": stretches})
    return sorted(out, key=lambda r: r["process"])


def cpu_table(rows: list[dict[str, Any]]) -> str:
    """Markdown: each process's stretches, then the rest of its iteration (``rest``: what no stretch holds)."""
    lines = ["| process | stretch | wall s | CPU s | phases (thread CPU s) | around | parts alone | over parts |",
             "|---|---|---:|---:|---|---:|---:|---:|"]
    for r in rows:
        for st in r["stretches"]:
            phases = ", ".join(f"{p} {v:.2f}" for p, v in sorted(st["phases"].items()))
            parts = st.get("parts")
            over = f"+{st['cpu'] - parts:.2f} ({st['cpu'] / parts:.2f}x)" if parts else ""
            lines.append(f"| {r['process']} | {st['stretch']} | {st['wall']:.1f} | {st['cpu']:.2f} | {phases} | "
                         f"{st['around']:.2f} | {'' if parts is None else f'{parts:.2f}'} | {over} |")
        rest = r["cpu"] - sum(st["cpu"] for st in r["stretches"])
        lines.append(f"| {r['process']} | rest | | {rest:.2f} | | | | |")
        lines.append(f"| {r['process']} | **iteration** | | **{r['cpu']:.2f}** | | | | |")
    return "\n".join(lines)


def draw(window: tuple[float, float], rows: list[Row], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(12, 0.6 * len(rows) + 1.4))
    for y, (_, spans) in enumerate(rows):
        for phase in {p for p, _, _ in spans}:
            bars = [(s - window[0], e - s) for p, s, e in spans if p == phase]
            ax.broken_barh(bars, (y - 0.4, 0.8), color=COLOURS.get(phase, "black"), label=phase, linewidth=0)
    handles = {h.get_label(): h for h in ax.get_legend_handles_labels()[0]}
    ax.legend(handles.values(), handles.keys(), loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=len(handles))
    ax.set_yticks(range(len(rows)), [name for name, _ in rows])
    ax.set_xlim(0, window[1] - window[0])
    ax.set_xlabel("seconds into the iteration")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def spans_between(window: tuple[float, float], rows: list[Row], start: float, stop: float) -> str:
    """Markdown: each span starting ``start`` to ``stop`` seconds into the window, in order of its start, in
    milliseconds from ``start``."""
    origin = window[0] + start
    spans = sorted((begin, end, name, phase) for name, row in rows for phase, begin, end in row
                   if origin <= begin < window[0] + stop)
    lines = ["| from ms | to ms | ms | thread | phase |", "|---:|---:|---:|---|---|"]
    lines += [f"| {1e3 * (b - origin):.1f} | {1e3 * (e - origin):.1f} | {1e3 * (e - b):.1f} | {name} | {phase} |"
              for b, e, name, phase in spans]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--iteration", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="draw the rows into this PNG")
    parser.add_argument("--title", default="")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--spans", default=None, help="FROM:TO seconds into the iteration: list those spans")
    parser.add_argument("--cpu", action="store_true", help="each process's CPU seconds by stretch and phase")
    parser.add_argument("--floor", type=Path, default=None, help="with --cpu: `splitrl bench floor --json` output")
    args = parser.parse_args()
    if args.cpu:
        floor = json.loads(args.floor.read_text()) if args.floor else None
        rows = cpu_account(args.directory, args.iteration, floor)
        print(f"iteration {args.iteration}: CPU seconds")
        print(cpu_table(rows))
        if args.json:
            args.json.write_text(json.dumps({"iteration": args.iteration, "processes": rows}, indent=1))
        return
    window, rows = load(args.directory, args.iteration)
    table = account(window, rows)
    phases = sorted({p for r in table for p in r["phases"]})
    print(f"iteration {args.iteration}: {window[1] - window[0]:.1f} s as stage0 saw it")
    print("| thread | " + " | ".join(phases) + " | in no phase |")
    print("|---|" + "---:|" * (len(phases) + 1))
    for r in table:
        cells = [f"{r['phases'].get(p, 0.0):.1f}" for p in phases]
        print(f"| {r['row']} | " + " | ".join(cells) + f" | {r['in no phase']:.1f} |")
    if args.spans:
        start, _, stop = args.spans.partition(":")
        print(spans_between(window, rows, float(start), float(stop)))
    if args.out:
        draw(window, rows, args.out, args.title or f"iteration {args.iteration}")
    if args.json:
        args.json.write_text(json.dumps({"iteration": args.iteration, "seconds": window[1] - window[0],
                                         "rows": table}, indent=1))


if __name__ == "__main__":
    main()
