"""Stage1's compute: the actor-critic heads and the PPO learner.

`Learner` owns no link (Sample Factory's learner/worker split): it acts on the
rollout messages stage0 sends, finishes the rollout with GAE, and takes one PPO
loss per minibatch (or per micro-batch of one) from whatever the training
exchange hands it (`splitrl.stages.exchange`). A schedule (`splitrl.schedule`)
decides when.

As on stage0 (`splitrl.stages.edge`), the envs may come in groups, two rollouts
may be stored at once, and the rollout may act with its own copy of the heads:
the asynchronous schedule acts with the newest finished policy while the next
one trains, so a sample may have been acted on by an older policy than the one
that trains on it. Each sample's acting version is kept; `begin_training` gives
such samples truncated importance weights for their value targets (V-trace style,
`splitrl.ppo.compute_gae`), and PPO's ratio is always taken against the
log-probability of the policy that acted.
"""

from __future__ import annotations

import copy
import logging
from collections import defaultdict
from typing import Any, Iterable

import torch
from torch import nn

from ..codecs import CodecError, CodecSet, Context
from ..envs import EnvSpec
from ..models import ActorCriticHeads, agent
from ..ppo import LOSS_STATS, RolloutBuffer, anneal, explained_variance, minibatch_schedule, ppo_loss
from ..settings import TrainSettings
from ..transport import Message, ProtocolError
from .autoencoder import Autoencoder, sampled, unpack_sample
from .budget import TRAINING, LinkBudget, switch
from .learners import Learners
from .protocol import ENCODER_PREFIX, Payload, tensor
from .weights import WeightSync

__all__ = ["Learner"]

log = logging.getLogger(__name__)

_MASK64 = (1 << 64) - 1

BATCH_INVARIANT_ROWS = 16
"""On one intra-op thread, torch's CPU matrix products give a row the same numbers in every batch of at least
this many rows whose count is a multiple of `BATCH_INVARIANT_MULTIPLE`, wherever the row sits; in any other
batch (fewer rows, or a count off the multiple) some rows get other numbers (last bits). On two threads other
sizes differ too. Measured per CPU (torch 2.13): an AVX2 machine gave every batch of 4 rows or more the same
numbers; an AVX-512 Xeon (2026-11-27) needs 16 rows for the heads' 4,096-wide first layers,
and a multiple of 4 for the critic's one-output layer (a batch's last ``n % 4`` rows take another kernel).
tests/schedule/test_fleet.py checks the rule on the machine it runs on. Acting for a fleet as its edges come
runs the heads on one thread with each batch padded to this rule (`_invariant_rows`), so that no action
depends on who came with whom; a batch of 1 row now costs what one of 16 does, about 1.8 times the 4 rows it
was padded to before."""
BATCH_INVARIANT_MULTIPLE = 4


