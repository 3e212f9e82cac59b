"""``--link-budget``: the ladders, stage0's choice, stage1's check, the codecs' switch, and runs that use it."""

import dataclasses
import json

import pytest
import torch

from splitrl.codecs import CodecSet, Context
from splitrl.launch import free_port_pair
from splitrl.settings import CodecSettings, ScheduleSettings, TrainSettings
from splitrl.stages.budget import LinkBudget, codec_ladder, exchange_ladder
from splitrl.transport import ProtocolError

from ..conftest import TINY, splitrl_here


def test_each_ladder_starts_at_the_configured_codec_and_only_gets_leaner():
    assert codec_ladder("fp32", "fwd") == [("fp32", 1.0), ("bf16", 0.5), ("int8", 0.25)]
    assert codec_ladder("bf16+zstd", "bwd") == [("bf16+zstd", 1.0), ("int8+zstd", 0.5)]
    assert codec_ladder("int8+zstd", "rollout") == [("int8+zstd", 1.0)]  # nothing leaner of its kind
    ef = codec_ladder("ef:density=0.04,values=int8", "bwd")
    assert [spec for spec, _ in ef[:3]] == ["ef:density=0.04,values=int8", "ef:density=0.02,values=int8",
                                           "ef:density=0.01,values=int8"]
    assert [f for _, f in ef] == [0.5 ** k for k in range(6)]
    assert codec_ladder("paper:p=0.9", "bwd")[1][0] == "paper:p=0.95"
    assert codec_ladder("relu:values=bf16", "rollout") == [("relu:values=bf16", 1.0), ("relu:values=int8", 0.5)]
    replica = exchange_ladder("replica:last_every=1,all_every=80", 320, (1000, 10))
    assert replica[0] == ("replica:sync=int8,last_every=1,all_every=80", 1.0)
    assert replica[1][0] == "replica:sync=int8,last_every=2,all_every=160"
    # 2 full updates (the rollout's, the 160th minibatch's) + 158 small ones, against 4 (80, 160, 240) + 316:
    assert replica[1][1] == pytest.approx((2 * 1000 + 158 * 10) / (4 * 1000 + 316 * 10))
    assert exchange_ladder("features", 320, (1, 1)) == [("features", 1.0)]


def _settings(**codecs) -> TrainSettings:
    return TrainSettings(codecs=CodecSettings(**codecs))


def _record(iteration, seconds, link_wait, **bytes_):
    record = {"iteration": iteration, "time/iteration": seconds, "time/link_wait": link_wait}
    record.update({f"net/{k.replace('__', '/')}": v for k, v in bytes_.items()})
    return record


def test_stage0_takes_the_heaviest_stream_down_until_the_iteration_fits():
    budget = LinkBudget(_settings(codec_rollout="bf16", codec_fwd="fp32", codec_bwd="ef:density=0.04"), rate=8e6)
    # 12 s of iteration, 2 of them waiting on the link: 10 s of compute at 1 MB/s = 10 MB allowed each way.
    record = _record(1, 12.0, 2.0, step__sent_bytes=4e6, train_fwd__sent_bytes=16e6, iter_end__sent_bytes=1e5,
                     train_bwd__recv_bytes=2e6, action__recv_bytes=1e5)
    metrics = budget.choose(2, record)
    # Up: fwd 16 MB -> bf16 8 MB (still 12.1 > 10) -> int8 4 MB (the heaviest again: 8 > 4): 8.1 MB.
    assert budget.levels == {"rollout": 0, "fwd": 2, "bwd": 0, "exchange": 0}
    assert metrics["budget/allowed_up_bytes"] == pytest.approx(10e6)
    assert metrics["budget/predicted_up_bytes"] == pytest.approx(4e6 + 4e6 + 1e5)
    assert metrics["budget/predicted_down_bytes"] == pytest.approx(2.1e6)
    assert budget.specs()["fwd"] == "int8"
    # The next iteration ran at those levels: its bytes are scaled back to the configured codec's. With twice
    # the compute time the budget allows 20 MB: fwd goes back to fp32 (16 MB) and 20.1 MB > 20 MB, so bf16.
    ran = _record(2, 20.0, 0.0, step__sent_bytes=4e6, train_fwd__sent_bytes=4e6, iter_end__sent_bytes=1e5)
    budget.choose(3, ran)
    assert budget.levels["fwd"] == 1
    # A link too thin for anything: every stream at its leanest, the prediction still above the allowance.
    thin = LinkBudget(_settings(codec_fwd="fp32"), rate=8.0)
    metrics = thin.choose(2, record)
    assert thin.levels["fwd"] == 2 and metrics["budget/predicted_up_bytes"] > metrics["budget/allowed_up_bytes"]


