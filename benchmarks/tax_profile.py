"""Where a split run's CPU goes: every process of `splitrl run` sampled by py-spy, each sample put in one part.

    python benchmarks/tax_profile.py [--iterations 2] [--rate 100] [--out DIR] [--raw FILE] [--twin] [-- RUN OPTIONS ...]

Runs `splitrl run` (the paper's configuration unless options follow ``--``) under ``py-spy record --subprocesses``
(`pip install py-spy`; root or ptrace rights), or reads a raw profile already taken (``--raw``), and prints for
each process (stage0, stage1, the env workers) the CPU seconds of each part: the ones `splitrl bench floor` times
alone (env steps, the networks' forwards and backwards, the optimizers' steps) and those around them (codecs and
framing, the transport, rollout storage and GAE, the schedule's own Python). A sample is put in the part of the
innermost frame that names one (`PARTS`, checked from the leaf up), but a codec, the framing, the transport and
the start-up hold what runs below them (a forward inside a codec is the codec's).
The first iteration (start-up: imports, the env's first reset, the handshake) is in the figures too: compare
runs of the same length. Prints a markdown table and one JSON object. ``--twin`` profiles the twin instead
(`splitrl train`: both stages in one process, each sample put in the stage of its thread's loop).
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

PARTS: list[tuple[str, tuple[str, ...]]] = [
    # (part, patterns matched against "function (file)"; the first part whose pattern a frame matches, from the
    # innermost frame outwards, takes the sample)
    ("start-up", ("<frozen importlib._bootstrap>", "_find_and_load", "inspect_env", "check (splitrl/runner")),
    ("optimizer step", ("Adam.step", "adam.py", "clip_grad_norm", "optimizer_step")),
    ("backward", ("run_backward", "_engine_run_backward", "autograd/__init__.py")),
    ("codec", ("splitrl/codecs/",)),
    ("framing", ("splitrl/transport/wire.py", "msgpack")),
    ("transport", ("splitrl/transport/", "zmq/")),
    ("storage and GAE", ("splitrl/ppo/buffer.py", "splitrl/ppo/gae.py", "RolloutBuffer", "compute_gae")),
    ("losses", ("splitrl/ppo/losses.py", "splitrl/ppo/distributions.py", "torch/distributions/")),
    ("forward", ("Module._call_impl", "torch/nn/modules/", "torch/nn/functional.py", "splitrl/models/")),
    ("env step", ("gymnasium/", "Box2D", "pygame", "splitrl/carracing.py", "splitrl/envs.py")),
    ("schedule and stages", ("splitrl/",)),
]
"""The parts a sample can fall in, innermost first; what matches none is 'other' (the interpreter, libraries)."""

_PROCESS = re.compile(r"^process \d+:")
_FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>.*?)(?::\d+)?\)$")


ACTING = ("_rollout", "act_groups", "Edge.encode", "Evaluation.run")
"""Frames of the rollout (or an evaluation): a forward under one is acting, not training."""


AROUND = ("start-up", "codec", "framing", "transport")
"""Parts that hold the computation below them: a forward inside a codec (a learned one) is the codec's."""


def part_of(frames: list[str]) -> str:
    """The part of one sample's stack (root first, as py-spy's raw format writes it): the innermost frame of one of
    the `AROUND` parts, else the innermost frame that names any part."""
    texts = []
    for frame in reversed(frames):
        m = _FRAME.match(frame)
        text = f"{m.group('func')} ({m.group('file').split('site-packages/')[-1]})" if m else frame
        texts.append(re.sub(r"\(/.*?/(splitrl/)", r"(\1", text))
    for around in (True, False):
        for text in texts:
            for part, patterns in PARTS:
                if (part in AROUND) == around and any(p in text for p in patterns):
                    if part == "forward":
                        return "forward, acting" if any(a in t for t in texts for a in ACTING) else "forward, training"
                    return part
    return "other"


def role_of(process: str) -> str:
    """stage0, stage1, an env worker or the launcher, from py-spy's 'process PID:"COMMAND"' frame."""
    command = process.partition(":")[2]
    for role in ("stage0", "stage1"):
        if re.search(rf"\b{role}\b", command):
            return role
    if "multiprocessing" in command or "spawn_main" in command or "forkserver" in command:
        return "env workers"
    return "launcher"


