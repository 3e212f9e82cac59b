"""Learning comparison: the same training with different codecs, one row per configuration.

Each configuration is a full `splitrl run` (split over loopback) with the same
seed and steps; the table comes from the run directories only, so it can be
rebuilt (`splitrl bench learning --table-only`) from runs made elsewhere;
each row is `splitrl.summary.summarise_run` of one run directory.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any, Sequence

from ..launch import progress
from ..runs import link_bytes, newest_evals
from ..summary import run_history, summarise_run

__all__ = ["CONFIGS", "run_learning_comparison", "learning_table"]

CONFIGS: dict[str, list[str]] = {
    "fp32": [],
    "bf16": ["--codec-rollout", "bf16", "--codec-fwd", "bf16", "--codec-bwd", "bf16"],
    "paper-p90": ["--codec-bwd", "paper"],
    "paper-p99": ["--codec-bwd", "paper:p=0.99"],
    "ours": ["--codec-rollout", "int8+zstd", "--codec-fwd", "delta:q=topk,density=0.02",
             "--codec-bwd", "ef:density=0.02,values=int8"],
    "ours-zero-fwd": ["--codec-rollout", "int8+zstd", "--codec-fwd", "delta:q=none",
                      "--codec-bwd", "ef:density=0.02,values=int8"],
    # The first "ours" stalled after iteration 16 with 2 % gradients. This one gives the
    # gradients three times the budget and pays for it with the forward deltas, whose top-2 %
    # cut the view's error only from 4.3 % to 3.7 % (docs/benchmarks/codecs.md).
    "ours-ef6": ["--codec-rollout", "int8+zstd", "--codec-fwd", "delta:q=none",
                 "--codec-bwd", "ef:density=0.06,values=int8+zstd"],
    # ours-ef6 fell behind as well while the paper's p90, with exact float32 features, kept up:
    # this keeps ours' rollout and gradients and makes the training features near-exact
    # (int8 deltas against the rollout view, 0.02 % error), to see whether staleness is the cause.
    "ours-exact-fwd": ["--codec-rollout", "int8+zstd", "--codec-fwd", "delta+zstd",
                       "--codec-bwd", "ef:density=0.06,values=int8+zstd"],
    # Stale or top-k training features cost the return. This keeps stage1's view of what matters
    # exact to second order instead: stage0 holds a replica of the heads (an int8 weight update
    # per iteration) and training sends only the change of the heads' outputs, 4 floats a sample.
    "ours-replica": ["--codec-rollout", "int8+zstd", "--exchange", "replica"],
    # ours-replica's replica is up to 320 minibatches old by the last epoch, and a 1-iteration
    # tiny run shows that costs 2.8 % of the encoder's move (0.0002 % when synced every minibatch).
    # This one also syncs the output layers and biases after every minibatch (about 3 KB each)
    # and all weights every 80 minibatches, which keeps it under 1/20 of bf16's bytes.
    "ours-replica-sync": ["--codec-rollout", "int8+zstd", "--exchange", "replica:last_every=1,all_every=80"],
    "cloud-frames": ["--cut", "input", "--codec-rollout", "frames"],
    # ours-replica-sync's bytes scale with the cut's width: the rollout's 4096 features a step and the
    # replica's 4096 x 512 first layers. A learned projection to 256 values at the end of the encoder
    # (--bottleneck, trained end to end) shrinks both 16-fold.
    "ours-bottleneck": ["--bottleneck", "256", "--codec-rollout", "int8+zstd",
                        "--exchange", "replica:last_every=1,all_every=80"],
    # The paper's literal variant at the same K: the projection fitted on stage1 as an autoencoder's encoder
    # half (reconstructing the 4096 features from every 16th step's, sent int8+zstd) and shipped to stage0 with
    # the replica's update; the heads take the decoder's reconstruction (splitrl/stages/autoencoder.py).
    "ours-autoencoder": ["--bottleneck", "256", "--bottleneck-train", "autoencoder", "--codec-rollout", "int8+zstd",
                         "--exchange", "replica:last_every=1,all_every=80"],
    # Half the width again: does the return hold at K = 128 (about 3/4 of ours-bottleneck's bytes)?
    "ours-bottleneck-128": ["--bottleneck", "128", "--codec-rollout", "int8+zstd",
                            "--exchange", "replica:last_every=1,all_every=80"],
    # The schedules of splitrl/schedule/ with fp32 on the link, as `splitrl bench pipeline` measures them:
    # the paper's 4096 samples an iteration from 4 envs x 1024 steps in 4 groups, 2 micro-batches a
    # minibatch, envs in worker processes; then the same with the rollout of the next iteration running
    # while this one trains.
    "pipelined": ["--num-envs", "4", "--num-steps", "1024", "--rollout-groups", "4", "--microbatches", "2",
                  "--vector", "async"],
    "async": ["--num-envs", "4", "--num-steps", "1024", "--rollout-groups", "4", "--microbatches", "2",
              "--vector", "async", "--async"],
    # The same two schedules with bf16 on the link, to compare with bf16's synchronous runs on seeds 1 and 2
    # (docs/benchmarks/pipeline.md).
    "bf16-pipelined": ["--codec-rollout", "bf16", "--codec-fwd", "bf16", "--codec-bwd", "bf16", "--num-envs", "4",
                       "--num-steps", "1024", "--rollout-groups", "4", "--microbatches", "2", "--vector", "async"],
    "bf16-async": ["--codec-rollout", "bf16", "--codec-fwd", "bf16", "--codec-bwd", "bf16", "--num-envs", "4",
                   "--num-steps", "1024", "--rollout-groups", "4", "--microbatches", "2", "--vector", "async",
                   "--async"],
    # bf16-async with its rollout scored again by the network that starts each training (--rescore): the
    # proximal policy, the importance weights and the baseline of the one that trains, not of the one that acted.
    "bf16-async-rescore": ["--codec-rollout", "bf16", "--codec-fwd", "bf16", "--codec-bwd", "bf16", "--num-envs",
                           "4", "--num-steps", "1024", "--rollout-groups", "4", "--microbatches", "2", "--vector",
                           "async", "--async", "--rescore"],
    # bf16-async with the weights published after every epoch and the rollout paced against the training beside
    # it (--publish epoch): its samples lag 10 down to 1 epochs, 0.55 of an iteration on average instead of 1.
    "bf16-async-epoch": ["--codec-rollout", "bf16", "--codec-fwd", "bf16", "--codec-bwd", "bf16", "--num-envs", "4",
                         "--num-steps", "1024", "--rollout-groups", "4", "--microbatches", "2", "--vector", "async",
                         "--async", "--publish", "epoch"],
    # A fleet of 4 edges x 1 env x 1024 steps whose encoders are averaged every 8 minibatches (int8 changes,
    # docs/PROTOCOL.md section 15), against bf16-pipelined: the same 4 envs x 1024 steps as one edge, which
    # `--encoder-sync grad` equals up to float sums.
    "fleet-bf16-avg": ["--codec-rollout", "bf16", "--codec-fwd", "bf16", "--codec-bwd", "bf16", "--edges", "4",
                       "--num-envs", "1", "--num-steps", "1024", "--encoder-sync", "avg:every=8,sync=int8"],
}
"""The paper's (fp32 features, sparse gradients after a 30,000-step warm start), the
bf16 reference of the 20x target, ours, and the cloud setup as the honest competitor."""


def run_learning_comparison(names: Sequence[str], total_steps: int, out_dir: Path,
                            extra_args: Sequence[str] = (), timeout: float = 6 * 3600) -> list[Path]:
    """Run each named configuration in turn (never concurrently: timings are compared)."""
    dirs = []
    for name in names:
        run_dir = out_dir / name
        command = [sys.executable, "-m", "splitrl", "run", "--total-steps", str(total_steps),
                   "--run-dir", str(run_dir), *CONFIGS[name], *extra_args]
        records = run_dir / "edge-0" if "--edges" in CONFIGS[name] else run_dir  # a fleet's: edge 0's
        with progress(records, total_steps // 4096, name):
            result = subprocess.run(command, timeout=timeout)
        if result.returncode != 0:
            raise RuntimeError(f"{name}: `{' '.join(command)}` exited {result.returncode}")
        dirs.append(run_dir)
    return dirs


KINDS = ("step", "action", "rollout_end", "heads", "train_fwd", "train_bwd")
"""The message kinds `kind_table` gives a column each (both directions); the rest are summed as 'other'."""


def kind_table(run_dirs: Sequence[Path], upto: int | None = None) -> str:
    """Markdown table of each run's training bytes per env step by message kind (stage0's meters, both ways)."""
    lines = ["| run | " + " | ".join(f"`{k}`" for k in KINDS) + " | other | total |",
             "|---|" + "---:|" * (len(KINDS) + 2)]
    for run_dir in run_dirs:
        last = run_history(run_dir, upto).records[-1]  # a fleet's: every edge's link summed
        steps, total = last["global_step"], link_bytes(last)
        kinds = [sum(last.get(f"net_total/{kind}/{way}_bytes", 0) for way in ("sent", "recv")) for kind in KINDS]
        cells = [f"{b / steps:,.1f}" for b in (*kinds, total - sum(kinds), total)]
        lines.append(f"| {Path(run_dir).name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def held_out(run_dir: Path, iteration: int) -> str:
    """The newest `splitrl eval` of ``iteration``'s checkpoints (RUN_DIR/eval.jsonl), deterministic and sampled:
    "mean ± std (n)" each, "-" for a mode not evaluated."""
    newest = newest_evals(run_dir, iteration)
    cells = [f"{r['return_mean']:.1f} ± {r['return_std']:.1f} ({r['episodes']})" if (r := newest.get(mode)) else "-"
             for mode in (True, False)]
    return " / ".join(cells)


def learning_table(run_dirs: Sequence[Path], reference: str = "bf16", upto: int | None = None) -> str:
    """Markdown table, one row per run; 'x fewer' is against the run named ``reference``. A column of held-out
    evaluations (`held_out`, at each run's last iteration counted) when any run has them."""
    rows = [summarise_run(Path(d), upto=upto) for d in run_dirs]
    evals = [held_out(Path(d), r["iterations"]) for d, r in zip(run_dirs, rows)]
    with_evals = any(e != "- / -" for e in evals)
    ref = next((r for r in rows if r["run"] == reference), None)
    head = ("| run | cut | codecs (rollout / fwd / bwd) | iterations | total bytes | bytes per env step "
            f"| x fewer than {reference} | final EMA return | mean of last 20 episodes | wall time |"
            + (" held-out eval: deterministic / sampled |" if with_evals else "") + "\n"
            + "|---|---|---|---:|---:|---:|---:|---:|---:|---:|" + ("---|" if with_evals else ""))
    lines = [head]
    for r, evaluated in zip(rows, evals):
        # Per env step, so a run cut short compares fairly with a finished one.
        ratio = f"{ref['bytes_per_step'] / r['bytes_per_step']:.1f}" if ref and r["bytes_per_step"] else ""
        ema = "n/a" if r["final_ema"] is None else f"{r['final_ema']:.1f}"
        tail = "n/a" if r["last_episodes_mean"] is None else f"{r['last_episodes_mean']:.1f}"
        wall = "" if r["wall_seconds"] is None else f"{r['wall_seconds'] / 60:.0f} min"
        lines.append(
            f"| {r['run']} | {r['cut']} | `{r['codecs']}` | {r['iterations']} | {r['total_bytes'] / 1e9:.2f} GB "
            f"| {r['bytes_per_step']:,.0f} | {ratio} | {ema} | {tail} | {wall} |"
            + (f" {evaluated} |" if with_evals else "")
        )
    return "\n".join(lines)
