"""What taking turns between two processes costs the synchronous split's training, with nothing else around it.

    python benchmarks/training_turns.py --minibatches 96 --rounds 4 [--links pipe,splitrl] [--threads 2]
        [--glibc-defaults]

The synchronous split trains minibatch by minibatch: stage0 runs the encoder's forward on 128 observations and
sends the features, stage1 runs the heads' forward, PPO's loss, the backward, the clipping and Adam's step and
sends the features' gradient back, stage0 runs the encoder's backward from it, its clipping and its step. Each
side sleeps while the other works, 320 times an iteration. `splitrl bench floor` times these parts in one
process, one after the other, with nothing in between (``one process``; its very functions, `heads_update` and
`encoder_update`). Here the same parts also run in two processes that take turns at every minibatch over a link,
one of ``--links``:

- ``pipe``: a pipe, the features' and the gradient's raw bytes received into buffers made once, and nothing else
  (no framing, checks, codec or schedule);
- ``splitrl``: splitrl's own link (`ZmqTransport` over TCP loopback, in a session as the handshake leaves it),
  the features as a ``train_fwd`` message and the gradient as a ``train_bwd``, framed, checked and decoded.

The settings run on ``--threads`` intra-op threads a process (torch's default here is two, the synchronous
split's) and alternate for ``--rounds`` rounds. Printed per setting, in milliseconds a minibatch: each part's CPU
(the process's, every thread's, as the floor times them), the processes' CPU in all, the rest (``turns``: the
link's calls, sleeping and waking), and the CPU in all over the one-process setting's in the same round: what
taking turns costs the training, the parts' own slowing after a sleep included. Times 320, it is what a
synchronous split of the paper's iteration pays for its training's turns on this machine; the rollout's share is
`benchmarks/turns.py`'s. The observations are the env's first frames repeated (a network's cost does not depend
on the values it reads). Each process keeps the memory it frees as every splitrl process does
(`splitrl.allocator`); ``--glibc-defaults`` leaves glibc's thresholds as they come (the page faults column).
"""

from __future__ import annotations

import argparse
import os
import resource
import time

if __package__:  # imported as benchmarks.training_turns
    from .turns import open_link, run_sides
else:  # run as a script: its folder, benchmarks/, is the first entry of sys.path
    from turns import open_link, run_sides

PARTS = ("encoder", "heads")
LINKS = ("pipe", "splitrl")
WARMUP = 4
"""Minibatches each side runs before its clocks start (allocations, oneDNN's primitives)."""


