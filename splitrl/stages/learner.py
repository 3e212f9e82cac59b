"""Stage1's compute: the actor-critic heads and the PPO learner.

`Learner` owns no link (Sample Factory's learner/worker split): it acts on the
rollout messages stage0 sends, finishes the rollout with GAE, and takes one PPO
loss per minibatch (or per micro-batch of one) from whatever the training
exchange hands it (`splitrl.stages.exchange`). A schedule (`splitrl.schedule`)
decides when. Its parts are objects of their own: the PPO update
(`splitrl.stages.update`), the decoupled-PPO state of samples an older policy
acted on (`splitrl.stages.decoupled`), the published policy versions
(`splitrl.stages.versions`), a fleet's encoder sum and average
(`splitrl.stages.fleet_encoder`), the padding that makes acting for a fleet
order-free (`splitrl.stages.order_free`), the stored rollouts
(`splitrl.stages.rollouts`) and the codecs' settings per iteration
(`splitrl.stages.budget.CodecTuning`).

As on stage0 (`splitrl.stages.edge`), the envs may come in groups, two rollouts
may be stored at once, and the rollout may act with its own copy of the heads:
the asynchronous schedule acts with the newest finished policy while the next
one trains, so a sample may have been acted on by an older policy than the one
that trains on it. Each sample's acting version is kept; `Learner.begin_training`
hands the lag to the decoupled-PPO state, and PPO's ratio is always taken against
the log-probability of the policy that acted.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable

import torch

from ..codecs import CodecSet, Context
from ..devices import acting_threads, place, to_host
from ..envs import EnvSpec
from ..models import ActorCriticHeads, agent
from ..ppo import explained_variance, load_adam_state, minibatch_schedule
from ..settings import TrainSettings
from ..transport import Message, ProtocolError
from .autoencoder import Autoencoder, sampled, unpack_sample
from .budget import CodecTuning
from .decoupled import Rescore
from .fleet_encoder import EncoderSum
from .learners import Learners
from .limits import EdgeLimits
from .order_free import batch_invariant, step_generator
from .outcomes import Outcome, read_outcome
from .protocol import ENCODER_PREFIX, Payload
from .rollouts import Groups, Rollouts
from .update import PPOUpdate
from .versions import PolicyVersions

__all__ = ["Learner", "ReadStep"]

log = logging.getLogger(__name__)

ReadStep = tuple[int, int, torch.Tensor, "tuple[torch.Tensor, ...] | None"]
"""A group's step as `Learner.read_step` reads it: (group, step, its decoded input, the outcome of its last action:
None at step 0)."""


class Learner:
    """Heads + PPO. With the cut before the first layer it also keeps the rollout's
    inputs and trains alone (`train_alone`); otherwise each minibatch's inputs arrive."""

    def __init__(self, settings: TrainSettings, spec: EnvSpec, *, slots: int = 1, acting_copy: bool = False,
                 device: torch.device | str = "cpu", channels_last: bool = False) -> None:
        self.settings, self.spec = settings, spec
        self.device = torch.device(device)
        """Where the heads, their optimizer, the rollout's storage and PPO's maths live (`splitrl.devices`); the
        codecs work in host memory, and the action sampler's generator is the CPU's on any device. With
        ``channels_last``, the heads' convolutions (a cut before them) take channels-last inputs (`place`)."""
        ppo = settings.ppo
        stage0_net, heads = agent(settings, spec)  # built on the CPU: the same weights on any device
        self.heads = place(heads, self.device, channels_last)
        self.params = [p for p in self.heads.parameters() if p.requires_grad]  # not an autoencoder's decoder
        self.autoencoder = (Autoencoder(stage0_net[-1].to(self.device), self.heads.trunk[-1], settings.seed)
                            if settings.bottleneck_train == "autoencoder" else None)
        """``--bottleneck-train autoencoder``: the fit of stage0's projection (a copy here) and the heads' trunk."""
        self.learners = Learners()
        """The other learners this one trains in step with (several stage1 processes of a fleet), if any."""
        self.update = PPOUpdate(self.heads, self.params, ppo, lambda: self.learners)
        """The optimizer, the decoupled-PPO state and the iteration's statistics."""
        self.decoupled = self.update.decoupled
        self.generator = torch.Generator().manual_seed(settings.seed)
        self.policy: PolicyVersions[ActorCriticHeads] = PolicyVersions(self.heads, acting_copy)
        """The heads the rollout acts with and the published ones (`publish`, `adopt`)."""
        self.trains_alone = not any(True for _ in stage0_net.parameters())
        self.limits = EdgeLimits(settings.schedule)  # what stage0's rewards, features, encoder gradients may hold
        self.encoder_sum = EncoderSum({ENCODER_PREFIX + name: to_host(p.detach()).clone()
                                       for name, p in stage0_net.named_parameters()}, lambda: self.learners,
                                      settings.schedule.parsed_encoder_sync(), self.limits)
        """A fleet's encoder: its edges' gradients summed, their encoders averaged (`EncoderSum`)."""
        self.feature_dim = self.heads.input_dim
        """The width of the features at the cut."""
        self.encoder_tensors = {name: (t.dtype, tuple(t.shape)) for name, t in stage0_net.state_dict().items()}
        """The layers before the cut as a fleet's edge hands them to one joining (``encoder_state``): each tensor of
        their state dict, its dtype and shape."""
        # Stored rollout inputs: the observations (`EnvSpec.rows`) when stage1 trains alone; with an acting copy,
        # the features, so that samples an older policy acted on can be scored by the one that trains.
        keep = ((spec.row_shape, getattr(torch, spec.row_dtype)) if self.trains_alone else
                ((self.feature_dim,), torch.float32) if acting_copy else None)
        self.rollouts = Rollouts(settings, spec, slots, keep, self.device)
        self.codecs = CodecSet(**settings.codecs.specs(), device=self.device)
        self.tuning = CodecTuning(settings, spec, self.codecs)
        """``--link-budget``: each iteration's settings as stage0 chose them (checked here)."""
        self.iteration = 0
        """The iteration being collected."""
        self.train_iteration = 0
        """The iteration being trained on."""
        self.rollout_stats: dict[str, float] = {}
        """Statistics of the rollout being trained on, taken when its training begins."""

    # -- the parts' state, by the names the schedules and tests use --------------------------
    optimizer = property(lambda self: self.update.optimizer)
    stats = property(lambda self: self.update.stats, doc="The iteration's statistics by key (`PPOUpdate.stats`).")
    acting = property(lambda self: self.policy.acting, doc="The heads the rollout acts with (`heads` themselves "
                      "without an acting copy).")
    acting_version = property(lambda self: self.policy.version)
    acting_as = property(lambda self: self.policy.newest, doc="The newest number the acting heads were published "
                         "under: what each sample's version is stored as, so that its lag counts the training it "
                         "really missed.")
    published = property(lambda self: self.policy.published)
    exchange = property(lambda self: self.tuning.exchange, doc="The training exchange as this iteration runs it.")
    groups = property(lambda self: self.rollouts.groups, doc="The envs' groups that step in turn (`set_groups`).")
    buffer = property(lambda self: self.rollouts.buffers[self.iteration], doc="The rollout being collected.")
    train_buffer = property(lambda self: self.rollouts.buffers[self.train_iteration],
                            doc="The rollout being trained on.")

    def set_groups(self, groups: int) -> None:
        """Expect the envs in ``groups`` equal groups that step in turn (stage0's ``plan``)."""
        self.rollouts.groups = Groups(self.settings.env.num_envs, groups)

    def global_step(self, t: int = 0, g: int = 0) -> int:
        """stage0's env-step count when it encoded group ``g``'s step ``t`` of the iteration being collected."""
        return self.rollouts.global_step(self.iteration, t, g)

    @property
    def train_step(self) -> int:
        """Env steps collected when the rollout being trained on ended (codecs' warm starts count these)."""
        return self.train_iteration * self.settings.steps_per_iteration

    def input_shape(self, rows: int) -> tuple[tuple[int, ...], torch.dtype]:
        """The shape and dtype of ``rows`` rows of what stage0's rollout sends: the features at the cut, or the
        observations (`EnvSpec.rows`) with the cut before the first layer."""
        if self.trains_alone:
            return (rows,) + self.spec.row_shape, getattr(torch, self.spec.row_dtype)
        return (rows, self.feature_dim), torch.float32

    def _input(self, msg: Message, ctx: Context, name: str = "features") -> torch.Tensor:
        """Decode stage0's rollout features (the observations with the cut before the first layer) for ``ctx``'s
        rows."""
        shape, dtype = self.input_shape(len(ctx.idx if ctx.idx is not None else ctx.envs))
        return self.limits.features(msg.kind, name, self.codecs.unpack("rollout", name, msg.tensors, msg.header, ctx,
                                                                       shape, dtype))

    # -- rollout ---------------------------------------------------------------------
    def begin_rollout(self, iteration: int) -> None:
        self.iteration = iteration
        self.rollouts.begin(iteration, self._acting_version())
        self.tuning.begin_rollout(iteration)

    def adopt(self, version: int) -> None:
        """Act with the heads of ``version`` (stage0 says when it switched its encoder)."""
        def unknown(version: int) -> ProtocolError:
            return ProtocolError(f"step: stage0 acts with policy version {version}; stage1 has published "
                                 f"{sorted(self.published) or 'none'} after acting with {self.acting_version}")
        self.policy.adopt(version, unknown)

    def act(self, t: int, msg: Message, g: int = 0) -> Payload:
        """Record the outcome that rides on group ``g``'s step ``t``, then sample the policy's action."""
        return self.act_groups([(g, t, msg)])[0]

    def act_groups(self, steps: list[tuple[int, int, Message]], order_free: bool = False) -> list[Payload]:
        """`act` for several groups' step messages (``(g, t, msg)``: group ``g``'s step ``t``) with one forward
        of the heads (a fleet's edges, batched as an inference server would): `read_step`s, then `act_read`."""
        return self.act_read([self.read_step(g, t, msg) for g, t, msg in steps], order_free)

    def read_step(self, g: int, t: int, msg: Message) -> ReadStep:
        """Group ``g``'s step ``t``, decoded and checked (`splitrl.stages.limits`), stored by `act_read`: a fleet
        drops an edge whose step fails here (a `ProtocolError`) and acts for the others."""
        rows = self.groups.rows[g]
        if t == 0 and "budget" in msg.header:
            self.tuning.take(self.iteration, msg.header["budget"])
        with torch.no_grad():
            outcome = self._outcome(t - 1, msg, g) if t > 0 else None
            x = self._input(msg, Context(idx=self.rollouts.sample_index[t, self.groups.slices[g]], envs=rows,
                                         global_step=self.global_step(t, g)))
            if self.autoencoder is not None and sampled(self.settings, t):
                self.autoencoder.add(unpack_sample(msg, len(rows), self.heads.trunk[-1].out_features))
        return g, t, x, outcome

    def act_read(self, steps: list[ReadStep], order_free: bool = False) -> list[Payload]:
        """Record the outcomes `read_step` read, then sample each group's actions in the order given, from the
        shared generator, unless ``order_free``: then as `splitrl.stages.order_free` makes them, whoever came
        together and in whatever order (a fleet served as its edges arrive, ``--act-wait``)."""
        with torch.no_grad():
            self.rollouts.record_outcomes(self.iteration, [(t - 1, g, out) for g, t, _, out in steps if t > 0])
            inputs = [x for _, _, x, _ in steps]
            x = inputs[0] if len(inputs) == 1 else torch.cat(inputs)
            if order_free:  # one thread, rows padded: any batch gives a row one result
                mean, value = batch_invariant(self.acting.outputs, x)
            else:
                with acting_threads(self.device, len(x)):
                    mean, value = self.acting.outputs(x)
            # Each group's draw is its own call, as it would be alone (`ActorCriticHeads.act`).
            parts = [(len(rows), self.step_generator(g, t) if order_free else self.generator)
                     for (g, t, _, _), rows in zip(steps, inputs)]
            u, logprob = self.acting.act(mean, parts)
        self.rollouts.store(self.iteration, [(t, g) for g, t, _, _ in steps], x, self._acting_version(),
                            actions=u, logprobs=logprob, values=value)
        wire = to_host(self.acting.wire_action(u))  # one copy for every group's actions
        if len(parts) == 1:
            return [({"action": wire}, {})]
        payloads, start = [], 0
        for size, _ in parts:
            payloads.append(({"action": wire[start:start + size]}, {}))
            start += size
        return payloads

    def step_generator(self, g: int, t: int) -> torch.Generator:
        """A generator for group ``g``'s step ``t`` of the iteration being collected (`order_free.step_generator`)."""
        return step_generator(self.settings.seed, self.iteration, g, t)

    def _acting_version(self) -> int:
        # Without a copy the heads act as they are: trained iteration - 1 times.
        return self.acting_as if self.acting is not self.heads else \
            (self.iteration - 1) * self.settings.versions_per_iteration

    def end_rollout(self, msg: Message, g: int = 0) -> None:
        """Group ``g``'s last outcome and the value of the observation it bootstraps from."""
        ppo = self.settings.ppo
        last = ppo.num_steps - 1
        with torch.no_grad():  # both read (and checked) before either is stored
            outcome = self._outcome(last, msg, g)
            rows = self.groups.slices[g]
            ctx = Context(envs=torch.arange(rows.start, rows.stop), global_step=self.global_step(ppo.num_steps, g))
            value = self.acting.get_value(self._input(msg, ctx))
            self.rollouts.record_outcomes(self.iteration, [(last, g, outcome)])
            self.rollouts.last_values[self.iteration][rows] = value

    def _outcome(self, step: int, msg: Message, g: int) -> Outcome:
        """Group ``g``'s (reward, terminated, truncated, final values) after step ``step``, as ``msg`` carries it."""
        envs = self.groups.slices[g]

        def final_values(index: torch.Tensor) -> torch.Tensor:
            ctx = Context(envs=index + envs.start, global_step=self.global_step(step + 1, g))
            return self.acting.get_value(self._input(msg, ctx, "final_features"))
        return self.limits.outcome(msg.kind, read_outcome(msg, envs, final_values, self.device))

    # -- training --------------------------------------------------------------------
    def begin_training(self, iteration: int) -> list[list[torch.Tensor]]:
        """Advantages and returns of ``iteration``'s rollout (`splitrl.ppo.compute_gae`); its minibatch indices
        per epoch (as on stage0). Samples an older policy acted on are decoupled PPO's (`splitrl.stages.decoupled`);
        their values stay the acting network's, the baseline being the rescored values with ``--rescore``."""
        ppo, stored = self.settings.ppo, self.rollouts
        self.train_iteration = iteration
        self.update.anneal(ppo.lr_fraction(iteration, self.settings.num_iterations))
        buffer, per_iteration = self.train_buffer, self.settings.versions_per_iteration
        lag = (iteration - 1) * per_iteration - stored.versions[iteration]  # in versions: iterations, or epochs
        rescored = self.decoupled.rescored is not None
        weights, baseline = self.decoupled.begin(
            iteration, lag, buffer, lambda: self.update.score_stored(stored.inputs[iteration], buffer.actions))
        buffer.finish(stored.last_values[iteration], ppo.gamma, ppo.gae_lambda, weights, baseline)
        # Now, not at the iteration's end: by then the next rollout may be writing this slot.
        self.rollout_stats = {"losses/explained_variance": explained_variance(buffer.b_values, buffer.b_returns)}
        if self.acting is not self.heads:
            self.rollout_stats.update({"async/staleness_mean": float(lag.float().mean()) / per_iteration,
                                       "async/staleness_max": float(lag.max()) / per_iteration})
            if weights is not None:  # how far the lagging samples' policy is from the one that trains
                self.rollout_stats["async/weight_mean"] = float(weights[lag > 0].mean())
        if not rescored:  # (a rescore set them up already: stage0 encoded it with them)
            self.tuning.begin_training(iteration)
        return minibatch_schedule(self.settings.seed, iteration, ppo.epochs, buffer.batch_size, ppo.minibatches)

    def begin_rescore(self, iteration: int) -> None:
        """``--rescore``: score ``iteration``'s rollout again with the heads as they start its training, sample by
        sample (`rescore`, before `begin_training`); the training codecs start ``iteration`` now."""
        self.tuning.begin_training(iteration)
        self.decoupled.rescored = Rescore(iteration, self.rollouts.buffers[iteration].batch_size, self.device)

    @property
    def rescore_step(self) -> int:
        """Env steps collected when the rollout being scored again (`begin_rescore`) ended."""
        assert self.decoupled.rescored is not None
        return self.decoupled.rescored.iteration * self.settings.steps_per_iteration

    def rescore(self, idx: torch.Tensor, x: torch.Tensor) -> None:
        """The log-probabilities of samples ``idx``'s actions and their values, with the heads on ``x``: the
        features stage0's encoder gives their observations now (or, when stage1 holds the whole network, their
        stored inputs)."""
        rescored = self.decoupled.rescored
        assert rescored is not None
        buffer = self.rollouts.buffers[rescored.iteration]
        rescored.set(idx, *self.update.score(x, buffer.actions.reshape((-1,) + buffer.action_shape)[idx]))

    def rescore_stored(self, chunks: list[torch.Tensor]) -> None:
        """`rescore` every sample from its stored input, in ``chunks`` of indices (the cut before the first
        layer: stage1 holds the whole network, nothing crosses the link)."""
        assert self.decoupled.rescored is not None and self.trains_alone
        flat = self.rollouts.flat_inputs(self.decoupled.rescored.iteration)
        for idx in chunks:
            self.rescore(idx, flat[idx])

    def loss(self, idx: torch.Tensor, mean: torch.Tensor, value: torch.Tensor,
             minibatch: torch.Tensor | None = None) -> torch.Tensor:
        """The PPO loss of samples ``idx`` given the heads' outputs on their inputs; its statistics are kept
        (`PPOUpdate.loss`). ``minibatch``: the whole minibatch when ``idx`` is one part of it (a micro-batch, a
        fleet edge's share): the parts' gradients, and their statistics, add up to the minibatch's."""
        return self.update.loss(self.train_buffer, idx, mean, value, minibatch)

    def part_gradients(self, x: torch.Tensor, idx: torch.Tensor, minibatch: torch.Tensor
                       ) -> tuple[list[torch.Tensor | None], dict[str, float]]:
        """A part's loss (`loss`) on the heads' inputs ``x`` (a leaf), its gradients returned instead of accumulated
        (a micro-batch on a worker thread: `splitrl.schedule.workers`): ([the gradient of ``x``, then each of the
        heads' trainable parameters'], its statistics, for `keep`)."""
        loss, stats = self.update.measure(self.train_buffer, idx, *self.heads.outputs(x), minibatch)
        return list(torch.autograd.grad(loss, [x, *self.params], allow_unused=True)), stats

    def keep(self, stats: dict[str, float], idx: torch.Tensor, minibatch: torch.Tensor | None = None) -> None:
        """Keep a part's statistics from `part_gradients`, in the parts' order."""
        self.update.keep(stats, idx, minibatch)

    def optimizer_step(self) -> None:
        self.update.step()

    def train_alone(self, minibatches: list[torch.Tensor]) -> bool:
        """One epoch on the stored rollout inputs (the cut before the first layer: no traffic); whether to stop
        here (`stop_early`)."""
        flat = self.rollouts.flat_inputs(self.train_iteration)
        for idx in minibatches:
            self.loss(idx, *self.heads.outputs(flat[idx])).backward()
            self.optimizer_step()
        return self.stop_early()

    def stop_early(self) -> bool:
        """CleanRL's ``--target-kl`` (`PPOUpdate.stop_early`). Stage1 decides and tells stage0 in the epoch's last
        ``train_bwd`` (``encoder_grad`` in a fleet, ``progress`` when stage1 trains alone) header: ``stop``."""
        return self.update.stop_early()

    def publish(self, versions: Iterable[int] | None = None) -> ActorCriticHeads:
        """The trained heads as the acting copy of each of ``versions`` (taken at stage0's word: `adopt`); default:
        the iterations trained, in versions (`TrainSettings.versions_per_iteration`)."""
        return self.policy.publish([self.train_iteration * self.settings.versions_per_iteration]
                                   if versions is None else versions)

    def iteration_stats(self) -> dict[str, Any]:
        """Mean losses over the iteration's minibatches, the explained variance, the staleness; starts the next count."""
        return self.update.iteration_stats(self.rollout_stats)

    def rollout_summary(self) -> dict[str, Any]:
        """Taken when a rollout ends: what a resumed run needs to act on from here (the action sampler's
        generator, the rollout codec's state); see `Edge.rollout_summary`."""
        return {"iteration": self.iteration, "generator": self.generator.get_state(),
                "codecs": self.codecs.state_dict("rollout")}

    def state_dict(self, rollout: dict[str, Any]) -> dict[str, Any]:
        """A checkpoint after training: heads, optimizer, the training codecs' state, and `rollout_summary`
        of the rollout just trained on."""
        return {"iteration": self.train_iteration, "heads": self.heads.state_dict(),
                "optimizer": self.optimizer.state_dict(), "codecs": self.codecs.state_dict("fwd", "bwd"),
                "rollout": rollout,
                **({"autoencoder": self.autoencoder.state_dict()} if self.autoencoder is not None else {}),
                **self.encoder_sum.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Go on from a checkpoint (`state_dict`)."""
        self.heads.load_state_dict(state["heads"])
        load_adam_state(self.optimizer, state["optimizer"])
        rollout = state["rollout"]
        self.train_iteration, self.iteration = state["iteration"], rollout["iteration"]
        self.generator.set_state(rollout["generator"])
        self.codecs.load_state_dict({**state["codecs"], **rollout["codecs"]})
        if self.autoencoder is not None:
            self.autoencoder.load_state_dict(state["autoencoder"])
        self.encoder_sum.load_state_dict(state)
        if self.policy.copied:
            self.policy.restart(self.train_iteration * self.settings.versions_per_iteration)
