"""``splitrl eval`` and ``splitrl export``: score a trained agent on held-out episodes, watch it, ship it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click
from click.core import ParameterSource

from ..settings.specs import DEFAULT_GREEDY, GREEDY_RULES
from .errors import run_cli

__all__ = ["eval_cmd", "export_cmd"]

_FORMATS = ("onnx", "torchscript")


def _given(name: str) -> bool:
    """Whether the option ``name`` was given (not left at its default)."""
    return click.get_current_context().get_parameter_source(name) not in (ParameterSource.DEFAULT, None)


def _line(record: dict[str, Any]) -> str:
    how = f"deterministic ({record['greedy']})" if record["deterministic"] else "sampled"
    where = f"iteration {record['iteration']}" if "iteration" in record else f"model {record['model']}"
    return (f"{where}: return {record['return_mean']:.1f} ± {record['return_std']:.1f} over {record['episodes']} "
            f"episodes (seeds {record['seed']}..{record['seed'] + record['episodes'] - 1}, {how})")


@click.command("eval")
@click.argument("run_dir", required=False, type=click.Path(exists=True, file_okay=False))
@click.option("--model", "model_dir", type=click.Path(exists=True, file_okay=False),
              help="play an exported policy (`splitrl export`) instead of a run's checkpoints")
@click.option("--format", "fmt", type=click.Choice(_FORMATS), default="onnx", show_default=True,
              help="with --model: which of its files plays (onnx needs onnxruntime: the export extra)")
@click.option("--iteration", type=int, help="the checkpoint pair to load  [default: the newest both stages have]")
@click.option("--episodes", default=10, show_default=True, type=click.IntRange(min=1), help="episodes to run")
@click.option("--seed", type=int,
              help="episode k starts from seed + k  [default: the run's seed + 1,000,000, never used in training]")
@click.option("--both", "play", flag_value="both", default=True,
              help="play the greedy policy and the sampled one on the same seeds, side by side  [default]")
@click.option("--deterministic", "play", flag_value="deterministic", help="only the greedy policy (--greedy)")
@click.option("--sample", "play", flag_value="sampled", help="only the sampled policy (seeded by --seed)")
@click.option("--greedy", type=click.Choice(GREEDY_RULES), default=DEFAULT_GREEDY, show_default=True,
              help="the deterministic action of a Box policy: the expected env action over the policy's draws, "
                   "the squashed distribution's mode, or tanh of the mean (splitrl bench greedy compares them)")
@click.option("--video", "video_dir", type=click.Path(file_okay=False),
              help="record every episode as an mp4 here (what a person would see: render_mode='rgb_array')")
@click.option("--record", is_flag=True, help="append the results to RUN_DIR/eval.jsonl (without it nothing is "
                                             "written into the run)")
@click.option("--stage1-dir", type=click.Path(exists=True, file_okay=False),
              help="stage1's run directory, when the stages ran on two machines  [default: RUN_DIR]")
@click.option("--threads", default=0, show_default=True, help="torch intra-op threads (0: torch's default)")
def eval_cmd(run_dir: str | None, model_dir: str | None, fmt: str, iteration: int | None, episodes: int,
             seed: int | None, play: str, greedy: str, video_dir: str | None, record: bool, stage1_dir: str | None,
             threads: int) -> None:
    """Score a trained agent on held-out seeds in this process and print the mean and standard deviation of
    the returns: both stages' checkpoints from RUN_DIR, or an exported policy (--model DIR, which plays its
    greedy action only)."""
    if (run_dir is None) == (model_dir is None):
        raise click.UsageError("give RUN_DIR or --model DIR (one of them)")
    if model_dir and (record or stage1_dir or iteration is not None):
        raise click.UsageError("--record, --stage1-dir and --iteration are for RUN_DIR, not --model")
    if model_dir and (play == "sampled" or _given("greedy")):
        raise click.UsageError("--sample and --greedy are for RUN_DIR: an exported model plays the greedy action "
                               "it was exported with (splitrl export --greedy)")

    def go() -> list[dict]:
        import torch

        from ..stages.evaluate import append_eval, eval_seed, evaluate, load_agent

        if threads:
            torch.set_num_threads(threads)
        if model_dir:
            from ..export import play_exported, read_model

            result, first = play_exported(model_dir, episodes=episodes, seed=seed, fmt=fmt, video_dir=video_dir)
            rule = read_model(model_dir)["action"]["greedy"]
            return [result.record(model=model_dir, format=fmt, seed=first, deterministic=True, greedy=rule)]
        settings, spec, encoder, heads, it = load_agent(run_dir, iteration, stage1_dir)
        first = eval_seed(settings) if seed is None else seed
        records = []
        for deterministic in {"both": (True, False), "deterministic": (True,), "sampled": (False,)}[play]:
            video = None if not video_dir else Path(video_dir) / ("greedy" if deterministic else "sampled")
            result = evaluate(settings, encoder, heads, spec, episodes=episodes, seed=first,
                              deterministic=deterministic, video_dir=video, greedy=greedy)
            records.append(result.record(iteration=it, global_step=it * settings.steps_per_iteration, seed=first,
                                         deterministic=deterministic, greedy=greedy if deterministic else None))
        if record:
            for r in records:
                append_eval(run_dir, r)
        return records

    for r in run_cli(go):
        click.echo(_line(r))
    if video_dir:
        click.echo(f"videos: {video_dir}")


@click.command("export")
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False),
              help="the directory to write the model into (new or empty, or an earlier export to replace)")
@click.option("--iteration", type=int, help="the checkpoint pair to export  [default: the newest both stages have]")
@click.option("--stage1-dir", type=click.Path(exists=True, file_okay=False),
              help="stage1's run directory, when the stages ran on two machines  [default: RUN_DIR]")
@click.option("--greedy", type=click.Choice(GREEDY_RULES), default=DEFAULT_GREEDY, show_default=True,
              help="the deterministic action the exported policy takes (see splitrl eval --greedy)")
@click.option("--format", "formats", default=",".join(_FORMATS), show_default=True,
              help="comma-separated: onnx, torchscript")
@click.option("--parts", default="edge,server,policy", show_default=True,
              help="comma-separated: edge, server, policy (the policy is the edge then the server in one file; "
                   "without it a player chains the two)")
@click.option("--fp16", is_flag=True, help="store the weights as float16 (half the size; computed in float32)")
@click.option("--check", "check_steps", default=1000, show_default=True, type=click.IntRange(min=2),
              help="observations of held-out episodes on which every file's actions are compared with the "
                   "checkpoints'")
@click.option("--episodes", default=0, show_default=True, type=click.IntRange(min=0),
              help="then play this many held-out episodes with the exported policy and put the score in the card")
def export_cmd(run_dir: str, out_dir: str, iteration: int | None, stage1_dir: str | None, greedy: str, formats: str,
               parts: str, fp16: bool, check_steps: int, episodes: int) -> None:
    """Export the trained policy of RUN_DIR alone (no optimizer or training state): the edge half, the server
    half and the whole policy as TorchScript and ONNX files, model.json and a model card (README.md)."""

    def go() -> dict:
        from ..export import export_run, score_export

        chosen = tuple(f.strip() for f in formats.split(",") if f.strip())
        model = export_run(run_dir, out_dir, iteration=iteration, stage1_dir=stage1_dir, greedy=greedy, fp16=fp16,
                           formats=chosen, parts=tuple(p.strip() for p in parts.split(",") if p.strip()),
                           check_steps=check_steps)
        if episodes:
            model = score_export(out_dir, run_dir, episodes, iteration=iteration, stage1_dir=stage1_dir)
        return model

    model = run_cli(go)
    files = sorted(p.name for p in Path(out_dir).iterdir())
    size = sum(p.stat().st_size for p in Path(out_dir).iterdir())
    click.echo(f"{out_dir}: {', '.join(files)} ({size / 1e6:.1f} MB; greedy action: {model['action']['greedy']})")
    for fmt, gaps in model["check"].items():
        if isinstance(gaps, dict):
            click.echo(f"  {fmt}: largest action difference from the checkpoints over "
                       f"{model['check']['observations']} observations: "
                       + ", ".join(f"{how.replace('_', ' ')} {gap:.3g}" for how, gap in gaps.items()))
    if "evaluation" in model:
        e, d = model["evaluation"], model["evaluation_sampled"]
        click.echo(f"  held-out: {e['return_mean']:.1f} ± {e['return_std']:.1f} over {e['episodes']} episodes (the "
                   f"checkpoints' sampled policy on the same seeds: {d['return_mean']:.1f} ± {d['return_std']:.1f})")
