"""What several learners exchange: the heads' gradient all-reduce of every minibatch, timed.

    python benchmarks/learners_bench.py [--learners L] [--repeats N]

Starts L processes of gloo on loopback (as ``torchrun`` would, one machine) and times the all-reduce that
every minibatch makes (`splitrl.stages.learners.Learners.sum_gradients`: the heads' parameters of the
paper's network, float32), as medians of ``repeats``; from it, the time and the bytes each learner sends
per paper iteration (epochs x minibatches all-reduces). The rollout's merge and the statistics are small
beside it (4,096 samples a few floats each; 7 floats a minibatch) and not timed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from typing import Any

__all__ = ["allreduce_times"]


def _learner(rank: int, world: int, store: str, repeats: int, out: Any) -> None:
    import torch
    import torch.distributed as dist

    from splitrl.envs import inspect_env
    from splitrl.models import agent
    from splitrl.settings import TrainSettings
    from splitrl.stages.learners import Learners

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        settings = TrainSettings()
        _, heads = agent(settings, inspect_env(settings.env))
        params = list(heads.parameters())
        learners = Learners(rank, world)
        times = []
        for i in range(repeats + 3):  # three to warm up
            for p in params:  # learner r's gradient is r + 1 everywhere: the sum is known
                p.grad = torch.full_like(p, rank + 1.0)
            dist.barrier()
            start = time.perf_counter()
            learners.sum_gradients(params)
            if i >= 3:
                times.append(time.perf_counter() - start)
        if rank == 0:
            out.update(params=sum(p.numel() for p in params), median_s=statistics.median(times),
                       minibatches=settings.ppo.epochs * settings.ppo.minibatches,
                       summed=sorted({float(v) for p in params for v in p.grad.unique()}))
    finally:
        dist.destroy_process_group()


def allreduce_times(learners: int = 2, repeats: int = 20) -> dict[str, Any]:
    """{params, median_s (one all-reduce), minibatches (a paper iteration's), per_iteration_s, mb_per_iteration
    (computed from the ring all-reduce's share, not counted), summed (the distinct values of learner 0's
    gradients after the last all-reduce: [L (L + 1) / 2] when every learner's gradient was its rank + 1)}."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp, mp.get_context("spawn").Manager() as manager:
        out = manager.dict()
        mp.start_processes(_learner, args=(learners, os.path.join(tmp, "store"), repeats, out), nprocs=learners,
                           start_method="spawn")
        result = dict(out)
    result["per_iteration_s"] = result["median_s"] * result["minibatches"]
    # A ring all-reduce sends 2 (L - 1) / L of the tensor from each learner.
    result["mb_per_iteration"] = result["params"] * 4 * 2 * (learners - 1) / learners * result["minibatches"] / 1e6
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--learners", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    r = allreduce_times(args.learners, args.repeats)
    print(f"{args.learners} learners (gloo, loopback): the heads' {r['params']:,} float32 gradients "
          f"({r['params'] * 4 / 1e6:.1f} MB) all-reduced in {r['median_s'] * 1e3:.1f} ms (median of {args.repeats}); "
          f"a paper iteration's {r['minibatches']} minibatches: {r['per_iteration_s']:.1f} s and "
          f"{r['mb_per_iteration']:,.0f} MB sent by each learner")


if __name__ == "__main__":
    main()
