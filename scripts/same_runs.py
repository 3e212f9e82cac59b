#!/usr/bin/env python3
"""Did two runs compute the same numbers? Bit for bit: every tensor of both stages' checkpoints, and every metric.

    python scripts/same_runs.py RUN_A RUN_B [--iteration N] [--net all|totals|none] [--records]

Compares both stages' checkpoints of iteration N (default: the newest both runs hold), every tensor in them
(weights, optimizer moments, codec state, the action sampler's generator; not the link's byte meter), and every
line of metrics.jsonl but times, CPU seconds, steps/s and the measured round trip. ``--net totals``: the link's
counts only as the last line's totals (an asynchronous rollout's messages fall in one iteration's line or the
next by the threads' timing); ``--net none``: not at all (the epoch-paced schedule's headers differ by a byte with
the timing, as tests/schedule/test_schedules.py knows). ``--records``: no checkpoints, but every training episode
(episodes.jsonl) too: a run trained again against the records committed of it (docs/results/, which keeps no
checkpoints). Prints one line and exits 1 on any difference: a split run against its twin
(scripts/device_check.sh), a run against one of an older revision.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Iterator

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from splitrl.runs import checkpoint_iterations, load_checkpoint  # noqa: E402

VOLATILE = ("time/", "cpu/", "link/")
"""Metrics that measure the machine, not the computation."""


def _tensors(value: Any, path: str) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(value, torch.Tensor):
        yield path, value
    elif isinstance(value, dict):
        for key, item in value.items():
            if key != "meter":  # bytes on the link: the twin's in-process link counts the same frames, but not RTTs
                yield from _tensors(item, f"{path}.{key}")
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _tensors(item, f"{path}[{i}]")


def _metrics(run_dir: Path, net: str = "all") -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [{k: v for k, v in r.items() if not k.startswith(VOLATILE) and k != "charts/SPS"} for r in rows]
    if net != "all":
        rows = [{k: v for k, v in r.items() if not k.startswith("net/") and not (
            k.startswith("net_total/") and (net == "none" or i < len(rows) - 1))} for i, r in enumerate(rows)]
    return rows


def _episodes(run_dir: Path) -> list[str]:
    return (run_dir / "episodes.jsonl").read_text().splitlines()


def differences(a: Path, b: Path, iteration: int | None = None, net: str = "all",
                records: bool = False) -> tuple[list[str], int]:
    """What differs between runs ``a`` and ``b`` (empty: nothing), and how many tensors (with ``records``:
    training episodes) were compared."""
    out, compared = [], 0
    if records:
        ea, eb = _episodes(a), _episodes(b)
        compared = len(ea)
        if ea != eb:
            first = next((i for i, (x, y) in enumerate(zip(ea, eb)) if x != y), min(len(ea), len(eb)))
            out.append(f"episodes: {len(ea)} against {len(eb)}, the first difference at line {first + 1}")
    for stage in ("stage0", "stage1") if not records else ():
        both = sorted(set(checkpoint_iterations(a, stage)) & set(checkpoint_iterations(b, stage)))
        if not both or (iteration is not None and iteration not in both):
            out.append(f"{stage}: no checkpoint of {iteration or 'any iteration'} in both")
            continue
        at = iteration or both[-1]
        ta = dict(_tensors(load_checkpoint(a, stage, at), stage))
        tb = dict(_tensors(load_checkpoint(b, stage, at), stage))
        out += [f"{name}: only in one run" for name in sorted(set(ta) ^ set(tb))]
        for name in sorted(set(ta) & set(tb)):
            compared += 1
            x, y = ta[name], tb[name]
            if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x, y):
                out.append(name)
    ma, mb = _metrics(a, net), _metrics(b, net)
    if len(ma) != len(mb):
        out.append(f"metrics: {len(ma)} against {len(mb)} iterations")
    for i, (ra, rb) in enumerate(zip(ma, mb), start=1):
        keys = sorted(k for k in set(ra) | set(rb) if ra.get(k) != rb.get(k))
        if keys:
            out.append(f"metrics of iteration {i}: {', '.join(keys[:6])}{' ...' if len(keys) > 6 else ''}")
    return out, compared


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("a", type=Path)
    parser.add_argument("b", type=Path)
    parser.add_argument("--iteration", type=int)
    parser.add_argument("--net", choices=("all", "totals", "none"), default="all",
                        help="the link's counts: every line's, the last line's totals, or none")
    parser.add_argument("--records", action="store_true",
                        help="the records alone: metrics and training episodes, no checkpoints")
    args = parser.parse_args()
    found, compared = differences(args.a, args.b, args.iteration, args.net, args.records)
    if found:
        print(f"DIFFERENT ({len(found)}): {'; '.join(found[:8])}{' ...' if len(found) > 8 else ''}")
        return 1
    what = f"{compared} training episodes" if args.records else f"{compared} tensors of both stages' checkpoints"
    print(f"identical: {what} and {len(_metrics(args.a))} iterations' metrics")
    return 0


if __name__ == "__main__":
    sys.exit(main())
