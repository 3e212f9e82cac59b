"""``splitrl eval``: score a trained agent on held-out episodes, and watch it."""

from __future__ import annotations

import click

from .errors import run_cli

__all__ = ["eval_cmd"]


@click.command("eval")
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--iteration", type=int, help="the checkpoint pair to load  [default: the newest both stages have]")
@click.option("--episodes", default=10, show_default=True, type=click.IntRange(min=1), help="episodes to run")
@click.option("--seed", type=int,
              help="episode k starts from seed + k  [default: the run's seed + 1,000,000, never used in training]")
@click.option("--deterministic/--sample", default=True, show_default=True,
              help="act with the policy's most likely action (tanh of the mean; for discrete actions the largest "
                   "logit), or sample the policy (seeded by --seed)")
@click.option("--video", "video_dir", type=click.Path(file_okay=False),
              help="record every episode as an mp4 here (what a person would see: render_mode='rgb_array')")
@click.option("--stage1-dir", type=click.Path(exists=True, file_okay=False),
              help="stage1's run directory, when the stages ran on two machines  [default: RUN_DIR]")
@click.option("--threads", default=0, show_default=True, help="torch intra-op threads (0: torch's default)")
def eval_cmd(run_dir: str, iteration: int | None, episodes: int, seed: int | None, deterministic: bool,
             video_dir: str | None, stage1_dir: str | None, threads: int) -> None:
    """Load both stages' checkpoints from RUN_DIR, run whole episodes on held-out seeds in this process,
    print the mean and standard deviation of the returns and append them to RUN_DIR/eval.jsonl."""

    def go() -> dict:
        import torch

        from ..stages.evaluate import append_eval, eval_seed, evaluate, load_agent

        if threads:
            torch.set_num_threads(threads)
        settings, spec, encoder, heads, it = load_agent(run_dir, iteration, stage1_dir)
        first = eval_seed(settings) if seed is None else seed
        result = evaluate(settings, encoder, heads, spec, episodes=episodes, seed=first,
                          deterministic=deterministic, video_dir=video_dir)
        record = result.record(iteration=it, global_step=it * settings.steps_per_iteration, seed=first,
                               deterministic=deterministic)
        append_eval(run_dir, record)
        return record

    record = run_cli(go)
    click.echo(f"iteration {record['iteration']}: return {record['return_mean']:.1f} ± {record['return_std']:.1f} "
               f"over {record['episodes']} episodes (seeds {record['seed']}..{record['seed'] + record['episodes'] - 1}, "
               f"{'deterministic' if record['deterministic'] else 'sampled'})")
    if video_dir:
        click.echo(f"videos: {video_dir}")