def test_stage1_takes_only_settings_on_its_ladders():
    budget = LinkBudget(_settings(codec_bwd="ef:density=0.04"), rate=1e6)
    good = {"rollout": "fp32", "fwd": "bf16", "bwd": "ef:density=0.01", "exchange": "features"}
    assert budget.check(good) == good
    for bad in ({**good, "bwd": "fp32"}, {**good, "fwd": "ef:density=0.5"}, {"rollout": "fp32"}, ["fp32"]):
        with pytest.raises(ProtocolError, match="budget"):
            budget.check(bad)


def test_a_codec_switched_to_a_leaner_setting_keeps_its_state():
    codecs = CodecSet(bwd="ef:density=0.5", fwd="fp32")
    grad = torch.randn(4, 8)
    codecs.pack("bwd", "grad", grad, Context(idx=torch.arange(4)), {}, {})
    residual = codecs["bwd"].residual
    codecs.retune("bwd", "ef:density=0.25")
    assert codecs["bwd"].density == 0.25 and codecs["bwd"].residual is residual
    codecs.retune("fwd", "int8")
    assert codecs["fwd"].name == "int8"
    # The delta codec's cache of the rollout's features goes with it (training needs what the rollout filled).
    deltas = CodecSet(fwd="delta:q=topk,density=0.2")
    deltas.observe_rollout(Context(idx=torch.arange(4)), torch.rand(4, 8))
    cache = deltas["fwd"].cache
    deltas.retune("fwd", "delta:q=topk,density=0.1")
    assert deltas["fwd"].cache is cache and deltas["fwd"].view is not None


def test_a_stage1_without_a_budget_refuses_one_and_groups_must_agree():
    from splitrl.envs import EnvSpec
    from splitrl.stages import Learner
    from splitrl.transport.wire import Message

    spec = EnvSpec(obs_shape=(4, 96, 96), action_dim=3, action_low=(-1.0, 0.0, 0.0), action_high=(1.0, 1.0, 1.0))
    step = {"features": torch.rand(1, 4096)}
    announced = {"rollout": "fp32", "fwd": "fp32", "bwd": "fp32", "exchange": "features"}
    plain = Learner(TrainSettings(), spec)
    plain.begin_rollout(1)
    with pytest.raises(ProtocolError, match="has none"):
        plain.act(0, Message("step", {"budget": announced}, step))
    two = dataclasses.replace(TrainSettings(), env=dataclasses.replace(TrainSettings().env, num_envs=2),
                              codecs=CodecSettings(link_budget="1mbit"))
    learner = Learner(two, spec)
    learner.set_groups(2)
    learner.begin_rollout(1)
    learner.act(0, Message("step", {"budget": announced}, step), g=0)
    with pytest.raises(ProtocolError, match="differs between groups"):
        learner.act(0, Message("step", {"budget": {**announced, "fwd": "int8"}}, step), g=1)


