"""`splitrl export` and `splitrl eval --model`: a trained policy alone, as TorchScript and ONNX files that act as
its checkpoints act."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from splitrl.export import record_rows
from splitrl.models.greedy import GreedyPolicy
from splitrl.stages.evaluate import load_agent
from splitrl.transport.handshake import settings_hash

from .conftest import TINY, splitrl_here

FILES = {"edge.pt", "edge.onnx", "server.pt", "server.onnx", "policy.pt", "policy.onnx", "model.json", "README.md"}


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("export") / "run"
    splitrl_here("train", "--run-dir", str(run), *TINY, "--bottleneck", "32")
    return run


@pytest.fixture(scope="module")
def exported(trained, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("model") / "car"
    splitrl_here("export", str(trained), "--out", str(out), "--check", "16")
    return out


def _reference(run: Path):
    """The checkpoints' greedy policy, built here from the checkpoints (not through the export's code)."""
    settings, spec, encoder, heads, _ = load_agent(run)
    policy = GreedyPolicy.of(heads, spec.action_low, spec.action_high, settings.env.action_map).eval()

    def act(rows: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            return policy(encoder(torch.as_tensor(rows))).numpy()

    return settings, spec, encoder, act


def _run(path: Path, rows: np.ndarray) -> np.ndarray:
    if path.suffix == ".onnx":
        import onnxruntime

        session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        return session.run(None, {session.get_inputs()[0].name: rows})[0]
    with torch.no_grad():
        return torch.jit.load(str(path)).eval()(torch.as_tensor(rows)).numpy()


def test_every_file_acts_as_the_checkpoints_on_recorded_observations(trained, exported):
    settings, spec, encoder, act = _reference(trained)
    rows = record_rows(settings, spec, act, 120, seed=12345)  # other seeds than the export's own check
    want = act(rows)
    assert sorted(p.name for p in exported.iterdir()) == sorted(FILES)  # the policy alone: no checkpoint
    for fmt in (".pt", ".onnx"):
        assert np.abs(_run(exported / f"policy{fmt}", rows) - want).max() < 1e-5
        features = _run(exported / f"edge{fmt}", rows)
        assert features.shape == (120, 32)
        assert np.abs(_run(exported / f"server{fmt}", features) - want).max() < 1e-5
    model = json.loads((exported / "model.json").read_text())
    assert model["env_id"] == "CarRacing-v3" and model["network"]["cut"] == "cnn"
    assert model["run"]["settings_hash"] == settings_hash(settings.shared()) and model["run"]["iteration"] == 2
    assert model["action"] == {"discrete": False, "low": [-1.0, 0.0, 0.0], "high": [1.0, 1.0, 1.0], "map": "clip",
                               "greedy": "expected"}
    assert model["check"]["observations"] == 16 and model["check"]["onnx"]["policy"] < 1e-5
    card = (exported / "README.md").read_text()
    assert f"{model['run']['bytes_per_step']:,.0f}" in card and "expected" in card


def test_eval_of_the_exported_model_plays_as_eval_of_the_run(trained, exported):
    run = splitrl_here("eval", str(trained), "--episodes", "2", "--deterministic", "--threads", "1")
    ours = run.stdout.split("return ")[1].split(" over")[0]
    for fmt in ("onnx", "torchscript"):
        played = splitrl_here("eval", "--model", str(exported), "--format", fmt, "--episodes", "2")
        assert played.stdout.split("return ")[1].split(" over")[0] == ours, fmt
    assert not (trained / "eval.jsonl").exists()  # eval writes into a run only with --record


def test_fp16_weights_halve_the_files_and_keep_the_actions(trained, exported, tmp_path):
    out = tmp_path / "half"
    splitrl_here("export", str(trained), "--out", str(out), "--fp16", "--check", "16")
    settings, spec, _, act = _reference(trained)
    rows = record_rows(settings, spec, act, 60, seed=777)
    for name in ("policy.pt", "policy.onnx"):
        assert (out / name).stat().st_size < 0.6 * (exported / name).stat().st_size
        assert np.abs(_run(out / name, rows) - act(rows)).max() < 2e-3
    assert json.loads((out / "model.json").read_text())["weights"] == "float16"


def test_the_two_halves_alone_play_chained_as_the_whole_policy_does(trained, exported, tmp_path):
    out = tmp_path / "halves"
    shown = splitrl_here("export", str(trained), "--out", str(out), "--parts", "edge,server", "--check", "16",
                         "--episodes", "1")
    assert "edge then server" in shown.stdout and "the checkpoints' sampled policy on the same seeds" in shown.stdout
    assert sorted(p.name for p in out.iterdir()) == sorted(FILES - {"policy.pt", "policy.onnx"})
    card = (out / "README.md").read_text()
    assert "edge.run(" in card and "policy.onnx" not in card and "sampled policy (the same seeds)" in card
    for fmt in ("onnx", "torchscript"):
        halves = splitrl_here("eval", "--model", str(out), "--format", fmt, "--episodes", "1").stdout
        whole = splitrl_here("eval", "--model", str(exported), "--format", fmt, "--episodes", "1").stdout
        assert halves.split("return ")[1] == whole.split("return ")[1]
    refused = splitrl_here("export", str(trained), "--out", str(tmp_path / "x"), "--parts", "edge", code=None)
    assert refused.exit_code == 2 and "neither policy nor server" in refused.stderr


def test_a_discrete_policy_cut_at_its_input_has_no_edge_half_and_the_same_actions(tmp_path):
    run, out = tmp_path / "run", tmp_path / "model"
    splitrl_here("train", "--run-dir", str(run), "--env-id", "CartPole-v1", "--model", "mlp", "--cut", "input",
                 "--total-steps", "64", "--num-steps", "32", "--epochs", "1", "--minibatches", "2", "--threads", "1",
                 "--checkpoint-every", "1")
    splitrl_here("export", str(run), "--out", str(out), "--check", "50", "--format", "onnx")
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "model.json", "policy.onnx", "server.onnx"]
    settings, spec, _, act = _reference(run)
    rows = record_rows(settings, spec, act, 80, seed=5)
    got = _run(out / "policy.onnx", rows)
    assert got.dtype == np.int64 and np.array_equal(got, act(rows))


def test_what_export_and_eval_refuse(trained, exported, tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    busy = splitrl_here("export", str(trained), "--out", str(tmp_path), code=None)
    assert busy.exit_code == 2 and "is not an exported model" in busy.stderr
    assert (tmp_path / "notes.txt").read_text() == "mine"
    wrong = splitrl_here("eval", "--model", str(trained), code=None)
    assert wrong.exit_code == 2 and "not an exported model" in wrong.stderr
    both = splitrl_here("eval", str(trained), "--model", str(exported), code=None)
    assert both.exit_code == 2 and "one of them" in both.stderr
    for option in (["--sample"], ["--greedy", "mode"]):  # the exported file plays its one greedy action
        ignored = splitrl_here("eval", "--model", str(exported), *option, code=None)
        assert ignored.exit_code == 2 and "an exported model plays the greedy action" in ignored.stderr
    fmt = splitrl_here("export", str(trained), "--out", str(tmp_path / "x"), "--format", "tflite", code=None)
    assert fmt.exit_code == 2 and "tflite" in fmt.stderr


def test_a_dict_policy_takes_its_image_and_its_vector_as_two_inputs(tmp_path):
    run, out = tmp_path / "run", tmp_path / "model"
    splitrl_here("train", "--run-dir", str(run), "--env-id", "splitrl/PickByCue-v0", "--model", "impala",
                 "--model-kwargs", "width=8,blocks=0,features=16", "--hidden", "16", "--num-envs", "2", "--num-steps",
                 "16", "--epochs", "1", "--minibatches", "2", "--total-steps", "32", "--threads", "1", "--vector",
                 "sync", "--checkpoint-every", "1")
    splitrl_here("export", str(run), "--out", str(out), "--check", "16")
    settings, spec, _, act = _reference(run)
    rows = record_rows(settings, spec, act, 40, seed=99)
    n = int(np.prod(spec.obs_shape))
    image, vector = rows[:, :n].reshape(-1, *spec.obs_shape), np.ascontiguousarray(rows[:, n:]).view(np.float32)
    import onnxruntime

    for name in ("policy.onnx", "edge.onnx"):
        session = onnxruntime.InferenceSession(str(out / name), providers=["CPUExecutionProvider"])
        assert [i.name for i in session.get_inputs()] == ["image", "vector"]
    session = onnxruntime.InferenceSession(str(out / "policy.onnx"), providers=["CPUExecutionProvider"])
    assert np.array_equal(session.run(None, {"image": image, "vector": vector})[0], act(rows))
    with torch.no_grad():
        traced = torch.jit.load(str(out / "policy.pt"))(torch.as_tensor(image), torch.as_tensor(vector)).numpy()
    assert np.array_equal(traced, act(rows))
    model = json.loads((out / "model.json").read_text())
    assert [i["name"] for i in model["observation"]["inputs"]] == ["image", "vector"]
    assert model["check"]["onnx"] == {"policy": 0.0, "edge_then_server": 0.0}
    assert "{'image': image, 'vector': vector}" in (out / "README.md").read_text()


def test_a_failed_export_leaves_no_half_written_model_and_keeps_what_is_not_its_own(trained, tmp_path, monkeypatch):
    import splitrl.export as export

    write = export._write

    def fails_at_the_policy(module, example, out, name, *args):
        if name == "policy":
            raise RuntimeError("no room")
        return write(module, example, out, name, *args)

    out = tmp_path / "new"
    monkeypatch.setattr(export, "_write", fails_at_the_policy)
    with pytest.raises(RuntimeError, match="no room"):
        export.export_run(trained, out, check_steps=2, formats=("torchscript",))
    assert not out.exists()
    monkeypatch.setattr(export, "_write", write)
    export.export_run(trained, out, check_steps=2, formats=("torchscript",))
    (out / "notes.txt").write_text("mine")
    export.export_run(trained, out, check_steps=2, formats=("torchscript",), parts=("policy",))
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "model.json", "notes.txt", "policy.pt"]
