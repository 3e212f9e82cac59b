"""The model card of an exported policy (`splitrl.export`): its README.md, written from ``model.json``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["write_card"]


def _num(value: Any, fmt: str = ",.1f") -> str:
    return "-" if value is None else format(value, fmt)


def _inputs(model: dict[str, Any]) -> list[dict[str, Any]]:
    """The inputs of a file that takes the observation (model.json's, or the rows where it names none)."""
    obs = model["observation"]
    return obs.get("inputs") or [{"name": "observation", "dtype": obs["dtype"], "shape": obs["rows"]}]


def _observation(model: dict[str, Any]) -> str:
    obs = model["observation"]
    if obs["kind"] == "dict":
        image, vector = _inputs(model)
        return (f"a Dict observation as two inputs: `image`, uint8 of shape {image['shape']}, channels first (its "
                f"`{image['key']}`), and `vector`, float32 of shape {vector['shape']} (its "
                f"{', '.join(f'`{k}`' for k in vector['keys'])} joined)")
    if obs["kind"] != "image":
        return f"{obs['kind']} observations as {obs['dtype']} rows of shape {obs['rows']}"
    parts = [f"{obs['frame_stack']} stacked" if obs["frame_stack"] > 1 else "single",
             "grayscale" if obs["grayscale"] else "colour", "frames"]
    if obs["resize"]:
        parts.append(f"resized to {obs['resize']}x{obs['resize']}")
    if obs["frame_skip"] > 1:
        parts.append(f"every {obs['frame_skip']}th (max-pooled)")
    return " ".join(parts) + f": uint8 rows of shape {obs['rows']}, channels first"


def _snippet(name: str, files: dict[str, dict[str, str]], inputs: list[dict[str, Any]]) -> list[str]:
    """Python that plays the ONNX files: the whole policy's, or the edge's then the server's."""
    feed = "{" + ", ".join(f"'{i['name']}': {i['name']}" for i in inputs) + "}"
    given = "; ".join(f"{i['name']}: {i['dtype']} (B, {', '.join(map(str, i['shape']))})" for i in inputs)
    if "policy" in files:
        return [f"policy = onnxruntime.InferenceSession('{name}/policy.onnx')",
                f"action = policy.run(None, {feed})[0]  # {given}"]
    lines = [f"server = onnxruntime.InferenceSession('{name}/server.onnx')  # on the server"]
    if "edge" in files:
        lines += [f"edge = onnxruntime.InferenceSession('{name}/edge.onnx')  # on the device",
                  f"features = edge.run(None, {feed})[0]  # {given}; send these",
                  "action = server.run(None, {'features': features})[0]"]
    else:
        lines.append(f"action = server.run(None, {feed})[0]  # {given}, sent as they are")
    return lines


def write_card(out: Path, model: dict[str, Any]) -> None:
    """README.md beside ``model.json``: what the policy plays, how it was trained, how close the files are to the
    checkpoints, and how to run it."""
    run, net, action, files = model["run"], model["network"], model["action"], model["files"]
    where = out.name if out.is_absolute() else out.as_posix()  # as the user named it
    evaluation = model.get("evaluation")
    lines = [
        f"# {model['env_id']}: a split-trained PPO policy",
        "",
        f"Trained with splitrl, the network cut in two across a link: `{net['model']}`"
        + (f" ({net['model_kwargs']})" if net["model_kwargs"] else "")
        + f", cut at `{net['cut']}`" + (f", a bottleneck of {net['bottleneck']} values" if net["bottleneck"] else "")
        + f", heads {net['hidden']} wide. Exported from run `{run['dir']}` at iteration {run['iteration']} "
        f"(settings hash `{run['settings_hash'][:16]}`).",
        "",
        "## Results",
        "",
        "| | |",
        "|---|---:|",
        f"| env steps trained | {_num(run.get('steps'), ',d')} |",
        f"| final return (EMA over training episodes) | {_num(run.get('final_ema'))} |",
        f"| mean return, last 20 training episodes | {_num(run.get('last_episodes_mean'))} |",
        f"| bytes on the link per env step | {_num(run.get('bytes_per_step'), ',.0f')} |",
    ]
    if evaluation:
        lines.append(f"| held-out return, this export's greedy play ({evaluation['format']}, "
                     f"{evaluation['episodes']} episodes from seed {evaluation['seed']}) | "
                     f"{evaluation['return_mean']:.1f} ± {evaluation['return_std']:.1f} |")
    sampled = model.get("evaluation_sampled")
    if sampled:
        lines.append(f"| held-out return, the checkpoints' sampled policy (the same seeds) | "
                     f"{sampled['return_mean']:.1f} ± {sampled['return_std']:.1f} |")
    lines += [
        "",
        f"Codecs on the link during training: `{run.get('codecs', '-')}`.",
        "",
        "## Acting",
        "",
        f"Input: {_observation(model)}. Output: the env action"
        + (" (an index)." if action["discrete"] else
           f" in [{', '.join(map(str, action['low']))}] .. [{', '.join(map(str, action['high']))}] (map "
           f"`{action['map']}`), the policy's greedy action by the rule `{action['greedy']}` "
           "(splitrl.models.greedy)."),
        "",
        "| part | what it computes | files |",
        "|---|---|---|",
    ]
    what = {"edge": "observation rows to the features sent over the link (runs on the device)",
            "server": "features to the action (runs on the server)",
            "policy": "observation rows to the action (one machine)"}
    for part, named in files.items():
        lines.append(f"| {part} | {what[part]} | {', '.join(f'`{f}`' for f in named.values())} |")
    check = model["check"]
    gaps = [f"{fmt}: " + ", ".join(f"{how.replace('_', ' ')} {gap:.2g}" for how, gap in c.items())
            for fmt, c in check.items() if isinstance(c, dict)]
    lines += [
        "",
        f"Weights stored as {model['weights']}, computed in float32. Largest difference from the training "
        f"checkpoints' actions over {check['observations']} observations of held-out episodes: {'; '.join(gaps)}.",
        "",
        "```",
        f"splitrl eval --model {where} --format onnx        # held-out episodes",
        "```",
        "",
        "```python",
        "import onnxruntime",
        *_snippet(where, files, _inputs(model)),
        "```",
        "",
    ]
    (out / "README.md").write_text("\n".join(lines))
