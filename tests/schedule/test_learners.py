"""Several learners: stage1 of a fleet as data-parallel processes (torch.distributed, gloo), one policy."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from splitrl.errors import SettingsError
from splitrl.runs import load_checkpoint
from splitrl.settings import RunOptions, ScheduleSettings, TrainSettings
from splitrl.stages.learners import Learners, edge_range

from ..conftest import child_env
from .test_fleet import LINK, ONE_ENV_EACH, _fleet_run, _rows

VOLATILE = ("time/", "cpu/", "net", "charts/SPS", "fleet/act_batch_mean")  # a learner's batch: its edges


def _same_run(a: Path, b: Path, iteration: int, edges: int = 2) -> None:
    """Stage1's heads, every edge's encoder and every edge's metrics the same, bit for bit."""
    heads = [load_checkpoint(run, "stage1", iteration)["heads"] for run in (a, b)]
    assert all(torch.equal(heads[0][name], heads[1][name]) for name in heads[0])
    for k in range(edges):
        nets = [load_checkpoint(run / f"edge-{k}", "stage0", iteration)["net"] for run in (a, b)]
        assert all(torch.equal(nets[0][name], nets[1][name]) for name in nets[0])
        rows = [[{key: v for key, v in r.items() if not key.startswith(VOLATILE)}
                 for r in _rows(run / f"edge-{k}" / "metrics.jsonl")] for run in (a, b)]
        assert rows[0] == rows[1] and [r["iteration"] for r in rows[0]] == list(range(1, iteration + 1))


def test_two_learners_of_an_edge_each_train_bit_for_bit_as_one_learner_of_both(tmp_path, spawn):
    """`splitrl run --learners 2 --edges 2` (torchrun, gloo): each learner serves one edge, and both learners end
    with the heads one learner of both edges ends with (acting as the edges come: each edge's actions from its
    own step's generator), bit for bit: every sum across learners has two terms."""
    one, two = tmp_path / "one", tmp_path / "two"
    args = [*ONE_ENV_EACH, "--edges", "2", *LINK]
    _fleet_run(spawn, one, "--act-wait", "60000", *args)  # one learner: the launcher is not the point here
    code, out = spawn("run", "--run-dir", str(two), "--learners", "2", "--min-edges", "2", *args).finish(timeout=300)
    assert code == 0, out
    assert "learner 0 of 2" in out and "learner 1 of 2" in out
    assert "edges 0 .. 0 of 2" in out and "edges 1 .. 1 of 2" in out
    _same_run(one, two, 2)
    learner1 = load_checkpoint(two / "learner-1", "stage1", 2)["heads"]  # the other learner's own checkpoint
    heads = load_checkpoint(two, "stage1", 2)["heads"]
    assert all(torch.equal(heads[name], learner1[name]) for name in heads)
    assert not torch.equal(heads["critic.0.weight"], load_checkpoint(two, "stage1", 1)["heads"]["critic.0.weight"])
    edges = [json.loads(line)["fleet/edges"] for line in (two / "edge-1" / "metrics.jsonl").read_text().splitlines()]
    assert edges == [2.0, 2.0]  # counted over both learners
    assert [r["fleet/act_batch_mean"] for r in _rows(two / "edge-0" / "metrics.jsonl")] == [1.0, 1.0]


def test_learners_that_average_the_encoders_resume_where_one_learner_goes_straight(tmp_path, spawn):
    """``--encoder-sync avg``: the edges' changes summed and counted across learners. Two learners for 2
    iterations, then --resume (each learner from its own directory) to 3: one learner's 3 straight, bit for bit."""
    three = [a if a != "128" else "192" for a in ONE_ENV_EACH]
    args = ["--edges", "2", "--encoder-sync", "avg:every=1", *LINK]
    one, two = tmp_path / "one", tmp_path / "two"
    _fleet_run(spawn, one, "--act-wait", "60000", *three, *args)
    code, out = spawn("run", "--run-dir", str(two), "--learners", "2", *ONE_ENV_EACH, *args).finish(timeout=300)
    assert code == 0, out
    code, out = spawn("run", "--resume", str(two), "--learners", "2", *three, *args).finish(timeout=300)
    assert code == 0, out
    assert out.count("resuming the fleet after iteration 2") == 2  # each learner
    _same_run(one, two, 3)


