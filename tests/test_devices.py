"""A device per stage (`splitrl.devices`): the names, the check before any socket opens, the crossings between host
memory and a device, and a device that stays each stage's own (recorded in its config, not in the handshake).

This machine may have no CUDA device: what needs one is checked with this machine's CUDA count replaced, or
with a stand-in tensor that records what is done to it; scripts/device_check.sh runs the rest on a GPU."""

import dataclasses
import json
import threading

import pytest
import torch

from splitrl import checkpoints, devices
from splitrl.devices import check_device_name, device_error, resolve_device, to_device, to_host, transfer
from splitrl.envs import EnvSpec
from splitrl.launch import free_port_pair
from splitrl.runner import run_stage0, run_stage1
from splitrl.runs import checkpoint_iterations, load_checkpoint
from splitrl.settings import EnvSettings, PPOSettings, RunOptions, SettingsError, TrainSettings

from .conftest import TINY, splitrl_here

CUDA = torch.device("cuda", 0)
SPEC = EnvSpec(obs_shape=(4, 96, 96), action_dim=3, action_low=(-1.0, 0.0, 0.0), action_high=(1.0, 1.0, 1.0))
"""A CarRacing-shaped spec, without making the env."""


@pytest.fixture
def no_cuda(monkeypatch):
    """This machine as one without a CUDA device, whatever it has."""
    monkeypatch.setattr(devices, "_cuda_count", lambda: 0)


def test_device_names_are_checked_without_a_device():
    for name in ("cpu", "cuda", "cuda:0", "cuda:12", "auto"):
        assert check_device_name(name) == name
    for name in ("gpu", "CUDA", "cuda:", "cuda:x", "cuda0", ""):
        with pytest.raises(SettingsError, match="expected one of cpu, cuda, cuda:N"):
            check_device_name(name, "--stage1-device")
    errors = RunOptions(stage0_device="gpu", stage1_device="tpu").errors()
    assert any(e.startswith("--stage0-device 'gpu'") for e in errors)
    assert any(e.startswith("--stage1-device 'tpu'") for e in errors)


def test_a_cuda_device_this_machine_lacks_is_one_line(no_cuda, monkeypatch):
    message = device_error("cuda", "--stage1-device")
    assert message.startswith("--stage1-device cuda: this machine has no CUDA device") and "\n" not in message
    assert device_error("cpu") is None and device_error("auto") is None
    assert resolve_device("auto") == torch.device("cpu") and resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(SettingsError, match="no CUDA device"):
        resolve_device("cuda:0")
    monkeypatch.setattr(devices, "_cuda_count", lambda: 2)  # a machine with two
    assert device_error("cuda:1") is None
    assert device_error("cuda:2", "--device") == "--device cuda:2: this machine has 2 CUDA device(s), cuda:0 .. cuda:1"


def test_a_device_stays_on_its_own_stage_when_checked():
    options = RunOptions(stage0_device="cpu", stage1_device="cuda:7")
    if torch.cuda.device_count() > 7:
        pytest.skip("this machine has a cuda:7")
    assert options.device_errors("stage0") == []  # an edge is not refused for the server's device
    assert options.device_errors("stage1", option="--device")[0].startswith("--device cuda:7: ")
    assert RunOptions(stage1_device="gpu").device_errors("stage1") == []  # the name's own check reports it


@pytest.mark.parametrize("command, args", [
    ("train", ["--stage1-device", "cuda"]),
    ("train", ["--stage0-device", "cuda:0"]),
    ("run", ["--stage1-device", "cuda"]),
    ("stage0", ["--device", "cuda", "--connect", "tcp://127.0.0.1:9"]),
    ("stage1", ["--device", "cuda:1"]),
])
def test_cuda_on_a_machine_without_it_is_refused_in_one_line_before_any_socket(command, args, no_cuda, monkeypatch,
                                                                                tmp_path):
    def no_link(*_, **__):
        raise AssertionError("a link was opened (or a stage started) before the device was checked")

    monkeypatch.setattr("splitrl.runner.stage0.open_link", no_link)
    monkeypatch.setattr("splitrl.runner.stage1.open_link", no_link)
    monkeypatch.setattr("splitrl.launch.launch_split", no_link)
    monkeypatch.setattr("splitrl.runner.twin.LocalTransport.pair", no_link)
    result = splitrl_here(command, "--run-dir", str(tmp_path / "run"), *args, *TINY, code=2)
    lines = [line for line in result.output.splitlines() if "this machine has no CUDA device" in line]
    assert len(lines) == 1, result.output
    named = ("--stage0-device cuda", "--stage1-device cuda", "--device cuda")
    assert lines[0].strip().removeprefix("error: ").removeprefix("- ").startswith(named)
    assert not (tmp_path / "run").exists()  # nothing written either


@pytest.mark.parametrize("command", ["run", "train", "stage1"])
def test_a_missing_device_is_reported_with_every_other_problem(command, no_cuda, tmp_path):
    device = ["--device", "cuda"] if command == "stage1" else ["--stage1-device", "cuda"]
    result = splitrl_here(command, "--run-dir", str(tmp_path), *device, "--gamma", "2", code=2)
    assert "--gamma must be in [0, 1]" in result.output and "this machine has no CUDA device" in result.output


