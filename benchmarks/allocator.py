"""What the allocator's thresholds save (`splitrl.allocator`): the training's minibatches through the paper's
encoder and heads, forward, PPO's loss, backward and both Adam steps, on one thread, in a fresh process each with
glibc's defaults or with `keep_freed_memory`, alternating.

    python benchmarks/allocator.py [--rounds 3] [--minibatches 48] [--json FILE]

Random observations and actions of the paper's shapes (the work does not depend on their values); the first
16 minibatches warm the process up untimed, the next ``--minibatches`` are timed and scaled to an iteration's
320. Prints, for each round and way: CPU seconds an iteration, of them in the kernel, minor page faults an
iteration, and the process's peak resident size; then one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

from splitrl.allocator import without_allocator_settings

WAYS = ("glibc's defaults", "keep_freed_memory")
_WARM_UP = 16


def child(way: str, minibatches: int) -> dict[str, float]:
    from splitrl.allocator import keep_freed_memory

    if way == WAYS[1] and not keep_freed_memory():
        raise SystemExit("keep_freed_memory changed nothing here (not glibc, or MALLOC_* set)")
    import torch

    from splitrl.envs import inspect_env
    from splitrl.models import agent
    from splitrl.ppo import adam, ppo_loss
    from splitrl.settings import TrainSettings

    torch.set_num_threads(1)
    settings = TrainSettings()
    spec = inspect_env(settings.env)
    settings = settings.for_observation(spec.observation)
    ppo = settings.ppo
    encoder, heads = agent(settings, spec)
    steps = [adam(list(encoder.parameters()), lr=ppo.lr_encoder), adam(list(heads.parameters()), lr=ppo.lr_heads)]
    generator = torch.Generator().manual_seed(0)
    n = 1024
    obs = torch.randint(0, 256, (n, *spec.obs_shape), dtype=torch.uint8, generator=generator)
    actions = torch.rand(n, spec.action_dim, generator=generator) * 2 - 1
    advantages, returns, zeros = torch.randn(n, generator=generator), torch.randn(n, generator=generator), torch.zeros(n)

    def minibatch() -> None:
        idx = torch.randperm(n, generator=generator)[:settings.steps_per_iteration // ppo.minibatches]
        out = encoder(obs[idx])
        cut = out.detach().requires_grad_()
        _, logprob, entropy, value = heads.evaluate(*heads.outputs(cut), actions[idx])
        loss, _ = ppo_loss(logprob, zeros[idx], advantages[idx], value.reshape(-1), zeros[idx], returns[idx], entropy,
                           clip_coef=ppo.clip_coef, vf_coef=ppo.vf_coef, ent_coef=ppo.ent_coef,
                           clip_vloss=ppo.clip_vloss, norm_adv=ppo.norm_adv)
        loss.backward()
        out.backward(cut.grad)
        for step in steps:
            step.step()
            step.zero_grad(set_to_none=True)

    for _ in range(_WARM_UP):
        minibatch()
    before, began = resource.getrusage(resource.RUSAGE_SELF), time.process_time()
    for _ in range(minibatches):
        minibatch()
    after, cpu = resource.getrusage(resource.RUSAGE_SELF), time.process_time() - began
    scale = ppo.epochs * ppo.minibatches / minibatches
    return {"cpu_s": cpu * scale, "sys_s": (after.ru_stime - before.ru_stime) * scale,
            "faults": (after.ru_minflt - before.ru_minflt) * scale, "peak_rss_mib": after.ru_maxrss / 1024}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--minibatches", type=int, default=48)
    parser.add_argument("--json", default="")
    parser.add_argument("--child", choices=WAYS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.minibatches)))
        return
    env = without_allocator_settings(os.environ)
    results: dict[str, list[dict[str, float]]] = {way: [] for way in WAYS}
    for _ in range(args.rounds):
        for way in WAYS:
            out = subprocess.run([sys.executable, __file__, "--child", way, "--minibatches", str(args.minibatches)],
                                 env=env, capture_output=True, text=True, check=True, timeout=1800).stdout
            r = json.loads(out.strip().splitlines()[-1])
            results[way].append(r)
            print(f"{way}: {r['cpu_s']:.2f} CPU-s an iteration ({r['sys_s']:.2f} in the kernel), "
                  f"{r['faults']:,.0f} minor faults, peak {r['peak_rss_mib']:.0f} MiB", flush=True)
    print(json.dumps(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": " ".join(["python", "benchmarks/allocator.py", *sys.argv[1:]]), "results": results},
                      f, indent=1)


if __name__ == "__main__":
    main()
