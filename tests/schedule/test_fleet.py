"""A fleet: N edges, one stage1, one policy. N edges x E envs train as 1 edge x N*E envs in N groups.

Spawned fleets here train and compare; who is in the fleet (drops, rejoins, the resume point) is
test_fleet_roster.py, the stages' own fleet parts and the fleet's settings test_fleet_stages.py.
"""

import itertools
import json
import shutil
import time

import pytest
import torch

from splitrl.launch import free_port
from splitrl.runs import load_checkpoint
from splitrl.settings import PPOSettings
from splitrl.summary import summarise_run

from ..conftest import WarmProc
from .test_schedules import TWO_ENVS, _twin

ONE_ENV_EACH = ["--num-envs", "1", *TWO_ENVS[2:]]  # the same 128 steps: each edge one of the two envs
LINK = ["--timeout", "60", "--start-timeout", "60", "--heartbeat", "2"]


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _first_row(proc, metrics, timeout, *watched):
    """Wait until ``proc`` (a stage0) has written its first metrics row to ``metrics``: its first iteration is over.
    Fails if it exits first or after ``timeout`` seconds, showing its output and that of ``watched``."""
    deadline = time.monotonic() + timeout
    while not (metrics.exists() and metrics.read_text().count("\n") >= 1):
        assert time.monotonic() < deadline and proc.popen.poll() is None, "".join(p.output() for p in (proc, *watched))
        time.sleep(0.05)


def _close(a, b, rtol=1e-4, atol=1e-12):
    """Equal but for the order of float sums: within ``rtol`` of the tensor's largest entry, plus ``atol``."""
    return float((a - b).abs().max()) <= rtol * float(b.abs().max()) + atol


# Adam scales each element's step to about the learning rate, so a sum's rounding moves a parameter by a share of a
# step, not of the parameter: the encoder's biases start at 0 and are a few steps from it after two iterations, where
# an Intel Xeon's sums left 1e-7 (3e-4 to 7e-4 of the largest bias; an AMD EPYC's passed 1e-4). A wrong gradient
# moves elements by whole steps.
ENCODER_ATOL = 0.01 * PPOSettings().lr_encoder


@pytest.mark.parametrize("cut", ["cnn", "input"])
def test_two_edges_of_one_env_train_as_one_edge_of_two_envs_in_two_groups(tmp_path, spawn, cut):
    """Two stage0s that find their places themselves (no --edge-id), one stage1: the encoder both edges
    end with is one encoder, and it, the heads, the losses and the episodes are the twin's with the two
    envs in two rollout groups, up to the order of float sums."""
    port = free_port(count=4)
    fleet = tmp_path / "fleet"
    args = [*ONE_ENV_EACH, "--edges", "2", "--cut", cut, *LINK]
    s1 = spawn("stage1", "--bind", f"tcp://127.0.0.1:{port}", "--run-dir", str(fleet), *args)
    edges = [spawn("stage0", "--connect", f"tcp://127.0.0.1:{port}", "--run-dir", str(fleet / f"edge-{k}"), *args)
             for k in range(2)]
    outs = [edge.finish(timeout=300) for edge in edges]
    code1, out1 = s1.finish(timeout=30)
    assert all(code == 0 for code, _ in outs) and code1 == 0, "\n".join(out for _, out in outs) + out1
    ids = sorted(json.loads((fleet / f"edge-{k}" / "metrics.jsonl").read_text().splitlines()[0])["fleet/edge"]
                 for k in range(2))
    assert ids == [0, 1]  # each took a place of its own
    twin = tmp_path / "twin"
    _twin(twin, *TWO_ENVS, "--rollout-groups", "2", "--cut", cut)

    heads, twin_heads = load_checkpoint(fleet, "stage1", 2)["heads"], load_checkpoint(twin, "stage1", 2)["heads"]
    assert all(_close(heads[name], twin_heads[name]) for name in twin_heads)
    assert not torch.equal(heads["critic.0.weight"], load_checkpoint(fleet, "stage1", 1)["heads"]["critic.0.weight"])
    if cut == "cnn":
        nets = [load_checkpoint(fleet / f"edge-{k}", "stage0", 2)["net"] for k in range(2)]
        twin_net = load_checkpoint(twin, "stage0", 2)["net"]
        assert all(torch.equal(nets[0][name], nets[1][name]) for name in twin_net)  # one encoder
        assert all(_close(nets[0][name], twin_net[name], atol=ENCODER_ATOL) for name in twin_net)
    for row, twin_row in zip(_rows(fleet / "edge-0" / "metrics.jsonl"), _rows(twin / "metrics.jsonl"), strict=True):
        assert row["global_step"] == twin_row["global_step"]
        for key in ("losses/policy_loss", "losses/value_loss", "losses/approx_kl", "losses/explained_variance"):
            assert row[key] == pytest.approx(twin_row[key], rel=1e-3, abs=1e-7), key
        assert row["fleet/act_batch_mean"] == 2.0  # one forward of the heads for both edges
    episodes = sorted((e["env"], e["length"], e["iteration"]) for k in range(2)
                      for e in _rows(fleet / f"edge-{k}" / "episodes.jsonl"))
    assert episodes == sorted((e["env"], e["length"], e["iteration"]) for e in _rows(twin / "episodes.jsonl"))
    # The fleet's summary (`splitrl bench learning`): the EMA over every edge's episodes, in the twin's order.
    ours, theirs = summarise_run(fleet), summarise_run(twin)
    assert ours["final_ema"] == pytest.approx(theirs["final_ema"], rel=1e-3)
    assert ours["last_episodes_mean"] == pytest.approx(theirs["last_episodes_mean"], rel=1e-3)
    assert ours["iterations"] == theirs["iterations"] == 2


