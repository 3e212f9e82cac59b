"""One encoder across a fleet's edges: each edge's part (`EdgeEncoder`) and stage1's (`EncoderSum`).

Every edge of a fleet trains its own copy of the layers before the cut, and the fleet keeps the
copies equal (``--encoder-sync``):

- ``grad``: after each minibatch every edge sends its encoder's gradients (``encoder_grad``), stage1
  adds them up in edge order (then over its learners) and sends the sum back; every edge steps its
  optimizer with the same gradients.
- ``avg``: every k minibatches each edge sends its encoder's change since the fleet last agreed
  (``encoder_avg``, through a dense codec: `splitrl.stages.weights.WeightSync`), stage1 sends the
  mean change back, and every edge's encoder becomes the agreed view plus that mean.

An edge joining a fleet that has trained already starts from another edge's encoder and optimizer
moments (`EdgeEncoder.state`, `EdgeEncoder.join`). The schedule (`splitrl.schedule.fleet`) decides
when any of this happens.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from ..codecs import CodecError
from ..devices import to_device, to_host
from ..settings import EncoderSync
from ..transport import Message, ProtocolError
from ..transport.errors import peer_repr
from .learners import Learners
from .protocol import ENCODER_PREFIX, tensor
from .digest import digests
from .limits import EdgeLimits
from .robust import combine
from .weights import WeightSync

__all__ = ["EdgeEncoder", "EncoderSum"]


def _named(net: nn.Module) -> dict[str, torch.Tensor]:
    """``net``'s parameters, named as the fleet's messages name them."""
    return {ENCODER_PREFIX + n: p for n, p in net.named_parameters()}


class EdgeEncoder:
    """An edge's side of the fleet's encoder: its gradients and changes out, the fleet's sum and mean in.

    ``built``: the encoder as built from the seed (called once, for the first average), the view the fleet
    first agrees on unless `agreed` says otherwise."""

    def __init__(self, net: nn.Module, optimizer: torch.optim.Optimizer | None,
                 built: Callable[[], nn.Module]) -> None:
        self.net, self.optimizer, self.built = net, optimizer, built
        self.agreed: dict[str, torch.Tensor] | None = None
        """The first view this edge averages against where it is not the encoder built from the seed: the one a
        late edge joined with (`join`), the one a resumed edge last agreed on (`load_state_dict`)."""
        self.average: WeightSync | None = None
        """``--encoder-sync avg``: the encoder as the fleet last agreed on it (`change`, `take_average`)."""

    def gradients(self) -> dict[str, torch.Tensor]:
        """The encoder's gradients accumulated since the last step, by name (zeros where none), in host memory."""
        return {ENCODER_PREFIX + name: to_host((p.grad if p.grad is not None else torch.zeros_like(p)).detach())
                for name, p in self.net.named_parameters()}

    def set_gradients(self, msg: Message) -> None:
        """Take the fleet's summed gradients (stage1's ``encoder_grad``) as this step's."""
        for name, p in self.net.named_parameters():
            p.grad = to_device(tensor(msg, ENCODER_PREFIX + name, tuple(p.shape), p.dtype), p.device)

    def change(self, mode: str) -> dict[str, torch.Tensor]:
        """``encoder_avg``'s parts: the encoder's change since the fleet last averaged, through the dense codec
        ``mode``."""
        if self.average is None:  # the fleet agreed on the encoder built from the seed, or the one joined
            built = _named(self.built())
            agreed = self.agreed or built
            self.average = WeightSync(agreed.items(), mode, "encoder average")
        return self.average.delta((ENCODER_PREFIX + n, p) for n, p in self.net.named_parameters())

    def take_average(self, msg: Message) -> None:
        """Stage1's mean of the edges' changes (``encoder_avg``): every edge's encoder becomes the same."""
        assert self.average is not None, "encoder_change comes first"
        try:
            view = self.average.decode(dict(msg.tensors))
        except CodecError as exc:
            raise ProtocolError(f"{msg.kind}: {exc}") from None
        with torch.no_grad():
            for name, p in self.net.named_parameters():
                p.copy_(view[ENCODER_PREFIX + name])

    def agree_on_current(self) -> None:
        """The encoder as it is now is what the fleet last agreed on."""
        self.agreed = {ENCODER_PREFIX + n: p.detach().clone() for n, p in self.net.named_parameters()}

    # -- joining ---------------------------------------------------------------------------------
    def _state(self) -> tuple[list[tuple[str, torch.Tensor]], int]:
        """The tensors of `state` as they are (not copied) and Adam's step count."""
        tensors = [(f"net.{name}", t) for name, t in self.net.state_dict().items()]
        step = 0
        if self.optimizer is not None:
            for name, p in ((n, p) for n, p in self.net.named_parameters() if p.requires_grad):
                moments = self.optimizer.state.get(p)
                if moments:
                    step = int(moments["step"])
                    tensors += [(f"exp_avg.{name}", moments["exp_avg"]), (f"exp_avg_sq.{name}", moments["exp_avg_sq"])]
        return tensors, step

    def state(self) -> tuple[dict[str, torch.Tensor], int]:
        """The encoder's weights and its optimizer's moments in host memory, as a joining edge takes them (`join`),
        and Adam's step count."""
        tensors, step = self._state()
        # Copies: a large tensor leaves zero-copy, after this edge may have stepped again.
        return {name: to_host(t.detach()).clone() for name, t in tensors}, step

    def digests(self, moments: bool) -> dict[str, str]:
        """The digest of each tensor of `state` the fleet's edges hold alike (`splitrl.stages.digest`): the
        parameters (not buffers, such as a batch norm's statistics of each edge's own data), and with ``moments``
        (``--encoder-sync grad``: every edge steps with the same gradients) Adam's moments."""
        tensors, _ = self._state()
        params = {f"net.{name}" for name, _ in self.net.named_parameters()}
        return digests((name, t) for name, t in tensors if name in params or (moments and not name.startswith("net.")))

    def join(self, msg: Message, iteration: int) -> int:
        """Take another edge's `state` (checked: every weight, each moment for every parameter or for none) after
        ``iteration`` iterations; returns the fleet's env-step count it carries."""
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
        self.agree_on_current()
        return global_step

    # -- checkpoints -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The agreed view, once there is one (``--encoder-sync avg``)."""
        return {"encoder_average": dict(self.average.view)} if self.average is not None else {}

    def load_state_dict(self, state: dict[str, Any], averaging: bool) -> None:
        """Go on averaging against what the fleet last agreed on (``averaging``: ``--encoder-sync avg``)."""
        if "encoder_average" in state:
            self.agreed, self.average = state["encoder_average"], None
        elif averaging:  # a checkpoint without the view: the encoder itself, which is the agreed view after an
            # iteration (each epoch's last minibatch averages)
            self.agree_on_current()


