"""The encoder's training on two micro-batches of 64 at once (one worker thread each, one intra-op thread), NCHW
against channels-last (`--channels-last`), and one after the other: wall ms a minibatch of 128, two rounds.

    python benchmarks/microbatch_pair.py      # docs/results/faster-parts/pair.txt
"""

import copy
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from splitrl.devices import place
from splitrl.envs import inspect_env
from splitrl.models import agent
from splitrl.settings import TrainSettings

torch.set_num_threads(1)
settings = TrainSettings()
spec = inspect_env(settings.env)
plain = agent(settings.for_observation(spec.observation), spec)[0]
nets = {"nchw": plain, "channels-last": place(copy.deepcopy(plain), torch.device("cpu"), True)}
g = torch.Generator().manual_seed(0)
x = torch.randint(0, 255, (128, 4, 96, 96), dtype=torch.uint8, generator=g)
upstream = torch.randn(128, 4096, generator=g)
pool = ThreadPoolExecutor(2, initializer=lambda: torch.set_num_threads(1))


def part(net, i):
    net(x[i * 64:(i + 1) * 64]).backward(upstream[i * 64:(i + 1) * 64])


def wall_ms(minibatch, n=12):
    start = time.perf_counter()
    for _ in range(n):
        minibatch()
    return (time.perf_counter() - start) / n * 1e3


for r in range(2):
    for name, net in nets.items():
        at_once = wall_ms(lambda: [f.result() for f in [pool.submit(part, net, i) for i in range(2)]])
        in_turn = wall_ms(lambda: (part(net, 0), part(net, 1)))
        print(f"round {r} {name}: two parts at once {at_once:.1f} ms, one after the other {in_turn:.1f} ms",
              flush=True)
