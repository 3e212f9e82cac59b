"""CPU and wall ms of the parts' kernels at 1 and 2 intra-op threads (OMP_WAIT_POLICY=PASSIVE, as splitrl sets)."""
import time, torch
from splitrl.settings import TrainSettings
from splitrl.envs import inspect_env
from splitrl.models import agent
from splitrl.ppo import adam
s = TrainSettings()
spec = inspect_env(s.env); s = s.for_observation(spec.observation)
enc, heads = agent(s, spec)
oe, oh = adam(list(enc.parameters()), lr=5e-5), adam(list(heads.parameters()), lr=1e-5)
g = torch.Generator().manual_seed(0)
x1 = torch.randint(0, 255, (1, 4, 96, 96), dtype=torch.uint8, generator=g)
xb = torch.randint(0, 255, (128, 4, 96, 96), dtype=torch.uint8, generator=g)
f1 = enc(x1).detach()
acts = torch.rand(128, 3, generator=g) * 0.5
def clock(fn, n):
    c, w = time.process_time(), time.perf_counter()
    for _ in range(n):
        fn()
    return (time.process_time() - c) / n * 1e3, (time.perf_counter() - w) / n * 1e3
def enc_act():
    with torch.no_grad():
        enc(x1)
def heads_act():
    with torch.no_grad():
        heads.evaluate(*heads.outputs(f1), generator=g)
def train():
    out = enc(xb)
    cut = out.detach().requires_grad_()
    _, logprob, entropy, value = heads.evaluate(*heads.outputs(cut), acts)
    (-(logprob.mean()) + value.pow(2).mean()).backward()
    oh.step(); oh.zero_grad(set_to_none=True)
    out.backward(cut.grad); oe.step(); oe.zero_grad(set_to_none=True)
for r in range(2):
    for t in (1, 2):
        torch.set_num_threads(t)
        row = [clock(enc_act, 400), clock(heads_act, 400), clock(train, 12)]
        print(f"round {r} threads {t}: encoder acting cpu/wall {row[0][0]:.3f}/{row[0][1]:.3f} ms, heads acting "
              f"{row[1][0]:.3f}/{row[1][1]:.3f} ms, a training minibatch {row[2][0]:.1f}/{row[2][1]:.1f} ms", flush=True)