def _learner_pids(root: int) -> dict[int, int]:
    """{RANK: pid} of the processes under ``root`` that torchrun started (from their environment)."""
    out = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            env = (proc / "environ").read_bytes().split(b"\0")
            if b"TORCHELASTIC_RUN_ID" not in b"\0".join(env) or f"SPLITRL_TEST_ROOT={root}".encode() not in env:
                continue
            rank = next(int(v.split(b"=")[1]) for v in env if v.startswith(b"RANK="))
            out[rank] = int(proc.name)
        except (OSError, StopIteration, ValueError):
            continue
    return out


def test_a_learner_that_dies_stops_the_other_learners_and_every_edge(tmp_path):
    """SIGKILL to learner 1 mid-run: learner 0 (whose next exchange with it fails, or whom torchrun stops) and
    both edges exit with an error, within the link's timeout, not hanging."""
    run = tmp_path / "run"
    log = open(tmp_path / "run.log", "w")
    tag = os.getpid()
    cmd = [sys.executable, "-m", "splitrl", "run", "--run-dir", str(run), "--learners", "2", "--edges", "2",
           "--num-envs", "1", "--total-steps", "6400", "--num-steps", "32", "--epochs", "2", "--minibatches", "2",
           "--max-episode-steps", "20", "--threads", "1", "--timeout", "20", "--start-timeout", "60",
           "--heartbeat", "2", "--hidden", "32"]
    proc = subprocess.Popen(cmd, env={**child_env(), "SPLITRL_TEST_ROOT": str(tag)}, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while not (run / "edge-0" / "metrics.jsonl").exists():  # an iteration done: every process is in
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "run.log").read_text()
            time.sleep(0.2)
        pids = _learner_pids(tag)
        assert sorted(pids) == [0, 1], pids
        os.kill(pids[1], signal.SIGKILL)
        killed = time.monotonic()
        code = proc.wait(timeout=120)
        took = time.monotonic() - killed
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        log.close()
    out = (tmp_path / "run.log").read_text()
    assert code != 0, out
    codes = out.rsplit("run directory:", 1)[1]
    assert "stage1 exit 0" not in codes and ", 0" not in codes, codes  # nobody finished as if nothing happened
    lines = (run / "edge-0" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) < 20  # of 100: it stopped when the learner died
    # Not the learners' own timeout (--start-timeout + (num_steps + 2) x --timeout = 740 s here): torchrun stops
    # learner 0, whose edge is told; learner 1's edge notices its link gone (--heartbeat 2).
    assert took < 60, took


# -- the collectives, in two processes of gloo ----------------------------------------------------------------


def _collectives(rank: int, init: str, results) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    learners = Learners(rank, 2)
    try:
        out = {}
        grads = [torch.full((2, 3), float(rank + 1)), torch.tensor([rank], dtype=torch.int64)]
        learners.sum_(grads)
        out["sum"] = (grads[0].tolist(), grads[1].tolist())
        out["stats"] = learners.sum_stats({"b": 0.5} if rank == 0 else {}, ["a", "b"])
        out["none"] = learners.sum_stats({}, ["a", "b"])
        out["count"] = learners.sum_count(rank + 2)
        out["common"] = learners.newest_common({1, 2, 3} if rank == 0 else {1, 2, 5})
        out["nothing"] = learners.newest_common({3} if rank == 0 else set())
        learners.agree({"x": 1}, "x")
        try:
            learners.agree({"x": rank}, "the settings")
            out["differ"] = None
        except SettingsError as exc:
            out["differ"] = str(exc)
        heads = torch.nn.Linear(3, 2)
        torch.nn.init.constant_(heads.weight, 1.0)
        torch.nn.init.constant_(heads.bias, float(rank))
        try:
            learners.same_weights(heads, "the heads")
            out["drift"] = None
        except SettingsError as exc:
            out["drift"] = str(exc)
        # A resumed fleet where learner 1 lost its checkpoints: both refuse, and no edge is told to start over.
        from splitrl.schedule.roster import Roster
        from splitrl.transport.local import LocalTransport

        stage1, edge = LocalTransport.pair("stage1", "stage0", timeout=5)
        roster = Roster([stage1], {}, first=rank, total=2, learners=learners)
        roster.alive = [True]
        roster.hellos = {0: {"checkpoints": [1, 2]}}
        try:
            roster.resume([1, 2] if rank == 0 else [])
            out["resume"] = None
        except Exception as exc:
            out["resume"] = f"{type(exc).__name__}: {exc}"
        from splitrl.transport import TransportTimeout

        try:
            out["told"] = edge.recv(timeout=0.2).kind
        except TransportTimeout:
            out["told"] = None
        results[rank] = out
    finally:
        dist.destroy_process_group()


