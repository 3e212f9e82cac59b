"""CarRacing's env step with gymnasium's road pass and with splitrl's (`splitrl.carracing`), side by side.

    python benchmarks/carracing_road.py [--steps 1000] [--rounds 3] [--seed 0]

Each round steps a stock env and a patched one through the same seeded episodes with the same random actions
(alternating which goes first), checks that every frame is equal, and reports each one's CPU milliseconds a step
(`time.process_time`, this process on one torch-free thread). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import gymnasium as gym
import numpy as np

from splitrl.carracing import draw_road_faster


def episode_frames(faster: bool, steps: int, seed: int, *, episode_steps: int = 500,
                   render_mode: str | None = None) -> tuple[list[np.ndarray], list[float], float]:
    """A stock (or, ``faster``, a patched) CarRacing stepped ``steps`` times from ``seed`` with seeded random actions
    that mostly drive on (over tiles, which the env repaints) and often off the road, reset with a new track when an
    episode of ``episode_steps`` ends: its frames (the observations, or with ``render_mode`` what `render` gives),
    the rewards and the CPU seconds of the steps."""
    env = gym.make("CarRacing-v3", max_episode_steps=episode_steps, render_mode=render_mode)
    if faster and not draw_road_faster(env):
        raise RuntimeError("this gymnasium's CarRacing is not one splitrl.carracing was checked against")
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
    ms: dict[str, list[float]] = {"stock": [], "splitrl": []}
    equal = True
    for round_ in range(args.rounds):
        order = (False, True) if round_ % 2 == 0 else (True, False)
        frames = {}
        for faster in order:
            frames[faster], _, seconds = episode_frames(faster, args.steps, args.seed + round_)
            ms["splitrl" if faster else "stock"].append(1000 * seconds / args.steps)
        equal &= len(frames[False]) == len(frames[True]) and all(
            np.array_equal(a, b) for a, b in zip(frames[False], frames[True]))
    stock, ours = statistics.median(ms["stock"]), statistics.median(ms["splitrl"])
    print(json.dumps({"gymnasium": gym.__version__, "steps": args.steps, "rounds": args.rounds,
                      "ms_per_step_stock": round(stock, 3), "ms_per_step_splitrl": round(ours, 3),
                      "stock_over_splitrl": round(stock / ours, 2), "frames_equal": bool(equal),
                      "per_round_ms": {k: [round(v, 3) for v in vs] for k, vs in ms.items()}}))


if __name__ == "__main__":
    main()
