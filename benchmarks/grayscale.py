"""gymnasium's grayscale of a CarRacing frame and splitrl's (`splitrl.grayscale`), side by side.

    python benchmarks/grayscale.py [--frames 200] [--count 20] [--rounds 3]

Collects ``--frames`` frames of CarRacing-v3 (96x96 RGB, seeded random actions), then for ``--rounds`` rounds times
each function over every frame ``--count`` times (alternating which goes first), thread CPU microseconds a
frame, and checks that their bytes are equal on every frame. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import gymnasium as gym
import numpy as np

from splitrl.grayscale import grayscale


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--frames", type=int, default=200)
    parser.add_argument("--count", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    env = gym.make("CarRacing-v3")
    stock = gym.wrappers.GrayscaleObservation(env, keep_dim=False).func  # gymnasium's own function
    rng = np.random.default_rng(0)
    obs, _ = env.reset(seed=0)
    frames = [obs]
    for _ in range(args.frames - 1):
        obs, *_ = env.step(rng.uniform([-1, 0.3, 0], [1, 1, 0.2]).astype(np.float32))
        frames.append(obs)
    env.close()
    equal = all(np.array_equal(stock(f), grayscale(f)) for f in frames)
    us: dict[str, list[float]] = {"gymnasium": [], "splitrl": []}
    for round_ in range(args.rounds):
        order = [("gymnasium", stock), ("splitrl", grayscale)]
        for name, func in order if round_ % 2 == 0 else order[::-1]:
            start = time.thread_time()
            for _ in range(args.count):
                for frame in frames:
                    func(frame)
            us[name].append(1e6 * (time.thread_time() - start) / (args.count * len(frames)))
    median = {name: statistics.median(values) for name, values in us.items()}
    print(json.dumps({"gymnasium": gym.__version__, "frames": len(frames),
                      "us_per_frame_gymnasium": round(median["gymnasium"], 1),
                      "us_per_frame_splitrl": round(median["splitrl"], 1),
                      "gymnasium_over_splitrl": round(median["gymnasium"] / median["splitrl"], 2),
                      "bytes_equal": bool(equal), "per_round_us": {k: [round(v, 1) for v in vs] for k, vs in us.items()}}))


if __name__ == "__main__":
    main()