def _build(threads: int, minibatches: int):
    """The paper's settings, both halves of the network with their optimizers, and ``minibatches`` training
    minibatches' worth of data: the rows, the actions, old log-probs, advantages, old values and returns."""
    import numpy as np
    import torch

    from splitrl.allocator import keep_freed_memory
    from splitrl.bench.floor_bench import random_actions
    from splitrl.envs import inspect_env
    from splitrl.models import agent
    from splitrl.ppo import adam, minibatch_schedule
    from splitrl.settings import TrainSettings
    from splitrl.stages.env_groups import training_envs

    keep_freed_memory()  # as every splitrl process does
    torch.set_num_threads(threads)
    settings = TrainSettings()
    spec = inspect_env(settings.env)
    settings = settings.for_observation(spec.observation)
    ppo = settings.ppo
    encoder, heads = agent(settings, spec)
    generator = torch.Generator().manual_seed(settings.seed)
    rng = np.random.default_rng(settings.seed)
    envs, _ = training_envs(settings)
    try:  # a few of the env's own frames, repeated to fill the batch
        obs, _ = envs.reset(seed=settings.seed)
        frames = [torch.as_tensor(spec.rows(obs, settings.env.image_pipeline[1] > 1))]
        for _ in range(31):
            obs, *_ = envs.step(spec.env_action(random_actions(spec, rng, settings.env.num_envs),
                                                settings.env.action_map))
            frames.append(torch.as_tensor(spec.rows(obs, settings.env.image_pipeline[1] > 1)))
    finally:
        envs.close()
    batch = settings.steps_per_iteration
    rows = torch.cat(frames)
    rows = rows.repeat(-(-batch // len(rows)), *([1] * (rows.dim() - 1)))[:batch].contiguous()
    if spec.discrete:
        actions = torch.randint(0, spec.action_dim, (batch,), generator=generator)
    else:
        actions = torch.rand(batch, spec.action_dim, generator=generator) * 2 - 1
    data = (actions, torch.zeros(batch), torch.randn(batch, generator=generator), torch.zeros(batch),
            torch.randn(batch, generator=generator))
    schedule = [idx for epoch in minibatch_schedule(settings.seed, 1, ppo.epochs, batch, ppo.minibatches)
                for idx in epoch]
    order = [schedule[i % len(schedule)] for i in range(WARMUP + minibatches)]
    optimizers = [adam(list(net.parameters()), lr=lr, fused=ppo.fused_adam)
                  for net, lr in ((encoder, ppo.lr_encoder), (heads, ppo.lr_heads))]
    return ppo, encoder, heads, optimizers, rows, data, order


def _faults() -> int:
    """This process's minor page faults so far (a page touched for the first time since it was mapped)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _clocked(seconds: dict[str, float], part: str, fn, *args):
    start = time.process_time()
    result = fn(*args)
    seconds[part] += time.process_time() - start
    return result


class _Pipe:
    """A `multiprocessing` pipe's end: the raw bytes each way, received into a buffer made once."""

    def __init__(self, conn, shape) -> None:
        import torch

        self.conn = conn
        self.received = bytearray(shape.numel() * 4)
        self.tensor = torch.frombuffer(self.received, dtype=torch.float32).view(shape)

    def send(self, tensor, mb: int) -> None:
        self.conn.send_bytes(tensor.numpy())

    def recv(self, mb: int):
        self.conn.recv_bytes_into(self.received)
        return self.tensor

    def close(self) -> None:
        self.conn.close()


class _Framed:
    """splitrl's link, a `ZmqTransport` over TCP loopback in a session (the heads' side binds, ``endpoint`` None,
    and reports where): the features as a ``train_fwd`` message and the gradient as a ``train_bwd``, framed,
    checked (the decoder's finite check of every value) and decoded as the stages do, each message's ``mb``
    expected."""

    def __init__(self, endpoint, report=None) -> None:
        from splitrl.schedule.common import expect

        self.expect = expect
        self.link = open_link(endpoint, report)
        self.heads = endpoint is None

    def send(self, tensor, mb: int) -> None:
        self.link.send(*(("train_bwd", {"grad": tensor}) if self.heads else ("train_fwd", {"features": tensor})),
                       {"mb": mb})

    def recv(self, mb: int):
        kind, name = ("train_fwd", "features") if self.heads else ("train_bwd", "grad")
        return self.expect(self.link, kind, mb=mb).tensors[name]

    def close(self) -> None:
        self.link.close()


def _open(link: str, peer, shape, report=None):
    """One side of a link of `LINKS`: ``peer`` is the pipe's end, or where the heads' side listens (None on that
    side, which reports it to ``report``)."""
    return _Pipe(peer, shape) if link == "pipe" else _Framed(peer, report)


def _edge(link: str | None, peer, threads: int, minibatches: int, out) -> None:
    """The encoder's side; the heads' in this process too when ``link`` is None."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as `python -m splitrl` runs, before torch loads
    import torch

    from splitrl.bench.floor_bench import encoder_update, heads_update

    ppo, encoder, heads, (enc_opt, heads_opt), rows, data, order = _build(threads, minibatches)
    enc_params, heads_params = list(encoder.parameters()), list(heads.parameters())
    other = None
    if link is not None:
        with torch.no_grad():
            other = _open(link, peer, encoder(rows[order[0]]).shape)
    seconds = dict.fromkeys(PARTS, 0.0)
    for i, idx in enumerate(order):
        if i == WARMUP:
            seconds = dict.fromkeys(PARTS, 0.0)
            cpu, wall, faults = time.process_time(), time.perf_counter(), _faults()
        features = _clocked(seconds, "encoder", lambda: encoder(rows[idx]))  # the gather too, as the floor
        if other is None:
            cut = features.detach().requires_grad_()
            _clocked(seconds, "heads", heads_update, heads, heads_params, heads_opt, cut, ppo,
                     *(d[idx] for d in data))
            grad = cut.grad
        else:
            other.send(features.detach(), i)
            grad = other.recv(i)
        _clocked(seconds, "encoder", encoder_update, enc_params, enc_opt, features, grad, ppo)
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    out.put(("edge", cpu, wall, _faults() - faults, seconds))
    if other is not None:
        other.close()


def _heads(link: str, peer, threads: int, minibatches: int, out, report) -> None:
    """The heads' side: each minibatch's features in, their gradient out."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import torch

    from splitrl.bench.floor_bench import heads_update

    ppo, encoder, heads, (_, heads_opt), rows, data, order = _build(threads, minibatches)
    with torch.no_grad():
        other = _open(link, peer, encoder(rows[order[0]]).shape, report)
    params = list(heads.parameters())
    seconds = dict.fromkeys(PARTS, 0.0)
    for i, idx in enumerate(order):
        if i == WARMUP:
            seconds = dict.fromkeys(PARTS, 0.0)
            cpu, faults = time.process_time(), _faults()
        cut = other.recv(i).detach().requires_grad_()
        _clocked(seconds, "heads", heads_update, heads, params, heads_opt, cut, ppo, *(d[idx] for d in data))
        other.send(cut.grad, i)
    out.put(("heads", time.process_time() - cpu, 0.0, _faults() - faults, seconds))
    other.close()


def measure(minibatches: int, threads: int, link: str | None) -> dict[str, float]:
    """One setting: CPU seconds by part, the processes' CPU in all and the edge's wall seconds over
    ``minibatches``; the heads in the edge's process (``link`` None), or in their own across a link of
    `LINKS`."""
    parts = dict.fromkeys(PARTS, 0.0)
    cpu = wall = faults = 0.0
    args = (threads, minibatches)
    for _, role_cpu, role_wall, role_faults, seconds in run_sides(_edge, _heads, link, args, args):
        cpu += role_cpu
        faults += role_faults
        wall = max(wall, role_wall)
        for part, s in seconds.items():
            parts[part] += s
    return {**parts, "cpu": cpu, "wall": wall, "faults": faults}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minibatches", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="intra-op threads a process")
    parser.add_argument("--links", default="pipe", help=f"comma-separated, of {', '.join(LINKS)}")
    parser.add_argument("--glibc-defaults", action="store_true",
                        help="leave glibc's malloc thresholds as they come (SPLITRL_ALLOCATOR=default), where every "
                             "splitrl process keeps freed memory (`splitrl.allocator`)")
    args = parser.parse_args()
    links = args.links.split(",")
    if not links or any(link not in LINKS for link in links):
        parser.error(f"--links: each of {', '.join(LINKS)}, got {args.links!r}")
    if args.minibatches < 1 or args.rounds < 1 or args.threads < 1:
        parser.error("--minibatches, --rounds and --threads: at least 1 each")
    if args.glibc_defaults:
        os.environ["SPLITRL_ALLOCATOR"] = "default"  # the processes spawned below inherit it
    names = {"pipe": "two processes, a pipe", "splitrl": "two processes, splitrl's link"}
    settings = [("one process", None), *((names[link], link) for link in links)]
    ms = 1e3 / args.minibatches
    memory = "glibc's malloc thresholds" if args.glibc_defaults else "freed memory kept"
    print(f"{args.minibatches} training minibatches a setting, {args.threads} intra-op threads a process, {memory}; "
          "milliseconds a minibatch (page faults: minor faults a minibatch)")
    print("| round | setting | encoder | heads | parts | CPU in all | turns | over one process | wall | page faults |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in range(args.rounds):  # alternating the order the settings run in
        m = {name: measure(args.minibatches, args.threads, link) for name, link in settings[:: 1 - 2 * (r % 2)]}
        alone = m["one process"]["cpu"]
        for name, link in settings:
            row = m[name]
            parts = sum(row[p] for p in PARTS)
            over = "" if link is None else f"{(row['cpu'] - alone) * ms:+.2f}"
            print(f"| {r + 1} | {name} | {row['encoder'] * ms:.2f} | {row['heads'] * ms:.2f} | {parts * ms:.2f} | "
                  f"{row['cpu'] * ms:.2f} | {(row['cpu'] - parts) * ms:.2f} | {over} | {row['wall'] * ms:.2f} | "
                  f"{row['faults'] / args.minibatches:.0f} |", flush=True)


if __name__ == "__main__":
    main()
