"""No single edge stalls or steers a fleet: an edge that speaks the protocol to the letter and lies in its values
(tests/hostile/edge.py: a real stage0 whose messages are altered as they leave) is dropped and named, and the
honest edges train on to the end with an encoder that moved; without --min-edges the run ends with the error,
which names the edge and the tensor (`splitrl.stages.limits`, `splitrl.schedule.agreement`)."""

import re
import signal

import pytest
import torch

from splitrl.launch import free_port
from splitrl.runs import load_checkpoint

from ..conftest import WarmProc
from .test_fleet import LINK, _first_row, _rows
from .test_fleet_roster import SMALL_FLEET


@pytest.fixture
def hostile(tmp_path, request):
    """Start hostile edges (`tests.hostile.edge`: ``splitrl stage0`` forked from the warm interpreter, its messages
    passed through the attack as they leave); every one is killed in teardown."""
    procs = []

    def start(attack, *args):
        procs.append(WarmProc(("stage0", *args), tmp_path / f"hostile{len(procs)}-{attack}.log",
                              request.getfixturevalue("_warm"), setup=["tests.hostile.edge:lie", attack]))
        return procs[-1]

    yield start
    for proc in procs:
        proc.stop()


def _moved(run_dir, stage, key, last):
    """Whether ``key`` of ``stage``'s checkpoint (its ``net`` or ``heads``) changed in iteration ``last``."""
    before, after = (load_checkpoint(run_dir, stage, i)[key] for i in (last - 1, last))
    return any(not torch.equal(before[name], after[name]) for name in after)


WHY = {"rewards": r"edge 1: step: tensor 'reward': a value of 1e\+30, beyond --edge-reward-limit 1e\+06",
       "gradient": r"edge 1: encoder_grad: tensor 'encoder\.[\w.]+': an L2 norm of [\d.]+e\+\d+ \(of all \d+: "
                   r"[\d.]+e\+\d+\), beyond --edge-grad-limit 1e\+06"}


@pytest.mark.parametrize("attack", ["rewards", "gradient"])
@pytest.mark.parametrize("min_edges", [1, 0])
def test_an_edge_that_sends_huge_values_is_dropped_and_the_honest_edge_learns_on(tmp_path, spawn, hostile, attack,
                                                                                  min_edges):
    """Edge 1 sends rewards of 1e30 (from its second step), or encoder gradients of 3e38: finite, so the wire lets
    them through, and unchecked they would make the value loss infinite (or the encoder's sum), so that the
    clipping zeroed every update and every process exited 0 having learnt nothing. Stage1 drops edge 1 at the
    first such message, naming it and the tensor; with --min-edges 1 edge 0 trains both iterations to the end,
    its encoder and the heads moving in the last, all exiting 0; without, the run ends with the error."""
    port = free_port(count=4)
    args = [*SMALL_FLEET.to_argv(), "--threads", "1", "--checkpoint-every", "1", *LINK]
    s1 = spawn("stage1", "--bind", f"tcp://127.0.0.1:{port}", "--run-dir", str(tmp_path / "fleet"),
               "--min-edges", str(min_edges), *args)
    bad = hostile(attack, "--connect", f"tcp://127.0.0.1:{port}", "--run-dir", str(tmp_path / "bad"), "--edge-id", "1",
                  *args)
    s1.wait_for("edge 1 of 2 connected", timeout=120)  # (started cold) the fleet begins with it and edge 0, which
    edge0 = spawn("stage0", "--connect", f"tcp://127.0.0.1:{port}", "--run-dir", str(tmp_path / "edge0"),
                  "--edge-id", "0", *args)  # comes within the 5 s stage1 waits for more once --min-edges are in
    code0, out0 = edge0.finish(timeout=180)
    code1, out1 = s1.finish(timeout=60)
    code_bad, out_bad = bad.finish(timeout=60)
    assert "edge 0 of 2 connected (joins" not in out1, out1
    assert code_bad != 0 and _found(WHY[attack], out_bad), out_bad  # told why, as it was dropped or the run ended
    if min_edges == 0:
        assert code1 == 1 and _found(WHY[attack], out1), out1
        assert code0 == 1 and _found(WHY[attack], out0), out0  # stage1's abort tells the honest edge why
        return
    assert code0 == 0 and code1 == 0, out0 + out1
    assert _found(rf"edge 1 dropped \(ProtocolError: {WHY[attack]}\); training goes on with 1 of 2 edges", out1), out1
    rows = _rows(tmp_path / "edge0" / "metrics.jsonl")
    assert [row["iteration"] for row in rows] == [1, 2] and rows[-1]["fleet/dropped"] == 1
    assert _moved(tmp_path / "edge0", "stage0", "net", 2) and _moved(tmp_path / "fleet", "stage1", "heads", 2)


def _found(pattern, text):
    return re.search(pattern, text) is not None


CRAFTED = r"edge 0: encoder_state: tensor 'net\.[\w.]+': not the fleet's encoder after iteration (\d+)"


