"""A discrete-action pixel env (tests/dots.py) through both stages: int64 actions on the wire, and a split
run that computes what its twin does, bit for bit."""

import json

import pytest
import torch

from splitrl.envs import inspect_env
from splitrl.launch import free_port_pair
from splitrl.models import build_agent
from splitrl.runs import load_checkpoint
from splitrl.settings import EnvSettings, PPOSettings, TrainSettings
from splitrl.stages import Edge, Learner
from splitrl.transport import ProtocolError
from splitrl.transport.wire import Message

from ..conftest import TINY, splitrl_here
from ..dots import DOTS_ENV_ID

SETTINGS = TrainSettings(env=EnvSettings(env_id=DOTS_ENV_ID, num_envs=2, max_episode_steps=20),
                         ppo=PPOSettings(num_steps=4, epochs=1, minibatches=2))


@pytest.fixture(scope="module")
def spec():
    return inspect_env(SETTINGS.env)


def test_stage1_answers_with_int64_indices_and_stage0_steps_with_them(spec):
    edge, learner = Edge(SETTINGS, spec), Learner(SETTINGS, spec)
    edge.open_envs()
    try:
        edge.begin_rollout(1)
        learner.begin_rollout(1)
        for t in range(4):
            tensors, header = edge.observe(t)
            action, _ = learner.act(t, Message("step", header, tensors))
            assert action["action"].dtype == torch.int64 and action["action"].shape == (2,)
            edge.step(Message("action", {}, action))
        tensors, header = edge.end_rollout()
        learner.end_rollout(Message("rollout_end", header, tensors))
    finally:
        edge.close()
    b = learner.buffer
    assert b.actions.dtype == torch.int64 and b.actions.shape == (4, 2)
    # The stored log-probs are the categorical's of the stored actions (step-major, as the observations).
    with torch.no_grad():
        logits, _ = learner.heads.outputs(edge.net(edge.buffers[0].reshape((8,) + spec.obs_shape)))
    ref = torch.distributions.Categorical(logits=logits).log_prob(b.actions.reshape(8))
    torch.testing.assert_close(b.logprobs.reshape(8), ref)


@pytest.mark.parametrize("bad, words", [
    (torch.tensor([0, 3]), r"expected indices in \[0, 3\), got values from 0 to 3"),
    (torch.tensor([-1, 0]), r"expected indices in \[0, 3\), got values from -1 to 0"),
    (torch.zeros(2, 3), r"expected torch.int64 \[2\], got torch.float32 \[2, 3\]"),
    (torch.zeros(2, dtype=torch.int32), r"expected torch.int64 \[2\], got torch.int32 \[2\]"),
])
def test_stage0_refuses_an_action_that_is_no_index_of_the_space(spec, bad, words):
    edge = Edge(SETTINGS, spec)
    edge.open_envs()
    try:
        edge.begin_rollout(1)
        edge.observe(0)
        with pytest.raises(ProtocolError, match=words):
            edge.step(Message("action", {}, {"action": bad}))
        edge.step(Message("action", {}, {"action": torch.tensor([2, 0])}))  # and it stays usable
    finally:
        edge.close()


def test_samples_an_older_policy_acted_on_are_scored_with_their_indices(spec):
    """The asynchronous schedule's re-scoring (`PPOUpdate.score_stored`) with int64 actions of shape (T, N)."""
    g = torch.Generator().manual_seed(0)
    learner = Learner(SETTINGS, spec, slots=2, acting_copy=True)
    outcome = {"reward": torch.ones(2), "terminated": torch.zeros(2, dtype=torch.bool),
               "truncated": torch.zeros(2, dtype=torch.bool)}

    def rollout(iteration, features, adopt_at=None):
        learner.begin_rollout(iteration)
        for t in range(4):
            if t == adopt_at:
                learner.adopt(1)
            learner.act(t, Message("step", {}, {"features": features[t], **(outcome if t else {})}))
        learner.end_rollout(Message("rollout_end", {}, {"features": features[4], **outcome}))

    rollout(1, torch.rand(5, 2, learner.feature_dim, generator=g))
    learner.begin_training(1)
    with torch.no_grad():
        for p in learner.heads.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    learner.publish()
    second = torch.rand(5, 2, learner.feature_dim, generator=g)
    rollout(2, second, adopt_at=2)
    b = learner.rollouts.buffers[0]
    behaviour = b.logprobs.clone()
    learner.begin_training(2)
    with torch.no_grad():
        logits, _ = learner.heads.outputs(second[:4].reshape(8, -1))
    logprob = torch.distributions.Categorical(logits=logits).log_prob(b.actions.reshape(8)).reshape(4, 2)
    weights = (logprob[:2] - behaviour[:2]).exp().clamp(max=1.0)
    assert learner.rollout_stats["async/weight_mean"] == pytest.approx(float(weights.mean()), rel=1e-6)
    assert torch.equal(b.logprobs, behaviour)
    assert bool((logprob[:2] != behaviour[:2]).any())  # the heads moved: the lagging samples are scored anew


