"""The asynchronous schedule trains on the data its envs and acting policies produced, sample by sample.

Each test runs benchmarks/async_probe.py (the twin with its Edge and Learner
watched; its docstring lists the invariants (a) to (f)) in this process, through
its `main`, as the command runs it: the twin is one process whatever it runs, so
a process of its own would only import torch again; every wait in it has a
timeout. The planted bugs show that each invariant fails when its data is off by
one step or one version.
"""

import json
import subprocess

import pytest

from benchmarks.async_probe import PLANTS
from benchmarks.async_probe import main as probe_main

from ..conftest import ROOT

# Three iterations of 2 envs x 32 steps in 2 groups, 2 epochs of 2 minibatches; episodes of 40 steps, so
# two truncations per env are bootstrapped. fp32 throughout (the default codecs).
TINY = ["--num-envs", "2", "--num-steps", "32", "--rollout-groups", "2", "--total-steps", "192", "--epochs", "2",
        "--minibatches", "2", "--max-episode-steps", "40", "--threads", "1", "--checkpoint-every", "0",
        "--hidden", "32", "--timeout", "30", "--start-timeout", "30"]
# The planted bugs stop the run in its first or second iteration: rollouts of 8 steps do.
SHORT = [*TINY, "--num-steps", "8", "--total-steps", "48"]


@pytest.fixture
def _probe(capsys):
    """``python benchmarks/async_probe.py ARGS...`` in this process: its exit code, stdout and stderr."""

    def probe(*args: str) -> subprocess.CompletedProcess:
        capsys.readouterr()
        code = probe_main(list(args))
        out = capsys.readouterr()
        return subprocess.CompletedProcess(["benchmarks/async_probe.py", *args], code, out.out, out.err)

    return probe


def _summary(done: subprocess.CompletedProcess) -> dict:
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["splitrl"] == str(ROOT / "splitrl")  # this checkout's code, not an installed copy
    assert summary["ok"] and summary["iterations"] == 3 and summary["samples"] == 192
    assert summary["truncations"] > 0 and summary["minibatch_parts"] == 3 * 2 * 2
    assert summary["neighbour_mismatches"] > 0  # (c) tells versions apart
    return summary


def test_async_samples_line_up_with_the_envs_and_the_acting_versions(_probe):
    """Free-running --async --max-staleness 1, as the machine's timing has it: every invariant holds and no
    sample lags more than one version."""
    summary = _summary(_probe("--", "--async", "--max-staleness", "1", *TINY))
    assert summary["mode"] == "async" and set(summary["lags"]) <= {"0", "1"}


def test_samples_lagging_one_and_two_versions_line_up_and_rescored_train_against_the_training_network(_probe):
    """--max-staleness 2 with the probe's --hold, which makes the largest lag happen, and --rescore: samples of
    lag 1 and of lag 2 both occur, a rollout swaps versions in flight, every invariant (a)-(e) holds, and (f)
    the baseline, the proximal policy and the value targets are version i - 1's on every sample."""
    summary = _summary(_probe("--hold", "--", "--async", "--rescore", "--max-staleness", "2", *TINY))
    assert summary["lags"].get("1", 0) > 0 and summary["lags"].get("2", 0) > 0
    assert set(summary["lags"]) <= {"0", "1", "2"}
    assert summary["rollouts_swapping_in_flight"] > 0
    assert "f rescore" in summary["invariants"] and summary["rescored_rollouts"] == 3


def test_epoch_paced_samples_line_up_and_rescored_train_against_the_training_network(_probe):
    """--publish epoch (E = 2 of T = 32 steps) with --rescore: every step acts with the pace's version (2 epochs
    behind for t < 16, 1 behind after), the layers of every epoch's end are what training left, and (a)-(f)
    hold."""
    summary = _summary(_probe("--", "--async", "--rescore", "--max-staleness", "1", "--publish", "epoch", *TINY))
    assert summary["versions_per_iteration"] == 2
    assert summary["lags"] == {"0": 64, "1": 64, "2": 64}  # in epochs: iteration 1 acts with the start
    assert summary["rollouts_swapping_in_flight"] == 2 * 2  # iterations 2 and 3, each group once
    assert "f rescore" in summary["invariants"] and summary["rescored_rollouts"] == 3


def test_a_version_tag_one_epoch_behind_fails_the_paced_check(_probe):
    done = _probe("--plant", "version-tag", "--", "--async", "--max-staleness", "1", "--publish", "epoch", *SHORT)
    assert done.returncode == 1, done.stdout + done.stderr[-3000:]
    assert "invariant (d)" in done.stderr and "the pace says" in done.stderr, done.stderr[-3000:]


def test_the_pipelined_schedule_passes_the_same_checks(_probe):
    """The control: without --async nothing lags, and the same checks pass."""
    summary = _summary(_probe("--", *TINY))
    assert summary["mode"] == "pipelined" and summary["lags"] == {"0": 192}


@pytest.mark.parametrize("plant", sorted(PLANTS))
def test_a_planted_misalignment_fails_the_invariant_that_covers_it(_probe, plant):
    """One deliberate bug at a time (an observation or an outcome stored a step late, the heads swapped a step
    late, the version tag one behind, stage1's minibatches reordered, the rollout scored again by the encoder
    stage0 started with): the probe exits 1 naming the invariant
    that covers it."""
    invariant, _ = PLANTS[plant]
    rescore = ["--rescore"] if plant.startswith("rescore") else []
    done = _probe("--hold", "--plant", plant, "--", "--async", *rescore, "--max-staleness", "1", *SHORT)
    assert done.returncode == 1, done.stdout + done.stderr[-3000:]
    assert f"invariant ({invariant})" in done.stderr, done.stderr[-3000:]
    assert "iteration" in done.stderr
