"""What micro-batches cost the heads: their forward and backward over a paper iteration's 320 minibatches of 128,
whole or in two micro-batches of 64, on one thread, alternating.

    python benchmarks/heads_microbatch.py [--rounds 2] [--minibatches 40]

Times ``--minibatches`` of them (the heads of the paper's configuration, a 4096-wide cut, random features and
actions, the input's gradient taken as the split takes it) and scales to 320. Prints CPU seconds an iteration for
each way and round, and one JSON object.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from splitrl.envs import inspect_env
from splitrl.models import agent
from splitrl.settings import TrainSettings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--minibatches", type=int, default=40)
    args = parser.parse_args()
    torch.set_num_threads(1)
    settings = TrainSettings()
    spec = inspect_env(settings.env)
    _, heads = agent(settings.for_observation(spec.observation), spec)
    generator = torch.Generator().manual_seed(0)
    actions = torch.rand(128, spec.action_dim, generator=generator) * 2 - 1

    def iteration(parts: int) -> float:
        began = time.process_time()
        for _ in range(args.minibatches):
            for part in actions.chunk(parts):
                features = torch.randn(len(part), heads.input_dim, generator=generator, requires_grad=True)
                _, logprob, entropy, value = heads.evaluate(*heads.outputs(features), part)
                (logprob.mean() + entropy.mean() + value.mean()).backward()
        return (time.process_time() - began) / args.minibatches * 320

    seconds: dict[str, list[float]] = {"1 x 128": [], "2 x 64": []}
    for _ in range(args.rounds):
        for name, parts in (("1 x 128", 1), ("2 x 64", 2)):
            seconds[name].append(iteration(parts))
            print(f"{name}: {seconds[name][-1]:.2f} CPU-s an iteration", flush=True)
    print(json.dumps(seconds))


if __name__ == "__main__":
    main()
