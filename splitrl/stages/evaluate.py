"""Scoring an agent: both halves in one process, whole episodes on seeds that training never used.

`evaluate` runs the encoder and the heads it is given on one environment with the training's
observation pipeline and no reward shaping (the returns are the environment's own), one episode
per seed, and optionally records every episode as an mp4 with gymnasium's `RecordVideo` (the
frames a person sees, ``render_mode="rgb_array"``). `load_agent` rebuilds both halves from a run
directory's checkpoints; `splitrl eval` and the evaluation during training (`Edge.evaluate`) both
end here.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path
from typing import Any, Callable

import gymnasium as gym
import numpy as np
import torch
from torch import nn

from ..devices import to_device, to_host
from ..envs import EnvSpec, batch, make_single_env
from ..models import ActorCriticHeads, agent
from ..models.greedy import DEFAULT_GREEDY, GreedyPolicy
from ..runs import checkpoint_iterations, load_checkpoint, run_config
from ..settings import SettingsError, TrainSettings
from .protocol import STAGE0, STAGE1

__all__ = ["EVAL_SEED_OFFSET", "EvalResult", "Evaluation", "evaluate", "play", "load_agent", "eval_seed", "append_eval"]

EVAL_SEED_OFFSET = 1_000_000
"""Held-out episodes start at seed + this. Training seeds env i once with seed + i and never again
(autoreset goes on with each env's generator), so these episodes begin where training never began."""


def eval_seed(settings: TrainSettings) -> int:
    """The first held-out seed of a run: far from every seed its training used."""
    return settings.seed + EVAL_SEED_OFFSET


@dataclasses.dataclass
class EvalResult:
    """Each episode's return and length, in seed order."""

    returns: list[float]
    lengths: list[int]

    @property
    def mean(self) -> float:
        return float(np.mean(self.returns))

    @property
    def std(self) -> float:
        return float(np.std(self.returns))

    def record(self, **extra: Any) -> dict[str, Any]:
        return {**extra, "episodes": len(self.returns), "return_mean": self.mean, "return_std": self.std,
                "returns": self.returns, "lengths": self.lengths}


def evaluate(settings: TrainSettings, encoder: nn.Module, heads: ActorCriticHeads, spec: EnvSpec, *, episodes: int,
             seed: int, deterministic: bool = True, video_dir: str | Path | None = None,
             max_steps: int | None = None, greedy: str = DEFAULT_GREEDY, video_episodes: int | None = None,
             video_prefix: str | None = None) -> EvalResult:
    """Run ``episodes`` episodes, episode k from ``seed + k``. ``deterministic``: the policy's greedy action by
    the rule ``greedy`` (`splitrl.models.greedy`; the largest logit for discrete actions); otherwise sampled, from
    a generator seeded with ``seed``. ``max_steps`` cuts an episode (the env's own time limit applies anyway).
    ``video_dir``: an mp4 of each of the first ``video_episodes`` episodes (default all) there, named
    ``PREFIX-episode-K.mp4`` (``video_prefix``, default ``eval-seedSEED``)."""
    device = next(heads.parameters()).device  # the encoder's too: both halves compute where the heads are
    generator = torch.Generator().manual_seed(seed)
    policy = GreedyPolicy.of(heads, spec.action_low, spec.action_high, settings.env.action_map, greedy).to(device)

    def act(rows: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            x = encoder(to_device(torch.as_tensor(rows), device))
            if deterministic:
                return to_host(policy(x)).numpy()
            u = heads.evaluate(*heads.outputs(x), generator=generator)[0]
        return spec.env_action(to_host(heads.wire_action(u)).numpy(), settings.env.action_map)

    was_training = encoder.training, heads.training
    encoder.eval()
    heads.eval()
    try:
        return play(settings, spec, act, episodes=episodes, seed=seed, video_dir=video_dir, max_steps=max_steps,
                    video_episodes=video_episodes, video_prefix=video_prefix)
    finally:
        encoder.train(was_training[0])
        heads.train(was_training[1])


def play(settings: TrainSettings, spec: EnvSpec, act: Callable[[np.ndarray], np.ndarray], *, episodes: int,
         seed: int, video_dir: str | Path | None = None, max_steps: int | None = None,
         video_episodes: int | None = None, video_prefix: str | None = None,
         total_steps: int | None = None) -> EvalResult:
    """``episodes`` whole episodes, episode k from ``seed + k``, with ``act`` (observation rows (1, ...), as
    `EnvSpec.rows` gives them, to env actions (1, ...)) choosing every action: `evaluate`'s loop, that of an
    exported policy, and the one that records observations for an export's check (`splitrl.export`).
    ``total_steps``: stop once this many steps are taken in all, the episode then going on left out."""
    if episodes < 1:
        raise SettingsError(f"--episodes must be >= 1, got {episodes}")
    env = make_single_env(settings.env, render_mode="rgb_array" if video_dir else None)
    if video_dir:
        filmed = episodes if video_episodes is None else video_episodes
        with warnings.catch_warnings():
            if video_prefix:  # training's videos share a folder: each evaluation's prefix keeps the others
                warnings.filterwarnings("ignore", message=".*Overwriting existing videos")
            env = gym.wrappers.RecordVideo(env, str(video_dir), episode_trigger=lambda k: k < filmed,
                                           name_prefix=video_prefix or f"eval-seed{seed}", disable_logger=True)
    stacked = settings.env.image_pipeline[1] > 1
    returns, lengths, taken = [], [], 0
    try:
        for k in range(episodes):
            obs, _ = env.reset(seed=seed + k)
            total, steps, done = 0.0, 0, False
            while not done:
                if total_steps is not None and taken >= total_steps:
                    return EvalResult(returns, lengths)
                action = act(spec.rows(batch([obs]), stacked))[0]
                obs, reward, terminated, truncated, _ = env.step(action)
                total += float(reward)
                steps += 1
                taken += 1
                done = terminated or truncated or (max_steps is not None and steps >= max_steps)
            returns.append(total)
            lengths.append(steps)
    finally:
        env.close()  # RecordVideo writes the last episode's file here
    return EvalResult(returns, lengths)


class Evaluation:
    """Scoring during training, on stage0 (``--eval-every N --eval-episodes K``).

    stage0 holds the environments and the encoder but not the heads, so at an iteration's end it asks
    for them (``eval`` in ``iter_end``) and stage1 sends their weights once (``eval_heads``, float32,
    metered under its own name and never counted as training's bytes, `splitrl.runs.NOT_TRAINING_KINDS`);
    the episodes then run on stage0 with no message per step. That costs one heads' worth of bytes per
    evaluation (16.8 MB with the paper's network) instead of 2 x 16 KiB per step of every episode, and
    it works with every exchange (the replica's heads would lag the trained ones). The episodes use the
    held-out seeds of `splitrl eval` and its default greedy action (`DEFAULT_GREEDY`); nothing of training's state is touched (own
    env, own generator), so training goes on exactly as without it.
    """

    def __init__(self, settings: TrainSettings, spec: EnvSpec, every: int, episodes: int,
                 device: torch.device | str = "cpu", video_dir: str | Path | None = None,
                 video_every: int = 1) -> None:
        self.settings, self.spec, self.every, self.episodes = settings, spec, every, episodes
        self.device = torch.device(device)
        """stage0's device, where its encoder is: the heads are put beside it."""
        self.video_dir, self.video_every = video_dir, video_every
        """``--capture-video``: the first episode of every ``video_every``-th evaluation (and of the last) as an
        mp4 in ``video_dir``, ``iterNNNNN-episode-0.mp4`` (`filmed`)."""
        self._heads: ActorCriticHeads | None = None

    def due(self, iteration: int) -> bool:
        """After every ``every``-th iteration and after the last."""
        return self.every > 0 and (iteration % self.every == 0 or iteration == self.settings.num_iterations)

    def filmed(self, iteration: int) -> bool:
        """Whether the evaluation after ``iteration`` records its first episode: the evaluations are counted
        1, 2, ... by iteration (the one after the last iteration is the next count), so a resumed run films
        the same ones."""
        count = -(-iteration // self.every)
        return self.video_dir is not None and (count % self.video_every == 0
                                               or iteration == self.settings.num_iterations)

    def run(self, encoder: nn.Module, heads_state: dict[str, torch.Tensor],
            iteration: int | None = None) -> dict[str, float]:
        """Score ``encoder`` with heads of ``heads_state`` after ``iteration`` (the video's, if `filmed`); the
        metrics keys of the iteration's record."""
        s = self.settings
        if self._heads is None:
            self._heads = agent(s, self.spec)[1].to(self.device)
        self._heads.load_state_dict(heads_state)
        film = iteration is not None and self.filmed(iteration)
        result = evaluate(s, encoder, self._heads, self.spec, episodes=self.episodes, seed=eval_seed(s),
                          video_dir=self.video_dir if film else None, video_episodes=1,
                          video_prefix=f"iter{iteration:05d}" if film else None)
        return {"eval/return_mean": result.mean, "eval/return_std": result.std, "eval/episodes": len(result.returns)}


def _settings_of(config: dict[str, Any]) -> TrainSettings:
    try:
        return TrainSettings.from_dict(config["settings"])
    except (KeyError, TypeError) as exc:
        raise SettingsError(f"the run's config does not describe its settings ({exc})") from None


def load_agent(run_dir: str | Path, iteration: int | None = None, stage1_dir: str | Path | None = None
               ) -> tuple[TrainSettings, EnvSpec, nn.Module, ActorCriticHeads, int]:
    """(settings, env spec, encoder, heads, iteration) from a run directory's checkpoints: the newest
    iteration both stages have unless ``iteration``; stage1's from ``stage1_dir`` when the run was split
    across machines (each stage its own directory)."""
    run_dir = Path(run_dir)
    stage1_dir = Path(stage1_dir) if stage1_dir else run_dir
    config = run_config(run_dir)
    settings = _settings_of(config)
    spec = EnvSpec.from_config(config["env_spec"])
    both = sorted(set(checkpoint_iterations(run_dir, STAGE0)) & set(checkpoint_iterations(stage1_dir, STAGE1)))
    if not both:
        raise SettingsError(f"{run_dir}: no iteration with checkpoints of both stages (stage1's looked for in "
                            f"{stage1_dir})")
    if iteration is None:
        iteration = both[-1]
    elif iteration not in both:
        raise SettingsError(f"--iteration {iteration}: no checkpoint pair of it; there are {both}")
    encoder, heads = agent(settings, spec)
    encoder.load_state_dict(load_checkpoint(run_dir, STAGE0, iteration)["net"])
    heads.load_state_dict(load_checkpoint(stage1_dir, STAGE1, iteration)["heads"])
    return settings, spec, encoder, heads, iteration


def append_eval(run_dir: str | Path, record: dict[str, Any]) -> None:
    """One line of eval.jsonl (NaN-free: the returns are finite sums)."""
    with open(Path(run_dir) / "eval.jsonl", "a") as out:
        out.write(json.dumps(record, allow_nan=False) + "\n")
