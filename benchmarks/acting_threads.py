"""What torch's second intra-op thread buys each part: CPU and wall milliseconds of the acting forwards (batches
of 1 to 16 rows) and of a training minibatch (128 rows through encoder and heads, backward and both Adam steps),
on 1 and on 2 threads, the paper's networks, alternating two rounds; and a one-row step on two threads switched
to one for its forwards and back (`splitrl.devices.acting_threads`, as the stages do at every step).

    OMP_WAIT_POLICY=PASSIVE python benchmarks/acting_threads.py      # as splitrl sets it

Decides `splitrl.devices.ACTING_ROWS`: the acting forwards up to it run on one thread.
"""

import time
from contextlib import nullcontext

import torch

from splitrl.devices import acting_threads
from splitrl.envs import inspect_env
from splitrl.models import agent
from splitrl.ppo import adam
from splitrl.settings import TrainSettings

settings = TrainSettings()
spec = inspect_env(settings.env)
settings = settings.for_observation(spec.observation)
encoder, heads = agent(settings, spec)
optimizers = adam(list(encoder.parameters()), lr=5e-5), adam(list(heads.parameters()), lr=1e-5)
g = torch.Generator().manual_seed(0)
batch = torch.randint(0, 255, (128, 4, 96, 96), dtype=torch.uint8, generator=g)
actions = torch.rand(128, 3, generator=g) * 0.5


def clock(fn, n):
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(n):
        fn()
    return (time.process_time() - cpu) / n * 1e3, (time.perf_counter() - wall) / n * 1e3


def acting(rows, switched=False):
    x = batch[:rows]

    def forward():
        with torch.no_grad(), acting_threads(torch.device("cpu"), rows) if switched else nullcontext():
            heads.evaluate(*heads.outputs(encoder(x)), generator=g)
    return forward


def train():
    out = encoder(batch)
    cut = out.detach().requires_grad_()
    _, logprob, _, value = heads.evaluate(*heads.outputs(cut), actions)
    (-(logprob.mean()) + value.pow(2).mean()).backward()
    out.backward(cut.grad)
    for optimizer in optimizers:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


for r in range(2):
    for threads in (1, 2):
        torch.set_num_threads(threads)
        cells = [f"acting, {rows} rows: {'%.3f / %.3f' % clock(acting(rows), 200)}" for rows in (1, 4, 8, 16)]
        if threads == 2:
            cells.append(f"acting, 1 row, switched to one thread: {'%.3f / %.3f' % clock(acting(1, True), 200)}")
        cells.append(f"a training minibatch: {'%.1f / %.1f' % clock(train, 12)}")
        print(f"round {r}, {threads} thread(s), CPU / wall ms: " + "; ".join(cells), flush=True)
