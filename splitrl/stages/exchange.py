"""What crosses the cut in training: a strategy with one half on each stage.

In every training minibatch stage0 forwards its encoder and sends something
that lets stage1 take the PPO loss; stage1 sends back the loss gradient with
respect to what it received, and stage0 back-propagates it. What that something
is, is the exchange (``--exchange``):

- `FeaturesExchange` (``features``, the paper's): the encoder's output through
  the fwd codec, and the gradient with respect to it through the bwd codec.
- `splitrl.stages.replica` (``replica``): the change of the heads' outputs
  since the rollout, computed on a replica of the heads that stage1 keeps up to
  date with ``heads`` messages.

The edge half (`EdgeExchange`) and the learner half (`LearnerExchange`) never
touch a link: they turn tensors into `Payload`s and received messages back into
tensors. Codecs stay pure tensor encoders underneath. Each half sees its stage
through a narrow collaborator (`EdgeSide`, `LearnerSide`: the few members it
reads), which `splitrl.stages.edge.Edge` and `splitrl.stages.learner.Learner`
satisfy; so neither half depends on the stage classes.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Protocol

import torch
from torch import nn

from ..codecs import CodecSet, Context
from ..envs import EnvSpec
from ..models import ActorCriticHeads
from ..settings import Exchange, TrainSettings
from ..transport import Message, ProtocolError
from .autoencoder import Autoencoder
from .limits import EdgeLimits
from .protocol import Payload

__all__ = ["Sent", "EdgeSide", "LearnerSide", "EdgeExchange", "LearnerExchange", "FeaturesEdge", "FeaturesLearner"]


class EdgeSide(Protocol):
    """What stage0's half of an exchange reads of stage0 (`splitrl.stages.edge.Edge` is one)."""

    settings: TrainSettings
    spec: EnvSpec
    codecs: CodecSet
    net: nn.Sequential
    """The layers before the cut (a replica exchange sets an autoencoder's projection, the last of them)."""

    @property
    def exchange(self) -> Exchange:
        """The exchange as this iteration runs it (``--link-budget`` may lengthen a replica's periods)."""

    @property
    def train_step(self) -> int:
        """Env steps collected when the rollout being trained on ended."""


class LearnerSide(Protocol):
    """What stage1's half of an exchange reads of stage1 (`splitrl.stages.learner.Learner` is one)."""

    settings: TrainSettings
    codecs: CodecSet
    heads: ActorCriticHeads
    autoencoder: Autoencoder | None
    limits: EdgeLimits
    """What stage0's features may hold (`splitrl.stages.limits`)."""
    train_iteration: int
    """The iteration being trained on."""

    @property
    def stats(self) -> dict[str, list[float]]:
        """The iteration's statistics, by key (an autoencoder's fit adds its own)."""

    @property
    def exchange(self) -> Exchange:
        """The exchange as this iteration runs it."""

    @property
    def train_step(self) -> int:
        """Env steps collected when the rollout being trained on ended."""

    @property
    def rescore_step(self) -> int:
        """``--rescore``: env steps collected when the rollout being scored again ended."""

    def loss(self, idx: torch.Tensor, mean: torch.Tensor, value: torch.Tensor,
             minibatch: torch.Tensor | None = None) -> torch.Tensor:
        """The PPO loss of samples ``idx`` given the heads' outputs on their inputs."""

    def part_gradients(self, x: torch.Tensor, idx: torch.Tensor, minibatch: torch.Tensor
                       ) -> tuple[list[torch.Tensor | None], dict[str, float]]:
        """A part's `loss` on the heads' inputs ``x``: (the gradients of ``x`` and of the heads' trainable
        parameters, returned instead of accumulated; its statistics, for `keep`)."""

    def keep(self, stats: dict[str, float], idx: torch.Tensor, minibatch: torch.Tensor | None = None) -> None:
        """Keep a part's statistics from `part_gradients`."""

    def rescore(self, idx: torch.Tensor, x: torch.Tensor) -> None:
        """Score samples ``idx`` again with the heads on ``x``."""


