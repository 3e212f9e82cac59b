"""Stage1's storage of one group's step: written as a slice (`Rollouts.store`, `Rollouts.record_outcomes` with one
part) against the same rows written through index tensors (`RolloutBuffer.add_rows`, `add_outcome_rows`, as every
step was stored before and a step of several groups still is), cold and warm.

    python benchmarks/rollout_store.py [--count 300] [--rounds 2]

Each round times both ways with `cold_calls.timed` (thread CPU after a cache-evicting pause, and back to back),
one after the other in one process; the paper's settings, one env. Prints a markdown table.
"""

from __future__ import annotations

import argparse

import torch

from splitrl.devices import to_device
from splitrl.envs import inspect_env
from splitrl.settings import TrainSettings
from splitrl.stages.rollouts import Rollouts

try:
    from benchmarks.cold_calls import timed
except ModuleNotFoundError:  # run as a script: its own directory is on the path
    from cold_calls import timed  # type: ignore[no-redef]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    settings = TrainSettings()
    spec = inspect_env(settings.env)
    rollouts = Rollouts(settings, spec, 2, None, torch.device("cpu"))
    outcome = (torch.zeros(1), torch.zeros(1, dtype=torch.bool), torch.zeros(1, dtype=torch.bool), torch.zeros(1))
    acted = {"actions": torch.zeros(1, spec.action_dim), "logprobs": torch.zeros(1), "values": torch.zeros(1)}
    step, group, version = 5, 0, 3

    def indexed() -> None:  # one part's rows as the index tensors they were made into before
        envs = rollouts.groups.rows[group]
        steps = torch.full((len(envs),), step)
        reward, terminated, truncated, final = (to_device(torch.cat([part]), rollouts.device) for part in outcome)
        rollouts.buffers[1].add_outcome_rows(steps, envs, rewards=reward, terminated=terminated, truncated=truncated,
                                             final_values=final)
        steps = torch.full((len(envs),), step)
        rollouts.buffers[1].add_rows(steps, envs, **acted)
        rollouts.versions[1][steps, envs] = version

    def sliced() -> None:
        rollouts.record_outcomes(1, [(step, group, outcome)])
        rollouts.store(1, [(step, group)], torch.zeros(1), version, **acted)

    print("thread CPU us a step's storage, after a 4 ms cache-evicting pause, and back to back")
    print("| round | written | cold | warm |")
    print("|---:|---|---:|---:|")
    for r in range(1, args.rounds + 1):
        for name, call in (("through index tensors", indexed), ("as a slice", sliced)):
            cold, warm = timed(call, args.count, 0.004)
            print(f"| {r} | {name} | {cold:.1f} | {warm:.1f} |")


if __name__ == "__main__":
    main()
