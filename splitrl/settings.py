"""Settings: one frozen dataclass per concern, every field with a default and a doc.

Fields that both stages must agree on (`TrainSettings.shared`) go into the
handshake hash. Click options are generated from these fields (see cli.py), so a
field's ``help`` is written once, here.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

__all__ = ["EnvSettings", "PPOSettings", "TrainSettings", "RunOptions", "CUTS", "TRANSPORTS", "doc"]

TRANSPORTS = ("zmq", "tcp")
CUTS = ("cnn", "input")
"""Where the network is split: after the CNN (the paper's pipeline) or before its
first layer (the paper's "cloud setup": raw observations cross the link)."""


def doc(default: Any, help: str) -> Any:
    """A dataclass field with a default and a one-line help text."""
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class EnvSettings:
    """The environment and its observation pipeline (gymnasium's own wrappers)."""

    env_id: str = doc("CarRacing-v3", "gymnasium environment id (image observations, Box actions)")
    num_envs: int = doc(1, "environments stepped in lock step by stage0 (gymnasium SyncVectorEnv)")
    grayscale: bool = doc(True, "convert RGB observations to grayscale")
    frame_stack: int = doc(4, "consecutive frames stacked into one observation")
    resize: int = doc(0, "resize frames to N x N pixels (0: keep the native size)")
    frame_skip: int = doc(1, "repeat each action N times, max-pooling the last two frames (1: no skip)")
    max_episode_steps: int = doc(0, "time limit per episode (0: the environment's own)")

    def errors(self) -> list[str]:
        out = []
        for name in ("num_envs", "frame_stack", "frame_skip"):
            if getattr(self, name) < 1:
                out.append(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        for name in ("resize", "max_episode_steps"):
            if getattr(self, name) < 0:
                out.append(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        if not self.env_id:
            out.append("--env-id must not be empty")
        return out


@dataclass(frozen=True)
class PPOSettings:
    """PPO hyperparameters; the defaults are the paper's."""

    num_steps: int = doc(4096, "environment steps per env per iteration (rollout length)")
    epochs: int = doc(10, "passes over the rollout per iteration")
    minibatches: int = doc(32, "minibatches per epoch")
    gamma: float = doc(0.99, "discount factor")
    gae_lambda: float = doc(0.95, "GAE lambda")
    clip_coef: float = doc(0.2, "PPO ratio clipping")
    clip_vloss: bool = doc(True, "clip the value loss like the policy ratio")
    vf_coef: float = doc(0.5, "value loss coefficient")
    ent_coef: float = doc(0.0, "entropy bonus coefficient")
    norm_adv: bool = doc(True, "normalise advantages per minibatch")
    lr_encoder: float = doc(5e-5, "Adam learning rate of the stage0 encoder")
    lr_heads: float = doc(1e-5, "Adam learning rate of the stage1 actor-critic heads")
    max_grad_norm: float = doc(0.5, "gradient-norm clipping, applied by each stage to its own parameters")

    def errors(self, num_envs: int) -> list[str]:
        out = []
        for name in ("num_steps", "epochs", "minibatches"):
            if getattr(self, name) < 1:
                out.append(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        batch = self.num_steps * num_envs
        if self.minibatches >= 1 and batch % self.minibatches:
            out.append(f"the batch (num_steps x num_envs = {batch}) must divide into --minibatches {self.minibatches}")
        for name in ("gamma", "gae_lambda"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                out.append(f"--{name.replace('_', '-')} must be in [0, 1], got {getattr(self, name)}")
        for name in ("clip_coef", "lr_encoder", "lr_heads", "max_grad_norm"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                out.append(f"--{name.replace('_', '-')} must be > 0, got {value}")
        return out


@dataclass(frozen=True)
class TrainSettings:
    """Everything both stages must agree on; hashed in the handshake."""

    seed: int = doc(1, "seed of the environments, the initial weights, action sampling and minibatch order")
    total_steps: int = doc(409_600, "environment steps to train for (the paper: 100 iterations of 4096)")
    cut: str = doc("cnn", "where the network is split: 'cnn' (after the encoder) or 'input' (cloud setup)")
    env: EnvSettings = field(default_factory=EnvSettings)
    ppo: PPOSettings = field(default_factory=PPOSettings)

    @property
    def steps_per_iteration(self) -> int:
        return self.ppo.num_steps * self.env.num_envs

    @property
    def num_iterations(self) -> int:
        return self.total_steps // self.steps_per_iteration

    def errors(self) -> list[str]:
        out = self.env.errors() + self.ppo.errors(self.env.num_envs)
        if self.cut not in CUTS:
            out.append(f"--cut must be one of {', '.join(CUTS)}, got {self.cut!r}")
        if self.seed < 0:
            out.append(f"--seed must be >= 0, got {self.seed}")
        if not out and self.num_iterations < 1:
            out.append(
                f"--total-steps {self.total_steps} is less than one iteration "
                f"(num_steps x num_envs = {self.steps_per_iteration})"
            )
        return out

    def validate(self, options: "RunOptions | None" = None) -> "TrainSettings":
        """Raise one ValueError listing every problem (with ``options``' too), or return self."""
        problems = self.errors() + (options.errors() if options is not None else [])
        if problems:
            raise ValueError("invalid settings:\n  - " + "\n  - ".join(problems))
        return self

    def shared(self) -> dict[str, Any]:
        """Flat ``section.field -> value`` map for the handshake."""
        flat: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if dataclasses.is_dataclass(value):
                for g in dataclasses.fields(value):
                    flat[f"{f.name}.{g.name}"] = getattr(value, g.name)
            else:
                flat[f.name] = value
        return flat

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TrainSettings":
        data = dict(data)
        env = EnvSettings(**data.pop("env", {}))
        ppo = PPOSettings(**data.pop("ppo", {}))
        return cls(env=env, ppo=ppo, **data)


@dataclass(frozen=True)
class RunOptions:
    """Per-process options that the stages need not agree on."""

    run_dir: str = doc("", "directory for config, metrics, episodes and checkpoints (default: runs/<time>-<env>)")
    timeout: float = doc(60.0, "seconds to wait for any message from the peer before giving up")
    start_timeout: float = doc(300.0, "seconds to wait for the peer to appear at start-up")
    checkpoint_every: int = doc(10, "save both stages every N iterations (0: only at the end)")
    threads: int = doc(0, "torch intra-op threads (0: torch's default)")
    transport: str = doc("zmq", "the link: 'zmq' (ZeroMQ PUSH/PULL) or 'tcp' (plain sockets, same frames); both sides alike")

    def errors(self) -> list[str]:
        out = []
        if not self.timeout > 0:
            out.append(f"--timeout must be > 0, got {self.timeout}")
        if not self.start_timeout > 0:
            out.append(f"--start-timeout must be > 0, got {self.start_timeout}")
        if self.checkpoint_every < 0:
            out.append(f"--checkpoint-every must be >= 0, got {self.checkpoint_every}")
        if self.transport not in TRANSPORTS:
            out.append(f"--transport must be one of {', '.join(TRANSPORTS)}, got {self.transport!r}")
        if self.threads < 0:
            out.append(f"--threads must be >= 0, got {self.threads}")
        return out