def test_device_and_the_stage_option_must_agree(tmp_path):
    result = splitrl_here("stage1", "--device", "cpu", "--stage1-device", "auto", "--run-dir", str(tmp_path), code=2)
    assert "--device cpu and --stage1-device auto contradict each other" in result.output


def test_a_host_tensor_crosses_to_a_cuda_device_through_pinned_memory_without_blocking():
    assert transfer(torch.device("cpu")) == (False, False)
    assert transfer(CUDA) == (True, True)
    t = torch.arange(4.0)
    assert to_device(t, torch.device("cpu")) is t and to_host(t) is t  # the CPU: the same tensor, no copy

    class Host:  # a host tensor as `to_device` sees it: what it is asked to do, in order
        device, calls = torch.device("cpu"), []

        def is_pinned(self):
            return False

        def pin_memory(self):
            self.calls.append("pin_memory")
            return self

        def to(self, device, non_blocking=False):
            self.calls.append(("to", device, non_blocking))
            return "moved"

    host = Host()
    assert to_device(host, CUDA) == "moved"
    assert host.calls == ["pin_memory", ("to", CUDA, True)]


def test_a_checkpoint_holds_host_tensors_whatever_device_they_were_on(monkeypatch):
    seen = []

    def recording(tensor):
        seen.append(tensor)
        return to_host(tensor)

    monkeypatch.setattr(checkpoints, "to_host", recording)
    state = {"net": {"w": torch.ones(2)}, "moments": [torch.zeros(3)], "step": 4}
    loaded = checkpoints.loads(checkpoints.dumps(state))
    assert len(seen) == 2  # every tensor went through the move to the host on its way out
    assert all(t.device.type == "cpu" for t in (loaded["net"]["w"], loaded["moments"][0]))


def _tiny() -> TrainSettings:
    return TrainSettings(total_steps=64, env=EnvSettings(max_episode_steps=20),
                         ppo=PPOSettings(num_steps=32, epochs=2, minibatches=2))


def test_two_stages_on_different_devices_connect_and_record_their_own(tmp_path):
    """The device is each stage's own choice: not in the handshake's hash, in each stage's config. ``auto`` on a
    machine without CUDA is the CPU, so the two compute alike, but their options differ as a GPU server's would.
    The server names the model (``--model nature``) that the edge's ``--model auto`` resolves to: the handshake
    compares the network that runs, so they agree."""
    settings = _tiny()
    named = dataclasses.replace(settings, model="nature")
    assert settings.model == "auto" and settings.shared() != named.shared()
    endpoint = f"tcp://127.0.0.1:{free_port_pair()}"
    common = dict(threads=1, checkpoint_every=1, start_timeout=120, timeout=120)
    edge = RunOptions(run_dir=str(tmp_path / "edge"), stage0_device="cpu", **common)
    server = RunOptions(run_dir=str(tmp_path / "server"), stage0_device="cuda:3", stage1_device="auto", **common)
    failure: list[BaseException] = []

    def serve() -> None:
        try:
            run_stage1(named, server, endpoint)
        except BaseException as exc:  # reported below
            failure.append(exc)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    records = run_stage0(settings, edge, endpoint)
    thread.join(timeout=60)
    assert not thread.is_alive() and not failure, failure
    assert len(records) == 2
    config0 = json.loads((tmp_path / "edge" / "config-stage0.json").read_text())
    config1 = json.loads((tmp_path / "server" / "config-stage1.json").read_text())
    assert config0["options"]["stage0_device"] == "cpu" and config0["devices"] == {"stage0": {"device": "cpu"}}
    assert config1["options"]["stage1_device"] == "auto"
    assert config1["devices"]["stage1"]["device"] == ("cuda:0" if torch.cuda.is_available() else "cpu")
    assert not any("device" in key for key in settings.shared())
    for run_dir, stage in ((tmp_path / "edge", "stage0"), (tmp_path / "server", "stage1")):
        state = load_checkpoint(run_dir, stage, checkpoint_iterations(run_dir, stage)[-1])
        weights = state["net" if stage == "stage0" else "heads"]
        assert all(t.device.type == "cpu" for t in weights.values())


def _layouts(net: torch.nn.Module) -> list[bool]:
    """Run by a forward: whether each 2-d convolution of ``net`` got its input in channels-last memory."""
    seen: list[bool] = []
    for layer in net.modules():
        if isinstance(layer, torch.nn.Conv2d):
            layer.register_forward_pre_hook(
                lambda _, args: seen.append(args[0].is_contiguous(memory_format=torch.channels_last)))
    return seen


