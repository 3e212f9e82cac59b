"""The instructions each call on the synchronous rollout's per-step path executes, counted by valgrind: the same
count on every run, where this machine's timings of the same call move by more than what a change to it saves.

    python benchmarks/step_instructions.py [--count 100] [--against REV]

The calls are `benchmarks/cold_calls.py`'s (the wire's encode and decode of a rollout step as the synchronous
split sends it, the heads' acting forward and draw on one row, `Learner.act` on that step, the encoder's acting
forward on one observation and `Edge.observe`) and a step's round trip over splitrl's link and over a raw ZeroMQ
pair (both ends in one process), built here from the stages' own classes so that an older revision runs the same
calls. A child process builds them and runs under callgrind; for each call it
zeroes the counters (``callgrind_control -z``), makes ``--count`` calls and has them dumped (``-d``), then the same
with twice as many, after a few calls unmeasured (the first of each is the slowest): a call's count is the
difference over ``--count``, in which what the zeroing and dumping add to each region cancels but for its
variation (up to about 130,000 instructions between two regions: keep ``--count`` at 50 or more). ``--against REV``
counts the same calls in a git worktree of REV beside this tree's, both children at once (one core each).

Instructions are not time: a call's cost after a wait depends on what misses the caches (`cold_calls.py`), which
this does not count. Python's and the framing's counts are exact to a few thousand instructions a call (calls of
the same code in two trees, PYTHONHASHSEED fixed); the networks' parts, oneDNN's and MKL's kernels, moved by up
to 2.5 % between two processes of the same code, so a stage's bookkeeping is best read as its call less its part.
Needs valgrind (``apt install valgrind``). Prints a markdown table.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
WARM = 3
"""Unmeasured calls of each before its count."""


def _calls(opened: contextlib.ExitStack) -> list[tuple[str, Callable[[], object]]]:
    """The per-step calls, on one thread, in the tree this process imports `splitrl` from; what they open is
    closed by ``opened``: `benchmarks/cold_calls.py`'s (this tree's script, `splitrl` from the tree counted)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from cold_calls import step_calls

    from splitrl.transport.wire import encode

    step, calls = step_calls(opened)
    return [("wire encode of a step", lambda: encode("step", 1, {"t": 1}, step)), calls[0],
            *_round_trips(step, opened), *calls[1:]]


def _round_trips(step: dict, opened: contextlib.ExitStack) -> list[tuple[str, Callable[[], object]]]:
    """A step's features out and its action back, both ends in this process over TCP loopback: on splitrl's link
    (two `ZmqTransport`s in a session, each message framed, checked and decoded as the synchronous split's,
    ``expect``-ed as its loops do) and on a raw ZeroMQ PUSH/PULL pair carrying the same tensors' bytes (a header
    frame and the bytes, made a tensor as received). ZeroMQ's I/O threads' instructions count too."""
    import numpy as np
    import torch
    import zmq

    from splitrl.schedule.common import expect
    from splitrl.transport import ZmqTransport

    heads = ZmqTransport("tcp://127.0.0.1:0", bind=True, timeout=60.0)
    opened.callback(heads.close)
    edge = ZmqTransport(heads.endpoint, bind=False, timeout=60.0)
    opened.callback(edge.close)
    heads.session = edge.session = 1 << 16  # as the handshake leaves them: each learns the other's layouts
    action = {"action": torch.zeros(1, 3)}

    def framed() -> object:
        edge.send("step", step, {"t": 1})
        expect(heads, "step", t=1)
        heads.send("action", action, {"t": 1})
        return expect(edge, "action", t=1)

    context = zmq.Context()
    opened.callback(context.destroy, linger=0)
    pull, push = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    back_pull, back_push = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    for socket in (pull, back_pull):
        socket.setsockopt(zmq.RCVTIMEO, 60_000)  # no receive waits forever
    push.connect(f"tcp://127.0.0.1:{pull.bind_to_random_port('tcp://127.0.0.1')}")
    back_push.connect(f"tcp://127.0.0.1:{back_pull.bind_to_random_port('tcp://127.0.0.1')}")
    header = bytes(16)

    def raw() -> object:
        push.send(header, zmq.SNDMORE)
        push.send(step["features"].numpy().tobytes())
        torch.from_numpy(np.frombuffer(pull.recv_multipart()[-1], np.float32).copy())
        back_push.send(header, zmq.SNDMORE)
        back_push.send(action["action"].numpy().tobytes())
        return torch.from_numpy(np.frombuffer(back_pull.recv_multipart()[-1], np.float32).copy())

    return [("a step's round trip, raw ZeroMQ (the bytes of its features and action)", raw),
            ("a step's round trip, splitrl's link (step and action messages)", framed)]


