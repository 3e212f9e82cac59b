"""A fleet's parts in the stages and the settings: an edge's share of the samples, stage1 acting for every
edge, averaging the edges' encoders, an edge joining with the fleet's encoder, what a fleet refuses."""

import pytest
import torch

from splitrl.envs import inspect_env
from splitrl.runner import joining
from splitrl.settings import CodecSettings, EnvSettings, PPOSettings, RunOptions, ScheduleSettings, TrainSettings
from splitrl.stages import Edge, Learner
from splitrl.stages.order_free import invariant_rows as _invariant_rows
from splitrl.transport import Message
from splitrl.transport.endpoints import slot_endpoint


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

@pytest.mark.parametrize("mode", ["fp32", "int8"])
def test_averaging_brings_every_edge_to_the_mean_of_their_encoders(mode):
    """Two rounds (the second against the view the first agreed on): after each, both edges hold the same encoder
    bit for bit, the mean of theirs, exactly up to float sums in fp32 and up to the rounding in int8: one scale a
    row, so half a step on each edge's change on its way up and half of the mean's on its way down, a step being
    the row's largest change / 127 (the mean's no larger than the edges')."""
    settings = TrainSettings(env=EnvSettings(num_envs=1),
                             schedule=ScheduleSettings(edges=2, encoder_sync=f"avg:sync={mode}"))
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
        mean = Message("encoder_avg", {}, learner.encoder_sum.mean([learner.encoder_sum.take(m) for m in changes]))
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
