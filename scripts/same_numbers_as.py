#!/usr/bin/env python3
"""Does this tree compute what an older revision computed? Bit for bit, on two tiny iterations.

    python scripts/same_numbers_as.py [REV] [--mode train|run] [CONFIG ...]

Checks REV (default 8593652, the last revision before the restructure of issue 13) out
into a temporary git worktree, trains each configuration there with `splitrl train` (the
old twin) and here with `splitrl train` (--mode train, the new twin) or `splitrl run`
(--mode run, the new split over ZeroMQ), then compares both stages' checkpoints and every
metric that is not a time (a round trip included), byte count of the handshake, or CPU figure. Each configuration
carries both spellings of its options (the replica moved from --codec-fwd/--codec-bwd to
--exchange in issue 13). Exit status 0 when every configuration is identical.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from splitrl.bench.e2e_bench import checkout  # noqa: E402
from splitrl.runs import load_checkpoint  # noqa: E402

TINY = ["--total-steps", "64", "--num-steps", "32", "--epochs", "2", "--minibatches", "2",
        "--max-episode-steps", "20", "--threads", "1", "--checkpoint-every", "1"]
CONFIGS: dict[str, tuple[list[str], list[str]]] = {
    # name: (the old revision's options, this tree's options)
    "plain": ([], []),
    "lossless": (["--codec-rollout", "relu+zstd", "--codec-fwd", "relu", "--codec-bwd", "ef:density=1,values=fp32"],) * 2,
    "mixed": (["--codec-rollout", "bf16", "--codec-fwd", "int8", "--codec-bwd", "paper:warm=64"],) * 2,
    "replica": (["--codec-rollout", "int8", "--codec-fwd", "replica", "--codec-bwd", "replica"],
                ["--codec-rollout", "int8", "--exchange", "replica"]),
    "replica-sync": (["--codec-rollout", "int8", "--codec-fwd", "replica:last_every=1,all_every=3", "--codec-bwd",
                      "replica"], ["--codec-rollout", "int8", "--exchange", "replica:last_every=1,all_every=3"]),
    "replica-bf16": (["--codec-fwd", "replica:sync=bf16", "--codec-bwd", "replica:values=bf16"],
                     ["--exchange", "replica:sync=bf16", "--codec-fwd", "fp32", "--codec-bwd", "bf16"]),
    "input-frames": (["--cut", "input", "--codec-rollout", "frames"],) * 2,
    "microbatches": (["--microbatches", "4", "--codec-fwd", "relu", "--codec-bwd", "ef:density=1,values=fp32"],) * 2,
}


def _metrics(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "cpu/")) and k != "charts/SPS"
             and "hello" not in k and not k.endswith("rtt_ms")} for r in rows]


def _train(tree: Path, command: str, run_dir: Path, args: list[str]) -> None:
    done = subprocess.run([sys.executable, "-m", "splitrl", command, "--run-dir", str(run_dir), *TINY, *args],
                          cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)}, capture_output=True,
                          text=True)
    if done.returncode != 0:
        raise SystemExit(f"{tree}: splitrl {command} failed:\n{done.stderr[-3000:]}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rev", nargs="?", default="8593652")
    parser.add_argument("--mode", choices=("train", "run"), default="train")
    parser.add_argument("configs", nargs="*", default=list(CONFIGS))
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="splitrl-same-"))
    same_everywhere = True
    with checkout(args.rev) as old_tree:
        for name in args.configs:
            old_args, new_args = CONFIGS[name]
            old, new = base / f"{name}-old", base / f"{name}-new"
            _train(old_tree, "train", old, old_args)
            _train(ROOT, args.mode, new, new_args)
            differences = []
            for stage, key in (("stage0", "net"), ("stage1", "heads")):
                # the old revision's checkpoints hold tensors only; ours go through their checksum
                a = torch.load(old / "checkpoints" / f"{stage}-iter00002.pt")[key]
                b = load_checkpoint(new, stage, 2)[key]
                differences += [f"{stage}.{k}" for k in a if not torch.equal(a[k], b[k])]
            old_rows, new_rows = _metrics(old), _metrics(new)
            if old_rows != new_rows:
                keys = sorted({k for a, b in zip(old_rows, new_rows) for k in a.keys() | b.keys()
                               if a.get(k) != b.get(k)})
                differences.append(f"metrics ({', '.join(keys) or 'rows'})")
            print(f"{name}: {'identical' if not differences else 'DIFFERENT: ' + ', '.join(differences)}")
            same_everywhere &= not differences
    return 0 if same_everywhere else 1


if __name__ == "__main__":
    sys.exit(main())
