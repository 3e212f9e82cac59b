"""Stage0's compute: the environments and the layers before the cut.

`Edge` owns no link. Its methods take what arrived and return what to send
(`Payload`); a schedule (`splitrl.schedule`) decides when each happens and moves
the messages. Per iteration: `begin_rollout`, then for every env group and step
`observe` / `begin_step` / `finish_step` and a last `end_rollout`; in training
`begin_training`, then `forward` / `backward` / `optimizer_step` for every
minibatch, the exchange (`splitrl.stages.exchange`) turning the forward's output
into a message and the reply into a gradient.

The environments may be cut into groups that step in turn (the pipelined
schedule: one group steps while stage1 acts for another), and the rollout may
use its own copy of the encoder (the asynchronous schedule: the rollout of the
next iteration acts while this one trains, and `publish` / `adopt` swap the
trained weights in between two steps). With one group and no copy, every call
is what the synchronous schedule makes.

Its parts are objects of their own: the published policy versions
(`splitrl.stages.versions`) and a fleet edge's share of the fleet's one encoder
(`splitrl.stages.fleet_encoder`).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Iterable

import numpy as np
import torch
from torch import nn

from ..codecs import CodecSet, Context
from ..devices import to_device
from ..envs import (EnvSpec, batch, choose_vector, make_vector_env, restore_vector_env, vector_env_state,
                    worker_cpu_seconds)
from ..models import agent
from ..ppo import anneal, minibatch_schedule
from ..runs import EMA_DECAY, RunLog
from ..settings import TrainSettings
from ..transport import Message, ProtocolError
from .autoencoder import pack_sample, sampled
from .budget import TRAINING, LinkBudget, switch
from .episodes import Episodes
from .fleet_encoder import EdgeEncoder
from .protocol import Payload, tensor
from .versions import PolicyVersions

__all__ = ["Edge", "EMA_DECAY"]

log = logging.getLogger(__name__)

JOIN_SEED_STRIDE = 1_000_003
"""How far a late edge's env seeds move per iteration it joined after (far beyond any fleet's env count)."""


class Edge:
    """Environments + the stage0 part of the network, its optimizer and its rollout storage.

    `set_groups` cuts the envs into groups (each its own vector env of ``num_envs / groups``);
    ``slots``: rollouts stored at once (2 when one trains while the next is collected);
    ``acting_copy``: the rollout acts with a copy of the encoder that `adopt` updates.
    """

    def __init__(self, settings: TrainSettings, spec: EnvSpec, run_log: RunLog | None = None, *,
                 vector: str = "auto", slots: int = 1, acting_copy: bool = False, edge: int = 0,
                 device: torch.device | str = "cpu") -> None:
        self.settings, self.spec, self.run_log = settings, spec, run_log
        self.device = torch.device(device)
        """Where the encoder, its optimizer and the rollout's observations live (`splitrl.devices`); the envs step on
        the CPU, and the codecs work in host memory."""
        self.edge = edge
        """Which edge of a fleet this is (`ScheduleSettings.edges`): its envs are the fleet's envs
        ``offset .. offset + num_envs - 1`` of `total_envs`, seeded, named and indexed as those."""
        self.offset, self.total_envs = edge * settings.env.num_envs, settings.total_envs
        self.joined_after = 0
        """A fleet's late edge: the iteration after which it joined (`join`); 0 for the others."""
        self.vector = choose_vector(vector, settings.env.num_envs)
        """'sync': the environments step in this process; 'async': in worker processes (`splitrl.envs.StepInTwo`)."""
        self.net = agent(settings, spec)[0].to(self.device)  # built on the CPU: the same weights on any device
        self.params = [p for p in self.net.parameters() if p.requires_grad]  # not an autoencoder's projection
        self.optimizer = torch.optim.Adam(self.params, lr=settings.ppo.lr_encoder, eps=1e-5) if self.params else None
        self.policy: PolicyVersions[nn.Sequential] = PolicyVersions(self.net, acting_copy)
        """The encoder the rollout acts with and the published ones (`publish`, `adopt`)."""
        self.fleet = EdgeEncoder(self.net, self.optimizer, lambda: agent(settings, spec)[0])
        """This edge's part of a fleet's one encoder (``--encoder-sync``, joining)."""
        n, t = settings.env.num_envs, settings.ppo.num_steps
        rows = (t, n) + spec.row_shape
        self.buffers = [torch.zeros(rows, dtype=getattr(torch, spec.row_dtype), device=self.device)
                        for _ in range(slots)]
        self.obs = self.buffers[0]
        """The observations of the rollout being collected (one slot of `buffers`), as `EnvSpec.rows`."""
        self.flat_obs = self.obs.view((-1,) + spec.row_shape)
        """The observations of the rollout being trained on, one row per sample (t * num_envs + env)."""
        self.codecs = CodecSet(**settings.codecs.specs(), device=self.device)
        self.exchange = settings.codecs.parsed_exchange()
        """The training exchange as this iteration runs it (``--link-budget`` may lengthen a replica's periods)."""
        self.budget = LinkBudget.of(settings, spec)
        self.budget_metrics: dict[int, dict[str, Any]] = {}
        """``--link-budget``: each iteration's choice, until its metrics record takes it."""
        self.last_record: dict[str, Any] | None = None
        """The newest iteration's metrics record (`splitrl.schedule.common.IterationLog`): what the budget measures."""
        self.announced: dict[int, dict[str, str]] = {}
        """``--link-budget``: each iteration's settings, sent with its first step, until its training takes them."""
        self.low, self.high = np.array(spec.action_low), np.array(spec.action_high)
        self.stacked = settings.env.image_pipeline[1] > 1
        self.envs: list[Any] = []
        self.steppers: list[Any] = []
        self.next_obs: list[np.ndarray] = []
        self.saved_envs: list[dict[str, Any]] | None = None
        """The envs' state from a checkpoint, put back by `open_envs`."""
        self.set_groups(1)
        self.global_step = 0
        self.iteration = 0
        """The iteration being collected."""
        self.train_iteration = 0
        """The iteration being trained on."""
        self.episodes = Episodes(run_log)
        """The finished episodes' returns and their EMA."""

    acting = property(lambda self: self.policy.acting, doc="The encoder the rollout acts with (`net` itself "
                      "without an acting copy).")
    acting_version = property(lambda self: self.policy.version, doc="The policy version the rollout acts with: "
                              "the training iterations done on its weights, or the epochs with --publish epoch.")
    published = property(lambda self: self.policy.published)

    @property
    def trains(self) -> bool:
        """Whether stage0 holds parameters (with the cut before the first layer, stage1 trains alone)."""
        return self.optimizer is not None

    @property
    def train_step(self) -> int:
        """Env steps collected when the rollout being trained on ended (codecs' warm starts count these)."""
        return self.train_iteration * self.settings.steps_per_iteration

    # -- environments ----------------------------------------------------------------
    def set_groups(self, groups: int) -> None:
        """Cut the envs into ``groups`` equal groups that step in turn (before `open_envs`)."""
        n = self.settings.env.num_envs
        if groups < 1 or n % groups or self.envs:
            raise ValueError(f"{n} envs do not split into {groups} equal groups (or the envs are open already)")
        size = n // groups
        self.groups = [torch.arange(g * size, (g + 1) * size) for g in range(groups)]
        """Each group's env indices in the rollout batch."""
        self.actions: list[np.ndarray | None] = [None] * groups
        self.outcome: list[Payload] = [({}, {}) for _ in range(groups)]
        """Each group's last outcome: it rides on the group's next message."""

    def open_envs(self) -> None:
        """Each group's vector env, reset so that env i has seed ``seed + i`` whatever the grouping."""
        s = self.settings
        if self.saved_envs is not None and len(self.saved_envs) != len(self.groups):
            raise ValueError(f"the checkpoint's rollout had {len(self.saved_envs)} env groups, this run has "
                             f"{len(self.groups)}: resume with the same --rollout-groups")
        group_env = dataclasses.replace(s.env, num_envs=len(self.groups[0]))
        for g, envs in enumerate(self.groups):
            env, stepper = make_vector_env(group_env, vector=self.vector, reward_clip=s.ppo.reward_clip,
                                           reward_gamma=s.ppo.gamma if s.ppo.norm_reward else None)
            self.envs.append(env)
            self.steppers.append(stepper)
            # A fleet's late edge does not replay its place's first episodes: its seeds move on by the iteration.
            obs = env.reset(seed=s.seed + self.offset + int(envs[0]) + JOIN_SEED_STRIDE * self.joined_after)[0]
            self.next_obs.append(obs if self.saved_envs is None else restore_vector_env(env, self.saved_envs[g]))
        self.saved_envs = None

    def env_cpu_seconds(self) -> float | None:
        """CPU seconds the envs' worker processes have used so far (0: the envs step in this process; None: not
        measurable here, or no envs open)."""
        seconds = [worker_cpu_seconds(stepper) for stepper in self.steppers]
        return None if not seconds or None in seconds else sum(seconds)

    def close(self) -> None:
        for env in self.envs:
            env.close()
        self.envs, self.steppers = [], []

    # -- rollout ---------------------------------------------------------------------
    def begin_rollout(self, iteration: int) -> None:
        self.iteration = iteration
        self.obs = self.buffers[iteration % len(self.buffers)]
        self.codecs.new_iteration("rollout")
        if self.budget is not None and self.last_record is not None:
            metrics = self.budget_metrics[iteration] = self.budget.choose(iteration, self.last_record)
            specs = self.announced[iteration] = self.budget.specs()
            metrics.update({f"budget/spec/{k}": v for k, v in specs.items()})
            switch(self.codecs, specs, ["rollout"])

    def adopt(self, version: int | None = None) -> int:
        """Act from now on with the newest published weights, or with those of ``version`` (--publish epoch's
        pace; it must be published); returns the version acting. Older copies are dropped."""
        def unknown(version: int) -> RuntimeError:
            return RuntimeError(f"stage0 was asked to act with policy version {version}; published: "
                                f"{sorted(self.published) or 'none'}, acting: {self.acting_version}")
        return self.policy.adopt(version, unknown)

    def encode(self, obs: np.ndarray | torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.acting(to_device(torch.as_tensor(obs), self.device))

    def observe(self, t: int, g: int = 0) -> Payload:
        """Group ``g``'s step ``t`` message: its observation stored and encoded, after its last outcome."""
        envs = self.groups[g]
        obs = to_device(torch.as_tensor(self.spec.rows(self.next_obs[g], self.stacked)), self.device)
        self.obs[t, envs[0]: envs[-1] + 1] = obs
        tensors, header = self.outcome[g]
        if t == 0 and self.iteration in self.announced:
            header["budget"] = self.announced[self.iteration]
        fleet_envs = self.offset + envs
        ctx = Context(idx=t * self.total_envs + fleet_envs, envs=fleet_envs, global_step=self.global_step)
        if sampled(self.settings, t):  # the features before the projection too, for stage1's autoencoder
            with torch.no_grad():
                before = self.acting[:-1](obs)
                features = self.acting[-1](before)
            pack_sample(before, tensors, header)
        else:
            features = self.encode(obs)
        self.codecs.pack("rollout", "features", features, ctx, tensors, header)
        return tensors, header

    def step(self, msg: Message, g: int = 0) -> None:
        """Take stage1's ``action``: step the environments, log finished episodes, keep the outcome."""
        self.begin_step(msg, g)
        self.finish_step(g)

    def begin_step(self, msg: Message, g: int = 0) -> None:
        """Start stepping group ``g`` with stage1's ``action`` (in its workers with ``vector='async'``)."""
        n = len(self.groups[g])
        if self.spec.discrete:
            action = tensor(msg, "action", (n,), torch.int64)
            if not bool(((action >= 0) & (action < self.spec.action_dim)).all()):
                raise ProtocolError(f"{msg.kind}: tensor 'action': expected indices in [0, {self.spec.action_dim}), "
                                    f"got values from {int(action.min())} to {int(action.max())}")
        else:
            action = tensor(msg, "action", (n, self.spec.action_dim), torch.float32)
        self.actions[g] = self.spec.env_action(action.numpy(), self.settings.env.action_map)
        self.steppers[g].begin(self.actions[g])

    def finish_step(self, g: int = 0) -> None:
        """Wait for group ``g``'s step; log finished episodes, keep the outcome for its next message."""
        self.next_obs[g], reward, terminated, truncated, info = self.envs[g].step(self.actions[g])
        self.global_step += len(self.groups[g]) * self.settings.schedule.edges  # a fleet's edges step in lock step
        self.episodes.record(info, self.offset + self.groups[g], self.global_step, self.iteration)
        self.outcome[g] = self._outcome(reward, terminated, truncated, info, g)

    def end_rollout(self, g: int = 0) -> Payload:
        """Group ``g``'s ``rollout_end``: its last outcome and the features of the observation to bootstrap from."""
        tensors, header = self.outcome[g]
        ctx = Context(envs=self.offset + self.groups[g], global_step=self.global_step)
        features = self.encode(self.spec.rows(self.next_obs[g], self.stacked))
        self.codecs.pack("rollout", "features", features, ctx, tensors, header)
        self.outcome[g] = ({}, {})
        return tensors, header

    def _outcome(self, reward, terminated, truncated, info, g: int) -> Payload:
        out = {
            "reward": torch.as_tensor(reward, dtype=torch.float32),
            "terminated": torch.as_tensor(terminated, dtype=torch.bool),
            "truncated": torch.as_tensor(truncated, dtype=torch.bool),
        }
        header: dict[str, Any] = {}
        bootstrap = np.flatnonzero(np.asarray(truncated) & ~np.asarray(terminated))
        if len(bootstrap):
            final = batch([info["final_obs"][i] for i in bootstrap])
            index = torch.as_tensor(bootstrap, dtype=torch.int64)  # within the group
            # Packed before the next step's features: stateful codecs see each env's frames in order.
            ctx = Context(envs=self.offset + self.groups[g][index], global_step=self.global_step)
            features = self.encode(self.spec.rows(final, self.stacked))
            self.codecs.pack("rollout", "final_features", features, ctx, out, header)
            out["final_index"] = index
        return out, header

    def rollout_summary(self) -> dict[str, Any]:
        """Taken when a rollout ends: env steps so far, the returns of the episodes finished since the last
        call, their EMA, and (``resume``) everything a resumed run needs to go on from here: the envs'
        state, the rollout codec's. The asynchronous schedule takes it from the rollout thread, so each
        iteration's metrics and checkpoint speak of that iteration's rollout while the next one runs."""
        returns, ema_return = self.episodes.take(), self.episodes.ema_return
        resume = {"iteration": self.iteration, "global_step": self.global_step, "ema_return": ema_return,
                  "envs": [vector_env_state(envs) for envs in self.envs], "codecs": self.codecs.state_dict("rollout")}
        return {"global_step": self.global_step, "returns": returns, "ema_return": ema_return, "resume": resume}

    # -- training --------------------------------------------------------------------
    def begin_training(self, iteration: int) -> list[list[torch.Tensor]]:
        """Train on ``iteration``'s rollout from now on; its minibatch indices per epoch (the same on both stages)."""
        self.train_iteration = iteration
        self.flat_obs = self.buffers[iteration % len(self.buffers)].view((-1,) + self.spec.row_shape)
        self.codecs.new_iteration("fwd", "bwd")
        if iteration in self.announced:
            self.exchange = switch(self.codecs, self.announced.pop(iteration), TRAINING)
        ppo = self.settings.ppo
        if self.optimizer is not None:
            anneal(self.optimizer, ppo.lr_encoder * ppo.lr_fraction(iteration, self.settings.num_iterations))
        return minibatch_schedule(self.settings.seed, iteration, ppo.epochs, self.settings.steps_per_iteration,
                                  ppo.minibatches)

    def own(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The samples of minibatch ``idx`` (indices ``t * total_envs + env`` over the fleet) that this edge
        holds: (their fleet indices, their rows in this edge's rollout). Without a fleet, all of them."""
        if self.total_envs == self.settings.env.num_envs:
            return idx, idx
        t, env = idx // self.total_envs, idx % self.total_envs - self.offset
        mine = (env >= 0) & (env < self.settings.env.num_envs)
        return idx[mine], t[mine] * self.settings.env.num_envs + env[mine]

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """The current encoder on the stored observations of samples ``idx``, with its graph."""
        return self.net(self.flat_obs[idx])

    def features_now(self, idx: torch.Tensor) -> torch.Tensor:
        """The current encoder on the stored observations of samples ``idx``, without a graph (``--rescore``)."""
        with torch.no_grad():
            return self.net(self.flat_obs[idx])

    def backward(self, out: torch.Tensor, grad: torch.Tensor) -> None:
        """Back-propagate the gradient stage1 sent for ``out`` (gradients accumulate until the step)."""
        torch.autograd.backward(out, grad)

    # -- a fleet's one encoder (`splitrl.stages.fleet_encoder.EdgeEncoder`) ----------------
    def gradients(self) -> dict[str, torch.Tensor]:
        """The encoder's gradients since the last step, by name, which a fleet's edges add up through stage1
        (``--encoder-sync grad``)."""
        return self.fleet.gradients()

    def set_gradients(self, msg: Message) -> None:
        """Take the fleet's summed encoder gradients (stage1's ``encoder_grad``) as this step's."""
        self.fleet.set_gradients(msg)

    def encoder_change(self, mode: str) -> dict[str, torch.Tensor]:
        """``encoder_avg``'s parts: the encoder's change since the fleet last averaged (``--encoder-sync avg``)."""
        return self.fleet.change(mode)

    def take_average(self, msg: Message) -> None:
        """Stage1's mean of the edges' changes (``encoder_avg``): every edge's encoder becomes the same."""
        self.fleet.take_average(msg)

    def encoder_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """What an edge joining the fleet after this iteration needs to train on as one of it (``encoder_state``):
        the encoder's weights and its optimizer's moments, the iteration and the fleet's step count."""
        tensors, step = self.fleet.state()
        return tensors, {"iteration": self.train_iteration, "global_step": self.global_step, "adam_step": step}

    def join(self, msg: Message, iteration: int) -> None:
        """Become an edge of a fleet that has trained ``iteration`` iterations: another edge's `encoder_state`.
        The envs start afresh."""
        global_step = self.fleet.join(msg, iteration)
        self.train_iteration = self.iteration = iteration
        self.global_step = global_step
        self.joined_after = iteration

    def optimizer_step(self) -> None:
        nn.utils.clip_grad_norm_(self.params, self.settings.ppo.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def publish(self, versions: Iterable[int] | None = None) -> nn.Module:
        """The trained weights as the rollout's next acting copy (it takes them at an `adopt`), under each of
        ``versions`` (default: the iterations trained, in versions: `TrainSettings.versions_per_iteration`)."""
        return self.policy.publish([self.train_iteration * self.settings.versions_per_iteration]
                                   if versions is None else versions)

    def state_dict(self, rollout: dict[str, Any]) -> dict[str, Any]:
        """A checkpoint after training: the weights, the optimizer, the training codecs' state, and the
        ``resume`` part of `rollout_summary` of the rollout just trained on."""
        return {
            "iteration": self.train_iteration,
            "net": self.net.state_dict(),
            "optimizer": self.optimizer.state_dict() if self.optimizer else None,
            "codecs": self.codecs.state_dict("fwd", "bwd"),
            "rollout": rollout["resume"],
            **self.fleet.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Go on from a checkpoint (`state_dict`): the envs are put back when `open_envs` opens them."""
        self.net.load_state_dict(state["net"])
        if self.optimizer is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        rollout = state["rollout"]
        self.train_iteration, self.iteration = state["iteration"], rollout["iteration"]
        self.global_step, self.episodes.ema_return = rollout["global_step"], rollout["ema_return"]
        self.codecs.load_state_dict({**state["codecs"], **rollout["codecs"]})
        self.saved_envs = rollout["envs"]
        self.fleet.load_state_dict(state, averaging=self.settings.schedule.parsed_encoder_sync().name == "avg")
        if self.policy.copied:
            self.policy.restart(self.train_iteration * self.settings.versions_per_iteration)
