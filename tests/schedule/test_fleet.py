"""A fleet: N edges, one stage1, one policy. N edges x E envs train as 1 edge x N*E envs in N groups."""

import json
import time

import pytest
import torch

from splitrl.envs import inspect_env
from splitrl.launch import free_port
from splitrl.runs import load_checkpoint, summarise_run
from splitrl.runner import joining
from splitrl.settings import CodecSettings, EnvSettings, PPOSettings, RunOptions, ScheduleSettings, TrainSettings
from splitrl.stages import Edge, Learner
from splitrl.stages.learner import _invariant_rows
from splitrl.transport import Message, PeerAbort
from splitrl.transport.endpoints import slot_endpoint

from .test_schedules import TWO_ENVS, _twin

ONE_ENV_EACH = ["--num-envs", "1", *TWO_ENVS[2:]]  # the same 128 steps: each edge one of the two envs
LINK = ["--timeout", "60", "--start-timeout", "60", "--heartbeat", "2"]


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


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


def test_a_fleet_run_resumed_ends_bit_for_bit_where_it_would_have(tmp_path, spawn):
    """`splitrl run --edges 2` for 3 iterations, against 2 iterations and then --resume to 3: stage1 and each
    edge go on from their checkpoints of iteration 2 (each edge from its own run directory)."""
    three = [a if a != "128" else "192" for a in ONE_ENV_EACH]
    assert three != ONE_ENV_EACH
    args = ["--edges", "2", *LINK]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    code, out = spawn("run", "--run-dir", str(straight), *three, *args).finish(timeout=300)
    assert code == 0, out
    code, out = spawn("run", "--run-dir", str(resumed), *ONE_ENV_EACH, *args).finish(timeout=300)
    assert code == 0, out
    code, out = spawn("run", "--resume", str(resumed), *three, *args).finish(timeout=300)
    assert code == 0, out
    assert "resuming the fleet after iteration 2" in out and out.count("[stage0] resuming after iteration 2") == 2
    heads = [load_checkpoint(run, "stage1", 3)["heads"] for run in (straight, resumed)]
    assert all(torch.equal(heads[0][name], heads[1][name]) for name in heads[0])
    for k in range(2):
        nets = [load_checkpoint(run / f"edge-{k}", "stage0", 3)["net"] for run in (straight, resumed)]
        assert all(torch.equal(nets[0][name], nets[1][name]) for name in nets[0])
        rows = [[{key: v for key, v in r.items() if not key.startswith(("time/", "cpu/", "net", "charts/SPS"))}
                 for r in _rows(run / f"edge-{k}" / "metrics.jsonl")] for run in (straight, resumed)]
        assert rows[0] == rows[1] and [r["iteration"] for r in rows[1]] == [1, 2, 3]


def test_a_resumed_fleet_starts_from_the_newest_iteration_stage1_and_every_edge_hold():
    """An edge interrupted while it wrote its checkpoint lacks the newest one stage1 has: all go back one; an
    edge that does not resume is dropped (here: the run cannot go on without it)."""
    from splitrl.schedule.roster import Roster
    from splitrl.transport.local import LocalTransport

    pairs = [LocalTransport.pair("stage1", "stage0", timeout=5) for _ in range(2)]
    roster = Roster([a for a, _ in pairs], {})
    roster.alive = [True, True]
    roster.hellos = {0: {"checkpoints": [4, 5]}, 1: {"checkpoints": [3, 4]}}
    assert roster.resume([4, 5]) == 4
    for _, edge in pairs:
        msg = edge.recv(timeout=1)
        assert (msg.kind, msg.header) == ("resume", {"iteration": 4})
    roster.hellos[1] = {}
    with pytest.raises(Exception, match="does not resume"):
        roster.resume([4, 5])