@dataclass
class Sent:
    """One minibatch as stage0 sent it: the tensor its reply is the gradient of, and how to decode that reply."""

    out: torch.Tensor
    ctx: Context


def relu_mask(settings: Any, seen: torch.Tensor) -> torch.Tensor | None:
    """Where the features at the cut, as stage1 sees them, are non-zero: the only places a ReLU's gradient can
    be (codecs may send the gradient there alone). None when the cut's features are no ReLU's: a
    ``--bottleneck`` projection's are not."""
    return None if settings.bottleneck else seen != 0


class EdgeExchange:
    """Stage0's half. Subclasses say what is sent for the encoder's output and what the reply means."""

    updates_after_rollout = False
    """Whether stage1 sends a ``heads`` update after every rollout."""

    def __init__(self, edge: EdgeSide) -> None:
        self.edge = edge
        self.codecs: CodecSet = edge.codecs

    def send(self, features: torch.Tensor, idx: torch.Tensor) -> tuple[Sent, Payload]:
        """``train_fwd``'s contents for the encoder's output ``features`` of samples ``idx``."""
        raise NotImplementedError

    def grad(self, sent: Sent, msg: Message) -> torch.Tensor:
        """The gradient of the loss with respect to ``sent.out``, decoded from ``train_bwd``."""
        return self.codecs.unpack("bwd", "grad", msg.tensors, msg.header, sent.ctx, tuple(sent.out.shape),
                                  sent.out.dtype)

    def due(self, epoch: int, mb: int) -> list[str]:
        """The weights a ``heads`` update after minibatch (epoch, mb) carries; [] if none follows it."""
        return []

    def apply_update(self, msg: Message, expected: dict[str, int], names: list[str] | None = None) -> None:
        raise ProtocolError(f"{msg.kind}: not expected with --exchange {self.edge.settings.codecs.exchange}")

    def state_dict(self) -> dict[str, Any]:
        """What carries over from one iteration to the next (for checkpoints)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class LearnerExchange:
    """Stage1's half: decodes what stage0 sent, takes the loss, encodes the gradient."""

    def __init__(self, learner: LearnerSide) -> None:
        self.learner = learner
        self.codecs: CodecSet = learner.codecs

    def learn(self, msg: Message, idx: torch.Tensor, minibatch: torch.Tensor | None = None,
              seen: torch.Tensor | None = None) -> Payload:
        """Back-propagate the loss of samples ``idx`` into the heads; ``train_bwd``'s contents.

        ``minibatch``: the whole minibatch when ``idx`` is one micro-batch of it (see `Learner.loss`); ``seen``:
        what `features` decoded of ``msg`` already. A loss that is not finite is an error (`PPOUpdate.loss`), with
        ``--exchange features`` a `ProtocolError` naming the features."""
        raise NotImplementedError

    apart = False
    """Whether a micro-batch's loss may be taken apart from the others' (`begin_part`, `end_part`): on a worker
    thread, the parts at once (`splitrl.schedule.workers`)."""

    def begin_part(self, msg: Message, idx: torch.Tensor, seen: torch.Tensor | None = None) -> tuple[torch.Tensor, Any]:
        """Part ``idx``'s ``train_fwd`` decoded (``seen``: as `learn`'s) for its loss to be taken apart
        (`LearnerSide.part_gradients`): (the heads' input, a leaf; what `end_part` needs)."""
        raise NotImplementedError

    def end_part(self, part: Any, taken: Callable[[], tuple[list[torch.Tensor | None], dict[str, float]]],
                 minibatch: torch.Tensor) -> tuple[Payload, list[torch.Tensor | None]]:
        """A part `begin_part` began, once ``taken()`` gives what `LearnerSide.part_gradients` returned: its
        statistics kept (call in the parts' order), its ``train_bwd`` contents and the heads' gradients."""
        raise NotImplementedError

    def features(self, msg: Message, idx: torch.Tensor) -> torch.Tensor:
        """What ``train_fwd`` carries for samples ``idx``, decoded and checked (a fleet reads every edge's share
        of a minibatch before any loss, and drops an edge whose share fails)."""
        raise ProtocolError(f"{msg.kind}: features are read ahead with --exchange features only")

    def rescore(self, msg: Message, idx: torch.Tensor) -> None:
        """Score samples ``idx`` again from ``rescore``'s features (`Learner.rescore`, ``--rescore``)."""
        raise ProtocolError(f"{msg.kind}: not expected with --exchange {self.learner.settings.codecs.exchange}")

    def update(self, epoch: int | None = None, mb: int | None = None) -> Payload | None:
        """A ``heads`` update to send after the rollout (no arguments) or after minibatch (epoch, mb); None if none."""
        return None

    def state_dict(self) -> dict[str, Any]:
        """What carries over from one iteration to the next (for checkpoints)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class FeaturesEdge(EdgeExchange):
    def send(self, features: torch.Tensor, idx: torch.Tensor) -> tuple[Sent, Payload]:
        tensors, header = {}, {}
        ctx = Context(idx=idx, global_step=self.edge.train_step)
        seen = self.codecs.pack("fwd", "features", features.detach(), ctx, tensors, header)
        # The gradient is zero wherever stage1's view of a ReLU feature is (the ef codec sends only the rest).
        mask = relu_mask(self.edge.settings, seen)
        return Sent(features, Context(idx=idx, mask=mask, global_step=ctx.global_step)), (tensors, header)


@contextmanager
def _finite(msg: Message) -> Iterator[None]:
    """A loss that is not finite (`PPOUpdate.measure`), refused before any statistic or gradient: an error naming
    the features ``msg`` carried."""
    try:
        yield
    except FloatingPointError as exc:
        raise ProtocolError(f"{msg.kind}: tensor 'features': {exc}") from None


class FeaturesLearner(LearnerExchange):
    def _features(self, msg: Message, idx: torch.Tensor, step: int) -> torch.Tensor:
        """The encoder's output for samples ``idx`` as stage1 sees it (through the fwd codec), in the training
        of the rollout that ended at env step ``step``."""
        return self.learner.limits.features(msg.kind, "features", self.codecs.unpack(
            "fwd", "features", msg.tensors, msg.header, Context(idx=idx, global_step=step),
            (len(idx), self.learner.heads.input_dim), torch.float32))

    def features(self, msg: Message, idx: torch.Tensor) -> torch.Tensor:
        return self._features(msg, idx, self.learner.train_step)

    def rescore(self, msg: Message, idx: torch.Tensor) -> None:
        # Decoded as the training about to begin decodes its features.
        self.learner.rescore(idx, self._features(msg, idx, self.learner.rescore_step))

    apart = True

    def learn(self, msg: Message, idx: torch.Tensor, minibatch: torch.Tensor | None = None,
              seen: torch.Tensor | None = None) -> Payload:
        learner = self.learner
        x, part = self.begin_part(msg, idx, seen)
        with _finite(msg):
            loss = learner.loss(idx, *learner.heads.outputs(x), minibatch)
        loss.backward()
        return self._reply(part, x.grad)

    def begin_part(self, msg: Message, idx: torch.Tensor,
                   seen: torch.Tensor | None = None) -> tuple[torch.Tensor, tuple[Message, Context]]:
        step = self.learner.train_step
        seen = self._features(msg, idx, step) if seen is None else seen
        ctx = Context(idx=idx, mask=relu_mask(self.learner.settings, seen), global_step=step)
        return seen.detach().requires_grad_(), (msg, ctx)

    def end_part(self, part: tuple[Message, Context],
                 taken: Callable[[], tuple[list[torch.Tensor | None], dict[str, float]]],
                 minibatch: torch.Tensor) -> tuple[Payload, list[torch.Tensor | None]]:
        msg, ctx = part
        with _finite(msg):
            grads, stats = taken()
        self.learner.keep(stats, ctx.idx, minibatch)
        return self._reply(part, grads[0]), grads[1:]

    def _reply(self, part: tuple[Message, Context], grad: torch.Tensor | None) -> Payload:
        tensors, header = {}, {}
        self.codecs.pack("bwd", "grad", grad, part[1], tensors, header)
        return tensors, header

