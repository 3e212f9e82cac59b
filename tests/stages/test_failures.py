"""Bad input gets a clear error, and no stage hangs when its peer misbehaves."""

import dataclasses
import re
import signal
import subprocess
import threading
import time

import pytest
import torch

from splitrl.launch import free_port_pair
from splitrl.envs import EnvSpec
from splitrl.settings import EnvSettings, PPOSettings, RunOptions, ScheduleSettings, TrainSettings
from splitrl import runner as session
from splitrl.runner import prepare
from splitrl.schedule.sync import stage1_loop
from splitrl.stages import LIMITS, Learner, learner_exchange
from splitrl.transport import ProtocolError
from splitrl.transport.local import LocalTransport

from ..conftest import TINY, child_env, splitrl_cmd


def run(*args, timeout=60):
    return subprocess.run(splitrl_cmd(*args), env=child_env(), capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize(
    "env_id, expected",
    [("NoSuchEnv-v0", "doesn't exist"),
     ("FrozenLake-v1", "or a Dict of one image and vectors, got Discrete")],
)
def test_unusable_env_is_refused_before_any_socket_opens(tmp_path, env_id, expected):
    with pytest.raises(ValueError, match=expected):
        prepare(TrainSettings(env=EnvSettings(env_id=env_id)), RunOptions(run_dir=str(tmp_path)), "stage0")
    # The endpoint is unreachable: had stage0 tried the link, it would report a timeout instead.
    result = run("stage0", "--env-id", env_id, "--connect", "tcp://127.0.0.1:9", "--start-timeout", "30")
    assert result.returncode == 2
    assert env_id in result.stderr and expected in result.stderr


def test_every_invalid_setting_is_reported_at_once():
    result = run("train", "--num-steps", "0", "--epochs", "0", "--gamma", "2", "--init-log-std", "9")
    assert result.returncode == 2
    for name in ("--num-steps", "--epochs", "--gamma", "--init-log-std"):
        assert name in result.stderr
    # A cut the model has not is refused with the others, naming the model's layers (known once the env is).
    result = run("train", "--cut", "middle", "--gamma", "2")
    assert result.returncode == 2 and "cut 'middle' is not a layer of model 'nature'" in result.stderr
    assert "--gamma" in result.stderr and "conv1" in result.stderr


def test_unreachable_peer_times_out_with_a_clear_error(tmp_path):
    port = free_port_pair()
    start = time.monotonic()
    result = run("stage0", "--connect", f"tcp://127.0.0.1:{port}", "--start-timeout", "2",
                 "--run-dir", str(tmp_path), *TINY)
    assert result.returncode == 1
    assert "no message from stage1" in result.stderr and "within 2 s" in result.stderr
    # Bounded, not timed: Python and torch start-up alone took 40 s on 2 loaded cores.
    assert time.monotonic() - start < 120


# Every schedule must fail as the synchronous one does (the pipelined one with two env groups and
# micro-batches, the asynchronous one with its two threads a side, free-running or paced by epochs).
MODES = {"sync": [], "pipelined": ["--num-envs", "2", "--rollout-groups", "2", "--microbatches", "2"],
         "async": ["--async", "--vector", "async"], "async-epoch": ["--async", "--publish", "epoch", "--vector", "async"]}


@pytest.mark.parametrize("mode", MODES)
def test_a_settings_mismatch_stops_stage0_and_stage1_waits_on_both_naming_the_setting(tmp_path, spawn, mode):
    """Stage0 exits naming the setting; stage1 names it too, once, and waits on for a stage0 it can serve (a
    failed hello is a stranger's: tests/hostile/test_session.py)."""
    endpoint = f"tcp://127.0.0.1:{free_port_pair()}"
    s1 = spawn("stage1", "--bind", endpoint, "--run-dir", str(tmp_path), "--seed", "1", *TINY, *MODES[mode])
    s0 = spawn("stage0", "--connect", endpoint, "--run-dir", str(tmp_path), "--seed", "2", *TINY, *MODES[mode])
    code0, out0 = s0.finish(timeout=90)
    assert code0 == 1 and "settings differ" in out0 and "seed: " in out0
    s1.wait_for("refused a peer whose hello failed", timeout=30)
    out1 = s1.output()
    assert s1.popen.poll() is None and "settings differ" in out1 and "seed: " in out1


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("victim", ["stage0", "stage1"])
def test_peer_dying_mid_run_makes_the_other_side_exit_nonzero(tmp_path, spawn, victim, mode):
    endpoint = f"tcp://127.0.0.1:{free_port_pair()}"
    args = ["--run-dir", str(tmp_path), "--timeout", "3", "--start-timeout", "60",
            "--total-steps", "4096", "--num-steps", "2048", "--threads", "1", "--hidden", "32", *MODES[mode]]
    procs = {
        "stage1": spawn("stage1", "--bind", endpoint, *args),
        "stage0": spawn("stage0", "--connect", endpoint, *args),
    }
    procs["stage1"].wait_for("stage0 connected", timeout=90)
    time.sleep(2)  # into the rollout
    procs[victim].popen.send_signal(signal.SIGKILL)
    survivor = procs["stage1" if victim == "stage0" else "stage0"]
    code, out = survivor.finish(timeout=30)
    assert code == 1, out
    # Noticed by the heartbeat's closed connection (within 2/5 of --heartbeat) or by --timeout, whichever first.
    assert "is gone" in out or "within 3 s" in out, out


SPEC = EnvSpec(obs_shape=(4, 96, 96), action_dim=3, action_low=(-1.0, 0.0, 0.0), action_high=(1.0, 1.0, 1.0))
SETTINGS = TrainSettings(total_steps=8, env=EnvSettings(num_envs=2), ppo=PPOSettings(num_steps=4, epochs=1, minibatches=2))


def _msg(kind, header, **tensors):
    return kind, tensors, header


def _step(t, **extra):
    outcome = {} if t == 0 else {"reward": torch.zeros(2), "terminated": torch.zeros(2, dtype=torch.bool),
                                 "truncated": torch.zeros(2, dtype=torch.bool)}
    return _msg("step", {"t": t}, features=torch.zeros(2, 4096), **{**outcome, **extra})


ROLLOUT = [_step(t) for t in range(4)] + [_msg("rollout_end", {}, features=torch.zeros(2, 4096), reward=torch.zeros(2),
                                              terminated=torch.zeros(2, dtype=torch.bool),
                                              truncated=torch.zeros(2, dtype=torch.bool))]
TRAINING = [_msg("train_fwd", {"epoch": 0, "mb": mb}, features=torch.zeros(4, 4096)) for mb in range(2)]


def stage1_refuses(messages, loop=None, settings=None):
    """Feed ``messages`` to stage1's loop (in-process, on a thread) and return the error that stopped it."""
    settings = settings or SETTINGS
    learner = session.make_learner(settings, SPEC)
    ours, theirs = LocalTransport.pair("test", "stage1", limits=LIMITS, timeout=5)
    failure = []

    def serve():
        try:
            (loop or stage1_loop)(learner, learner_exchange(learner), theirs)
        except Exception as exc:
            failure.append(exc)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    for kind, tensors, header in messages:
        ours.send(kind, tensors, header)
    thread.join(30)
    assert not thread.is_alive() and failure, "stage1 accepted every message"
    return failure[0]


@pytest.mark.parametrize(
    "messages, expected",
    [
        ([_step(1)], "step: expected t=0, got t=1"),
        ([_msg("step", {"t": 0}, features=torch.zeros(3, 4096))], "expected torch.float32 \\[2, 4096\\]"),
        ([_msg("step", {"t": 0}, features=torch.zeros(2, 4096, dtype=torch.float16))], "features"),
        ([_msg("step", {"t": 0})], "tensor 'features'.*missing"),
        ([_msg("train_fwd", {"epoch": 0, "mb": 0}, features=torch.zeros(4, 4096))], "expected 'step'.*got 'train_fwd'"),
        (ROLLOUT + TRAINING[1:], "train_fwd: expected epoch=0, mb=0, got epoch=0, mb=1"),
        ([_msg("rollout_end", {}, features=torch.zeros(2, 4096))], "expected 'step'.*got 'rollout_end'"),
        (ROLLOUT[:2] + ROLLOUT[-1:], "expected 'step' \\(t=2\\).*got 'rollout_end'"),
        (ROLLOUT + TRAINING + [_msg("iter_end", {"iteration": 7})], "iter_end: expected iteration=1, got iteration=7"),
        ([_msg("hello", {})], "expected 'step'.*got 'hello'"),
        ([_step(0), _step(1, truncated=torch.ones(2, dtype=torch.bool), final_features=torch.zeros(1, 4096),
                           final_index=torch.tensor([5]))], "final_index"),
    ],
    ids=["step-order", "feature-shape", "feature-dtype", "no-features", "train-before-rollout", "minibatch-order",
         "rollout-end-first", "rollout-end-early", "iteration", "hello-again", "bad-outcome"],
)
def test_stage1_refuses_out_of_protocol_messages(messages, expected):
    error = stage1_refuses(messages)
    assert isinstance(error, ProtocolError)
    assert re.search(expected, str(error)), str(error)


PINGS = [_msg("ping", {"i": i}) for i in range(5)]


def _plan(groups):
    return _msg("plan", {"rollout_groups": groups})


def _group_step(t, g, **header):
    kind, tensors, head = _step(t)
    tensors = {k: v[:1] if v.dim() else v for k, v in tensors.items()}  # one env a group
    return kind, tensors, {**head, "g": g, **header}


@pytest.mark.parametrize(
    "loop, messages, expected",
    [
        ("pipelined", PINGS + [_plan(3)], "plan: expected rollout_groups dividing 2"),
        ("pipelined", PINGS[:2] + [_plan(2)], "expected 'ping'"),
        ("pipelined", PINGS + [_plan(2), _group_step(0, 1)], "step: expected t=0, g=0, got t=0, g=1"),
        ("pipelined", PINGS + [_plan(1), _msg("step", {"t": 0, "g": 0}, features=torch.zeros(2, 4096))]
         + [_msg("step", {"t": t, "g": 0}, features=torch.zeros(2, 4096), reward=torch.zeros(2),
                 terminated=torch.zeros(2, dtype=torch.bool), truncated=torch.zeros(2, dtype=torch.bool))
            for t in range(1, 4)]
         + [_msg("rollout_end", {"g": 0}, features=torch.zeros(2, 4096), reward=torch.zeros(2),
                 terminated=torch.zeros(2, dtype=torch.bool), truncated=torch.zeros(2, dtype=torch.bool)),
            _msg("train_fwd", {"epoch": 0, "mb": 0, "j": 1}, features=torch.zeros(4, 4096))],
         "train_fwd: expected epoch=0, mb=0, j=0, got epoch=0, mb=0, j=1"),
        ("async", PINGS + [_plan(2), _group_step(0, 0)], "acting version v >= 0, got None"),
        ("async", PINGS + [_plan(2), _group_step(0, 0, v=-1)], "acting version v >= 0, got -1"),
    ],
    ids=["plan-groups", "too-few-pings", "group-order", "micro-batch-order", "no-version", "bad-version"],
)
def test_the_pipelined_and_asynchronous_loops_refuse_out_of_protocol_messages(loop, messages, expected):
    from splitrl.schedule import asynchronous, pipelined

    before = threading.active_count()
    module = {"pipelined": pipelined, "async": asynchronous}[loop]
    schedule = ScheduleSettings(rollout_groups="auto", microbatches=2, asynchronous=loop == "async")
    settings = dataclasses.replace(SETTINGS, schedule=schedule)

    def opened_loop(learner, exchange, link):  # as the runner does: the pings and the plan, then the iterations
        module.stage1_open(learner, link)
        return module.stage1_loop(learner, exchange, link)

    error = stage1_refuses(messages, opened_loop, settings)
    assert isinstance(error, ProtocolError)
    assert re.search(expected, str(error)), str(error)
    deadline = time.monotonic() + 5
    while threading.active_count() > before and time.monotonic() < deadline:  # the async loop's threads stop too
        time.sleep(0.05)
    assert threading.active_count() == before


def test_stage1_refuses_to_act_with_a_version_it_never_published():
    learner = Learner(SETTINGS, SPEC, slots=2, acting_copy=True)
    learner.publish()  # version 0 (train_iteration 0)
    with pytest.raises(ProtocolError, match="policy version 3"):
        learner.adopt(3)