def test_a_stale_edge_does_not_send_a_resumed_fleet_back_to_the_start():
    """An edge dropped earlier in the run kept only old checkpoints: the fleet goes on from the newest point
    --min-edges of them hold, without it; no such point is an error, not a silent start from scratch."""
    from splitrl.schedule.roster import Roster
    from splitrl.transport.local import LocalTransport

    pairs = [LocalTransport.pair("stage1", "stage0", timeout=5) for _ in range(3)]
    roster = Roster([a for a, _ in pairs], {}, min_edges=2)
    roster.alive = [True, True, True]
    roster.hellos = {0: {"checkpoints": [99, 100]}, 1: {"checkpoints": [99, 100]}, 2: {"checkpoints": [4, 5]}}
    assert roster.resume([99, 100]) == 100
    assert roster.alive == [True, True, False]
    assert [pairs[g][1].recv(timeout=1).header for g in (0, 1)] == [{"iteration": 100}] * 2
    with pytest.raises(PeerAbort, match="edge 2 has no checkpoint of iteration 100"):
        pairs[2][1].recv(timeout=1)
    roster = Roster([a for a, _ in pairs[:2]], {})
    roster.alive = [True, True]
    roster.hellos = {0: {"checkpoints": [4, 5]}, 1: {"checkpoints": []}}
    with pytest.raises(Exception, match="no iteration that stage1"):
        roster.resume([99, 100])


def test_an_edge_holds_its_share_of_the_fleets_samples():
    settings = TrainSettings(env=EnvSettings(num_envs=2), ppo=PPOSettings(num_steps=3, minibatches=1),
                             schedule=ScheduleSettings(edges=3))
    edge = Edge(settings, inspect_env(settings.env), edge=1)
    assert (edge.offset, edge.total_envs) == (2, 6)
    idx = torch.tensor([0, 2, 3, 5, 8, 9, 14, 17])  # t * 6 + env: envs 2 and 3 are edge 1's
    fleet_idx, rows = edge.own(idx)
    assert fleet_idx.tolist() == [2, 3, 8, 9, 14]
    assert rows.tolist() == [0, 1, 2, 3, 4]  # t * 2 + (env - 2) in the edge's own rollout
    alone = Edge(TrainSettings(env=EnvSettings(num_envs=2)), inspect_env(settings.env))
    assert [x.tolist() for x in alone.own(idx)] == [idx.tolist()] * 2


def test_the_fleets_stage1_acts_for_all_edges_with_one_forward_as_it_would_group_by_group():
    settings = TrainSettings(env=EnvSettings(num_envs=4), ppo=PPOSettings(num_steps=2, epochs=1, minibatches=1))
    spec = inspect_env(settings.env)
    batched, one_by_one = Learner(settings, spec), Learner(settings, spec)
    for learner in (batched, one_by_one):
        learner.set_groups(2)
        learner.begin_rollout(1)
    features = torch.randn(2, 2, batched.feature_dim, generator=torch.Generator().manual_seed(0))
    steps = [(g, 0, Message("step", {}, {"features": features[g]})) for g in range(2)]
    together = batched.act_groups(steps)
    apart = [one_by_one.act(0, msg, g) for g, _, msg in steps]
    for (a, _), (b, _) in zip(together, apart):
        torch.testing.assert_close(a["action"], b["action"])
    torch.testing.assert_close(batched.buffer.logprobs, one_by_one.buffer.logprobs)