class EncoderSum:
    """Stage1's side of the fleet's encoder: each edge's gradient or change taken (`take`: held against
    ``--edge-grad-limit``, clipped), then summed or averaged (over every learner's edges; robustly with
    ``--encoder-sync ...:robust=``). ``start``: the encoder as built from the seed, named as the edges send it."""

    def __init__(self, start: dict[str, torch.Tensor], learners: Callable[[], Learners],
                 sync: EncoderSync | None = None, limits: EdgeLimits | None = None) -> None:
        self.start = start
        """The view a fleet's average starts from; a resumed fleet's as it last agreed on it."""
        self.learners = learners
        self.sync = sync or EncoderSync()
        self.limits = limits
        self.average: WeightSync | None = None

    def _view(self) -> WeightSync:
        if self.average is None:
            self.average = WeightSync(self.start.items(), self.sync.sync, "encoder average")
        return self.average

    def take(self, msg: Message) -> dict[str, torch.Tensor]:
        """One edge's ``encoder_grad`` (its gradients) or ``encoder_avg`` (its change, decoded), checked against
        ``--edge-grad-limit`` and clipped (`EdgeLimits.gradient`); `ProtocolError` if it does not fit."""
        if msg.kind == "encoder_avg":
            try:
                tensors = self._view().changes(msg.tensors)
            except CodecError as exc:
                raise ProtocolError(f"{msg.kind}: {exc}") from None
        else:
            tensors = {name: tensor(msg, name, tuple(start.shape), torch.float32) for name, start in self.start.items()}
        return self.limits.gradient(msg.kind, tensors) if self.limits is not None else tensors

    def sum_gradients(self, grads: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """The edges' gradients (each `take`n), added up in edge order (then over the learners), or combined as
        ``robust`` says (`splitrl.stages.robust`)."""
        return self.learners().sum_named(combine(grads, self.start, self.sync.robust), self.start)

    def mean(self, changes: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """The edges' encoders averaged: each change (`take`n from an ``encoder_avg``) is an edge's since the last
        average; the parts of their mean (or ``robust`` combination), which every edge then adds to the same
        view."""
        sync, learners = self._view(), self.learners()
        count = learners.sum_count(len(changes))
        total = learners.sum_named(combine(changes, sync.view, self.sync.robust), self.start)
        return sync.encode({name: sync.view[name] + change / count for name, change in total.items()})

    def state_dict(self) -> dict[str, Any]:
        return {"encoder_average": dict(self.average.view)} if self.average is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "encoder_average" in state:  # --encoder-sync avg: the view the edges average against
            self.start, self.average = dict(state["encoder_average"]), None
