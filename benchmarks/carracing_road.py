"""CarRacing's env step as gymnasium draws it and as splitrl does (`splitrl.carracing`), side by side.

    python benchmarks/carracing_road.py [--steps 1000] [--rounds 3] [--seed 0]

Each round steps a stock env, one with splitrl's road pass alone (``road``) and one with everything
`splitrl.carracing.draw_faster` gives (``splitrl``: the road and the kept font) through the same seeded episodes
with the same random actions (in an order that turns round by round), checks that every frame is equal, and
reports each one's CPU milliseconds a step (`time.process_time`, this process on one torch-free thread). Prints
one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import gymnasium as gym
import numpy as np

from splitrl.carracing import draw_faster


def episode_frames(faster: bool, steps: int, seed: int, *, episode_steps: int = 500,
                   render_mode: str | None = None, font: bool = True) -> tuple[list[np.ndarray], list[float], float]:
    """A stock (or, ``faster``, a patched) CarRacing stepped ``steps`` times from ``seed`` with seeded random actions
    that mostly drive on (over tiles, which the env repaints) and often off the road, reset with a new track when an
    episode of ``episode_steps`` ends: its frames (the observations, or with ``render_mode`` what `render` gives),
    the rewards and the CPU seconds of the steps. ``font=False``: the faster env without the kept font."""
    env = gym.make("CarRacing-v3", max_episode_steps=episode_steps, render_mode=render_mode)
    if faster and not draw_faster(env):
        raise RuntimeError("this gymnasium's CarRacing is not one splitrl.carracing was checked against")
    if not font:
        vars(env.unwrapped).pop("_render", None)
    rng = np.random.default_rng(seed)
    obs, _ = env.reset(seed=seed)
    frames, rewards = [obs], []
    start = time.process_time()
    for step in range(steps):
        obs, reward, terminated, truncated, _ = env.step(rng.uniform([-1, 0.3, 0], [1, 1, 0.2]).astype(np.float32))
        frames.append(env.render() if render_mode else obs)
        rewards.append(float(reward))
        if terminated or truncated:
            obs, _ = env.reset(seed=seed + step + 1)
            frames.append(obs)
    seconds = time.process_time() - start
    env.close()
    return frames, rewards, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    variants = {"stock": (False, True), "road": (True, False), "splitrl": (True, True)}
    ms: dict[str, list[float]] = {name: [] for name in variants}
    equal = True
    for round_ in range(args.rounds):
        names = list(variants)[round_ % 3:] + list(variants)[:round_ % 3]
        frames = {}
        for name in names:
            faster, font = variants[name]
            frames[name], _, seconds = episode_frames(faster, args.steps, args.seed + round_, font=font)
            ms[name].append(1000 * seconds / args.steps)
        equal &= all(len(frames[name]) == len(frames["stock"]) and all(
            np.array_equal(a, b) for a, b in zip(frames["stock"], frames[name])) for name in variants)
    median = {name: statistics.median(values) for name, values in ms.items()}
    print(json.dumps({"gymnasium": gym.__version__, "steps": args.steps, "rounds": args.rounds,
                      "ms_per_step_stock": round(median["stock"], 3), "ms_per_step_road": round(median["road"], 3),
                      "ms_per_step_splitrl": round(median["splitrl"], 3),
                      "stock_over_splitrl": round(median["stock"] / median["splitrl"], 2),
                      "road_over_splitrl": round(median["road"] / median["splitrl"], 2), "frames_equal": bool(equal),
                      "per_round_ms": {k: [round(v, 3) for v in vs] for k, vs in ms.items()}}))

if __name__ == "__main__":
    main()
