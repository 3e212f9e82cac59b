"""A rollout step's forwards in one process, after a training minibatch on two threads: switched to one intra-op
thread and back at every step (`splitrl.devices.acting_threads`, as the stages do), on two threads, and on one
throughout; CPU and wall ms a step, two rounds.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/acting_toggle.py      # docs/results/faster-parts/acting-toggle.txt
"""
import time

import torch

from splitrl.devices import acting_threads
from splitrl.settings import TrainSettings
from splitrl.envs import inspect_env
from splitrl.models import agent
s = TrainSettings()
spec = inspect_env(s.env); s = s.for_observation(spec.observation)
enc, heads = agent(s, spec)
torch.set_num_threads(2)
g = torch.Generator().manual_seed(0)
xb = torch.randint(0, 255, (128, 4, 96, 96), dtype=torch.uint8, generator=g)
enc(xb).sum().backward()  # a training minibatch first, on two threads: whatever pools it makes exist
x1 = xb[:1]
cpu = torch.device("cpu")
def step_toggled():
    with torch.no_grad(), acting_threads(cpu, 1):
        heads.outputs(enc(x1))
    torch.ones(4096).mul_(2)  # an op between, at two threads
def step_two():
    with torch.no_grad():
        heads.outputs(enc(x1))
    torch.ones(4096).mul_(2)
def step_one_fixed():
    with torch.no_grad():
        heads.outputs(enc(x1))
    torch.ones(4096).mul_(2)
def clock(fn, n=1000):
    c, w = time.process_time(), time.perf_counter()
    for _ in range(n): fn()
    return round((time.process_time() - c) / n * 1e3, 3), round((time.perf_counter() - w) / n * 1e3, 3)
for r in range(2):
    torch.set_num_threads(2)
    a = clock(step_toggled); b = clock(step_two)
    torch.set_num_threads(1)
    c = clock(step_one_fixed)
    torch.set_num_threads(2)
    print(f"round {r}: CPU/wall ms a step: toggled to one thread {a}, two threads {b}, one thread throughout {c}", flush=True)