def test_a_step_that_saves_nothing_is_not_taken():
    """Four minibatches an iteration: past periods of 2 and 4 the replica saves at most one small update (1 %),
    then nothing, so the budget stops there (it would make the replica staler for nothing), even with the link
    far too thin."""
    base = _settings(exchange="replica:last_every=1,all_every=2", codec_fwd="bf16", codec_bwd="bf16")
    settings = dataclasses.replace(base, ppo=dataclasses.replace(base.ppo, epochs=2, minibatches=2))
    budget = LinkBudget(settings, rate=8.0, weights=(1000, 10))
    factors = [f for _, f in budget.ladders["exchange"]]
    assert factors[2] == factors[3] == factors[4] == factors[5] > 0.98 * factors[1]
    budget.choose(2, _record(1, 10.0, 0.0, heads__recv_bytes=4e6, train_bwd__recv_bytes=1e3))
    assert budget.levels["exchange"] == 1 and budget.levels["bwd"] == 1


@pytest.mark.parametrize("change, words", [
    ({"codecs": CodecSettings(link_budget="fast")}, "--link-budget"),
    ({"codecs": CodecSettings(link_budget="2mbit"), "cut": "input"}, "--cut cnn"),
    ({"codecs": CodecSettings(link_budget="2mbit"), "schedule": ScheduleSettings(edges=2)}, "one edge"),
])
def test_what_a_budget_cannot_run_is_refused(change, words):
    with pytest.raises(ValueError, match=words):
        dataclasses.replace(TrainSettings(), **change).validate()


def _records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


BUDGET = TINY[:1] + ["96"] + TINY[2:] + ["--codec-bwd", "ef:density=0.2", "--link-budget", "2kbit"]
"""Three iterations; a budget no iteration fits: each knob goes to its ladder's foot. 2 kbit/s is 250 bytes a
second of compute against ~1 MB of fp32 training features an iteration, however slow the machine: at 100 kbit/s
a loaded machine's slow iteration was allowed enough bytes to stop the gradients a level higher."""


def test_a_split_run_within_a_budget_chooses_leaner_codecs_and_says_so(tmp_path, spawn):
    endpoint = f"tcp://127.0.0.1:{free_port_pair()}"
    run = tmp_path / "split"
    args = [*BUDGET, "--timeout", "60", "--start-timeout", "60"]
    s1 = spawn("stage1", "--bind", endpoint, "--run-dir", str(run), *args)
    s0 = spawn("stage0", "--connect", endpoint, "--run-dir", str(run), *args)
    code0, out0 = s0.finish(timeout=300)
    code1, out1 = s1.finish(timeout=30)
    assert code0 == 0 and code1 == 0, out0 + out1
    first, second, third = _records(run)
    assert not any(k.startswith("budget/") for k in first)  # nothing measured yet: the codecs as given
    leanest_bwd = codec_ladder("ef:density=0.2", "bwd")
    for later in (second, third):
        assert later["budget/spec/fwd"] == "int8" and later["budget/spec/rollout"] == "int8"
        assert later["budget/spec/bwd"] == leanest_bwd[-1][0] and later["budget/level/bwd"] == len(leanest_bwd) - 1
    # Fewer bytes for the same samples: features in int8, gradients at 1/8 of the density or less.
    assert second["net/train_fwd/sent_bytes"] < first["net/train_fwd/sent_bytes"] / 3
    assert second["net/train_bwd/recv_bytes"] < first["net/train_bwd/recv_bytes"] / 4


def test_the_replica_exchange_lengthens_its_periods_on_both_stages(tmp_path):
    """Stage0 and stage1 must agree on when an update follows a minibatch: a twin run finishes only if they do."""
    run = tmp_path / "twin"
    splitrl_here("train", "--run-dir", str(run), *TINY[:1], "96", *TINY[2:], "--codec-fwd", "bf16", "--codec-bwd",
                 "bf16", "--exchange", "replica:last_every=1,all_every=2", "--link-budget", "100kbit")
    first, second, _ = _records(run)
    assert second["budget/level/exchange"] > 0
    assert second["net/heads/recv_bytes"] < first["net/heads/recv_bytes"]
