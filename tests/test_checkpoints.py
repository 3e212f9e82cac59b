"""Checkpoints are data: tensors and plain values, read back without running anything a file names."""

import collections
import hashlib
import os
import re
import shutil
import subprocess

import numpy as np
import pytest
import torch

from splitrl.checkpoints import UnsafeCheckpointError, dumps, loads, upgrade
from splitrl.runs import RunLog, checkpoint_path, load_checkpoint, upgrade_checkpoints

from .conftest import ROOT, TINY, child_env, splitrl_cmd


def _same(a, b, path="state"):
    assert type(a) is type(b), f"{path}: {type(a).__name__} became {type(b).__name__}"
    if isinstance(a, dict):
        assert list(a) == list(b), path
        for key in a:
            _same(a[key], b[key], f"{path}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{path}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), path
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b), path
    else:
        assert a == b, path


def test_what_a_stage_saves_comes_back_with_its_types():
    rng = np.random.default_rng(3)
    state = {
        "net": collections.OrderedDict(w=torch.randn(3, 4), b=torch.zeros(4, dtype=torch.bfloat16)),
        "optimizer": {"state": {0: {"step": torch.tensor(5.0)}}, "param_groups": [{"lr": 2.5e-4, "betas": (0.9, 0.999)}]},
        "numpy_rng": rng.bit_generator.state,  # 128-bit integers
        "python_rng": (3, tuple(range(625)), None),
        "torch_rng": torch.get_rng_state(),
        "wrappers": {"returns": np.arange(4, dtype=np.float64), "dones": np.zeros(4, bool), "count": np.int64(7),
                     "var": np.float64(0.5), "queue": [1.0, 2.0], "actions": np.zeros((0, 3), np.float32)},
        "flags": [True, None, "cnn", 3],
    }
    back = loads(dumps(state))
    _same(state, back)
    rng.bit_generator.state = back["numpy_rng"]  # a generator takes its state back


def test_a_value_that_could_not_be_read_back_is_refused_when_written():
    with pytest.raises(TypeError, match=r"state\.envs\[1\]: .* not deque"):
        dumps({"envs": [1, collections.deque([1])]})


class _Payload:
    """What a crafted checkpoint carries: unpickling it calls ``os.mkdir`` on the marker (any call would do)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (str(self.marker),)


def _plant(run_dir, stage, iteration, marker):
    """Replace a checkpoint by one holding `_Payload`, and rewrite its checksum to match (as an attacker would)."""
    path = checkpoint_path(run_dir, stage, iteration)
    torch.save({"format": 2, "net": _Payload(marker)}, path)
    path.with_name(path.name + ".sha256").write_text(hashlib.sha256(path.read_bytes()).hexdigest())


def test_a_crafted_checkpoint_with_a_matching_checksum_runs_nothing(tmp_path):
    log = RunLog(tmp_path / "run")
    log.checkpoint("stage0", 1, {"net": {"w": torch.ones(2)}})
    marker = tmp_path / "pwned"
    _plant(tmp_path / "run", "stage0", 1, marker)
    with pytest.raises(UnsafeCheckpointError, match=r"stage0-iter00001\.pt names the Python object (posix|os).mkdir"):
        load_checkpoint(tmp_path / "run", "stage0", 1)
    with pytest.raises(UnsafeCheckpointError):  # the upgrade's wider allow-list does not take it either
        upgrade_checkpoints(tmp_path / "run")
    assert not marker.exists()


def test_an_older_checkpoint_is_refused_then_upgraded_on_request(tmp_path):
    """Format 1: numpy arrays and a deque pickled as objects, no format key."""
    legacy = {"net": collections.OrderedDict(w=torch.randn(2)), "rollout": {
        "queue": collections.deque([1.0, 2.0], maxlen=100), "returns": np.arange(3.0), "count": np.int64(4)}}
    path = checkpoint_path(tmp_path, "stage0", 1)
    path.parent.mkdir()
    torch.save(legacy, path)
    path.with_name(path.name + ".sha256").write_text(hashlib.sha256(path.read_bytes()).hexdigest())
    with pytest.raises(UnsafeCheckpointError, match="upgrade-checkpoints"):
        load_checkpoint(tmp_path, "stage0", 1)
    assert upgrade(dumps({"x": 1})) is None  # a current one needs nothing
    assert upgrade_checkpoints(tmp_path) == [path]
    state = load_checkpoint(tmp_path, "stage0", 1)
    legacy["rollout"]["queue"] = [1.0, 2.0]  # a queue comes back as a list; the live deque keeps its maxlen
    _same(legacy, state)
    assert upgrade_checkpoints(tmp_path) == []


def test_no_load_goes_around_the_checkpoint_reader():
    """Every torch.load in the package is the one in splitrl/checkpoints.py, and none lets objects through."""
    loads_found = []
    for path in (ROOT / "splitrl").rglob("*.py"):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"torch\.load\(|pickle\.loads?\(|weights_only\s*=\s*False", line):
                loads_found.append((path.relative_to(ROOT).as_posix(), line.strip()))
    assert loads_found and all(p == "splitrl/checkpoints.py" and "weights_only=True" in line
                               for p, line in loads_found), loads_found


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("tiny") / "run"
    done = subprocess.run(splitrl_cmd("train", "--run-dir", str(run_dir), *TINY), env=child_env(),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return run_dir


@pytest.mark.parametrize("stage, args", [
    ("stage0", lambda run: ("eval", str(run), "--episodes", "1")),
    ("stage1", lambda run: ("train", "--resume", str(run), *TINY, "--total-steps", "128")),
], ids=["eval", "resume"])
def test_eval_and_resume_of_a_crafted_run_refuse_it_in_one_line(tiny_run, tmp_path, stage, args):
    """Each command through the one reader (`test_no_load_goes_around_the_checkpoint_reader`): eval meets the
    planted stage0 checkpoint first, a resume reaches stage1's after stage0's loaded."""
    run_dir, marker = tmp_path / "run", tmp_path / "pwned"
    shutil.copytree(tiny_run, run_dir)
    _plant(run_dir, stage, 2, marker)
    done = subprocess.run(splitrl_cmd(*args(run_dir)), env=child_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert re.search(rf"{stage}-iter00002\.pt names the Python object (posix|os).mkdir", done.stderr), done.stderr
    assert done.stderr.count("names the Python object") == 1, done.stderr  # said once
    assert not marker.exists()
