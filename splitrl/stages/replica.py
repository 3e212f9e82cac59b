"""The replica exchange: training sends the change in the heads' outputs, not the features.

With the cut after the CNN, the loss depends on a sample's 4,096 features only
through the heads' outputs: the actor's mean (one value per action dimension;
with a Discrete action space its logits, one per action) and the critic's
value. Stage0 keeps a replica of the heads, brought up to date after each
rollout (``heads``) and, if asked, during training (see below). In each
training minibatch:

- stage0 computes its current features f and sends, per sample, the change of
  the replica's outputs since the rollout, ``o(f) - o(view)`` (4 floats for
  CarRacing), where ``view`` is the sample's rollout features as stage1 has them;
- stage1 trains its heads on ``view`` and adds that change to their outputs, so
  the PPO ratio and the value loss see what the encoder did since the rollout
  (the error is second order: the heads' drift since the sync times the features'
  drift since the rollout);
- stage1 sends back the loss gradient with respect to those outputs (4 floats),
  and stage0 back-propagates it through the replica and the encoder.

So a minibatch costs 32 bytes a sample both ways instead of 16 KiB each way in
float32 (the fwd and bwd codecs still apply: bf16 halves it), and the replica
costs one quantised weight update per iteration (plus those asked for during
training). What is not exact: the heads' own gradients are taken at the
rollout's features, and the encoder's gradient goes through weights up to one
iteration (or ``all_every`` minibatches; its output layers ``last_every``) old.

`splitrl.stages.weights.WeightSync` sends the heads' weights as the quantised change against the
replica both sides keep (as the delta codec does for features), so quantisation
errors never accumulate; it starts from the weights both stages build from the
seed, so the full weights never cross the link, only their changes.

The price is compute on the edge: stage0 runs the heads' forward and backward to
the features for every training sample (about 4.2 M multiply-adds a sample next
to the CNN's 10 M) and the heads on every rollout sample once an iteration.
After an update during training, the cached outputs on the rollout view are stale,
so each later minibatch of that iteration runs the heads' forward on its view
rows as well (about 4.2 M more multiply-adds a sample).
Once an iteration is the cheapest schedule but not the most exact: the heads
train 320 minibatches an iteration at the paper's settings, and their output
layers start near zero (``std=0.01``), so the replica's output layers can be
far from the heads' by the last epoch. ``last_every=N`` also sends, after every
N-th training minibatch, the change of every weight but the two first layers
(about 3,100 values: the output layers and the biases); ``all_every=N`` sends all
of them. Both count minibatches over the iteration (``all_every=160`` is every 5
epochs at 32 minibatches an epoch); 0 means only after the rollout. They travel
as ``heads`` messages after the ``train_bwd`` of that minibatch. Which weights
the replica holds and which follow which minibatch is the plan both stages
derive from the settings (`splitrl.stages.replica_plan`).
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

from ..codecs import CodecError, Context
from ..devices import to_device
from ..models import ActorCriticHeads, agent
from ..settings import Exchange
from ..transport import Message, ProtocolError
from ..transport.errors import peer_repr
from .autoencoder import PROJECTION
from .exchange import EdgeExchange, EdgeSide, LearnerExchange, LearnerSide, Sent
from .protocol import Payload
from .replica_plan import due, replicated
from .weights import WeightSync

__all__ = ["ReplicaEdge", "ReplicaLearner", "folded", "replica_weights"]


def replica_weights(heads: ActorCriticHeads, names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
    """What stage0's replica of ``heads`` holds (`replicated`), or of ``names`` of it: with an autoencoder's
    decoder as the heads' trunk (``--bottleneck-train autoencoder``), the decoder folded into the first layers
    (W (D x + d) + b = (W D) x + (W d + b)), so the replica takes the code itself and stays K wide. A first
    layer's folded weight (a 512 x 4096 by 4096 x K product) is computed only when ``names`` asks for it."""
    weights = {name: p.detach() for name, p in replicated(heads)}
    decoder_weight, decoder_bias = weights.pop("trunk.0.weight", None), weights.pop("trunk.0.bias", None)
    if decoder_weight is None:
        return weights
    wanted = None if names is None else set(names)
    for layer in ("critic.0", "actor_mean.0"):
        weight = weights.pop(layer + ".weight")
        weights[layer + ".bias"] = weight @ decoder_bias + weights[layer + ".bias"]
        if wanted is None or layer + ".weight" in wanted:
            weights[layer + ".weight"] = weight @ decoder_weight
    return weights