def test_acting_as_the_edges_come_draws_the_same_actions_whoever_came_together():
    """``--act-wait``: each group's actions come from a generator of its own step and the forward is padded to
    a batch size whose rows do not depend on the batch, so serving the four groups (two envs each) together, or
    in any other grouping and order (batches of 2, 4, 6 and 8 rows), fills the same buffer bit for bit."""
    settings = TrainSettings(env=EnvSettings(num_envs=8), ppo=PPOSettings(num_steps=2, epochs=1, minibatches=1))
    spec = inspect_env(settings.env)
    features = torch.rand(2, 4, 2, 4096, generator=torch.Generator().manual_seed(0))
    outcome = {"reward": torch.ones(2), "terminated": torch.zeros(2, dtype=torch.bool),
               "truncated": torch.zeros(2, dtype=torch.bool)}

    def step(g, t):
        return g, t, Message("step", {}, {"features": features[t, g], **(outcome if t else {})})

    def served(batches):
        learner = Learner(settings, spec)
        learner.set_groups(4)
        learner.begin_rollout(1)
        actions = {}
        for batch in batches:
            for (g, t), (tensors, _) in zip(batch, learner.act_groups([step(g, t) for g, t in batch],
                                                                      order_free=True)):
                actions[g, t] = tensors["action"]
        return actions, learner.buffer

    together, buffer = served([[(0, 0), (1, 0), (2, 0), (3, 0)], [(0, 1), (1, 1), (2, 1), (3, 1)]])
    apart, other = served([[(2, 0)], [(3, 0), (0, 0)], [(2, 1)], [(1, 0), (0, 1), (3, 1)], [(1, 1)]])
    assert all(torch.equal(together[key], apart[key]) for key in together)
    for name in ("actions", "logprobs", "values", "rewards"):
        assert torch.equal(getattr(buffer, name), getattr(other, name)), name
    lock_step, _ = served([[(0, 0), (1, 0), (2, 0), (3, 0)]])
    assert torch.equal(lock_step[0, 0], together[0, 0])
    # The fact the padding rests on, for this machine's torch: on one thread, a row padded to `_invariant_rows`
    # gets the numbers it gets in any other such batch, wherever it sits (both outputs: the critic's one-output
    # layer has a rule of its own on AVX-512 machines).
    heads, threads = Learner(settings, spec).heads, torch.get_num_threads()
    x = torch.rand(128, 4096, generator=torch.Generator().manual_seed(1))

    def padded(rows):
        return torch.cat([rows, rows.new_zeros(_invariant_rows(len(rows)) - len(rows), rows.shape[1])])

    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            whole = heads.outputs(x)
            for n in (1, 3, 5, 16, 17, 33):
                for i in (0, 9, 50):
                    got = heads.outputs(padded(x[i:i + n]))
                    assert all(torch.equal(g[:n], w[i:i + n]) for g, w in zip(got, whole)), (n, i)
    finally:
        torch.set_num_threads(threads)


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


@pytest.mark.parametrize("schedule, codecs, words", [
    (ScheduleSettings(edges=2, microbatches=2), CodecSettings(), "the fleet's own schedule"),
    (ScheduleSettings(edges=2, rollout_groups="auto"), CodecSettings(), "the fleet's own schedule"),
    (ScheduleSettings(edges=2), CodecSettings(codec_bwd="ef"), "--codec-bwd ef"),
    (ScheduleSettings(edges=2), CodecSettings(codec_fwd="delta"), "--codec-fwd delta"),
    (ScheduleSettings(edges=2), CodecSettings(exchange="replica"), "--exchange features only"),
    (ScheduleSettings(edges=0), CodecSettings(), "--edges must be >= 1"),
])
def test_what_a_fleet_cannot_run_is_refused_saying_why(schedule, codecs, words):
    errors = TrainSettings(schedule=schedule, codecs=codecs).errors()
    assert any(words in e for e in errors), errors


def test_a_fleet_iteration_is_every_edges_rollout_and_its_edge_ids_are_checked():
    settings = TrainSettings(total_steps=2 * 24576, env=EnvSettings(num_envs=2), schedule=ScheduleSettings(edges=3))
    assert settings.steps_per_iteration == 3 * 2 * 4096 == 24576
    view = settings.fleet_view()
    assert (view.env.num_envs, view.schedule.edges, view.schedule.rollout_groups) == (6, 1, "3")
    assert view.steps_per_iteration == settings.steps_per_iteration
    assert settings.errors() == [] and TrainSettings(total_steps=8192, codecs=CodecSettings(codec_fwd="int8+zstd"),
                                                     schedule=ScheduleSettings(edges=2)).errors() == []
    assert "num_steps x num_envs x edges" in TrainSettings(schedule=ScheduleSettings(edges=3)).errors()[0]
    with pytest.raises(ValueError, match="--edge-id 3: the fleet has --edges 3"):
        settings.validate(RunOptions(edge_id=3))
    with pytest.raises(ValueError, match="zmq only"):
        settings.validate(RunOptions(transport="tcp"))
    settings.validate(RunOptions(resume="runs/x"))  # a fleet resumes (test_a_fleet_run_resumed_...)
    settings.validate(RunOptions(rejoin=10, min_edges=2))
    settings.validate(RunOptions(heartbeat=0))  # stage1, and `run`, which gives each edge its id
    with pytest.raises(ValueError, match="need --heartbeat > 0"):  # an edge that must find its place
        joining.join_fleet(RunOptions(heartbeat=0), "tcp://127.0.0.1:5555", 3)


