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
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import threading
from typing import Any, Iterable

import numpy as np
import torch
from torch import nn

from ..codecs import CodecError, CodecSet, Context
from ..envs import (EnvSpec, choose_vector, make_vector_env, restore_vector_env, to_chw, vector_env_state,
                    worker_cpu_seconds)
from ..models import agent
from ..ppo import anneal, minibatch_schedule
from ..runs import EMA_DECAY, RunLog
from ..settings import TrainSettings
from ..transport import Message, ProtocolError
from ..transport.errors import peer_repr
from .autoencoder import pack_sample, sampled
from .budget import TRAINING, LinkBudget, switch
from .protocol import ENCODER_PREFIX, Payload, tensor
from .weights import WeightSync

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
                 vector: str = "auto", slots: int = 1, acting_copy: bool = False, edge: int = 0) -> None:
        self.settings, self.spec, self.run_log = settings, spec, run_log
        self.edge = edge
        """Which edge of a fleet this is (`ScheduleSettings.edges`): its envs are the fleet's envs
        ``offset .. offset + num_envs - 1`` of `total_envs`, seeded, named and indexed as those."""
        self.offset, self.total_envs = edge * settings.env.num_envs, settings.total_envs
        self.joined_after = 0
        """A fleet's late edge: the iteration after which it joined (`join`); 0 for the others."""
        self.agreed_weights: dict[str, torch.Tensor] | None = None
        """The first view a fleet's edge averages against where it is not the encoder built from the seed: the
        one a late edge joined with (`join`), the one a resumed edge last agreed on (`load_state_dict`)."""
        self.encoder_average: WeightSync | None = None
        """``--encoder-sync avg``: the encoder as the fleet last agreed on it (`encoder_change`, `take_average`)."""
        self.vector = choose_vector(vector, settings.env.num_envs)
        """'sync': the environments step in this process; 'async': in worker processes (`splitrl.envs.StepInTwo`)."""
        self.net, _ = agent(settings, spec)
        self.params = [p for p in self.net.parameters() if p.requires_grad]  # not an autoencoder's projection
        self.optimizer = torch.optim.Adam(self.params, lr=settings.ppo.lr_encoder, eps=1e-5) if self.params else None
        self.acting = copy.deepcopy(self.net).requires_grad_(False) if acting_copy else self.net
        self.acting_version = 0
        """The policy version the rollout acts with: the training iterations done on its weights, or the epochs
        with --publish epoch (`TrainSettings.versions_per_iteration`)."""
        self.published: dict[int, nn.Module] = {}
        """Trained weights not adopted yet, by version (several numbers may name one copy: `publish`)."""
        n, t = settings.env.num_envs, settings.ppo.num_steps
        self.buffers = [torch.zeros((t, n) + spec.obs_shape, dtype=torch.uint8) for _ in range(slots)]
        self.obs = self.buffers[0]
        """The observations of the rollout being collected (one slot of `buffers`)."""
        self.flat_obs = self.obs.view((-1,) + spec.obs_shape)
        """The observations of the rollout being trained on, one row per sample (t * num_envs + env)."""
        self.codecs = CodecSet(**settings.codecs.specs())
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
        self.stacked = settings.env.frame_stack > 1
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
        self.ema_return: float | None = None
        self.returns: list[float] = []
        """Returns of the episodes finished since `rollout_summary` last took them."""
        self._returns_lock = threading.Lock()  # the asynchronous schedule takes them from its training thread

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
        if version is None:
            version = max([self.acting_version, *list(self.published)])
        if version != self.acting_version:
            module = self.published.get(version)
            if module is None:
                raise RuntimeError(f"stage0 was asked to act with policy version {version}; published: "
                                   f"{sorted(self.published) or 'none'}, acting: {self.acting_version}")
            self.acting_version, self.acting = version, module
        for old in [v for v in list(self.published) if v <= version]:  # list(): publish() may add meanwhile
            del self.published[old]
        return self.acting_version

    def encode(self, obs: np.ndarray | torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.acting(torch.as_tensor(obs))

    def observe(self, t: int, g: int = 0) -> Payload:
        """Group ``g``'s step ``t`` message: its observation stored and encoded, after its last outcome."""
        envs = self.groups[g]
        obs = torch.as_tensor(to_chw(self.next_obs[g], self.stacked))
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
        self._episodes(info, g)
        self.outcome[g] = self._outcome(reward, terminated, truncated, info, g)

    def end_rollout(self, g: int = 0) -> Payload:
        """Group ``g``'s ``rollout_end``: its last outcome and the features of the observation to bootstrap from."""
        tensors, header = self.outcome[g]
        ctx = Context(envs=self.offset + self.groups[g], global_step=self.global_step)
        features = self.encode(to_chw(self.next_obs[g], self.stacked))
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
            final = np.stack([info["final_obs"][i] for i in bootstrap])
            index = torch.as_tensor(bootstrap, dtype=torch.int64)  # within the group
            # Packed before the next step's features: stateful codecs see each env's frames in order.
            ctx = Context(envs=self.offset + self.groups[g][index], global_step=self.global_step)
            self.codecs.pack("rollout", "final_features", self.encode(to_chw(final, self.stacked)), ctx, out, header)
            out["final_index"] = index
        return out, header

    def _episodes(self, info: dict[str, Any], g: int) -> None:
        if "episode" not in info:
            return
        for i in np.flatnonzero(info["_episode"]):
            r, length = float(info["episode"]["r"][i]), int(info["episode"]["l"][i])
            self.ema_return = r if self.ema_return is None else EMA_DECAY * self.ema_return + (1 - EMA_DECAY) * r
            with self._returns_lock:
                self.returns.append(r)
            if self.run_log is not None:
                self.run_log.episode({"global_step": self.global_step, "iteration": self.iteration,
                                      "env": self.offset + int(self.groups[g][i]), "return": r, "length": length,
                                      "ema_return": self.ema_return})

    def rollout_summary(self) -> dict[str, Any]:
        """Taken when a rollout ends: env steps so far, the returns of the episodes finished since the last
        call, their EMA, and (``resume``) everything a resumed run needs to go on from here: the envs'
        state, the rollout codec's. The asynchronous schedule takes it from the rollout thread, so each
        iteration's metrics and checkpoint speak of that iteration's rollout while the next one runs."""
        with self._returns_lock:
            returns, self.returns = self.returns, []
        resume = {"iteration": self.iteration, "global_step": self.global_step, "ema_return": self.ema_return,
                  "envs": [vector_env_state(envs) for envs in self.envs], "codecs": self.codecs.state_dict("rollout")}
        return {"global_step": self.global_step, "returns": returns, "ema_return": self.ema_return, "resume": resume}

    # -- training --------------------------------------------------------------------
    def begin_training(self, iteration: int) -> list[list[torch.Tensor]]:
        """Train on ``iteration``'s rollout from now on; its minibatch indices per epoch (the same on both stages)."""
        self.train_iteration = iteration
        self.flat_obs = self.buffers[iteration % len(self.buffers)].view((-1,) + self.spec.obs_shape)
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

    def gradients(self) -> dict[str, torch.Tensor]:
        """The encoder's gradients accumulated since the last step, by parameter name (zeros where the minibatch
        held none of this edge's samples): a fleet's edges add theirs up through stage1 (``--encoder-sync grad``)."""
        return {ENCODER_PREFIX + name: (p.grad if p.grad is not None else torch.zeros_like(p)).detach()
                for name, p in self.net.named_parameters()}

    def set_gradients(self, msg: Message) -> None:
        """Take the fleet's summed encoder gradients (stage1's ``encoder_grad``) as this step's."""
        for name, p in self.net.named_parameters():
            p.grad = tensor(msg, ENCODER_PREFIX + name, tuple(p.shape), p.dtype)

    def encoder_change(self, mode: str) -> dict[str, torch.Tensor]:
        """``encoder_avg``'s parts: this edge's encoder's change since the fleet last averaged (``--encoder-sync
        avg``), through the dense codec ``mode``."""
        if self.encoder_average is None:  # the fleet agreed on the encoder built from the seed, or the one joined
            start = agent(self.settings, self.spec)[0]
            agreed = self.agreed_weights or {ENCODER_PREFIX + n: p for n, p in start.named_parameters()}
            self.encoder_average = WeightSync(agreed.items(), mode, "encoder average")
        return self.encoder_average.delta((ENCODER_PREFIX + n, p) for n, p in self.net.named_parameters())

    def encoder_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """What an edge joining the fleet after this iteration needs to train on as one of it (``encoder_state``):
        the encoder's weights and its optimizer's moments (every edge's are the same with ``--encoder-sync grad``,
        and after an average with ``avg`` the weights are), the iteration and the fleet's step count."""
        # Copies: a large tensor leaves zero-copy, after this edge may have stepped again.
        tensors = {f"net.{name}": t.detach().clone() for name, t in self.net.state_dict().items()}
        step = 0
        if self.optimizer is not None:
            for name, p in ((n, p) for n, p in self.net.named_parameters() if p.requires_grad):
                moments = self.optimizer.state.get(p)
                if moments:
                    step = int(moments["step"])
                    tensors[f"exp_avg.{name}"] = moments["exp_avg"].clone()
                    tensors[f"exp_avg_sq.{name}"] = moments["exp_avg_sq"].clone()
        return tensors, {"iteration": self.train_iteration, "global_step": self.global_step, "adam_step": step}

    def join(self, msg: Message, iteration: int) -> None:
        """Become an edge of a fleet that has trained ``iteration`` iterations: another edge's `encoder_state`
        (checked: every weight, each moment for every parameter or for none). The envs start afresh."""
        header = msg.header
        step, global_step = header.get("adam_step"), header.get("global_step")
        if header.get("iteration") != iteration or type(step) is not int or step < 0 or type(global_step) is not int \
                or global_step < 0:
            raise ProtocolError(f"encoder_state: expected iteration={iteration} and counts >= 0, got iteration="
                                f"{peer_repr(header.get('iteration'))}, adam_step={peer_repr(step)}, "
                                f"global_step={peer_repr(global_step)}")
        names = set(self.net.state_dict())
        moments = {f"{m}.{n}" for n, _ in self.net.named_parameters() for m in ("exp_avg", "exp_avg_sq")}
        wanted = {f"net.{n}" for n in names} | (moments if step and self.optimizer is not None else set())
        if set(msg.tensors) != wanted:
            raise ProtocolError(f"encoder_state: expected tensors {sorted(wanted)[:4]}... ({len(wanted)}), got "
                                f"{peer_repr(sorted(msg.tensors))} ({len(msg.tensors)})")
        state = self.net.state_dict()
        self.net.load_state_dict({n: tensor(msg, f"net.{n}", tuple(t.shape), t.dtype) for n, t in state.items()})
        if step and self.optimizer is not None:
            adam = {i: {"step": torch.tensor(float(step)),
                        **{m: tensor(msg, f"{m}.{name}", tuple(p.shape), torch.float32).clone()
                           for m in ("exp_avg", "exp_avg_sq")}}
                    for i, (name, p) in enumerate(self.net.named_parameters())}
            if any(bool((moments["exp_avg_sq"] < 0).any()) for moments in adam.values()):
                raise ProtocolError("encoder_state: a second moment (exp_avg_sq) is negative")
            self.optimizer.load_state_dict({"state": adam, "param_groups": self.optimizer.state_dict()["param_groups"]})
        self.train_iteration = self.iteration = iteration
        self.global_step = global_step
        self.joined_after = iteration
        self.agreed_weights = {ENCODER_PREFIX + n: p.detach().clone() for n, p in self.net.named_parameters()}

    def take_average(self, msg: Message) -> None:
        """Stage1's mean of the edges' changes (``encoder_avg``): every edge's encoder becomes the same."""
        assert self.encoder_average is not None, "encoder_change comes first"
        try:
            view = self.encoder_average.decode(dict(msg.tensors))
        except CodecError as exc:
            raise ProtocolError(f"{msg.kind}: {exc}") from None
        with torch.no_grad():
            for name, p in self.net.named_parameters():
                p.copy_(view[ENCODER_PREFIX + name])

    def optimizer_step(self) -> None:
        nn.utils.clip_grad_norm_(self.params, self.settings.ppo.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def publish(self, versions: Iterable[int] | None = None) -> nn.Module:
        """The trained weights as the rollout's next acting copy (it takes them at an `adopt`), under each of
        ``versions`` (default: the iterations trained, in versions: `TrainSettings.versions_per_iteration`).
        Several numbers name one copy where training ended early (--target-kl): every version still exists."""
        module = copy.deepcopy(self.net).requires_grad_(False)
        for version in [self.train_iteration * self.settings.versions_per_iteration] if versions is None else versions:
            self.published[version] = module
        return module

    def state_dict(self, rollout: dict[str, Any]) -> dict[str, Any]:
        """A checkpoint after training: the weights, the optimizer, the training codecs' state, and the
        ``resume`` part of `rollout_summary` of the rollout just trained on."""
        return {
            "iteration": self.train_iteration,
            "net": self.net.state_dict(),
            "optimizer": self.optimizer.state_dict() if self.optimizer else None,
            "codecs": self.codecs.state_dict("fwd", "bwd"),
            "rollout": rollout["resume"],
            **({"encoder_average": dict(self.encoder_average.view)} if self.encoder_average is not None else {}),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Go on from a checkpoint (`state_dict`): the envs are put back when `open_envs` opens them."""
        self.net.load_state_dict(state["net"])
        if self.optimizer is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        rollout = state["rollout"]
        self.train_iteration, self.iteration = state["iteration"], rollout["iteration"]
        self.global_step, self.ema_return = rollout["global_step"], rollout["ema_return"]
        self.codecs.load_state_dict({**state["codecs"], **rollout["codecs"]})
        self.saved_envs = rollout["envs"]
        if "encoder_average" in state:  # --encoder-sync avg: go on averaging against what the fleet last agreed on
            self.agreed_weights, self.encoder_average = state["encoder_average"], None
        elif self.settings.schedule.parsed_encoder_sync().name == "avg":  # a checkpoint from before it was kept:
            # the encoder itself, which is the agreed view after an iteration (each epoch's last minibatch averages)
            self.agreed_weights = {ENCODER_PREFIX + n: p.detach().clone() for n, p in self.net.named_parameters()}
        if self.acting is not self.net:
            self.acting = copy.deepcopy(self.net).requires_grad_(False)
            self.acting_version = self.train_iteration * self.settings.versions_per_iteration
            self.published = {}