def test_channels_last_changes_the_convolutions_inputs_and_not_their_maths_or_weights():
    import copy

    from splitrl.models import agent

    plain = agent(TrainSettings(), SPEC)[0]
    fast = devices.place(copy.deepcopy(plain), torch.device("cpu"), channels_last=True)
    acting = copy.deepcopy(fast)  # as an acting copy is made (`PolicyVersions`)
    seen_plain, seen_fast, seen_acting = _layouts(plain), _layouts(fast), _layouts(acting)
    x = torch.randint(0, 256, (8, 4, 96, 96), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    out_plain, out_fast = plain(x), fast(x)
    with torch.no_grad():
        acting(x[:1])
    assert seen_plain == [False] * 3 and seen_fast == [True] * 3 and seen_acting == [True] * 3
    assert out_fast.is_contiguous()  # what goes on to the heads or the wire is laid out as before
    torch.testing.assert_close(out_fast, out_plain, rtol=1e-5, atol=1e-5)
    assert not torch.equal(out_fast, out_plain)  # another kernel: float32 sums in another order
    grad = torch.randn(out_plain.shape, generator=torch.Generator().manual_seed(1))
    out_plain.backward(grad)
    out_fast.backward(grad)
    for (name, a), b in zip(plain.named_parameters(), fast.parameters()):
        assert b.is_contiguous() and b.grad.is_contiguous(), name  # weights, gradients, Adam's moments, checkpoints
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-3 * a.grad.abs().max().item())


def test_each_stage_applies_channels_last_to_its_own_convolutions():
    from splitrl.stages import Learner

    settings = TrainSettings(cut="input", env=EnvSettings(num_envs=1), ppo=PPOSettings(num_steps=4, minibatches=2))
    heads = Learner(settings, SPEC, channels_last=True).heads  # the cut before the first layer: stage1's convolutions
    seen = _layouts(heads)
    with torch.no_grad():
        heads.outputs(torch.zeros(1, 4, 96, 96, dtype=torch.uint8))
    assert seen == [True] * 3
    plain = Learner(settings, SPEC).heads
    assert not any(isinstance(m, torch.nn.Conv2d) and m._forward_pre_hooks for m in plain.modules())


def test_a_forward_of_few_rows_on_the_cpu_runs_on_one_thread_and_then_the_threads_come_back():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with devices.acting_threads(torch.device("cpu"), devices.ACTING_ROWS):
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
        with devices.acting_threads(torch.device("cpu"), devices.ACTING_ROWS + 1):  # a minibatch: every thread
            assert torch.get_num_threads() == 2
        with devices.acting_threads(CUDA, 1):  # the CPU's threads are not a GPU's business
            assert torch.get_num_threads() == 2
        with pytest.raises(ValueError), devices.one_thread():
            raise ValueError
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("top", [{}, {"bottleneck": 32}, {"model": "impala"}, {"cut": "input"}],
                         ids=["nature", "bottleneck", "impala", "input"])
def test_the_built_in_networks_act_on_one_thread_as_on_two(top):
    """What lets the acting forwards take one thread without changing a run's numbers."""
    from splitrl.models import agent

    encoder, heads = agent(TrainSettings(**top), SPEC)
    threads = torch.get_num_threads()
    try:
        for rows in (1, devices.ACTING_ROWS):
            x = torch.randint(0, 256, (rows, 4, 96, 96), dtype=torch.uint8,
                              generator=torch.Generator().manual_seed(rows))
            outs = []
            for n in (1, 2):
                torch.set_num_threads(n)
                with torch.no_grad():
                    outs.append(heads.outputs(encoder(x)))
            assert all(torch.equal(a, b) for a, b in zip(*outs)), rows
    finally:
        torch.set_num_threads(threads)


def test_the_encoder_acts_on_one_thread():
    from splitrl.stages import Edge

    edge = Edge(TrainSettings(env=EnvSettings(num_envs=2)), SPEC, vector="sync")  # (its envs open in `open_envs`)
    seen = []
    edge.acting.register_forward_pre_hook(lambda *_: seen.append(torch.get_num_threads()))
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        edge.encode(torch.zeros((2,) + SPEC.obs_shape, dtype=torch.uint8))
        edge.encode(torch.zeros((16,) + SPEC.obs_shape, dtype=torch.uint8))  # a minibatch's rows: every thread
        assert seen == [1, 2] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)


def test_each_stage_steps_its_optimizer_on_one_thread_and_then_the_threads_come_back():
    """`update_threads`: the clip and Adam's update stream memory, which a second thread does not speed up."""
    from splitrl.stages import Edge, Learner

    settings = TrainSettings(env=EnvSettings(num_envs=2))
    edge, learner = Edge(settings, SPEC, vector="sync"), Learner(settings, SPEC)
    seen = []
    for optimizer in (edge.optimizer, learner.update.optimizer):
        optimizer.register_step_pre_hook(lambda *_: seen.append(torch.get_num_threads()))
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for params in (edge.params, learner.update.params):
            for p in params:
                p.grad = torch.ones_like(p)
        edge.optimizer_step()
        learner.optimizer_step()
        assert seen == [1, 1] and torch.get_num_threads() == 2
        with devices.update_threads(CUDA):  # a GPU's step is not the CPU's threads' business
            assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)