def test_the_learners_collectives_sum_count_and_agree(tmp_path):
    ctx = mp.get_context("spawn")
    results = ctx.Manager().dict()
    procs = [ctx.Process(target=_collectives, args=(rank, f"file://{tmp_path}/store", results)) for rank in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        if p.is_alive():
            p.kill()
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    for rank in (0, 1):
        out = results[rank]
        assert out["sum"] == ([[3.0] * 3] * 2, [1])
        assert out["stats"] == {"a": 0.0, "b": 0.5}
        assert out["none"] == {}  # no learner had a part: no entry
        assert out["count"] == 5
        assert out["common"] == 2 and out["nothing"] == 0
        assert "the 2 learners differ in the settings" in out["differ"]
        assert "the 2 learners differ in the heads" in out["drift"]
        assert out["resume"].startswith("HandshakeError") and out["told"] is None  # no edge told to start over
    assert "no iteration that stage1" in results[0]["resume"]
    assert "another learner holds checkpoints and this one none" in results[1]["resume"]


def test_one_learner_does_nothing_across_learners():
    alone = Learners()
    t = torch.ones(3)
    alone.sum_([t])
    assert torch.equal(t, torch.ones(3))
    assert alone.sum_stats({"a": 1.0}, ["a"]) == {"a": 1.0} and alone.sum_count(3) == 3
    assert alone.newest_common({4, 2}) == 4 and alone.newest_common(set()) == 0
    alone.agree(1, "anything")


def test_the_edges_are_shared_out_between_the_learners_in_order():
    assert [list(edge_range(5, 2, r)) for r in (0, 1)] == [[0, 1], [2, 3, 4]]
    assert [list(edge_range(4, 4, r)) for r in range(4)] == [[0], [1], [2], [3]]


@pytest.mark.parametrize("settings, options, words", [
    (TrainSettings(schedule=ScheduleSettings(edges=1)), RunOptions(learners=2), "at least as many edges"),
    (TrainSettings(schedule=ScheduleSettings(edges=2)), RunOptions(learners=2, min_edges=1), "--min-edges"),
    (TrainSettings(schedule=ScheduleSettings(edges=2)), RunOptions(learners=2, rejoin=5), "--rejoin"),
    (TrainSettings(cut="input", schedule=ScheduleSettings(edges=2)), RunOptions(learners=2), "--cut input"),
    (TrainSettings(), RunOptions(learners=0), "--learners must be >= 1"),
])
def test_what_several_learners_cannot_run_is_refused_saying_why(settings, options, words):
    with pytest.raises(SettingsError, match="invalid settings") as info:
        settings.validate(options)
    assert words in str(info.value)


def test_a_stage1_that_asks_for_learners_torchrun_did_not_start_says_how(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SettingsError, match="torchrun --nproc-per-node 2"):
        Learners.from_environment(10.0, expected=2)


def test_several_learners_without_a_run_directory_are_refused_before_they_meet(monkeypatch):
    """Each would choose runs/<time>-<env> by itself; refused before any rendezvous (nothing to wait for)."""
    from splitrl.runner.joining import join_learners

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SettingsError, match="several learners need --run-dir"):
        join_learners(TrainSettings(schedule=ScheduleSettings(edges=2)), RunOptions())