@pytest.mark.parametrize("attack", ["negated", "huge"])
def test_an_edge_that_shares_a_crafted_encoder_is_dropped_and_the_joiner_gets_the_fleets(tmp_path, spawn, hostile,
                                                                                        attack):
    """Three places, --min-edges 1: the hostile edge 0 trains honestly but gives a joining edge its encoder
    negated, or at 1e30 (unchecked, the joiner would train on another encoder unnoticed, or be dropped and
    blamed). Edge 2 comes once the fleet of edges 0 and 1 has trained an iteration; stage1 asks edges 0 and 1
    for their encoder, finds edge 0's is not the one the edges reported, drops it, naming the tensor, and hands
    edge 1's over. Edges 1 and 2 train to the end with one encoder, which moved."""
    port = free_port(count=6)
    iterations = 20  # (edge 2 joins at whichever iteration's end it comes by)
    fleet = ["--edges", "3", "--num-envs", "1", "--total-steps", str(32 * 3 * iterations), "--num-steps", "32",
             "--epochs", "2", "--minibatches", "2", "--max-episode-steps", "20", "--env-id", "CartPole-v1",
             "--model", "mlp", "--hidden", "16", "--threads", "1", "--checkpoint-every", "1", *LINK]
    s1 = spawn("stage1", "--bind", f"tcp://127.0.0.1:{port}", "--run-dir", str(tmp_path / "fleet"),
               "--min-edges", "1", *fleet)
    bad = hostile(attack, "--connect", f"tcp://127.0.0.1:{port}", "--run-dir", str(tmp_path / "bad"), "--edge-id",
                  "0", *fleet)
    s1.wait_for("edge 0 of 3 connected", timeout=120)  # (started cold) the fleet begins with it and edge 1, which
    edge1 = spawn("stage0", "--connect", f"tcp://127.0.0.1:{port}", "--run-dir", str(tmp_path / "edge1"),
                  "--edge-id", "1", *fleet)  # comes within the 5 s stage1 waits for more once --min-edges are in
    s1.wait_for("edge 1 of 3 connected", timeout=60)
    assert "edge 1 of 3 connected (joins" not in s1.output(), s1.output()
    metrics = tmp_path / "edge1" / "metrics.jsonl"
    _first_row(edge1, metrics, 180, s1)  # the fleet of two has begun
    edge2 = spawn("stage0", "--connect", f"tcp://127.0.0.1:{port}", "--run-dir", str(tmp_path / "edge2"),
                  "--edge-id", "2", *fleet)
    outs = [edge1.finish(timeout=240), edge2.finish(timeout=120), s1.finish(timeout=60)]
    assert all(code == 0 for code, _ in outs), "\n".join(out for _, out in outs)
    out1 = outs[2][1]
    joined = next(iter(re.findall(CRAFTED, out1)), None)
    assert joined and f"edge 0 dropped (ProtocolError: edge 0: encoder_state: tensor 'net." in out1, out1
    assert f"joined the fleet after its iteration {joined}" in outs[1][1], outs[1][1]
    assert bad.finish(timeout=60)[0] != 0
    rows, rejoined = _rows(metrics), _rows(tmp_path / "edge2" / "metrics.jsonl")
    assert [row["iteration"] for row in rows] == list(range(1, iterations + 1)) and rows[-1]["fleet/dropped"] == 1
    assert rejoined[0]["iteration"] == int(joined) + 1 and rejoined[-1]["iteration"] == iterations
    nets = [load_checkpoint(tmp_path / name, "stage0", iterations)["net"] for name in ("edge1", "edge2")]
    assert all(torch.equal(nets[0][name], nets[1][name]) for name in nets[0])  # one encoder
    assert _moved(tmp_path / "edge1", "stage0", "net", iterations)


def test_the_only_edge_that_could_share_its_encoder_lies_and_the_run_ends_naming_it(tmp_path, spawn, hostile):
    """Two places, every edge needed (no --min-edges), --rejoin 60: edge 1 is killed after its first iteration and
    a new stage0 comes to its place; the hostile edge 0, the only one left, gives it a negated encoder. With
    nobody else holding the fleet's encoder, stage1 ends the run with the error naming edge 0 and the tensor,
    and tells the new edge why, instead of starting it on another encoder."""
    port = free_port(count=4)
    args = [*SMALL_FLEET.to_argv(), "--total-steps", str(32 * 2 * 4), "--threads", "1", "--checkpoint-every", "1",
            *LINK]
    s1 = spawn("stage1", "--bind", f"tcp://127.0.0.1:{port}", "--run-dir", str(tmp_path / "fleet"), "--rejoin", "60",
               *args)
    bad = hostile("negated", "--connect", f"tcp://127.0.0.1:{port}", "--run-dir", str(tmp_path / "bad"),
                  "--edge-id", "0", *args)
    edge1 = spawn("stage0", "--connect", f"tcp://127.0.0.1:{port}", "--run-dir", str(tmp_path / "edge1"),
                  "--edge-id", "1", *args)
    _first_row(edge1, tmp_path / "edge1" / "metrics.jsonl", 180, s1)
    edge1.popen.send_signal(signal.SIGKILL)
    s1.wait_for("edge 1 dropped", timeout=60)
    again = spawn("stage0", "--connect", f"tcp://127.0.0.1:{port}", "--run-dir", str(tmp_path / "again"),
                  "--edge-id", "1", *args)
    code1, out1 = s1.finish(timeout=120)
    code_again, out_again = again.finish(timeout=60)
    assert code1 == 1 and _found(CRAFTED + r" \(digest \w{12}\.\., the edges reported \w{12}\.\.\)", out1), out1
    assert code_again != 0 and _found(CRAFTED, out_again), out_again
    assert bad.finish(timeout=60)[0] != 0
