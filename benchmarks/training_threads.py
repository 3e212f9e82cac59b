"""What torch's second intra-op thread costs and saves in each part of a training minibatch: wall and CPU
milliseconds (the process's, every thread's) of the encoder's and the heads' forward and backward and of each
side's gradient clipping and Adam step, on one and on two threads, the paper's networks and minibatch of 128
rows, alternating ``--rounds`` rounds.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/training_threads.py [--count 30] [--rounds 2] [--fused-adam]

(``OMP_WAIT_POLICY=PASSIVE`` as splitrl sets it; ``--fused-adam`` as the option of that name steps.)
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

from splitrl.envs import inspect_env
from splitrl.models import agent
from splitrl.ppo import adam
from splitrl.settings import TrainSettings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--fused-adam", action="store_true")
    args = parser.parse_args()
    settings = TrainSettings()
    spec = inspect_env(settings.env)
    settings = settings.for_observation(spec.observation)
    encoder, heads = agent(settings, spec)
    g = torch.Generator().manual_seed(0)
    batch = torch.randint(0, 255, (128, 4, 96, 96), dtype=torch.uint8, generator=g)
    actions = torch.rand(128, 3, generator=g) * 0.5
    features = encoder(batch).detach()
    optimizers = {net: adam(list(net.parameters()), lr=1e-5, fused=args.fused_adam) for net in (encoder, heads)}

    def encoder_pass() -> None:
        encoder(batch).backward(features)

    def heads_pass() -> None:
        cut = features.clone().requires_grad_()
        _, logprob, _, value = heads.evaluate(*heads.outputs(cut), actions)
        (-(logprob.mean()) + value.pow(2).mean()).backward()

    def update(net: nn.Module):
        def step() -> None:
            nn.utils.clip_grad_norm_(list(net.parameters()), settings.ppo.max_grad_norm)
            optimizers[net].step()
        return step

    encoder_pass(), heads_pass()  # every parameter has a gradient (they accumulate; the steps do not care)
    calls = [("encoder forward and backward", encoder_pass), ("heads forward and backward", heads_pass),
             (f"encoder clip and Adam ({sum(p.numel() for p in encoder.parameters()):,} parameters)",
              update(encoder)),
             (f"heads clip and Adam ({sum(p.numel() for p in heads.parameters()):,} parameters)", update(heads))]
    print(f"ms a call: wall and CPU on one thread, then on two{' (fused Adam)' if args.fused_adam else ''}")
    print("| part | 1 thread wall | CPU | 2 threads wall | CPU | CPU, 2 over 1 |")
    print("|---|---:|---:|---:|---:|---:|")
    for _ in range(args.rounds):
        for name, call in calls:
            row = []
            for threads in (1, 2):
                torch.set_num_threads(threads)
                for _ in range(3):
                    call()
                cpu, wall = time.process_time(), time.perf_counter()
                for _ in range(args.count):
                    call()
                row += [(time.perf_counter() - wall) / args.count * 1e3, (time.process_time() - cpu) / args.count * 1e3]
            print(f"| {name} | {row[0]:.2f} | {row[1]:.2f} | {row[2]:.2f} | {row[3]:.2f} | {row[3] - row[1]:+.2f} |",
                  flush=True)


if __name__ == "__main__":
    main()
