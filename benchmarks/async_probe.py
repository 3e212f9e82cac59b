"""Run the twin (`splitrl train`) with its stages watched, and check that what trains is what happened.

    python benchmarks/async_probe.py [--hold] [--plant NAME] -- TRAIN_ARGS...

The asynchronous schedule collects the next rollout while the last one trains,
with acting copies of the encoder and the heads swapped in flight. Nothing in a
run's metrics shows whether a sample's stored observation, outcome, behaviour
log-probability and version still belong together. This script builds the same
`Edge` and `Learner` as the twin (`splitrl.runner.build.make_edge` and
``make_learner``, patched), wraps methods of those two objects, records each env
step at the vector env's boundary and keeps a frozen copy of every policy
version as training leaves it. For every iteration it trains it checks:

(a) observations: stage0's stored observations are the env's at each (t, env);
(b) outcomes: stage1's stored reward / terminated / truncated are what the env
    returned for the action taken at t, and that action is the one stored at t;
(c) behaviour: each sample's stored log-probability and value (and its stored
    features, the bootstrap values) are what its recorded version's encoder and
    heads give on the stored observation and action; over the run, a neighbouring
    version must fail to match at least once, or the check could not tell;
(d) versions: stage0's tag, the encoder that encoded, the heads that acted and
    the stored version agree at each step and lag within the staleness bound;
    published copies equal the trained weights, and iteration i trains from
    version (i - 1) P on both stages, exactly (P versions an iteration: its E
    epochs with --publish epoch, where step t must also act with the pace's
    version (i - 2) E + floor(t E / T); else 1);
(e) training data: both stages train on the same minibatch indices, in the same
    order, and the trained slot's rows and versions do not change while it trains;
(f) with ``--rescore``: the baseline of the advantages and value targets and the
    proximal log-probabilities of lagging samples are version i - 1's (the network
    that starts training) on each sample's stored observation and action, and the
    value targets are GAE on that baseline with weights min(1, pi_{i-1} / mu).

The first broken invariant stops the run: a line naming it, the iteration, the
(t, env) and the numbers goes to stderr and the exit code is 1 (2: the probe
could not run). Otherwise one JSON line on stdout says what was checked.

``--hold`` (asynchronous, ``--max-staleness`` S >= 1) makes the largest lag
happen whatever the machine's timing, with condition waits, not sleeps: version
i is published only once the rollout of i + S has sent its first step, and that
rollout's second step waits for the publish. So every rollout after the S-th
starts at lag S and swaps versions in flight.

``--plant NAME`` corrupts one thing on purpose (`PLANTS`), to show the check that
should catch it does.

This file is the command; the probe's parts (the record, the checks, the hooks on
each stage, the pacing, the plants) are the package `benchmarks/alignment/`.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

if __package__:  # imported as benchmarks.async_probe (the tests run it so)
    from .alignment import PLANTS, InvariantBroken, Probe, ProbeError
else:  # run as a script: its folder, benchmarks/, is the first entry of sys.path
    from alignment import PLANTS, InvariantBroken, Probe, ProbeError

__all__ = ["PLANTS", "InvariantBroken", "Probe", "main"]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    own, train_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(prog="python benchmarks/async_probe.py",
                                     description=__doc__.split("\n\n")[0],
                                     epilog="Everything after -- goes to `splitrl train`.")
    parser.add_argument("--hold", action="store_true", help="make the largest lag and in-flight swaps happen")
    parser.add_argument("--plant", choices=sorted(PLANTS), help="corrupt one thing on purpose")
    args = parser.parse_args(own)

    from splitrl.cli.train import train
    from splitrl.runner import build

    probe = Probe(hold=args.hold, plant=args.plant)
    make_edge, make_learner = build.make_edge, build.make_learner

    def watched_learner(settings: Any, spec: Any, *a: Any, **kw: Any) -> Any:
        probe.take_settings(settings)
        learner = make_learner(settings, spec, *a, **kw)
        probe.watch_learner(learner)
        return learner

    def watched_edge(*a: Any, **kw: Any) -> Any:
        edge = make_edge(*a, **kw)
        probe.watch_edge(edge)
        return edge

    build.make_edge, build.make_learner = watched_edge, watched_learner
    try:  # the builders are put back, so one process (the tests) can run the probe again and again
        with tempfile.TemporaryDirectory(prefix="async-probe-") as tmp:
            if "--run-dir" not in train_args and "--resume" not in train_args:
                train_args += ["--run-dir", str(Path(tmp) / "run")]
            try:
                train.main(args=train_args, prog_name="async_probe", standalone_mode=False)
            except BaseException as exc:  # the run stops on the first broken invariant, however it surfaces
                if probe.failure is not None:
                    print(probe.failure, file=sys.stderr)
                    return 1
                if isinstance(exc, ProbeError):
                    print(f"async probe: {exc}", file=sys.stderr)
                    return 2
                traceback.print_exc()
                return 2
    finally:
        build.make_edge, build.make_learner = make_edge, make_learner
    if probe.failure is not None:
        print(probe.failure, file=sys.stderr)
        return 1
    try:
        summary = probe.finish()
    except InvariantBroken as exc:
        print(exc, file=sys.stderr)
        return 1
    except ProbeError as exc:
        print(f"async probe: {exc}", file=sys.stderr)
        return 2
    if args.plant:
        summary["planted"] = args.plant
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())