@pytest.fixture(scope="module")
def two_edges_two_iterations(tmp_path_factory, _warm):
    """What `splitrl run --edges 2` (the default --encoder-sync grad) makes in 2 iterations: the run a resumed
    fleet goes on from (on a copy) and the traffic an averaging fleet is weighed against."""
    run = tmp_path_factory.mktemp("fleet") / "grad"
    logs = (run.parent / f"proc{k}.log" for k in itertools.count())
    _fleet_run(lambda *args: WarmProc(args, next(logs), _warm), run, *ONE_ENV_EACH, "--edges", "2", *LINK)
    return run


def _fleet_run(spawn, run_dir, *args, edges=2):
    """A fleet's stages as `splitrl run --edges N` lays them out (stage1 in ``run_dir``, edge k with --edge-id k in
    ``run_dir/edge-k``), started by ``spawn``: where the launcher is not what a test is about."""
    endpoint = f"tcp://127.0.0.1:{free_port(count=4)}"
    procs = [spawn("stage1", "--bind", endpoint, "--run-dir", str(run_dir), *args)]
    procs += [spawn("stage0", "--connect", endpoint, "--edge-id", str(k), "--run-dir", str(run_dir / f"edge-{k}"),
                    *args) for k in range(edges)]
    try:
        done = [proc.finish(timeout=300) for proc in procs[1:]] + [procs[0].finish(timeout=60)]
    finally:
        for proc in procs:
            proc.stop()
    assert all(code == 0 for code, _ in done), "\n".join(out for _, out in done)


def test_a_fleet_run_resumed_ends_bit_for_bit_where_it_would_have(tmp_path, spawn, two_edges_two_iterations):
    """`splitrl run --edges 2` for 3 iterations, against 2 iterations and then --resume to 3: stage1 and each
    edge go on from their checkpoints of iteration 2 (each edge from its own run directory), and so do the link's
    byte counters (each place numbered on from stage1's checkpoint)."""
    three = [a if a != "128" else "192" for a in ONE_ENV_EACH]
    assert three != ONE_ENV_EACH
    args = ["--edges", "2", *LINK]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    _fleet_run(spawn, straight, *three, *args)
    shutil.copytree(two_edges_two_iterations, resumed)  # `splitrl run --run-dir resumed` of 2 iterations
    code, out = spawn("run", "--resume", str(resumed), *three, *args).finish(timeout=300)
    assert code == 0, out
    assert "resuming the fleet after iteration 2" in out and out.count("[stage0] resuming after iteration 2") == 2
    ends = [load_checkpoint(run, "stage1", 3) for run in (straight, resumed)]
    assert all(torch.equal(ends[0]["heads"][name], ends[1]["heads"][name]) for name in ends[0]["heads"])
    # Numbered on: each place's sequence position is the straight run's (here every number fits in frame 0's
    # byte either way, so the counters alone would not tell).
    assert ends[0]["links"] == ends[1]["links"] and set(ends[0]["links"]) == {"0", "1"}
    for k in range(2):
        edges = [load_checkpoint(run / f"edge-{k}", "stage0", 3) for run in (straight, resumed)]
        assert all(torch.equal(edges[0]["net"][name], edges[1]["net"][name]) for name in edges[0]["net"])
        assert edges[0]["link"] == edges[1]["link"] == {"sent": ends[0]["links"][str(k)]["received"],
                                                        "received": ends[0]["links"][str(k)]["sent"]}
        rows = [[{key: v for key, v in r.items() if not key.startswith(("time/", "cpu/", "charts/SPS"))}
                 for r in _rows(run / f"edge-{k}" / "metrics.jsonl")] for run in (straight, resumed)]
        assert rows[0] == rows[1] and [r["iteration"] for r in rows[1]] == [1, 2, 3]



