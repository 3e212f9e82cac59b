"""The encoder's training on two micro-batches of 64 at once (one worker thread each, one intra-op thread), NCHW
against channels-last: wall ms a minibatch, and each alone on one thread."""
import copy, time, torch
from concurrent.futures import ThreadPoolExecutor
from splitrl.devices import place
from splitrl.settings import TrainSettings
from splitrl.envs import inspect_env
from splitrl.models import agent
torch.set_num_threads(1)
s = TrainSettings()
spec = inspect_env(s.env); s = s.for_observation(spec.observation)
plain = agent(s, spec)[0]
nets = {"nchw": plain, "channels-last": place(copy.deepcopy(plain), torch.device("cpu"), True)}
g = torch.Generator().manual_seed(0)
x = torch.randint(0, 255, (128, 4, 96, 96), dtype=torch.uint8, generator=g)
gy = torch.randn(128, 4096, generator=g)
pool = ThreadPoolExecutor(2, initializer=lambda: torch.set_num_threads(1))
def part(net, i):
    net(x[i * 64:(i + 1) * 64]).backward(gy[i * 64:(i + 1) * 64])
def at_once(net, n=12):
    w = time.perf_counter()
    for _ in range(n):
        for f in [pool.submit(part, net, i) for i in range(2)]:
            f.result()
    return (time.perf_counter() - w) / n * 1e3
def in_turn(net, n=12):
    w = time.perf_counter()
    for _ in range(n):
        part(net, 0); part(net, 1)
    return (time.perf_counter() - w) / n * 1e3
for r in range(2):
    for k, net in nets.items():
        print(f"round {r} {k}: two parts at once {at_once(net):.1f} ms, one after the other {in_turn(net):.1f} ms", flush=True)
