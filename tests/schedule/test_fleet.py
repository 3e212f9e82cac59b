"""A fleet: N edges, one stage1, one policy. N edges x E envs train as 1 edge x N*E envs in N groups."""

import json

import pytest
import torch

from splitrl.envs import inspect_env
from splitrl.launch import free_port
from splitrl.runs import load_checkpoint
from splitrl.schedule import session
from splitrl.settings import CodecSettings, EnvSettings, PPOSettings, RunOptions, ScheduleSettings, TrainSettings
from splitrl.stages import Edge, Learner
from splitrl.transport import Message
from splitrl.transport.endpoints import slot_endpoint

from .test_schedules import TWO_ENVS, _twin

ONE_ENV_EACH = ["--num-envs", "1", *TWO_ENVS[2:]]  # the same 128 steps: each edge one of the two envs
LINK = ["--timeout", "60", "--start-timeout", "60", "--heartbeat", "2"]


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _close(a, b, rtol=1e-4):
    """Equal but for the order of float sums: relative to the tensor's largest entry."""
    return float((a - b).abs().max()) <= rtol * float(b.abs().max()) + 1e-12


@pytest.mark.parametrize("cut", ["cnn", "input"])
def test_two_edges_of_one_env_train_as_one_edge_of_two_envs_in_two_groups(tmp_path, spawn, cut):
    """Two stage0s that find their places themselves (no --edge-id), one stage1: the encoder both edges
    end with is one encoder, and it, the heads, the losses and the episodes are the twin's with the two
    envs in two rollout groups, up to the order of float sums."""
    port = free_port(count=4)
    fleet = tmp_path / "fleet"
    args = [*ONE_ENV_EACH, "--edges", "2", "--cut", cut, *LINK]
    s1 = spawn("stage1", "--bind", f"tcp://127.0.0.1:{port}", "--run-dir", str(fleet), *args)
    edges = [spawn("stage0", "--connect", f"tcp://127.0.0.1:{port}", "--run-dir", str(tmp_path / f"edge{k}"), *args)
             for k in range(2)]
    outs = [edge.finish(timeout=300) for edge in edges]
    code1, out1 = s1.finish(timeout=30)
    assert all(code == 0 for code, _ in outs) and code1 == 0, "\n".join(out for _, out in outs) + out1
    ids = sorted(json.loads((tmp_path / f"edge{k}" / "metrics.jsonl").read_text().splitlines()[0])["fleet/edge"]
                 for k in range(2))
    assert ids == [0, 1]  # each took a place of its own
    twin = tmp_path / "twin"
    _twin(twin, *TWO_ENVS, "--rollout-groups", "2", "--cut", cut)

    heads, twin_heads = load_checkpoint(fleet, "stage1", 2)["heads"], load_checkpoint(twin, "stage1", 2)["heads"]
    assert all(_close(heads[name], twin_heads[name]) for name in twin_heads)
    assert not torch.equal(heads["critic.0.weight"], load_checkpoint(fleet, "stage1", 1)["heads"]["critic.0.weight"])
    if cut == "cnn":
        nets = [load_checkpoint(tmp_path / f"edge{k}", "stage0", 2)["net"] for k in range(2)]
        twin_net = load_checkpoint(twin, "stage0", 2)["net"]
        assert all(torch.equal(nets[0][name], nets[1][name]) for name in twin_net)  # one encoder
        assert all(_close(nets[0][name], twin_net[name]) for name in twin_net)
    for row, twin_row in zip(_rows(tmp_path / "edge0" / "metrics.jsonl"), _rows(twin / "metrics.jsonl"), strict=True):
        assert row["global_step"] == twin_row["global_step"]
        for key in ("losses/policy_loss", "losses/value_loss", "losses/approx_kl", "losses/explained_variance"):
            assert row[key] == pytest.approx(twin_row[key], rel=1e-3, abs=1e-7), key
        assert row["fleet/act_batch_mean"] == 2.0  # one forward of the heads for both edges
    episodes = sorted((e["env"], e["length"], e["iteration"]) for k in range(2)
                      for e in _rows(tmp_path / f"edge{k}" / "episodes.jsonl"))
    assert episodes == sorted((e["env"], e["length"], e["iteration"]) for e in _rows(twin / "episodes.jsonl"))


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
    steps = [(g, Message("step", {}, {"features": features[g]})) for g in range(2)]
    together = batched.act_groups(0, steps)
    apart = [one_by_one.act(0, msg, g) for g, msg in steps]
    for (a, _), (b, _) in zip(together, apart):
        torch.testing.assert_close(a["action"], b["action"])
    torch.testing.assert_close(batched.buffer.logprobs, one_by_one.buffer.logprobs)


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
    with pytest.raises(ValueError, match="--resume and --rejoin of a fleet"):
        settings.validate(RunOptions(rejoin=10))
    settings.validate(RunOptions(heartbeat=0))  # stage1, and `run`, which gives each edge its id
    with pytest.raises(ValueError, match="need --heartbeat > 0"):  # an edge that must find its place
        session.join_fleet(RunOptions(heartbeat=0), "tcp://127.0.0.1:5555", 3)


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
    args = [*ONE_ENV_EACH, "--edges", "2", "--curve", str(keys), *LINK]
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
    assert code == 0 and "the 2 edges closed the session after iteration 2" in out, out


def test_averaging_brings_every_edge_to_the_mean_of_their_encoders():
    settings = TrainSettings(env=EnvSettings(num_envs=1), schedule=ScheduleSettings(edges=2, encoder_sync="avg"))
    spec = inspect_env(settings.env)
    edges = [Edge(settings, spec, edge=k) for k in range(2)]
    learner = Learner(settings.fleet_view(), spec)
    start = {name: p.detach().clone() for name, p in edges[0].net.named_parameters()}
    g = torch.Generator().manual_seed(0)
    for edge in edges:  # each edge trained on its own
        with torch.no_grad():
            for p in edge.net.parameters():
                p.add_(0.01 * torch.randn(p.shape, generator=g))
    wanted = {name: sum(dict(e.net.named_parameters())[name].detach() for e in edges) / 2 for name in start}
    changes = [Message("encoder_avg", {}, edge.encoder_change("fp32")) for edge in edges]
    mean = Message("encoder_avg", {}, learner.average_encoders(changes, "fp32"))
    for edge in edges:
        edge.take_average(mean)
    for name in start:
        assert torch.equal(dict(edges[0].net.named_parameters())[name], dict(edges[1].net.named_parameters())[name])
        torch.testing.assert_close(dict(edges[0].net.named_parameters())[name], wanted[name])
    # int8 changes: the edges still agree bit for bit, on the mean up to the codec's rounding
    with torch.no_grad():
        for p in edges[1].net.parameters():
            p.add_(0.01)
    changes = [Message("encoder_avg", {}, edge.encoder_change("fp32")) for edge in edges]
    assert sum(t.numel() for t in changes[1].tensors.values()) == sum(p.numel() for p in edges[1].net.parameters())
    mean = Message("encoder_avg", {}, learner.average_encoders(changes, "fp32"))
    for edge in edges:
        edge.take_average(mean)
    assert all(torch.equal(a, b) for a, b in zip(edges[0].net.parameters(), edges[1].net.parameters()))


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
