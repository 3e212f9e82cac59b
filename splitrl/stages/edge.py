"""Stage0's compute: the environments and the layers before the cut.

`Edge` owns no link. Its methods take what arrived and return what to send
(`Payload`); a schedule (`splitrl.schedule`) decides when each happens and moves
the messages. Per iteration: `begin_rollout`, then `observe` / `step` for every
rollout step and `end_rollout`; in training `forward` / `backward` /
`optimizer_step` for every minibatch, the exchange (`splitrl.stages.exchange`)
turning the forward's output into a message and the reply into a gradient.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch
from torch import nn

from ..codecs import CodecSet, Context
from ..envs import EnvSpec, make_vector_env, to_chw, to_env_action
from ..models import build_agent
from ..ppo import minibatch_schedule
from ..runs import RunLog
from ..settings import TrainSettings
from ..transport import Message
from .protocol import Payload, tensor

__all__ = ["Edge", "EMA_DECAY"]

log = logging.getLogger(__name__)

EMA_DECAY = 0.9
"""The paper smooths episodic returns with an EMA of this decay, one update per episode."""


class Edge:
    """Environments + the stage0 part of the network, its optimizer and its rollout storage."""

    def __init__(self, settings: TrainSettings, spec: EnvSpec, run_log: RunLog | None = None, *,
                 vector: str = "sync") -> None:
        self.settings, self.spec, self.run_log = settings, spec, run_log
        self.vector = vector
        """'sync': the environments step in this process; 'async': in worker processes (`splitrl.envs.StepInTwo`)."""
        self.net, _ = build_agent(spec.obs_shape, spec.action_dim, settings.cut, settings.seed, settings.ppo.init_log_std)
        self.params = list(self.net.parameters())
        self.optimizer = torch.optim.Adam(self.params, lr=settings.ppo.lr_encoder, eps=1e-5) if self.params else None
        n, t = settings.env.num_envs, settings.ppo.num_steps
        self.obs = torch.zeros((t, n) + spec.obs_shape, dtype=torch.uint8)
        self.flat_obs = self.obs.view((-1,) + spec.obs_shape)
        self.codecs = CodecSet(**settings.codecs.specs())
        self.all_envs = torch.arange(n)
        self.low, self.high = np.array(spec.action_low), np.array(spec.action_high)
        self.stacked = settings.env.frame_stack > 1
        self.envs: Any = None
        self.stepper: Any = None
        self.action: np.ndarray | None = None
        self.next_obs: np.ndarray | None = None
        self.outcome: Payload = ({}, {})
        """The last step's outcome: it rides on the next message."""
        self.global_step = 0
        self.iteration = 0
        self.ema_return: float | None = None
        self.returns: list[float] = []
        """Returns of the episodes finished in this iteration."""

    @property
    def trains(self) -> bool:
        """Whether stage0 holds parameters (with the cut before the first layer, stage1 trains alone)."""
        return self.optimizer is not None

    # -- environments ----------------------------------------------------------------
    def open_envs(self) -> None:
        s = self.settings
        self.envs, self.stepper = make_vector_env(s.env, vector=self.vector, reward_clip=s.ppo.reward_clip,
                                                  reward_gamma=s.ppo.gamma if s.ppo.norm_reward else None)
        self.next_obs, _ = self.envs.reset(seed=s.seed)

    def close(self) -> None:
        if self.envs is not None:
            self.envs.close()
            self.envs = None

    # -- rollout ---------------------------------------------------------------------
    def begin_rollout(self, iteration: int) -> None:
        self.iteration = iteration
        self.returns = []
        self.codecs.new_iteration()

    def encode(self, obs: np.ndarray | torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.net(torch.as_tensor(obs))

    def observe(self, t: int) -> Payload:
        """Step ``t``'s message: the current observation stored and encoded, after the last step's outcome."""
        n = self.settings.env.num_envs
        obs = torch.as_tensor(to_chw(self.next_obs, self.stacked))
        self.obs[t] = obs
        tensors, header = self.outcome
        ctx = Context(idx=t * n + self.all_envs, envs=self.all_envs, global_step=self.global_step)
        self.codecs.pack("rollout", "features", self.encode(obs), ctx, tensors, header)
        header["t"] = t
        return tensors, header

    def step(self, msg: Message) -> None:
        """Take stage1's ``action``: step the environments, log finished episodes, keep the outcome."""
        self.begin_step(msg)
        self.finish_step()

    def begin_step(self, msg: Message) -> None:
        """Start stepping the environments with stage1's ``action`` (in their workers with ``vector='async'``)."""
        action = tensor(msg, "action", (self.settings.env.num_envs, self.spec.action_dim), torch.float32)
        self.action = to_env_action(action.numpy(), self.low, self.high, self.settings.env.action_map)
        self.stepper.begin(self.action)

    def finish_step(self) -> None:
        """Wait for the step `begin_step` started; log finished episodes, keep the outcome for the next message."""
        self.next_obs, reward, terminated, truncated, info = self.envs.step(self.action)
        self.global_step += self.settings.env.num_envs
        self._episodes(info)
        self.outcome = self._outcome(reward, terminated, truncated, info)

    def end_rollout(self) -> Payload:
        """``rollout_end``: the last outcome and the features of the observation to bootstrap from."""
        tensors, header = self.outcome
        ctx = Context(envs=self.all_envs, global_step=self.global_step)
        self.codecs.pack("rollout", "features", self.encode(to_chw(self.next_obs, self.stacked)), ctx, tensors, header)
        self.outcome = ({}, {})
        return tensors, header

    def _outcome(self, reward, terminated, truncated, info) -> Payload:
        out = {
            "reward": torch.as_tensor(reward, dtype=torch.float32),
            "terminated": torch.as_tensor(terminated, dtype=torch.bool),
            "truncated": torch.as_tensor(truncated, dtype=torch.bool),
        }
        header: dict[str, Any] = {}
        bootstrap = np.flatnonzero(np.asarray(truncated) & ~np.asarray(terminated))
        if len(bootstrap):
            final = np.stack([info["final_obs"][i] for i in bootstrap])
            index = torch.as_tensor(bootstrap, dtype=torch.int64)
            # Packed before the next step's features: stateful codecs see each env's frames in order.
            ctx = Context(envs=index, global_step=self.global_step)
            self.codecs.pack("rollout", "final_features", self.encode(to_chw(final, self.stacked)), ctx, out, header)
            out["final_index"] = index
        return out, header

    def _episodes(self, info: dict[str, Any]) -> None:
        if "episode" not in info:
            return
        for i in np.flatnonzero(info["_episode"]):
            r, length = float(info["episode"]["r"][i]), int(info["episode"]["l"][i])
            self.ema_return = r if self.ema_return is None else EMA_DECAY * self.ema_return + (1 - EMA_DECAY) * r
            self.returns.append(r)
            if self.run_log is not None:
                self.run_log.episode({"global_step": self.global_step, "iteration": self.iteration, "env": int(i),
                                      "return": r, "length": length, "ema_return": self.ema_return})

    # -- training --------------------------------------------------------------------
    def minibatches(self) -> list[list[torch.Tensor]]:
        """This iteration's minibatch indices, per epoch: the same on both stages."""
        ppo = self.settings.ppo
        return minibatch_schedule(self.settings.seed, self.iteration, ppo.epochs, self.flat_obs.shape[0], ppo.minibatches)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """The current encoder on the stored observations of samples ``idx``, with its graph."""
        return self.net(self.flat_obs[idx])

    def backward(self, out: torch.Tensor, grad: torch.Tensor) -> None:
        """Back-propagate the gradient stage1 sent for ``out`` (gradients accumulate until the step)."""
        torch.autograd.backward(out, grad)

    def optimizer_step(self) -> None:
        nn.utils.clip_grad_norm_(self.params, self.settings.ppo.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def state_dict(self) -> dict[str, Any]:
        return {
            "iteration": self.iteration,
            "net": self.net.state_dict(),
            "optimizer": self.optimizer.state_dict() if self.optimizer else None,
        }