def test_each_edge_meets_stage1_on_a_port_pair_of_its_own():
    assert slot_endpoint("tcp://10.0.0.1:5555", 0) == "tcp://10.0.0.1:5555"
    assert slot_endpoint("tcp://10.0.0.1:5555", 3) == "tcp://10.0.0.1:5561"
    assert slot_endpoint("ipc:///tmp/link", 2) == "ipc:///tmp/link-2"
    with pytest.raises(ValueError, match="fixed port"):
        slot_endpoint("tcp://127.0.0.1:0", 1)


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


@pytest.mark.parametrize("mode", ["fp32", "int8"])
def test_averaging_brings_every_edge_to_the_mean_of_their_encoders(mode):
    """Two rounds (the second against the view the first agreed on): after each, both edges hold the same encoder
    bit for bit, the mean of theirs, exactly up to float sums in fp32 and up to the rounding in int8: one scale a
    row, so half a step on each edge's change on its way up and half of the mean's on its way down, a step being
    the row's largest change / 127 (the mean's no larger than the edges')."""
    settings = TrainSettings(env=EnvSettings(num_envs=1), schedule=ScheduleSettings(edges=2, encoder_sync="avg"))
    spec = inspect_env(settings.env)
    edges = [Edge(settings, spec, edge=k) for k in range(2)]
    learner = Learner(settings.fleet_view(), spec)
    g = torch.Generator().manual_seed(0)
    agreed = {name: p.detach().clone() for name, p in edges[0].net.named_parameters()}
    for moving in (edges, edges[1:]):  # both edges trained on their own; then only the second
        with torch.no_grad():
            for edge in moving:
                for p in edge.net.parameters():
                    p.add_(0.01 * torch.randn(p.shape, generator=g))
        params = [dict(e.net.named_parameters()) for e in edges]
        wanted = {name: (params[0][name].detach() + params[1][name].detach()) / 2 for name in agreed}
        step = {name: max(float((p[name].detach() - agreed[name]).abs().max()) for p in params) / 127 for name in agreed}
        changes = [Message("encoder_avg", {}, edge.encoder_change(mode)) for edge in edges]
        mean = Message("encoder_avg", {}, learner.average_encoders(changes, mode))
        for edge in edges:
            edge.take_average(mean)
        params = [dict(e.net.named_parameters()) for e in edges]
        rounded = 0.0
        for name in agreed:
            assert torch.equal(params[0][name], params[1][name]), name
            off = float((params[0][name].detach() - wanted[name]).abs().max())
            assert off <= (1e-6 if mode == "fp32" else step[name] + 1e-6), (name, off, step[name])
            rounded = max(rounded, off)
        assert (rounded > 1e-6) == (mode == "int8")  # the int8 codec did round: it was the one used
        agreed = {name: p.detach().clone() for name, p in params[0].items()}


def test_a_fleet_that_averages_keeps_one_encoder_for_fewer_bytes(tmp_path):
    """--encoder-sync avg every 3 minibatches (and each epoch's last), int8: the edges end with the same encoder,
    and the encoder's traffic is a fraction of what summing the gradients every minibatch costs."""
    from splitrl.launch import launch_split

    runs = {}
    for mode in ("grad", "avg:every=3"):
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


class _FakeLink:
    """An edge's link that answers from a list, or fails with ``error`` (a dead or hostile edge)."""

    def __init__(self, msgs=(), error=None):
        self.msgs, self.error, self.sent, self.aborted, self.sessions = list(msgs), error, [], None, 0
        self.peer = "fake edge"

    def recv(self, timeout=None):
        if self.error is not None:
            raise self.error
        return self.msgs.pop(0)

    def send(self, kind, tensors=None, header=None, timeout=None):
        if self.error is not None:
            raise self.error
        self.sent.append(kind)

    def abort(self, reason, timeout=1.0):
        self.aborted = reason

    def new_session(self):
        self.sessions += 1