def account(raw: str, rate: float) -> dict[str, dict[str, float]]:
    """CPU seconds by process role and part, from py-spy's raw output sampled at ``rate`` Hz."""
    samples = []
    forked: dict[str, str] = {}  # a forked stage's pid -> its role, from its main thread's frames
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        frames = stack.split(";")
        processes = list(itertools.takewhile(_PROCESS.match, frames))  # each parent's, then the sampled one's
        frames = frames[len(processes):]
        role = role_of(processes[-1]) if processes else "?"
        pid = processes[-1].partition(":")[0] if processes else ""
        # a forked stage keeps its launcher's command line: its main thread names the stage's loop
        if role == "launcher" and any(f.startswith(("serve_stage0 ", "run_stage0 ")) for f in frames):
            role = forked[pid] = "stage0"
        elif role == "launcher" and any(f.startswith(("serve_stage1 ", "run_stage1 ", "serve_fleet ",
                                                      "_run_fleet_stage1 ")) for f in frames):
            role = forked[pid] = "stage1"
        if any(f.startswith("_async_worker ") for f in frames):  # forked by a stage: its command line, its own work
            role = "env workers"
        samples.append((pid, role, frames, int(count)))
    seconds: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for pid, role, frames, count in samples:
        if role == "launcher":  # another thread of a forked stage (its micro-batches' workers) is the stage's
            role = forked.get(pid, role)
        seconds[role][part_of(frames)] += count / rate
    return {role: dict(parts.most_common()) for role, parts in sorted(seconds.items())}


def table(accounted: dict[str, dict[str, float]]) -> str:
    parts = [q for p, _ in PARTS for q in ((f"{p}, acting", f"{p}, training") if p == "forward" else (p,))]
    parts.append("other")
    roles = list(accounted)
    lines = ["| part | " + " | ".join(roles) + " | all |", "|---|" + "---:|" * (len(roles) + 1)]
    for part in parts:
        values = [accounted[r].get(part, 0.0) for r in roles]
        if any(values):
            lines.append(f"| {part} | " + " | ".join(f"{v:.1f}" for v in values) + f" | {sum(values):.1f} |")
    totals = [sum(accounted[r].values()) for r in roles]
    lines.append("| all | " + " | ".join(f"{v:.1f}" for v in totals) + f" | {sum(totals):.1f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=2, help="of 4,096 steps (or give --total-steps after --)")
    parser.add_argument("--rate", type=float, default=100.0, help="py-spy's samples a second")
    parser.add_argument("--out", default=None, help="keep the run directory and the raw profile here")
    parser.add_argument("--raw", default=None, help="account for a raw py-spy profile already taken")
    parser.add_argument("--twin", action="store_true", help="profile `splitrl train` (one process) instead")
    parser.add_argument("run_args", nargs="*", help="options for `splitrl run` (after --)")
    args = parser.parse_args()
    if args.raw:
        raw = Path(args.raw).read_text()
    else:
        spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
        if not Path(spy).exists():
            raise SystemExit("py-spy is not installed: pip install py-spy")
        out = Path(args.out or tempfile.mkdtemp(prefix="splitrl-tax-"))
        out.mkdir(parents=True, exist_ok=True)
        length = [] if "--total-steps" in args.run_args else ["--total-steps", str(4096 * args.iterations)]
        run = [sys.executable, "-m", "splitrl", "train" if args.twin else "run", "--run-dir", str(out / "run"),
               "--overwrite", *length,
               "--checkpoint-every", "0", *args.run_args]
        profile = out / "profile.raw"
        subprocess.run([spy, "record", "--subprocesses", "--rate", f"{args.rate:g}", "--format", "raw",
                        "--output", str(profile), "--", *run], check=True)
        raw = profile.read_text()
    accounted = account(raw, args.rate)
    print(table(accounted))
    print(json.dumps({"rate": args.rate, "seconds": accounted}))


if __name__ == "__main__":
    main()