def _load(run_dir, stage):
    return load_checkpoint(run_dir, stage, 2)


def _metrics(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    volatile = ("time/", "cpu/", "link/")
    return [{k: v for k, v in r.items() if not k.startswith(volatile) and k != "charts/SPS"} for r in rows]


DOTS = TINY + ["--env-id", DOTS_ENV_ID]
LINK = ["--timeout", "60", "--start-timeout", "60"]
TWO_ENVS = ["--num-envs", "2", "--total-steps", "128"]


def _split_and_twin(tmp_path, spawn, args):
    """Train ``args`` split over ZeroMQ and as the twin (in this process); assert both end with the same weights
    and metrics."""
    endpoint = f"tcp://127.0.0.1:{free_port_pair()}"
    split_dir, twin_dir = tmp_path / "split", tmp_path / "twin"
    s1 = spawn("stage1", "--bind", endpoint, "--run-dir", str(split_dir), *args, *LINK)
    s0 = spawn("stage0", "--connect", endpoint, "--run-dir", str(split_dir), *args, *LINK)
    code0, out0 = s0.finish(timeout=240)
    code1, out1 = s1.finish(timeout=30)
    assert code0 == 0, out0
    assert code1 == 0, out1
    splitrl_here("train", "--run-dir", str(twin_dir), *args)
    for stage, key in (("stage0", "net"), ("stage1", "heads")):
        split_state, twin_state = _load(split_dir, stage)[key], _load(twin_dir, stage)[key]
        assert split_state.keys() == twin_state.keys()
        for name in split_state:
            assert torch.equal(split_state[name], twin_state[name]), f"{stage}.{name}"
    split_metrics = _metrics(split_dir)
    assert split_metrics == _metrics(twin_dir)
    assert len(split_metrics) == 2
    assert split_metrics[-1]["net/action/recv_messages"] > 0
    return split_dir


@pytest.mark.parametrize("extra", [
    [],
    ["--cut", "input"],
    ["--codec-rollout", "int8", "--exchange", "replica:last_every=1,all_every=3"],
    TWO_ENVS + ["--rollout-groups", "2", "--microbatches", "2"],
], ids=["cnn", "input", "replica", "pipelined"])
def test_a_discrete_pixel_env_trains_split_and_twin_bit_identically(tmp_path, spawn, extra):
    split_dir = _split_and_twin(tmp_path, spawn, DOTS + extra)
    config = json.loads((split_dir / "config-stage0.json").read_text())
    assert config["env_spec"]["discrete"] and config["env_spec"]["action_dim"] == 3
    _, initial = build_agent((4, 48, 48), 3, "input" if "input" in extra else "cnn", 1, discrete=True,
                             hidden=int(TINY[TINY.index("--hidden") + 1]))
    heads = _load(split_dir, "stage1")["heads"]
    assert "actor_logstd" not in heads
    assert not torch.equal(heads["actor_mean.2.weight"], initial.state_dict()["actor_mean.2.weight"])  # it trained
    episodes = [json.loads(line) for line in (split_dir / "episodes.jsonl").read_text().splitlines()]
    assert episodes, "no episode ended"
    if not extra:  # and `splitrl eval` scores it with its most likely actions, the same twice
        runs = [splitrl_here("eval", str(split_dir), "--episodes", "2") for _ in range(2)]
        assert "over 2 episodes" in runs[0].stdout and runs[0].stdout == runs[1].stdout


# An Atari game as users run them (CleanRL's ppo_atari: 84 x 84 grey, 4 frames stacked, every 4th frame
# acted on, the max of the last two kept); ale-py's own frame skip off so ours does it (`--env-kwargs`).
ATARI = [*TINY, "--env-id", "ale_py:ALE/Pong-v5", "--env-kwargs", "frameskip=1", "--resize", "84",
         "--frame-stack", "4", "--frame-skip", "4"]


def test_an_atari_game_trains_split_and_twin_bit_identically(tmp_path, spawn):
    pytest.importorskip("ale_py", reason="the atari extra (ale-py) is not installed")
    split_dir = _split_and_twin(tmp_path, spawn, ATARI)
    spec = json.loads((split_dir / "config-stage0.json").read_text())["env_spec"]
    assert spec["discrete"] and spec["action_dim"] == 6 and spec["obs_shape"] == [4, 84, 84]