def test_acting_as_edges_come_drops_an_edge_that_is_gone_or_silent_past_its_timeout():
    """`Roster.check`, what the as-they-come rollout asks of edges whose step has not come."""
    from splitrl.schedule.roster import Roster
    from splitrl.transport import PeerGone

    class Silent(_FakeLink):
        timeout = 1.0

        def check_alive(self):
            if self.error is not None:
                raise self.error

    links = [Silent(), Silent(error=PeerGone("edge 1 is gone")), Silent()]
    roster = _started(Roster(links, {}, min_edges=1))
    roster.check(0, silent=0.5)
    roster.check(1, silent=0.0)
    assert roster.live() == [0, 2]
    roster.check(2, silent=1.5)
    assert roster.live() == [0] and roster.dropped == 2 and "no message from fake edge within 1 s" in links[2].aborted


def _started(roster):
    roster.alive = [True] * len(roster.links)
    return roster


def test_a_roster_drops_an_edge_that_fails_and_ends_the_run_below_min_edges():
    from splitrl.schedule.roster import Roster
    from splitrl.transport import PeerGone, ProtocolError

    links = [_FakeLink([Message("iter_end", {"iteration": 1}, {})]), _FakeLink(error=PeerGone("edge 1 is gone")),
             _FakeLink([Message("step", {"iteration": 1}, {})])]  # edge 2 answers with the wrong kind
    roster = _started(Roster(links, {}, min_edges=1))
    assert [g for g, _ in roster.gather("iter_end", iteration=1)] == [0]
    assert roster.live() == [0] and roster.dropped == 2
    assert links[1].aborted is None and "ProtocolError" in links[2].aborted  # a gone edge's successor is not told
    assert links[1].sessions == links[2].sessions == 1  # whoever comes to their places next is a new edge
    idx = torch.tensor([10, 11, 12, 13])
    assert roster.members(idx, torch.tensor([0, 1, 2, 0])).tolist() == [10, 13]  # edges 1 and 2's samples out
    roster.send(1, "action")  # a dropped edge is sent nothing more
    roster.link(1).send("iter_stats")
    roster.link(0).send("iter_stats")
    assert links[0].sent == ["iter_stats"] and roster.dropped == 2

    everyone = _started(Roster([_FakeLink(error=PeerGone("edge 0 is gone")), _FakeLink()], {}))  # all of them
    assert everyone.members(idx, torch.tensor([0, 1, 1, 0])) is idx  # nobody dropped: the minibatch as it is
    with pytest.raises(PeerGone, match="^edge 0 is gone$"):
        everyone.expect(0, "step")
    assert everyone.alive == [True, True]
    three = _started(Roster([_FakeLink(error=PeerGone("edge 0 is gone")), _FakeLink(),
                             _FakeLink(error=ProtocolError("bad"))], {}, min_edges=2))
    assert three.expect(0, "step") is None
    with pytest.raises(ProtocolError, match=r"^bad \(edge 2; 1 of 3 edges left, fewer than --min-edges 2\)$"):
        three.expect(2, "step")


def test_min_edges_is_checked():
    settings = TrainSettings(total_steps=2 * 8192, schedule=ScheduleSettings(edges=2))
    with pytest.raises(ValueError, match="--min-edges 3: the fleet has --edges 2"):
        settings.validate(RunOptions(min_edges=3))
    assert "--min-edges must be >= 0, got -1" in RunOptions(min_edges=-1).errors()


