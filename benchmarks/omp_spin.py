"""What libgomp's spinning costs and saves in the split's training: two processes (an encoder's and the heads'),
two intra-op threads each, take turns on every minibatch as the synchronous split's stages do (features one way
through a pipe, their gradient back), under ``GOMP_SPINCOUNT`` values from 0 (what ``OMP_WAIT_POLICY=PASSIVE``,
which splitrl sets, means) up. Prints each setting's wall seconds and both processes' CPU seconds (every thread's),
alternating the settings for ``--rounds`` rounds, and the same minibatches on one thread a process for the parts.

    python benchmarks/omp_spin.py --spins 0,3000,30000 --minibatches 96 --rounds 2

libgomp reads the variable when it starts, so each setting runs in processes of its own; with PASSIVE and no
``GOMP_SPINCOUNT`` a thread that finds no work sleeps at once (a futex wait and a wake per parallel region), with a
count it spins that many times first (about 100,000 a millisecond, libgomp's own estimate in its env.c).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import time

ROWS = 128


def _side(role: str, conn, minibatches: int, threads: int, spins: int | None, out) -> None:
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"  # read when libgomp loads, with torch, just below
    os.environ.pop("GOMP_SPINCOUNT", None)
    if spins is not None:
        os.environ["GOMP_SPINCOUNT"] = str(spins)
    import torch
    from torch import nn

    from splitrl.envs import inspect_env
    from splitrl.models import agent
    from splitrl.ppo import adam
    from splitrl.settings import TrainSettings

    torch.set_num_threads(threads)
    settings = TrainSettings()
    spec = inspect_env(settings.env)
    settings = settings.for_observation(spec.observation)
    encoder, heads = agent(settings, spec)
    g = torch.Generator().manual_seed(0)
    if role == "encoder":
        net, lr = encoder, settings.ppo.lr_encoder
        batch = torch.randint(0, 255, (ROWS, 4, 96, 96), dtype=torch.uint8, generator=g)
    else:
        net, lr = heads, settings.ppo.lr_heads
        actions = torch.rand(ROWS, 3, generator=g) * 0.5
    params = list(net.parameters())
    optimizer = adam(params, lr=lr)

    def step() -> None:
        if role == "encoder":
            out = encoder(batch)
            conn.send_bytes(out.detach().numpy().tobytes())
            grad = torch.frombuffer(bytearray(conn.recv_bytes()), dtype=torch.float32).view_as(out)
            out.backward(grad)
        else:
            features = torch.frombuffer(bytearray(conn.recv_bytes()), dtype=torch.float32).view(ROWS, -1)
            cut = features.requires_grad_()
            _, logprob, _, value = heads.evaluate(*heads.outputs(cut), actions)
            (-(logprob.mean()) + value.pow(2).mean()).backward()
            conn.send_bytes(cut.grad.numpy().tobytes())
        nn.utils.clip_grad_norm_(params, settings.ppo.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(4):  # warm-up: allocations, oneDNN's primitives
        step()
    if role == "encoder":  # both warm before either is timed
        conn.send_bytes(b"ready")
        conn.recv_bytes()
    else:
        conn.recv_bytes()
        conn.send_bytes(b"go")
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(minibatches):
        step()
    out.put((role, time.process_time() - cpu, time.perf_counter() - wall))


def measure(spins: int | None, threads: int, minibatches: int) -> dict[str, float]:
    """One setting: both sides' CPU seconds and the encoder side's wall seconds over ``minibatches``."""
    ctx = mp.get_context("spawn")  # fresh interpreters: torch (and libgomp) load in `_side`
    a, b = ctx.Pipe()
    results = ctx.Queue()
    sides = [ctx.Process(target=_side, args=(role, conn, minibatches, threads, spins, results))
             for role, conn in (("encoder", a), ("heads", b))]
    for p in sides:
        p.start()
    got = {}
    for _ in sides:
        role, cpu, wall = results.get(timeout=600)
        got[role] = (cpu, wall)
    for p in sides:
        p.join(timeout=60)
    return {"encoder cpu": got["encoder"][0], "heads cpu": got["heads"][0], "wall": got["encoder"][1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spins", default="0,3000,30000", help="comma-separated GOMP_SPINCOUNT values")
    parser.add_argument("--minibatches", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    settings = [(f"2 threads, GOMP_SPINCOUNT={s}", int(s), 2) for s in args.spins.split(",")]
    settings.append(("1 thread (as the parts)", None, 1))
    print(f"{args.minibatches} minibatches of {ROWS} rows; seconds")
    print(f"{'setting':<36} {'wall':>7} {'encoder CPU':>12} {'heads CPU':>10} {'CPU':>7}")
    for r in range(args.rounds):
        for name, spins, threads in settings:
            m = measure(spins, threads, args.minibatches)
            cpu = m["encoder cpu"] + m["heads cpu"]
            print(f"{name:<36} {m['wall']:>7.2f} {m['encoder cpu']:>12.2f} {m['heads cpu']:>10.2f} {cpu:>7.2f}",
                  flush=True)


if __name__ == "__main__":
    main()
