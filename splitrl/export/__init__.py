"""A trained policy on its own: exported from a run's checkpoints, played without them.

`export_run` writes, into a directory of its own:

- the edge half (the layers before the cut: observation rows to features), the server half (features to the
  greedy env action, `splitrl.models.greedy`) and the whole policy (observation rows to the env action), each as
  TorchScript (``*.pt``, `torch.jit.load`) and ONNX (``*.onnx``, onnxruntime: the ``export`` extra);
- ``model.json``: what a player needs to feed the files (the env and its observation pipeline, the rows'
  layout, the action mapping, the cut, the codecs the link used) and where the policy came from (the run's
  settings and their hash, its iteration, return and bytes per env step), and how close the files' actions are
  to the checkpoints' (`check`);
- ``README.md``: a model card written from the run (`splitrl.export.card`).

No optimizer, buffer or training state goes along. With ``fp16`` the weights are stored as float16 and cast to
float32 where they are used, so the files are half the size and compute as float32 does. A file that takes the
observation takes stage0's rows (`splitrl.envs.EnvSpec.rows`), but for a Dict observation, whose rows are its
image's bytes and its vectors' float32 values packed together: that file takes two inputs, ``image`` (uint8,
channels first) and ``vector`` (float32, the vectors joined), so a player need not pack them (`_split_rows` is how
the rows part).
`load_policy` and `play_exported` read such a directory back (``splitrl eval --model DIR``).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import warnings
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from torch import nn

from ..envs import DICT, EnvSpec
from ..errors import SettingsError
from ..models.greedy import DEFAULT_GREEDY, GreedyPolicy
from ..models.layers import ImageStep
from ..settings import TrainSettings

__all__ = ["FORMATS", "PARTS", "export_run", "load_policy", "play_exported", "read_model", "record_rows",
           "score_export"]

FORMATS = ("torchscript", "onnx")
PARTS = ("edge", "server", "policy")
SUFFIX = {"torchscript": ".pt", "onnx": ".onnx"}
MODEL_FILE = "model.json"
MODEL_VERSION = 1
_OPSET = 17


class _Float(nn.Module):
    """A float16 tensor used as float32: what a parameter becomes in an fp16 export (`_half_weights`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.float()


def _half_weights(module: nn.Module) -> nn.Module:
    """A copy of ``module`` whose floating parameters are stored as float16 and cast to float32 when used."""
    from torch.nn.utils import parametrize

    module = copy.deepcopy(module)
    for sub in list(module.modules()):
        for name, p in list(sub.named_parameters(recurse=False)):
            if p.is_floating_point():
                half = p.detach().half()
                parametrize.register_parametrization(sub, name, _Float(), unsafe=True)
                sub.parametrizations[name].original = nn.Parameter(half, requires_grad=False)
    return module


def _onnx_half(path: Path) -> None:
    """Store an ONNX file's float32 weights as float16, each cast back to float32 by a node before use."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    model = onnx.load(str(path))
    graph, casts = model.graph, []
    for init in graph.initializer:
        if init.data_type != TensorProto.FLOAT:
            continue
        name = init.name
        init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init).astype(np.float16), name + "_fp16"))
        casts.append(helper.make_node("Cast", [name + "_fp16"], [name], to=TensorProto.FLOAT))
    for node in reversed(casts):
        graph.node.insert(0, node)
    onnx.checker.check_model(model)
    onnx.save(model, str(path))


@contextlib.contextmanager
def _torchscript() -> Any:
    """torch marks TorchScript deprecated in favour of `torch.export`; TorchScript is still what LibTorch (C++,
    no Python) loads, which is why an export writes it, so its deprecation notes are not repeated to the user."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        yield


class _DictInputs(nn.Module):
    """``module``, whose first layer unpacks a Dict observation's rows (`ImageStep`), given the two parts instead:
    ``forward(image, vector)``."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = copy.deepcopy(module)
        first = next(m for m in self.module.modules() if isinstance(m, ImageStep) and m.first)
        first.first = False  # takes (image, vector) as unpack_rows would have returned them

    def forward(self, image: torch.Tensor, vector: torch.Tensor) -> torch.Tensor:
        return self.module((image, vector))


def _split_rows(spec: EnvSpec) -> Callable[[np.ndarray], tuple[np.ndarray, ...]]:
    """Observation rows as the exported files take them: the rows, or a Dict's (image, vector) (numpy's
    `splitrl.models.layers.unpack_rows`)."""
    if spec.observation != DICT:
        return lambda rows: (rows,)
    n = int(np.prod(spec.obs_shape))
    return lambda rows: (rows[:, :n].reshape(-1, *spec.obs_shape), np.ascontiguousarray(rows[:, n:]).view(np.float32))


def _inputs(spec: EnvSpec) -> list[dict[str, Any]]:
    """The inputs of a file that takes the observation: name, dtype and shape of a row (model.json, the card)."""
    if spec.observation != DICT:
        return [{"name": "observation", "dtype": spec.row_dtype, "shape": list(spec.row_shape)}]
    return [{"name": "image", "dtype": "uint8", "shape": list(spec.obs_shape), "key": spec.keys[0]},
            {"name": "vector", "dtype": "float32", "shape": [spec.vector_dim], "keys": list(spec.keys[1:])}]


def _write(module: nn.Module, example: tuple[torch.Tensor, ...], out: Path, name: str, inputs: list[str],
           outputs: str, formats: tuple[str, ...], fp16: bool) -> dict[str, str]:
    """``module`` as TorchScript and/or ONNX files ``name.pt`` / ``name.onnx`` in ``out``; {format: file}."""
    module = module.eval()
    files = {}
    with torch.no_grad():
        if "torchscript" in formats:
            with _torchscript():
                traced = torch.jit.trace(_half_weights(module) if fp16 else module, example, check_trace=False)
                torch.jit.save(traced, str(out / f"{name}.pt"))
            files["torchscript"] = f"{name}.pt"
        if "onnx" in formats:
            path = out / f"{name}.onnx"
            _onnx_export(module, example, path, inputs, outputs)
            if fp16:
                _onnx_half(path)
            files["onnx"] = path.name
    return files


def _onnx_export(module: nn.Module, example: tuple[torch.Tensor, ...], path: Path, inputs: list[str],
                 outputs: str) -> None:
    """torch's TorchScript-based ONNX exporter, the batch dimension left free."""
    try:
        import onnx  # noqa: F401  (the exporter writes through it)
    except ImportError:
        raise SettingsError("ONNX export needs the onnx package: pip install 'splitrl[export]' (or --format "
                            "torchscript)") from None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the exporter's notes on its own future, not on this model
        torch.onnx.export(module, example, str(path), input_names=inputs, output_names=[outputs],
                          dynamic_axes={name: {0: "batch"} for name in (*inputs, outputs)}, opset_version=_OPSET,
                          dynamo=False)