def _invariant_rows(rows: int) -> int:
    """The batch `_batch_invariant` pads ``rows`` rows to."""
    return max(BATCH_INVARIANT_ROWS, -(-rows // BATCH_INVARIANT_MULTIPLE) * BATCH_INVARIANT_MULTIPLE)


def _batch_invariant(forward: Any, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``forward(x)`` on one intra-op thread, ``x`` padded with zero rows to `_invariant_rows`."""
    rows, threads = len(x), torch.get_num_threads()
    padded = _invariant_rows(rows)
    if padded > rows:
        x = torch.cat([x, x.new_zeros((padded - rows,) + tuple(x.shape[1:]))])
    torch.set_num_threads(1)
    try:
        return tuple(out[:rows] for out in forward(x))
    finally:
        torch.set_num_threads(threads)


class Learner:
    """Heads + PPO. With the cut before the first layer it also keeps the rollout's
    inputs and trains alone (`train_alone`); otherwise each minibatch's inputs arrive."""

    def __init__(self, settings: TrainSettings, spec: EnvSpec, *, slots: int = 1, acting_copy: bool = False) -> None:
        self.settings, self.spec = settings, spec
        ppo = settings.ppo
        stage0_net, self.heads = agent(settings, spec)
        self.params = [p for p in self.heads.parameters() if p.requires_grad]  # not an autoencoder's decoder
        self.autoencoder = (Autoencoder(stage0_net[-1], self.heads.trunk[-1], settings.seed)
                            if settings.bottleneck_train == "autoencoder" else None)
        """``--bottleneck-train autoencoder``: the fit of stage0's projection (a copy here) and the heads' trunk."""
        self.optimizer = torch.optim.Adam(self.params, lr=ppo.lr_heads, eps=1e-5)
        self.generator = torch.Generator().manual_seed(settings.seed)
        self.acting: ActorCriticHeads = copy.deepcopy(self.heads).requires_grad_(False) if acting_copy else self.heads
        self.acting_version = 0
        self.acting_as = 0
        """The newest number the acting heads were published under: `acting_version` but where an early stop
        (--target-kl) published one copy under several (`publish`); what each sample's version is stored as, so
        that its lag counts the training it really missed."""
        self.published: dict[int, ActorCriticHeads] = {}
        n, t = settings.env.num_envs, ppo.num_steps
        self.set_groups(1)
        self.buffers = [RolloutBuffer(t, n, spec.action_dim, spec.discrete) for _ in range(slots)]
        self.buffer = self.buffers[0]
        """The rollout being collected."""
        self.train_buffer = self.buffers[0]
        """The rollout being trained on."""
        self.trains_alone = not any(True for _ in stage0_net.parameters())
        self.encoder_start = {ENCODER_PREFIX + name: p.detach().clone() for name, p in stage0_net.named_parameters()}
        """The layers before the cut as built from the seed, named as a fleet's edges send their gradients
        (`sum_gradients`) or weights (`average_encoders`); a resumed fleet's as it last agreed on them."""
        self.encoder_average: WeightSync | None = None
        self.feature_dim = self.heads.input_dim
        """The width of the features at the cut."""
        # Stored rollout inputs: pixels when stage1 trains alone; with an acting copy, the features,
        # so that samples an older policy acted on can be scored by the one that trains.
        keep = (t, n) + spec.obs_shape if self.trains_alone else (t, n, self.feature_dim) if acting_copy else None
        keep_dtype = torch.uint8 if self.trains_alone else torch.float32
        self.inputs = [torch.zeros(keep, dtype=keep_dtype) for _ in range(slots)] if keep else None
        self.versions = [torch.zeros((t, n), dtype=torch.int64) for _ in range(slots)]
        """The policy version that acted on each sample: training iterations done before it, or epochs with
        --publish epoch (`TrainSettings.versions_per_iteration`)."""
        self.last_values = [torch.zeros(n) for _ in range(slots)]
        self.codecs = CodecSet(**settings.codecs.specs())
        self.exchange = settings.codecs.parsed_exchange()
        """The training exchange as this iteration runs it (``--link-budget`` may lengthen a replica's periods)."""
        self.budget = LinkBudget.of(settings, spec)
        """``--link-budget``: only to check what stage0 chooses (`announced`)."""
        self.announced: dict[int, dict[str, str]] = {}
        """``--link-budget``: each iteration's settings as stage0 sent them, until its training takes them."""
        self.iteration = 0
        """The iteration being collected."""
        self.train_iteration = 0
        """The iteration being trained on."""
        self.stats: dict[str, list[float]] = defaultdict(list)
        self._parts: dict[str, float] = {}
        self.lagging = torch.zeros(0, dtype=torch.bool)
        """Which samples of the rollout being trained on an older policy acted on (flat, as ``b_*``)."""
        self.proximal_values: torch.Tensor | None = None
        """And the proximal network's values of them, the centre of their value clip."""
        self.proximal: torch.Tensor | None = None
        """Decoupled PPO's proximal log-probabilities of those samples (NaN until a minibatch first holds one)."""
        self.rescored: tuple[int, torch.Tensor, torch.Tensor] | None = None
        """``--rescore``: the iteration whose rollout is being scored again, and its samples' log-probabilities
        and values under the network that starts training (flat; NaN until `rescore` fills them)."""
        """The statistics of the minibatch being taken in parts, weighted by each part's share so far."""
        self.rollout_stats: dict[str, float] = {}
        """Statistics of the rollout being trained on, taken when its training begins."""
        self.learners = Learners()
        """The other learners this one trains in step with (several stage1 processes of a fleet), if any."""

    def set_groups(self, groups: int) -> None:
        """Expect the envs in ``groups`` equal groups that step in turn (stage0's ``plan``)."""
        n = self.settings.env.num_envs
        if groups < 1 or n % groups:
            raise ValueError(f"{n} envs do not split into {groups} equal groups")
        size = n // groups
        self.groups = [slice(g * size, (g + 1) * size) for g in range(groups)]
        self.group_rows = [torch.arange(g * size, (g + 1) * size) for g in range(groups)]
        """Each group's env indices in the rollout batch, as a tensor."""

    def _slot(self, iteration: int) -> int:
        return iteration % len(self.buffers)

    def global_step(self, t: int = 0, g: int = 0) -> int:
        """stage0's env-step count when it encoded group ``g``'s step ``t`` of the iteration being collected.

        The groups step in order (`splitrl.schedule.pipelined`): before step t + 1 of group g, every
        group has taken t steps and groups 0 .. g one more."""
        start = (self.iteration - 1) * self.settings.steps_per_iteration
        if t == 0:
            return start
        size = self.groups[g].stop - self.groups[g].start
        return start + (t - 1) * self.settings.env.num_envs + (g + 1) * size

    @property
    def train_step(self) -> int:
        """Env steps collected when the rollout being trained on ended (codecs' warm starts count these)."""
        return self.train_iteration * self.settings.steps_per_iteration

    def _input(self, msg: Message, ctx: Context, name: str = "features") -> torch.Tensor:
        """Decode stage0's rollout features (pixels with the cut before the first layer) for ``ctx``'s rows."""
        rows = len(ctx.idx if ctx.idx is not None else ctx.envs)
        if self.trains_alone:
            shape, dtype = (rows,) + self.spec.obs_shape, torch.uint8
        else:
            shape, dtype = (rows, self.feature_dim), torch.float32
        return self.codecs.unpack("rollout", name, msg.tensors, msg.header, ctx, shape, dtype)

    # -- rollout ---------------------------------------------------------------------
    def begin_rollout(self, iteration: int) -> None:
        self.iteration = iteration
        self.buffer = self.buffers[self._slot(iteration)]
        # Rows no step fills (a fleet's edge dropped in or before this rollout) are never trained on: not lagging.
        self.versions[self._slot(iteration)].fill_(self._acting_version())
        self.codecs.new_iteration("rollout")

    def adopt(self, version: int) -> None:
        """Act with the heads of ``version`` (stage0 says when it switched its encoder)."""
        if version == self.acting_version:
            return
        heads = self.published.get(version)
        if heads is None:
            raise ProtocolError(f"step: stage0 acts with policy version {version}; stage1 has published "
                                f"{sorted(self.published) or 'none'} after acting with {self.acting_version}")
        self.acting, self.acting_version = heads, version
        # An early stop's aliases (`publish`) are all >= version, none dropped yet: the newest names the copy.
        self.acting_as = max(v for v, h in list(self.published.items()) if h is heads)
        for old in [v for v in list(self.published) if v < version]:  # list(): publish() may add meanwhile
            del self.published[old]

    def act(self, t: int, msg: Message, g: int = 0) -> Payload:
        """Record the outcome that rides on group ``g``'s step ``t``, then sample the policy's action."""
        return self.act_groups([(g, t, msg)])[0]

    def act_groups(self, steps: list[tuple[int, int, Message]], order_free: bool = False) -> list[Payload]:
        """`act` for several groups' step messages (``(g, t, msg)``: group ``g``'s step ``t``) with one forward
        of the heads (a fleet's edges, batched as an inference server would).

        Each group's actions are sampled in the order given, from the shared generator, unless
        ``order_free``: then from a generator seeded by (seed, iteration, g, t) alone (`step_generator`), and
        the heads' forward gets a batch padded to `_invariant_rows`, so the actions do not depend on which
        groups came together or in what order (a fleet served as its edges arrive, ``--act-wait``)."""
        n, slot = self.settings.env.num_envs, self._slot(self.iteration)
        inputs, outcomes = [], []
        with torch.no_grad():
            for g, t, msg in steps:
                rows = self.group_rows[g]
                if t == 0 and "budget" in msg.header:
                    self._budget(msg.header["budget"])
                if t > 0:
                    outcomes.append((t - 1, g, self._outcome(t - 1, msg, g)))
                ctx = Context(idx=t * n + rows, envs=rows, global_step=self.global_step(t, g))
                inputs.append(self._input(msg, ctx))
                if self.autoencoder is not None and sampled(self.settings, t):
                    self.autoencoder.add(unpack_sample(msg, len(rows), self.heads.trunk[-1].out_features))
            self._record_outcomes(outcomes)
            x = inputs[0] if len(inputs) == 1 else torch.cat(inputs)
            if order_free:  # one thread, rows padded: any batch gives a row one result
                mean, value = _batch_invariant(self.acting.outputs, x)
            else:
                mean, value = self.acting.outputs(x)
            # Each group's draw is its own call, as one group alone would make it (a draw of the whole batch
            # at once would give other numbers: torch fills large normal tensors block-wise).
            parts = [(len(rows), self.step_generator(g, t) if order_free else self.generator)
                     for (g, t, _), rows in zip(steps, inputs)]
            u, logprob, _, v = self.acting.evaluate(mean, value, parts=parts)
        at, envs = self._rows_of([(t, g) for g, t, _ in steps])
        self.buffer.add_rows(at, envs, actions=u, logprobs=logprob, values=v)
        if self.inputs is not None:
            self.inputs[slot][at, envs] = x
        self.versions[slot][at, envs] = self._acting_version()
        wire = self.acting.wire_action(u)
        payloads, start = [], 0
        for size, _ in parts:
            payloads.append(({"action": wire[start:start + size]}, {}))
            start += size
        return payloads

    def step_generator(self, g: int, t: int) -> torch.Generator:
        """A generator for group ``g``'s step ``t`` of the iteration being collected, seeded by those and the
        run's seed alone (a splitmix64-style mix, so that nearby steps get unrelated streams)."""
        key = (self.settings.seed, self.iteration, g, t)
        h = 0x9E3779B97F4A7C15
        for part in key:
            h = (h ^ (part & _MASK64)) * 0xBF58476D1CE4E5B9 & _MASK64
            h ^= h >> 31
        return torch.Generator().manual_seed(h & 0x7FFF_FFFF_FFFF_FFFF)

    def _budget(self, announced: Any) -> None:
        """Stage0's ``--link-budget`` choice for the iteration being collected: the rollout codec switches now."""
        if self.budget is None:
            raise ProtocolError("step: header 'budget' from a stage0 with --link-budget; this stage1 has none")
        specs = self.budget.check(announced)
        before = self.announced.get(self.iteration)
        if before is not None and before != specs:  # every group's first step says the same
            raise ProtocolError(f"step: header 'budget' differs between groups of iteration {self.iteration}")
        self.announced[self.iteration] = specs
        switch(self.codecs, specs, ["rollout"])

    def _acting_version(self) -> int:
        # Without a copy the heads act as they are: trained iteration - 1 times.
        return self.acting_as if self.acting is not self.heads else \
            (self.iteration - 1) * self.settings.versions_per_iteration

    def end_rollout(self, msg: Message, g: int = 0) -> None:
        """Group ``g``'s last outcome and the value of the observation it bootstraps from."""
        ppo = self.settings.ppo
        with torch.no_grad():
            self._record_outcome(ppo.num_steps - 1, msg, g)
            rows = torch.arange(self.groups[g].start, self.groups[g].stop)
            ctx = Context(envs=rows, global_step=self.global_step(ppo.num_steps, g))
            x, slot = self._input(msg, ctx), self._slot(self.iteration)
            self.last_values[slot][self.groups[g]] = self.acting.get_value(x)

    def _record_outcome(self, step: int, msg: Message, g: int) -> None:
        self._record_outcomes([(step, g, self._outcome(step, msg, g))])

    def _record_outcomes(self, outcomes: list[tuple[int, int, tuple[torch.Tensor, ...]]]) -> None:
        """Write `_outcome`s ((step, group, outcome) each) into the rollout buffer, all at once."""
        if not outcomes:
            return
        steps, envs = self._rows_of([(step, g) for step, g, _ in outcomes])
        reward, terminated, truncated, final_values = (torch.cat(parts) for parts in zip(*(o for _, _, o in outcomes)))
        self.buffer.add_outcome_rows(steps, envs, rewards=reward, terminated=terminated, truncated=truncated,
                                     final_values=final_values)

    def _rows_of(self, parts: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """(step, env) index tensors of the rows of ``parts`` ((step, group) each), in that order."""
        if len(parts) == 1:
            t, g = parts[0]
            rows = self.group_rows[g]
            return torch.full((len(rows),), t), rows
        size = self.groups[0].stop - self.groups[0].start  # every group is this wide
        return (torch.tensor([t for t, _ in parts]).repeat_interleave(size),
                torch.cat([self.group_rows[g] for _, g in parts]))

    def _outcome(self, step: int, msg: Message, g: int) -> tuple[torch.Tensor, ...]:
        """Group ``g``'s (reward, terminated, truncated, final values) after step ``step``, as ``msg`` carries it."""
        envs = self.groups[g]
        n = envs.stop - envs.start
        reward = tensor(msg, "reward", (n,), torch.float32)
        terminated = tensor(msg, "terminated", (n,), torch.bool)
        truncated = tensor(msg, "truncated", (n,), torch.bool)
        final_values = torch.zeros(n)
        if "final_index" in msg.tensors:
            index = msg.tensors["final_index"]
            if index.dtype != torch.int64 or index.dim() != 1 or not bool(((index >= 0) & (index < n)).all()):
                raise ProtocolError(f"{msg.kind}: final_index: expected int64 env indices in [0, {n}), got {index}")
            ctx = Context(envs=index + envs.start, global_step=self.global_step(step + 1, g))
            final_values[index] = self.acting.get_value(self._input(msg, ctx, "final_features"))
        return reward, terminated, truncated, final_values

    # -- training --------------------------------------------------------------------
    def begin_training(self, iteration: int) -> list[list[torch.Tensor]]:
        """Advantages and returns of ``iteration``'s rollout; its minibatch indices per epoch (as on stage0).

        Samples an older policy acted on than the one training (the asynchronous
        schedule: version < iteration - 1) get truncated importance weights min(1, pi / mu)
        on their value targets (`splitrl.ppo.compute_gae`), pi scored by the heads that
        train on the features the rollout sent. Their policy loss is decoupled PPO's
        (Hilton et al. 2021, "Batch size-invariance for policy optimization"): the ratio is
        clipped against a proximal policy, the network that trains as it first sees the sample
        this iteration (its log-probability kept in `proximal`), and the advantage carries the
        truncated importance weight min(1, pi_prox / mu) of the policy that acted. Clipped
        against mu itself, a sample starts a whole iteration's update away from the trust
        region's centre. Their values stay the acting network's: the heads
        that train paired with features of the older encoder that the rollout sent are no
        network that ever was, and on CarRacing their values differed from the acting ones
        by about a quarter of a normalised return, enough noise to stall learning
        (docs/results/pipeline.md, "Learning"). Scoring with the current encoder would need
        another pass of those samples across the link.

        With ``--rescore`` that pass happened (`begin_rescore`, `rescore`): the network that starts training
        scored every sample, and its log-probabilities are the proximal policy from the first minibatch on and
        the importance weights' numerator, its values the baseline of the advantages, of the value targets and
        of the value clip. The bootstrap values after the rollout's last step and at truncations stay the
        acting network's.
        """
        ppo, slot = self.settings.ppo, self._slot(iteration)
        self.train_iteration = iteration
        anneal(self.optimizer, ppo.lr_heads * ppo.lr_fraction(iteration, self.settings.num_iterations))
        self.train_buffer = buffer = self.buffers[slot]
        per_iteration = self.settings.versions_per_iteration
        lag = (iteration - 1) * per_iteration - self.versions[slot]  # in versions: iterations, or epochs
        weights, self.proximal, self.proximal_values = None, None, None
        self.lagging = (lag > 0).reshape(-1)
        rescored, self.rescored = self.rescored, None
        baseline = None
        if rescored is not None:
            scored, scored_logprobs, scored_values = rescored
            if scored != iteration or bool(scored_logprobs.isnan().any()):
                raise ProtocolError(f"iteration {iteration}: the rollout was not scored again before its training "
                                    f"(--rescore; scored: iteration {scored}, {int(scored_logprobs.isnan().sum())} "
                                    "samples missing)")
            baseline = scored_values.reshape(lag.shape)
        if bool(self.lagging.any()):
            if rescored is not None:
                logprob = scored_logprobs.reshape(lag.shape)
                self.proximal, self.proximal_values = scored_logprobs.clone(), scored_values.clone()
            else:
                logprob = self._logprobs(self.inputs[slot], buffer.actions)
                self.proximal = torch.full_like(self.lagging, float("nan"), dtype=torch.float32)
                self.proximal_values = torch.full_like(self.lagging, float("nan"), dtype=torch.float32)
            weights = torch.where(lag > 0, (logprob - buffer.logprobs).exp().clamp(max=1.0), torch.ones_like(logprob))
        buffer.finish(self.last_values[slot], ppo.gamma, ppo.gae_lambda, weights, baseline)
        # Now, not at the iteration's end: by then the next rollout may be writing this slot.
        self.rollout_stats = {"losses/explained_variance": explained_variance(buffer.b_values, buffer.b_returns)}
        if self.acting is not self.heads:
            self.rollout_stats.update({"async/staleness_mean": float(lag.float().mean()) / per_iteration,
                                       "async/staleness_max": float(lag.max()) / per_iteration})
            if weights is not None:  # how far the lagging samples' policy is from the one that trains
                self.rollout_stats["async/weight_mean"] = float(weights[lag > 0].mean())
        if rescored is None:  # (a rescore set them up already: stage0 encoded it with them)
            self._training_codecs(iteration)
        return minibatch_schedule(self.settings.seed, iteration, ppo.epochs, buffer.batch_size, ppo.minibatches)

    def _training_codecs(self, iteration: int) -> None:
        """The training streams' codecs as ``iteration``'s training runs them, from its rescore if there is one
        (`begin_rescore`), else from `begin_training`."""
        self.codecs.new_iteration("fwd", "bwd")
        if iteration in self.announced:
            self.exchange = switch(self.codecs, self.announced.pop(iteration), TRAINING)

    def begin_rescore(self, iteration: int) -> None:
        """``--rescore``: score ``iteration``'s rollout again with the heads as they start its training, sample by
        sample (`rescore`, before `begin_training`)."""
        self._training_codecs(iteration)
        n = self.buffers[self._slot(iteration)].batch_size
        self.rescored = (iteration, torch.full((n,), float("nan")), torch.full((n,), float("nan")))

    def rescore(self, idx: torch.Tensor, x: torch.Tensor) -> None:
        """The log-probabilities of samples ``idx``'s actions and their values, with the heads on ``x``: the
        features stage0's encoder gives their observations now (or, when stage1 holds the whole network, their
        stored inputs)."""
        assert self.rescored is not None
        iteration, logprobs, values = self.rescored
        buffer = self.buffers[self._slot(iteration)]
        logprobs[idx], values[idx] = self._score(x, buffer.actions.reshape((-1,) + buffer.action_shape)[idx])

    def rescore_stored(self, chunks: list[torch.Tensor]) -> None:
        """`rescore` every sample from its stored input, in ``chunks`` of indices (the cut before the first
        layer: stage1 holds the whole network, nothing crosses the link)."""
        assert self.rescored is not None and self.trains_alone
        flat = self.inputs[self._slot(self.rescored[0])].reshape((-1,) + self.spec.obs_shape)
        for idx in chunks:
            self.rescore(idx, flat[idx])

    def _logprobs(self, inputs: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        """The training heads' log-probability of ``actions`` on stored inputs shaped (T, N, ...), by rows."""
        t, n = inputs.shape[:2]
        flat = inputs.reshape((t * n,) + inputs.shape[2:])
        flat_actions = actions.reshape((t * n,) + actions.shape[2:])
        logprobs = [self._score(flat[rows], flat_actions[rows])[0] for rows in torch.arange(t * n).split(512)]
        return torch.cat(logprobs).reshape(t, n)

    def _score(self, x: torch.Tensor, actions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The training heads' log-probabilities of ``actions`` and values on inputs ``x``, without a graph."""
        with torch.no_grad():
            _, logprob, _, value = self.heads.evaluate(*self.heads.outputs(x), actions)
        return logprob, value.reshape(-1)

    def loss(self, idx: torch.Tensor, mean: torch.Tensor, value: torch.Tensor,
             minibatch: torch.Tensor | None = None) -> torch.Tensor:
        """The PPO loss of samples ``idx`` given the heads' outputs on their inputs; its statistics are kept.

        ``minibatch``: the whole minibatch when ``idx`` is one part of it (a micro-batch, a fleet edge's
        share): advantages are normalised over the minibatch and the loss and its statistics weighted by
        the part's share, so the parts' gradients, and their statistics, add up to the minibatch's (the
        statistics are kept once the minibatch is whole: `optimizer_step` or `stop_early`).
        """
        b, ppo = self.train_buffer, self.settings.ppo
        whole = idx if minibatch is None else minibatch
        advantages = b.b_advantages[idx]
        if ppo.norm_adv and len(whole) > 1:  # (one sample has no spread: a fleet's minibatch after drops)
            everything = b.b_advantages[whole]
            advantages = (advantages - everything.mean()) / (everything.std() + 1e-8)
        _, newlogprob, entropy, newvalue = self.heads.evaluate(mean, value, b.b_actions[idx])
        behaviour, old_values = b.b_logprobs[idx], b.b_values[idx]
        if self.proximal is not None:  # some samples lag: decoupled PPO for them (see `begin_training`)
            assert self.proximal_values is not None
            prox = torch.where(torch.isnan(self.proximal[idx]), newlogprob.detach(), self.proximal[idx])
            prox_v = torch.where(torch.isnan(self.proximal_values[idx]), newvalue.detach(), self.proximal_values[idx])
            self.proximal[idx], self.proximal_values[idx] = prox, prox_v
            lagging = self.lagging[idx]
            advantages = torch.where(lagging, advantages * (prox - behaviour).exp().clamp(max=1.0), advantages)
            behaviour = torch.where(lagging, prox, behaviour)
            # The value clip too is centred on the proximal network: clipped against the acting network's
            # values, a critic that moved more than clip_coef since then gets no gradient from those samples.
            old_values = torch.where(lagging, prox_v, old_values)
        loss, stats = ppo_loss(
            newlogprob, behaviour, advantages, newvalue, old_values, b.b_returns[idx], entropy,
            clip_coef=ppo.clip_coef, vf_coef=ppo.vf_coef, ent_coef=ppo.ent_coef,
            clip_vloss=ppo.clip_vloss, norm_adv=False,
        )
        if minibatch is None:
            for key, v in stats.items():
                self.stats[key].append(v)
            return loss
        share = len(idx) / len(minibatch)
        for key, v in stats.items():
            self._parts[key] = self._parts.get(key, 0.0) + v * share
        return loss * share

    def _minibatch_done(self) -> None:
        """The statistics of a minibatch taken in parts, as one entry (each is linear in the samples; summed over
        the learners)."""
        for key, v in self.learners.sum_stats(self._parts, LOSS_STATS).items():
            self.stats[key].append(v)
        self._parts.clear()

    def sum_gradients(self, msgs: list[Message]) -> dict[str, torch.Tensor]:
        """A fleet's encoder gradients (each edge's ``encoder_grad``), added up in edge order (then over the
        learners)."""
        total: dict[str, torch.Tensor] = {}
        for msg in msgs:
            for name, start in self.encoder_start.items():
                grad = tensor(msg, name, tuple(start.shape), torch.float32)
                total[name] = grad.clone() if name not in total else total[name].add_(grad)
        total = self.learners.sum_named(total, self.encoder_start)
        return total

    def average_encoders(self, msgs: list[Message], mode: str) -> dict[str, torch.Tensor]:
        """A fleet's encoders averaged (``--encoder-sync avg``): each edge's ``encoder_avg`` carries its change
        since the last average; the parts of their mean, which every edge then adds to the same view."""
        if self.encoder_average is None:
            self.encoder_average = WeightSync(self.encoder_start.items(), mode, "encoder average")
        sync = self.encoder_average
        total: dict[str, torch.Tensor] = {}
        for msg in msgs:
            try:
                for name, change in sync.changes(msg.tensors).items():
                    total[name] = change if name not in total else total[name].add_(change)
            except CodecError as exc:
                raise ProtocolError(f"{msg.kind}: {exc}") from None
        count = self.learners.sum_count(len(msgs))
        total = self.learners.sum_named(total, self.encoder_start)
        return sync.encode({name: sync.view[name] + change / count for name, change in total.items()})

    def optimizer_step(self) -> None:
        self._minibatch_done()
        self.learners.sum_gradients(self.params)
        nn.utils.clip_grad_norm_(self.params, self.settings.ppo.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def train_alone(self, minibatches: list[torch.Tensor]) -> bool:
        """One epoch on the stored rollout inputs (the cut before the first layer: no traffic); whether to stop
        here (`stop_early`)."""
        flat = self.inputs[self._slot(self.train_iteration)].reshape((-1,) + self.spec.obs_shape)
        for idx in minibatches:
            self.loss(idx, *self.heads.outputs(flat[idx])).backward()
            self.optimizer_step()
        return self.stop_early()

    def stop_early(self) -> bool:
        """CleanRL's ``--target-kl``: after an epoch, whether the approximate KL of its last minibatch exceeds the
        target, so that the iteration's epochs end here. Stage1 decides and tells stage0 in the epoch's last
        ``train_bwd`` (``encoder_grad`` in a fleet, ``progress`` when stage1 trains alone) header: ``stop``."""
        self._minibatch_done()
        target = self.settings.ppo.target_kl
        kls = self.stats["losses/approx_kl"][-1:]
        stop = target > 0 and bool(kls) and kls[0] > target
        if stop:
            self.stats["losses/early_stop"].append(1.0)
        return stop

    def publish(self, versions: Iterable[int] | None = None) -> ActorCriticHeads:
        """The trained heads as the acting copy of each of ``versions`` (taken at stage0's word: `adopt`); default:
        the iterations trained, in versions (`TrainSettings.versions_per_iteration`). Several numbers name one
        copy where training ended early (--target-kl)."""
        heads = copy.deepcopy(self.heads).requires_grad_(False)
        for version in [self.train_iteration * self.settings.versions_per_iteration] if versions is None else versions:
            self.published[version] = heads
        return heads

    def iteration_stats(self) -> dict[str, Any]:
        """Mean losses over the iteration's minibatches, the explained variance, the staleness; starts the next count."""
        stats: dict[str, Any] = {k: sum(v) / len(v) for k, v in self.stats.items() if v}
        stats.update(self.rollout_stats)
        self.stats.clear()
        return stats

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
                **({"encoder_average": dict(self.encoder_average.view)} if self.encoder_average is not None else {})}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Go on from a checkpoint (`state_dict`)."""
        self.heads.load_state_dict(state["heads"])
        self.optimizer.load_state_dict(state["optimizer"])
        rollout = state["rollout"]
        self.train_iteration, self.iteration = state["iteration"], rollout["iteration"]
        self.generator.set_state(rollout["generator"])
        self.codecs.load_state_dict({**state["codecs"], **rollout["codecs"]})
        if self.autoencoder is not None:
            self.autoencoder.load_state_dict(state["autoencoder"])
        if "encoder_average" in state:  # --encoder-sync avg: the view the edges average against
            self.encoder_start, self.encoder_average = dict(state["encoder_average"]), None
        if self.acting is not self.heads:
            self.acting_version = self.acting_as = self.train_iteration * self.settings.versions_per_iteration
            self.acting = copy.deepcopy(self.heads).requires_grad_(False)
            self.published = {self.acting_version: self.acting}