def _control(flag: str, dumps: Path) -> int:
    """Send callgrind ``flag`` (``-z`` or ``-d``) to this process; with ``-d``, the instructions of the dump it
    wrote (the newest file in ``dumps``)."""
    before = set(dumps.iterdir())
    subprocess.run(["callgrind_control", flag, str(os.getpid())], check=True, capture_output=True, timeout=600)
    if flag != "-d":
        return 0
    new = sorted(set(dumps.iterdir()) - before, key=lambda p: p.stat().st_mtime)
    if not new:
        raise RuntimeError(f"callgrind wrote no dump into {dumps}")
    text = new[-1].read_text()
    found = re.search(r"^(?:totals|summary): (\d+)", text, re.MULTILINE)
    if found is None:
        raise RuntimeError(f"no instruction total in {new[-1]}")
    return int(found.group(1))


def child(count: int, dumps: Path, out: Path) -> None:
    """Under callgrind: each call's instructions (what ``count`` more calls add, over ``count``) into ``out``
    (JSON)."""
    calls = _calls(contextlib.ExitStack())  # (not closed: the process ends when the counts are written)
    gc.collect()
    gc.disable()  # (a collection would fall in one call's count or another's as each tree allocates)
    result = {}
    for name, call in calls:
        for _ in range(WARM):
            call()
        regions = []
        for calls_made in (count, 2 * count):
            _control("-z", dumps)
            for _ in range(calls_made):
                call()
            regions.append(_control("-d", dumps))
        result[name] = (regions[1] - regions[0]) / count  # (what zeroing and dumping add is in both: it cancels)
    out.write_text(json.dumps(result))
    os._exit(0)  # at once: closing the env and the links under valgrind would only take minutes more


def _start(tree: Path, count: int, work: Path, label: str, opened: contextlib.ExitStack) -> subprocess.Popen:
    """A child counting the calls in ``tree`` under callgrind, its output in ``work``; killed by ``opened`` if it
    is still running then."""
    dumps = work / label
    dumps.mkdir()
    env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1"}
    command = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={dumps}/callgrind.out", sys.executable,
               str(Path(__file__).resolve()), "--child", str(dumps), str(work / f"{label}.json"), "--count", str(count)]
    log = opened.enter_context(open(work / f"{label}.log", "w"))
    process = subprocess.Popen(command, cwd=tree, env=env, stdout=log, stderr=subprocess.STDOUT)

    def stop() -> None:
        if process.poll() is None:
            process.kill()
        process.wait()
    opened.callback(stop)
    return process


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=100)
    parser.add_argument("--against", help="a git revision to count the same calls in, beside this tree")
    parser.add_argument("--child", nargs=2, metavar=("DUMPS", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.count, Path(args.child[0]), Path(args.child[1]))
        return
    if subprocess.run(["which", "callgrind_control"], capture_output=True).returncode:
        parser.error("needs valgrind's callgrind (apt install valgrind)")
    sys.path.insert(0, str(ROOT))
    from splitrl.bench.e2e_bench import checkout

    with tempfile.TemporaryDirectory(prefix="step-instructions-") as tmp, contextlib.ExitStack() as stack:
        work = Path(tmp)
        trees = [("this tree", ROOT)]
        if args.against:
            trees.append((args.against, stack.enter_context(checkout(args.against))))
        started = [(label, _start(tree, args.count, work, f"side{i}", stack)) for i, (label, tree) in enumerate(trees)]
        counts = {}
        for i, (label, process) in enumerate(started):  # (any still running when this ends is killed)
            code, out = process.wait(timeout=3600), work / f"side{i}.json"
            if code != 0 or not out.exists():
                raise SystemExit(f"{label}: valgrind's child failed ({code}):\n"
                                 + (work / f"side{i}.log").read_text()[-3000:])
            counts[label] = json.loads(out.read_text())
    labels = [label for label, _ in trees]
    print(f"instructions a call (callgrind: {2 * args.count} calls less {args.count}, over {args.count}, after "
          f"{WARM} unmeasured; PYTHONHASHSEED=0)")
    print("| call | " + " | ".join(labels) + (" | this tree less the other |" if len(labels) == 2 else " |"))
    print("|---|" + "---:|" * (len(labels) + (len(labels) == 2)))
    for name in counts[labels[0]]:
        row = [counts[label][name] for label in labels]
        cells = [f"{value:,.0f}" for value in row]
        if len(row) == 2:
            cells.append(f"{row[0] - row[1]:+,.0f} ({(row[0] - row[1]) / row[1]:+.1%})")
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