def record_rows(settings: TrainSettings, spec: EnvSpec, act: Callable[[np.ndarray], np.ndarray], steps: int,
                seed: int) -> np.ndarray:
    """``steps`` observation rows (`EnvSpec.rows`) met while ``act`` (rows (1, ...) to env actions (1, ...))
    plays episodes from ``seed`` on; a new episode (seed + 1, ...) begins where one ends."""
    from ..stages.evaluate import play

    rows: list[np.ndarray] = []

    def recording(row: np.ndarray) -> np.ndarray:
        rows.append(row[0])
        return act(row)

    play(settings, spec, recording, episodes=steps, seed=seed, total_steps=steps)  # an episode is a step or more
    return np.stack(rows)


def _run_summary(run_dir: Path) -> dict[str, Any]:
    """The training's figures for the card: final EMA, mean of the last 20 episodes, bytes per env step."""
    from ..summary import summarise_run

    try:
        s = summarise_run(run_dir)
    except (ValueError, OSError):
        return {}
    return {k: s[k] for k in ("iterations", "steps", "final_ema", "last_episodes_mean", "bytes_per_step", "codecs")}


def export_run(run_dir: str | Path, out_dir: str | Path, *, iteration: int | None = None,
               stage1_dir: str | Path | None = None, greedy: str = DEFAULT_GREEDY, fp16: bool = False,
               formats: tuple[str, ...] = FORMATS, parts: tuple[str, ...] = PARTS,
               check_steps: int = 1000) -> dict[str, Any]:
    """Export the policy of ``run_dir``'s checkpoints (the newest pair unless ``iteration``) into ``out_dir``
    (created; an existing model there is replaced, any other content is an error); ``model.json``'s content.
    ``parts``: which of edge, server and policy to write (the policy is the edge, then the server: without it a
    player chains the two halves).

    ``check_steps`` observations, met by the checkpoints' greedy policy on held-out seeds, are run through every
    file written, and the largest difference of each from the checkpoints' actions goes into ``check``."""
    from .card import write_card
    from ..stages.evaluate import eval_seed, load_agent
    from ..transport.handshake import settings_hash

    unknown = sorted(set(formats) - set(FORMATS))
    if unknown or not formats:
        raise SettingsError(f"--format: {', '.join(unknown) or 'none given'}; choose from {', '.join(FORMATS)}")
    unknown = sorted(set(parts) - set(PARTS))
    if unknown or not ("policy" in parts or "server" in parts):
        raise SettingsError(f"--parts: {', '.join(unknown) or 'neither policy nor server'}; choose from "
                            f"{', '.join(PARTS)}, with the policy or the server among them")
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (out / MODEL_FILE).exists())):
        raise SettingsError(f"--out {out}: exists and is not an exported model; give a new or empty directory")
    settings, spec, encoder, heads, it = load_agent(run_dir, iteration, stage1_dir)
    encoder, heads = encoder.eval(), heads.eval()
    server = GreedyPolicy.of(heads, spec.action_low, spec.action_high, settings.env.action_map, greedy).eval()
    policy = nn.Sequential(encoder, server).eval()

    def reference(rows: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            return policy(torch.as_tensor(rows)).numpy()

    check = record_rows(settings, spec, reference, max(check_steps, 2), eval_seed(settings))
    split = _split_rows(spec)
    observed = tuple(torch.as_tensor(part) for part in split(check[:2]))  # what a file that takes the observation
    names = [i["name"] for i in _inputs(spec)]

    def taking_observation(module: nn.Module) -> nn.Module:
        return _DictInputs(module).eval() if spec.observation == DICT else module

    with torch.no_grad():
        features = encoder(torch.as_tensor(check[:2]))
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    _remove_export(out)  # an earlier export's files (nothing else is there: checked above)
    files: dict[str, dict[str, str]] = {}
    try:
        if len(encoder) and "edge" in parts:  # a run cut at the input has no edge half: its edge sends the observation
            files["edge"] = _write(taking_observation(encoder), observed, out, "edge", names, "features", formats,
                                   fp16)
        if "server" in parts:
            files["server"] = (_write(server, (features,), out, "server", ["features"], "action", formats, fp16)
                               if len(encoder) else
                               _write(taking_observation(server), observed, out, "server", names, "action", formats,
                                      fp16))
        if "policy" in parts:
            files["policy"] = _write(taking_observation(policy), observed, out, "policy", names, "action", formats,
                                     fp16)
        model = {
            "format": MODEL_VERSION,
            "env_id": settings.env.env_id,
            "observation": {"kind": spec.observation, "rows": list(spec.row_shape), "dtype": spec.row_dtype,
                            "inputs": _inputs(spec), "frame_stack": settings.env.image_pipeline[1],
                            "grayscale": settings.env.image_pipeline[0], "resize": settings.env.resize,
                            "frame_skip": settings.env.frame_skip},
            "action": {"discrete": spec.discrete, "low": list(spec.action_low), "high": list(spec.action_high),
                       "map": settings.env.action_map, "greedy": "argmax" if spec.discrete else greedy},
            "network": {"model": settings.for_observation(spec.observation).model,
                        "model_kwargs": settings.model_kwargs, "hidden": settings.hidden,
                        "bottleneck": settings.bottleneck, "cut": settings.cut,
                        "features": int(features.shape[1]) if len(encoder) else None},
            "codecs": dataclasses.asdict(settings.codecs),
            "weights": "float16" if fp16 else "float32",
            "files": files,
            "run": {"dir": Path(run_dir).name, "iteration": it, "settings_hash": settings_hash(settings.shared()),
                    **_run_summary(Path(run_dir))},
            "settings": settings.to_dict(),
            "env_spec": dataclasses.asdict(spec),
            "check": _check(out, files, check, reference(check), split, not len(encoder)),
        }
        (out / MODEL_FILE).write_text(json.dumps(model, indent=2))
        write_card(out, model)
    except BaseException:
        _remove_export(out)  # no half-written model: the directory is as empty as it was, or gone
        if created:
            out.rmdir()
        raise
    return model


def _remove_export(out: Path) -> None:
    """Delete the files an export writes in ``out`` (and nothing else)."""
    for name in (MODEL_FILE, "README.md", *(part + suffix for part in PARTS for suffix in SUFFIX.values())):
        (out / name).unlink(missing_ok=True)


Split = Callable[[np.ndarray], tuple[np.ndarray, ...]]
"""Observation rows as the inputs of a file that takes the observation (`_split_rows`)."""


def _check(out: Path, files: dict[str, dict[str, str]], rows: np.ndarray, actions: np.ndarray, split: Split,
           cut_at_input: bool) -> dict[str, Any]:
    """Each format's largest |action - checkpoints' action| over ``rows``: of the policy file, and of the edge
    file then the server file (the server alone where the run was cut at the input)."""
    result: dict[str, Any] = {"observations": len(rows)}
    for fmt in FORMATS:
        gaps = {}
        if fmt in files.get("policy", {}):
            gaps["policy"] = _gap(_session(out / files["policy"][fmt], fmt, split)(rows), actions)
        chained = _chained(out, files, fmt, split, cut_at_input)
        if chained is not None:
            gaps["edge_then_server"] = _gap(chained(rows), actions)
        if gaps:
            result[fmt] = gaps
    return result


def _chained(here: Path, files: dict[str, dict[str, str]], fmt: str, split: Split,
             cut_at_input: bool) -> Callable[[np.ndarray], np.ndarray] | None:
    """The edge's file then the server's, as a function of observation rows; the server's alone for a run cut at
    the input (it takes the observation); None where the files of ``fmt`` do not make the policy."""
    if fmt not in files.get("server", {}):
        return None
    if cut_at_input:
        return _session(here / files["server"][fmt], fmt, split)
    if fmt not in files.get("edge", {}):
        return None
    edge, server = _session(here / files["edge"][fmt], fmt, split), _session(here / files["server"][fmt], fmt)
    return lambda rows: server(edge(rows))


def _gap(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.max(np.abs(got.astype(np.float64) - want.astype(np.float64)))) if len(want) else 0.0


def _session(path: Path, fmt: str, split: Split | None = None) -> Callable[[np.ndarray], np.ndarray]:
    """One exported file as a function of a numpy batch (observation rows, parted by ``split``, for a file that
    takes the observation)."""
    split = split or (lambda x: (x,))
    if fmt == "onnx":
        try:
            import onnxruntime
        except ImportError:
            raise SettingsError("playing ONNX files needs onnxruntime: pip install 'splitrl[export]' (or "
                                "--format torchscript)") from None
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = 1
        session = onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        names = [i.name for i in session.get_inputs()]
        return lambda x: session.run(None, dict(zip(names, split(x))))[0]
    with _torchscript():
        module = torch.jit.load(str(path), map_location="cpu").eval()

    def run(x: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            return module(*(torch.as_tensor(part) for part in split(x))).numpy()

    return run


def read_model(model_dir: str | Path) -> dict[str, Any]:
    """An exported model's ``model.json``; SettingsError if ``model_dir`` is not one."""
    path = Path(model_dir) / MODEL_FILE
    try:
        model = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise SettingsError(f"{model_dir}: not an exported model ({MODEL_FILE}: {exc})") from None
    if model.get("format") != MODEL_VERSION:
        raise SettingsError(f"{model_dir}: exported model format {model.get('format')!r}, this splitrl reads "
                            f"{MODEL_VERSION}")
    return model


def load_policy(model_dir: str | Path, fmt: str = "onnx") -> Callable[[np.ndarray], np.ndarray]:
    """The exported policy as a function: observation rows (B, ...) to env actions (B, ...): the policy file, or
    the edge's file then the server's where the whole policy was not exported."""
    model = read_model(model_dir)
    files, here = model["files"], Path(model_dir)
    split = _split_rows(EnvSpec.from_config(model["env_spec"]))
    if fmt in files.get("policy", {}):
        return _session(here / files["policy"][fmt], fmt, split)
    chained = _chained(here, files, fmt, split, model["network"]["features"] is None)
    if chained is not None:
        return chained
    there = sorted({f for named in files.values() for f in named})
    raise SettingsError(f"{model_dir}: no {fmt} policy was exported; there are {', '.join(there) or 'no'} files")


def play_exported(model_dir: str | Path, *, episodes: int, seed: int | None = None, fmt: str = "onnx",
                  video_dir: str | Path | None = None) -> tuple[Any, int]:
    """Whole episodes of an exported policy (`splitrl.stages.evaluate.play`); (the result, the first seed)."""
    from ..stages.evaluate import eval_seed, play

    model = read_model(model_dir)
    settings = TrainSettings.from_dict(model["settings"])
    spec = EnvSpec.from_config(model["env_spec"])
    act = load_policy(model_dir, fmt)
    first = eval_seed(settings) if seed is None else seed
    return play(settings, spec, act, episodes=episodes, seed=first, video_dir=video_dir), first


def score_export(model_dir: str | Path, run_dir: str | Path, episodes: int, *, iteration: int | None = None,
                 stage1_dir: str | Path | None = None) -> dict[str, Any]:
    """Play ``episodes`` held-out episodes with the exported files (ONNX if written) and, on the same seeds, the
    checkpoints' sampled policy; both scores go into ``model.json`` and the card. The updated model."""
    from ..stages.evaluate import evaluate, load_agent
    from .card import write_card

    model = read_model(model_dir)
    fmt = "onnx" if any("onnx" in named for named in model["files"].values()) else "torchscript"
    result, first = play_exported(model_dir, episodes=episodes, fmt=fmt)
    model["evaluation"] = result.record(format=fmt, seed=first)
    settings, spec, encoder, heads, _ = load_agent(run_dir, iteration, stage1_dir)
    sampled = evaluate(settings, encoder, heads, spec, episodes=episodes, seed=first, deterministic=False)
    model["evaluation_sampled"] = sampled.record(seed=first)
    (Path(model_dir) / MODEL_FILE).write_text(json.dumps(model, indent=2))
    write_card(Path(model_dir), model)
    return model