def folded(heads: ActorCriticHeads) -> ActorCriticHeads:
    """``heads`` as stage0's replica holds them: themselves without a decoder, else a K-wide copy with the decoder
    folded in (`replica_weights`)."""
    if len(heads.trunk) == 0:
        return heads
    critic, actor = heads.critic, heads.actor_mean
    with torch.random.fork_rng(devices=[]):  # the new layers' own initial weights are overwritten below
        out = ActorCriticHeads(nn.Sequential(), heads.input_dim, actor[2].out_features, hidden=critic[0].out_features,
                               discrete=heads.discrete)
    with torch.no_grad():
        weights = replica_weights(heads)
        for name, p in replicated(out):
            p.copy_(weights[name])
        if not heads.discrete:
            out.actor_logstd.copy_(heads.actor_logstd)
    return out


def _finite(x: torch.Tensor, what: str) -> torch.Tensor:
    if not bool(torch.isfinite(x).all()):
        raise CodecError(f"replica exchange: non-finite values in {what}")
    return x


def _outputs(heads: ActorCriticHeads, x: torch.Tensor) -> torch.Tensor:
    """[actor mean (or logits), value] per sample: what crosses instead of the features."""
    mean, value = heads.outputs(x)
    return torch.cat([mean, value[:, None]], dim=1)


