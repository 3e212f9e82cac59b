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

Its parts are objects of their own: the envs in their groups
(`splitrl.stages.env_groups`), the stored rollouts (`splitrl.stages.rollouts`),
the codecs' settings per iteration (`splitrl.stages.budget.CodecTuning`), the
published policy versions (`splitrl.stages.versions`) and a fleet edge's share
of the fleet's one encoder (`splitrl.stages.fleet_encoder`).
"""

from __future__ import annotations

import logging
from typing import Any, Iterable

import numpy as np
import torch
from torch import nn

from ..codecs import CodecSet, Context
from ..devices import acting_threads, place, to_device, update_threads
from ..envs import EnvSpec, batch
from ..models import agent
from ..ppo import adam, anneal, load_adam_state, minibatch_schedule
from ..runs import EMA_DECAY, RunLog
from ..settings import TrainSettings
from ..transport import Message, ProtocolError
from .autoencoder import pack_sample, sampled
from .budget import CodecTuning
from .env_groups import EnvGroups
from .episodes import Episodes
from .fleet_encoder import EdgeEncoder
from .progress import Progress
from .protocol import Payload, tensor
from .rollouts import Slots, sample_indices
from .versions import PolicyVersions

__all__ = ["Edge", "EMA_DECAY"]

log = logging.getLogger(__name__)

JOIN_SEED_STRIDE = 1_000_003
"""How far a late edge's env seeds move per iteration it joined after (far beyond any fleet's env count)."""


class Edge:
    """Environments + the stage0 part of the network, its optimizer and its rollout storage.

    `set_groups` cuts the envs into groups (each its own vector env of ``num_envs / groups``);
    ``slots``: rollouts stored at once (2 when one trains while the next is collected);
    ``acting_copy``: the rollout acts with a copy of the encoder that `adopt` updates;
    ``env_nice``: how much nicer than this process its worker envs run (a run's ``--env-nice``,
    `splitrl.envs.lower_priority`).
    """

    def __init__(self, settings: TrainSettings, spec: EnvSpec, run_log: RunLog | None = None, *,
                 vector: str = "auto", env_nice: int = 0, slots: int = 1, acting_copy: bool = False, edge: int = 0,
                 device: torch.device | str = "cpu", channels_last: bool = False) -> None:
        self.settings, self.spec, self.run_log = settings, spec, run_log
        self.device = torch.device(device)
        """Where the encoder, its optimizer and the rollout's observations live (`splitrl.devices`); the envs step on
        the CPU, and the codecs work in host memory. With ``channels_last``, the encoder's convolutions take
        channels-last inputs (`place`)."""
        self.edge = edge
        """Which edge of a fleet this is (`ScheduleSettings.edges`): its envs are the fleet's envs
        ``offset .. offset + num_envs - 1`` of `total_envs`, seeded, named and indexed as those."""
        self.offset, self.total_envs = edge * settings.env.num_envs, settings.total_envs
        self.sample_index = sample_indices(settings.ppo.num_steps, self.total_envs,
                                           slice(self.offset, self.offset + settings.env.num_envs))
        """This edge's samples' indices in the fleet's rollout batch (row 0: its envs' fleet indices)."""
        self.joined_after = 0
        """A fleet's late edge: the iteration after which it joined (`join`); 0 for the others."""
        self.envs = EnvGroups(settings, vector, env_nice)
        self.net = place(agent(settings, spec)[0], self.device, channels_last)  # built on the CPU: the same weights
        self.params = [p for p in self.net.parameters() if p.requires_grad]  # not an autoencoder's projection
        self.optimizer = (adam(self.params, lr=settings.ppo.lr_encoder, fused=settings.ppo.fused_adam)
                          if self.params else None)
        self.policy: PolicyVersions[nn.Sequential] = PolicyVersions(self.net, acting_copy)
        """The encoder the rollout acts with and the published ones (`publish`, `adopt`)."""
        self.fleet = EdgeEncoder(self.net, self.optimizer, lambda: agent(settings, spec)[0])
        """This edge's part of a fleet's one encoder (``--encoder-sync``, joining)."""
        rows = (settings.ppo.num_steps, settings.env.num_envs) + spec.row_shape
        self.buffers = Slots(slots, lambda: torch.zeros(rows, dtype=getattr(torch, spec.row_dtype), device=self.device))
        self.obs = self.buffers[0]
        """The observations of the rollout being collected (one slot of `buffers`), as `EnvSpec.rows`."""
        self.flat_obs = self.obs.view((-1,) + spec.row_shape)
        """The observations of the rollout being trained on, one row per sample (t * num_envs + env)."""
        self.codecs = CodecSet(**settings.codecs.specs(), device=self.device)
        self.tuning = CodecTuning(settings, spec, self.codecs)
        """``--link-budget``: each iteration's settings, chosen here and sent with its first step."""
        self.low, self.high = np.array(spec.action_low), np.array(spec.action_high)
        self.stacked = settings.env.image_pipeline[1] > 1
        self.set_groups(1)
        self.global_step = 0
        self.iteration = 0
        """The iteration being collected."""
        self.train_iteration = 0
        """The iteration being trained on."""
        self.episodes = Episodes(run_log)
        """The finished episodes' returns and their EMA."""
        self.progress = Progress()
        """Told of each env step and training minibatch (a terminal's progress bar replaces it)."""

    acting = property(lambda self: self.policy.acting, doc="The encoder the rollout acts with (`net` itself "
                      "without an acting copy).")
    acting_version = property(lambda self: self.policy.version, doc="The policy version the rollout acts with: "
                              "the training iterations done on its weights, or the epochs with --publish epoch.")
    published = property(lambda self: self.policy.published)
    exchange = property(lambda self: self.tuning.exchange, doc="The training exchange as this iteration runs it.")
    groups = property(lambda self: self.envs.groups, doc="The envs' groups that step in turn (`set_groups`).")

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
        self.envs.set_groups(groups)
        self.outcome: list[Payload] = [({}, {}) for _ in range(groups)]
        """Each group's last outcome: it rides on the group's next message."""

    def open_envs(self) -> None:
        """Each group's vector env, env i of the fleet seeded ``seed + i`` (`EnvGroups.open`)."""
        # A fleet's late edge does not replay its place's first episodes: its seeds move on by the iteration.
        self.envs.open(self.settings.seed + self.offset + JOIN_SEED_STRIDE * self.joined_after)

    def env_cpu_seconds(self) -> float | None:
        """CPU seconds the envs' worker processes have used so far (`EnvGroups.cpu_seconds`)."""
        return self.envs.cpu_seconds()

    def close(self) -> None:
        self.envs.close()

    # -- rollout ---------------------------------------------------------------------
    def begin_rollout(self, iteration: int) -> None:
        self.iteration = iteration
        self.obs = self.buffers[iteration]
        self.tuning.begin_rollout(iteration)

    def adopt(self, version: int | None = None) -> int:
        """Act from now on with the newest published weights, or with those of ``version`` (--publish epoch's
        pace; it must be published); returns the version acting. Older copies are dropped."""
        def unknown(version: int) -> RuntimeError:
            return RuntimeError(f"stage0 was asked to act with policy version {version}; published: "
                                f"{sorted(self.published) or 'none'}, acting: {self.acting_version}")
        return self.policy.adopt(version, unknown)

    def encode(self, obs: np.ndarray | torch.Tensor) -> torch.Tensor:
        obs = torch.as_tensor(obs)
        with torch.no_grad(), acting_threads(self.device, len(obs)):
            return self.acting(to_device(obs, self.device))

    def observe(self, t: int, g: int = 0) -> Payload:
        """Group ``g``'s step ``t`` message: its observation stored and encoded, after its last outcome."""
        rows = self.groups.slices[g]
        obs = to_device(torch.as_tensor(self.spec.rows(self.envs.next_obs[g], self.stacked)), self.device)
        self.obs[t, rows] = obs  # (the group's rows as a slice: no index arithmetic in torch)
        tensors, header = self.outcome[g]
        if t == 0 and self.iteration in self.tuning.announced:
            header["budget"] = self.tuning.announced[self.iteration]
        ctx = Context(idx=self.sample_index[t, rows], envs=self.sample_index[0, rows], global_step=self.global_step)
        if sampled(self.settings, t):  # the features before the projection too, for stage1's autoencoder
            with torch.no_grad(), acting_threads(self.device, len(obs)):
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
        n = self.groups.size
        if self.spec.discrete:
            action = tensor(msg, "action", (n,), torch.int64)
            if not bool(((action >= 0) & (action < self.spec.action_dim)).all()):
                raise ProtocolError(f"{msg.kind}: tensor 'action': expected indices in [0, {self.spec.action_dim}), "
                                    f"got values from {int(action.min())} to {int(action.max())}")
        else:
            action = tensor(msg, "action", (n, self.spec.action_dim), torch.float32)
        self.envs.begin_step(g, self.spec.env_action(action.numpy(), self.settings.env.action_map))

    def finish_step(self, g: int = 0) -> None:
        """Wait for group ``g``'s step; log finished episodes, keep the outcome for its next message."""
        reward, terminated, truncated, info = self.envs.finish_step(g)
        self.global_step += self.groups.size * self.settings.schedule.edges  # a fleet's edges step in lock step
        self.episodes.record(info, self.offset + self.groups.rows[g], self.global_step, self.iteration)
        self.progress.steps(self.groups.size)
        self.outcome[g] = self._outcome(reward, terminated, truncated, info, g)

    def end_rollout(self, g: int = 0) -> Payload:
        """Group ``g``'s ``rollout_end``: its last outcome and the features of the observation to bootstrap from."""
        tensors, header = self.outcome[g]
        ctx = Context(envs=self.offset + self.groups.rows[g], global_step=self.global_step)
        features = self.encode(self.spec.rows(self.envs.next_obs[g], self.stacked))
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
            ctx = Context(envs=self.offset + self.groups.rows[g][index], global_step=self.global_step)
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
                  "envs": self.envs.state(), "codecs": self.codecs.state_dict("rollout")}
        return {"global_step": self.global_step, "returns": returns, "ema_return": ema_return, "resume": resume}

    # -- training --------------------------------------------------------------------
    def begin_training(self, iteration: int) -> list[list[torch.Tensor]]:
        """Train on ``iteration``'s rollout from now on; its minibatch indices per epoch (the same on both stages)."""
        self.train_iteration = iteration
        self.flat_obs = self.buffers[iteration].view((-1,) + self.spec.row_shape)
        self.tuning.begin_training(iteration)
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

    def part_gradients(self, out: torch.Tensor, grad: torch.Tensor) -> list[torch.Tensor | None]:
        """`backward`'s gradients for the encoder's parameters, returned instead of accumulated (a micro-batch
        on a worker thread: `splitrl.schedule.workers`)."""
        return list(torch.autograd.grad(out, self.params, grad, allow_unused=True))

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
        with update_threads(self.device):
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
            load_adam_state(self.optimizer, state["optimizer"])
        rollout = state["rollout"]
        self.train_iteration, self.iteration = state["iteration"], rollout["iteration"]
        self.global_step, self.episodes.ema_return = rollout["global_step"], rollout["ema_return"]
        self.codecs.load_state_dict({**state["codecs"], **rollout["codecs"]})
        self.envs.saved = rollout["envs"]
        self.fleet.load_state_dict(state, averaging=self.settings.schedule.parsed_encoder_sync().name == "avg")
        if self.policy.copied:
            self.policy.restart(self.train_iteration * self.settings.versions_per_iteration)