def test_a_fleet_served_as_its_edges_come_trains_the_same_whether_it_waits_or_not(tmp_path, spawn):
    """``--act-wait 0`` answers whichever edge's step is there (batches of one or two, the edges drifting
    apart); ``--act-wait 5000`` waits for both (batches of two): the same heads, encoders and episodes."""
    runs = {}
    for wait in ("0", "5000"):
        port = free_port(count=4)
        fleet = tmp_path / f"wait-{wait}"
        args = [*ONE_ENV_EACH, "--edges", "2", *LINK]
        s1 = spawn("stage1", "--bind", f"tcp://127.0.0.1:{port}", "--run-dir", str(fleet), "--act-wait", wait, *args)
        edges = [spawn("stage0", "--connect", f"tcp://127.0.0.1:{port}", "--edge-id", str(k),
                       "--run-dir", str(tmp_path / f"wait-{wait}-edge{k}"), *args) for k in range(2)]
        outs = [edge.finish(timeout=300) for edge in edges]
        code1, out1 = s1.finish(timeout=30)
        assert all(code == 0 for code, _ in outs) and code1 == 0, "\n".join(out for _, out in outs) + out1
        runs[wait] = fleet
    heads = [load_checkpoint(runs[w], "stage1", 2)["heads"] for w in ("0", "5000")]
    assert all(torch.equal(heads[0][name], heads[1][name]) for name in heads[1])
    for k in range(2):
        nets = [load_checkpoint(tmp_path / f"wait-{w}-edge{k}", "stage0", 2)["net"] for w in ("0", "5000")]
        assert all(torch.equal(nets[0][name], nets[1][name]) for name in nets[1])
        episodes = [_rows(tmp_path / f"wait-{w}-edge{k}" / "episodes.jsonl") for w in ("0", "5000")]
        assert [(e["return"], e["length"]) for e in episodes[0]] == [(e["return"], e["length"]) for e in episodes[1]]
    batches = [[r["fleet/act_batch_mean"] for r in _rows(tmp_path / f"wait-{w}-edge0" / "metrics.jsonl")]
               for w in ("0", "5000")]
    assert batches[1] == [2.0, 2.0]  # it waited for both every time
    assert all(1.0 <= b <= 2.0 for b in batches[0])



def test_a_fleet_over_curve_with_a_key_an_edge_and_no_place_for_a_third(tmp_path, spawn):
    """Each edge its own CURVE key pair; a third edge of a two-edge fleet finds every place taken and says so
    at its --start-timeout, while the fleet trains to the end."""
    from click.testing import CliRunner

    from splitrl.cli import main

    keys = tmp_path / "keys"
    for name in ("stage0", "edge1", "edge2"):
        result = CliRunner().invoke(main, ["keys", str(keys), "--name", name])
        assert result.exit_code == 0, result.output
    port = free_port(count=4)
    args = [*ONE_ENV_EACH, "--total-steps", "384", "--edges", "2", "--curve", str(keys), *LINK]  # outlasts the third
    s1 = spawn("stage1", "--bind", f"tcp://127.0.0.1:{port}", "--run-dir", str(tmp_path / "s1"), *args)
    edges = [spawn("stage0", "--connect", f"tcp://127.0.0.1:{port}", "--run-dir", str(tmp_path / name), *args,
                   "--curve-name", name) for name in ("stage0", "edge1")]
    for edge in edges:
        edge.wait_for("of 2", timeout=120)  # "edge K of 2": it has its place
    third = spawn("stage0", "--connect", f"tcp://127.0.0.1:{port}", "--run-dir", str(tmp_path / "edge2"), *args,
                  "--curve-name", "edge2", "--start-timeout", "4")
    code, out = third.finish(timeout=60)
    assert code == 1 and "every edge's place at stage1" in out and "is taken (--edges 2" in out, out
    for edge in edges:
        code, out = edge.finish(timeout=300)
        assert code == 0, out
    code, out = s1.finish(timeout=30)
    assert code == 0 and "the fleet's edges closed the session after iteration 6" in out, out



def test_a_fleet_that_averages_keeps_one_encoder_for_fewer_bytes(tmp_path, two_edges_two_iterations):
    """--encoder-sync avg every 3 minibatches (and each epoch's last), int8: the edges end with the same encoder,
    and the encoder's traffic is a fraction of what summing the gradients every minibatch costs."""
    from splitrl.launch import launch_split

    runs = {"grad": two_edges_two_iterations}
    for mode in ("avg:every=3",):
        run = tmp_path / mode.partition(":")[0]
        args = [*ONE_ENV_EACH, "--edges", "2", "--encoder-sync", mode, *LINK, "--run-dir", str(run)]
        assert launch_split(args, str(run), edges=2) == 0
        runs[mode] = run
    avg = runs["avg:every=3"]
    nets = [load_checkpoint(avg / f"edge-{k}", "stage0", 2)["net"] for k in range(2)]
    assert all(torch.equal(nets[0][name], nets[1][name]) for name in nets[0])
    last = [_rows(runs[m] / "edge-0" / "metrics.jsonl")[-1] for m in ("grad", "avg:every=3")]
    grad_bytes = last[0]["net_total/encoder_grad/sent_bytes"] + last[0]["net_total/encoder_grad/recv_bytes"]
    avg_bytes = last[1]["net_total/encoder_avg/sent_bytes"] + last[1]["net_total/encoder_avg/recv_bytes"]
    assert "net_total/encoder_grad/sent_bytes" not in last[1]
    # 4 minibatches an iteration: grad sends 4 float32 gradients each way, avg 3 int8 changes (after the 3rd
    # minibatch and each epoch's last, the 2nd and the 4th): 3 x 1 byte against 4 x 4 bytes a weight
    assert avg_bytes < grad_bytes / 5, (avg_bytes, grad_bytes)