@pytest.mark.parametrize("min_edges, act_wait", [(1, "all"), (0, "all"), (1, "2")])
def test_an_edge_that_dies_is_dropped_and_the_fleet_trains_on_above_min_edges(tmp_path, spawn, min_edges, act_wait):
    """Edge 1 is killed after its first iteration. With --min-edges 1 stage1 drops it (logged, counted in
    metrics) and trains on with edge 0 to the end, in lock step or acting as the edges come; with the
    default (every edge) the loss ends the run."""
    import signal
    import time

    port = free_port(count=4)
    iterations = 8
    args = ["--num-envs", "1", "--total-steps", str(32 * 2 * iterations), *TWO_ENVS[4:], *LINK,
            "--min-edges", str(min_edges)]
    s1 = spawn("stage1", "--bind", f"tcp://127.0.0.1:{port}", "--run-dir", str(tmp_path / "fleet"), "--edges", "2",
               "--act-wait", act_wait, *args)
    edges = [spawn("stage0", "--connect", f"tcp://127.0.0.1:{port}", "--run-dir", str(tmp_path / f"edge{k}"),
                   "--edges", "2", "--edge-id", str(k), *args) for k in range(2)]
    metrics = tmp_path / "edge1" / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.exists() and metrics.read_text().count("\n") >= 1):
        assert time.monotonic() < deadline and edges[1].popen.poll() is None, edges[1].output()
        time.sleep(0.05)
    edges[1].popen.send_signal(signal.SIGKILL)
    code0, out0 = edges[0].finish(timeout=120)
    code1, out1 = s1.finish(timeout=60)
    if min_edges == 0:
        assert code1 != 0 and "edge 1" in out1 and "gone" in out1, out1
        assert code0 != 0, out0
        return
    assert code0 == 0 and code1 == 0, out0 + out1
    assert "edge 1 dropped (PeerGone" in out1 and "training goes on with 1 of 2 edges" in out1, out1
    rows = _rows(tmp_path / "edge0" / "metrics.jsonl")
    assert [row["iteration"] for row in rows] == list(range(1, iterations + 1))
    assert rows[0]["fleet/edges"] == 2 and rows[0]["fleet/dropped"] == 0
    assert rows[-1]["fleet/edges"] == 1 and rows[-1]["fleet/dropped"] == 1 and rows[-1]["fleet/act_batch_mean"] == 1
    first, last = (load_checkpoint(tmp_path / "fleet", "stage1", i)["heads"] for i in (iterations - 1, iterations))
    assert not torch.equal(first["critic.0.weight"], last["critic.0.weight"])  # it learned after the loss


def test_an_edge_that_dies_and_comes_back_rejoins_with_the_fleets_encoder(tmp_path, spawn):
    """--min-edges 2 --rejoin: edge 1 is killed after its first iteration; edge 0 trains on alone to that
    iteration's end, where stage1 waits; a new stage0 takes edge 1's place, joins with edge 0's encoder and
    optimizer, and the two end the run with one encoder."""
    import signal
    import time

    port = free_port(count=4)
    iterations = 5
    args = ["--num-envs", "1", "--total-steps", str(32 * 2 * iterations), *TWO_ENVS[4:], *LINK, "--edges", "2"]
    s1 = spawn("stage1", "--bind", f"tcp://127.0.0.1:{port}", "--run-dir", str(tmp_path / "fleet"), *args,
               "--min-edges", "2", "--rejoin", "60")
    edge0, edge1 = (spawn("stage0", "--connect", f"tcp://127.0.0.1:{port}", "--run-dir", str(tmp_path / f"edge{k}"),
                          *args, "--edge-id", str(k)) for k in range(2))
    metrics = tmp_path / "edge1" / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.exists() and metrics.read_text().count("\n") >= 1):
        assert time.monotonic() < deadline and edge1.popen.poll() is None, edge1.output()
        time.sleep(0.05)
    edge1.popen.send_signal(signal.SIGKILL)
    s1.wait_for("edge 1 dropped", timeout=60)
    again = spawn("stage0", "--connect", f"tcp://127.0.0.1:{port}", "--run-dir", str(tmp_path / "again"), *args)
    outs = [edge0.finish(timeout=120), again.finish(timeout=120), s1.finish(timeout=60)]
    assert all(code == 0 for code, _ in outs), "\n".join(out for _, out in outs)
    assert "joined the fleet after its iteration" in outs[1][1]
    rows, rejoined = _rows(tmp_path / "edge0" / "metrics.jsonl"), _rows(tmp_path / "again" / "metrics.jsonl")
    assert [row["iteration"] for row in rows] == list(range(1, iterations + 1))
    assert rows[-1]["fleet/dropped"] == 1 and rows[-1]["fleet/joined"] == 1 and rows[-1]["fleet/edges"] == 2
    assert 2 < rejoined[0]["iteration"] <= iterations and rejoined[-1]["iteration"] == iterations
    assert rejoined[0]["fleet/edge"] == 1 and rejoined[0]["global_step"] == rows[rejoined[0]["iteration"] - 1]["global_step"]
    nets = [load_checkpoint(tmp_path / name, "stage0", iterations)["net"] for name in ("edge0", "again")]
    assert all(torch.equal(nets[0][name], nets[1][name]) for name in nets[0])  # one encoder again