class ReplicaEdge(EdgeExchange):
    """Stage0's half: the replica, its cached outputs on the rollout view, the updates it applies."""

    updates_after_rollout = True

    def __init__(self, edge: EdgeSide) -> None:
        super().__init__(edge)
        s, spec = edge.settings, edge.spec
        _, heads = agent(s, spec)
        # Never trained here: stage1's heads, as last sent; on stage0's device (the sync's view stays in host memory).
        self.replica = folded(heads).requires_grad_(False).to(self.codecs.device)
        weights = replicated(self.replica)
        if s.bottleneck_train == "autoencoder":  # stage1 fits the projection: it comes with the update too
            weights.append((PROJECTION, edge.net[-1].weight))
        self.sync = WeightSync(weights, self.exchange.sync)
        self.view = self.codecs.rollout_view()
        self.feature_dim = self.replica.input_dim
        self.view_outputs: torch.Tensor | None = None

    @property
    def exchange(self) -> Exchange:
        """The exchange as this iteration runs it (``--link-budget`` may lengthen its periods)."""
        return self.edge.exchange

    def _view_rows(self, idx: torch.Tensor) -> torch.Tensor:
        return to_device(self.view.rows(idx, (len(idx), self.feature_dim)), self.codecs.device)

    def _view_outputs(self, idx: torch.Tensor) -> torch.Tensor:
        """The replica's outputs on the rollout view of samples ``idx``: cached for the
        whole view after the rollout's update, computed per minibatch after a later one."""
        if self.view_outputs is not None:
            return self.view_outputs[idx]
        with torch.no_grad():
            return _outputs(self.replica, self._view_rows(idx))

    def send(self, features: torch.Tensor, idx: torch.Tensor) -> tuple[Sent, Payload]:
        out = _outputs(self.replica, features)
        tensors, header = {}, {}
        ctx = Context(idx=idx, global_step=self.edge.train_step)
        self.codecs.pack("fwd", "outputs", out.detach() - self._view_outputs(idx), ctx, tensors, header)
        return Sent(out, ctx), (tensors, header)

    def grad(self, sent: Sent, msg: Message) -> torch.Tensor:
        return _finite(super().grad(sent, msg), "the outputs' gradient")

    def state_dict(self) -> dict[str, Any]:
        return {"view": {name: t.clone() for name, t in self.sync.view.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sync.view = {name: t.clone() for name, t in state["view"].items()}
        with torch.no_grad():
            for name, p in replicated(self.replica):
                p.copy_(self.sync.view[name])
        self.view_outputs = None

    def due(self, epoch: int, mb: int) -> list[str]:
        ppo = self.edge.settings.ppo
        return due(self.exchange, epoch, mb, ppo.epochs, ppo.minibatches, self.sync.view)

    def apply_update(self, msg: Message, expected: dict[str, int], names: list[str] | None = None) -> None:
        """Check that ``msg`` is the update ``expected`` names, apply it to the view, copy that into the replica.

        After the rollout's update (``names`` None) the replica's outputs on the whole view are cached."""
        got = {key: msg.header.get(key) for key in expected}
        if got != expected:
            raise ProtocolError(f"heads: expected the update for {expected}, got {peer_repr(got)}")
        view = self.sync.decode(msg.tensors, names)
        with torch.no_grad():
            for name, p in replicated(self.replica):
                p.copy_(view[name])
            if PROJECTION in view:
                self.edge.net[-1].weight.copy_(view[PROJECTION])
            if names is None:
                samples = self.edge.settings.ppo.num_steps * self.edge.settings.env.num_envs  # the edge's rollout
                self.view_outputs = torch.cat([_outputs(self.replica, self._view_rows(idx))
                                               for idx in torch.arange(samples).split(1024)])
            else:
                self.view_outputs = None  # stale now; `_view_outputs` computes what each minibatch needs


class ReplicaLearner(LearnerExchange):
    """Stage1's half: heads trained on the rollout view plus the change stage0's replica saw."""

    def __init__(self, learner: LearnerSide) -> None:
        super().__init__(learner)
        self.sync = WeightSync(self._weights().items(), self.exchange.sync)
        self.view = self.codecs.rollout_view()

    def _weights(self, names: list[str] | None = None) -> dict[str, torch.Tensor]:
        """The replica's weights as the heads have them now (``names`` of them at least), and an autoencoder's
        projection."""
        weights = replica_weights(self.learner.heads, names)
        if self.learner.autoencoder is not None:
            weights[PROJECTION] = self.learner.autoencoder.projection.weight.detach()
        return weights

    @property
    def exchange(self) -> Exchange:
        return self.learner.exchange

    def learn(self, msg: Message, idx: torch.Tensor, minibatch: torch.Tensor | None = None,
              seen: torch.Tensor | None = None) -> Payload:
        learner = self.learner
        ctx = Context(idx=idx, global_step=learner.train_step)
        heads = learner.heads
        width = heads.actor_mean[-1].out_features + 1  # the actor's outputs (the action's width) and the value
        change = self.codecs.unpack("fwd", "outputs", msg.tensors, msg.header, ctx, (len(idx), width), torch.float32)
        offset = _finite(change, "the outputs' change").requires_grad_()
        mean, value = heads.outputs(to_device(self.view.rows(idx, (len(idx), heads.input_dim)), self.codecs.device))
        learner.loss(idx, mean + offset[:, :-1], value + offset[:, -1], minibatch).backward()
        tensors, header = {}, {}
        self.codecs.pack("bwd", "grad", offset.grad, ctx, tensors, header)
        return tensors, header

    def state_dict(self) -> dict[str, Any]:
        return {"view": {name: t.clone() for name, t in self.sync.view.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sync.view = {name: t.clone() for name, t in state["view"].items()}

    def update(self, epoch: int | None = None, mb: int | None = None) -> Payload | None:
        iteration = self.learner.train_iteration
        if epoch is None:  # after the rollout: everything, before stage0 trains
            autoencoder = self.learner.autoencoder
            if autoencoder is not None:  # fitted to this rollout's samples first
                for key, value in autoencoder.fit().items():
                    self.learner.stats[key].append(value)
            return self.sync.encode(self._weights().items()), {"iteration": iteration}
        ppo = self.learner.settings.ppo
        names = due(self.exchange, epoch, mb, ppo.epochs, ppo.minibatches, self.sync.view)
        if not names:
            return None
        # The replica's weights, brought closer to the heads' mid-iteration.
        return self.sync.encode(self._weights(names).items(), names), {"iteration": iteration, "epoch": epoch, "mb": mb}