@pytest.mark.parametrize("sync", ["grad", "avg"])
def test_a_joining_edge_takes_the_encoder_and_its_optimizer_and_refuses_a_wrong_one(sync):
    from splitrl.transport import ProtocolError

    settings = TrainSettings(env=EnvSettings(num_envs=1), schedule=ScheduleSettings(edges=2, encoder_sync=sync))
    spec = inspect_env(settings.env)
    old, new = Edge(settings, spec), Edge(settings, spec, edge=1)
    with torch.no_grad():
        for p in old.net.parameters():
            p.add_(0.01)
    loss = sum(p.square().sum() for p in old.net.parameters())
    loss.backward()
    old.optimizer_step()
    old.train_iteration, old.global_step = 3, 384
    tensors, header = old.encoder_state()
    assert header == {"iteration": 3, "global_step": 384, "adam_step": 1}
    new.join(Message("encoder_state", header, tensors), 3)
    assert (new.train_iteration, new.iteration, new.global_step) == (3, 3, 384)
    assert all(torch.equal(a, b) for a, b in zip(old.net.state_dict().values(), new.net.state_dict().values()))
    for p, q in zip(old.params, new.params):
        assert torch.equal(old.optimizer.state[p]["exp_avg_sq"], new.optimizer.state[q]["exp_avg_sq"])
    if sync == "avg":  # the view it averages against from now on is the encoder it joined with
        assert all(float(v.abs().max()) == 0 for v in new.encoder_change("fp32").values())
    with pytest.raises(ProtocolError, match="expected iteration=4"):
        new.join(Message("encoder_state", header, tensors), 4)
    with pytest.raises(ProtocolError, match="expected tensors"):
        new.join(Message("encoder_state", header, {k: v for k, v in list(tensors.items())[1:]}), 3)
    name = next(iter(tensors))
    with pytest.raises(ProtocolError, match=f"tensor '{name}'"):
        new.join(Message("encoder_state", header, {**tensors, name: tensors[name][:1]}), 3)


def test_a_hello_is_answered_when_the_edges_receiving_connection_comes_up_after_it():
    """stage0's hello arrives before its receiving socket is connected: the answer waits for it (the link's
    --timeout), instead of failing after the short listen and leaving the hello consumed and unanswered."""
    import threading

    import zmq

    from splitrl.schedule.roster import Roster
    from splitrl.stages.protocol import LIMITS
    from splitrl.transport.handshake import PROTOCOL_VERSION, settings_hash
    from splitrl.transport.wire import decode, encode
    from splitrl.transport.zmq_transport import ZmqTransport, paired_endpoint

    shared = TrainSettings(schedule=ScheduleSettings(edges=2)).shared()
    link = ZmqTransport("tcp://127.0.0.1:0", bind=True, timeout=10, limits=LIMITS, heartbeat=2, name="edge 0")
    ctx = zmq.Context()
    push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    try:
        push.connect(link.endpoint)
        header = {"proto": PROTOCOL_VERSION, "role": "stage0", "settings_hash": settings_hash(shared), "edge": 0}
        push.send_multipart(encode("hello", 0, header, None))
        late = threading.Timer(0.5, pull.connect, args=(paired_endpoint(link.endpoint),))
        late.start()
        time.sleep(0.2)
        roster = Roster([link], shared, min_edges=1)
        assert roster._answer(0, 0) is True
        late.join()
        assert pull.poll(5000) != 0
        reply = decode(pull.recv_multipart(), LIMITS)
        assert reply.kind == "hello" and reply.header["join_after"] == 0
    finally:
        link.close()
        push.close(0)
        pull.close(0)
        ctx.term()
