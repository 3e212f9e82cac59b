"""What a fleet's stage1 takes from an edge: each message checked as it arrives, before code that serves every
edge at once sees it.

Stage1 serves a fleet's edges together: one forward of the heads for every edge's step
(`Learner.act_groups`), one sum of their encoders' gradients (`EncoderSum.sum_gradients`), one mean of their
changes (`EncoderSum.mean`). A message that does not fit would fail in there, for every edge, without saying
whose it was. So `Door.check` holds each message against what the learner knows it must carry (every tensor
by name, dtype and shape, and the few header values stage1 reads) as it comes off the edge's link;
`splitrl.schedule.roster.Roster.expect` calls it and drops an edge whose message does not fit, as it drops one
whose link fails.

Per kind (docs/PROTOCOL.md; `splitrl.stages.protocol`):

  step           the features of the edge's envs through the rollout codec (`CodecSet.layout`), the outcome
                 of the last action from t = 1 on (`read_outcome`'s tensors), no ``budget`` (a fleet runs
                 without --link-budget)
  rollout_end    the features and the last outcome
  train_fwd      the features of the edge's share of the minibatch through the fwd codec
  encoder_grad   every parameter of the encoder, float32, as the learner's copy has it
  encoder_avg    every parameter's change through ``--encoder-sync avg``'s dense codec (`update_layout`)
  encoder_state  the encoder's state dict, and Adam's moments once it has stepped (what `EdgeEncoder.join`
                 takes)
  iter_end       no tensors; ``checkpoint`` and ``eval`` true or false; ``encoder``: a digest (32 hex digits) of
                 every tensor of the edge's encoder the fleet's edges hold alike (`EdgeEncoder.digests`)
  close          no tensors

What only decoding can tell (the values inside a compressed or varint-coded part) the decoders still check.
A check is dict lookups and shape and dtype compares: no copies.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..codecs import CodecError, Layout, fits
from ..transport import Message, ProtocolError
from ..transport.errors import peer_repr
from .digest import DIGEST_CHARS
from .learner import Learner
from .protocol import ENCODER_PREFIX
from .weights import update_layout

__all__ = ["Door", "check_layout"]

HEX = "0123456789abcdef"


def _shown(dtype: torch.dtype, dims: tuple[int | None, ...]) -> str:
    return f"{str(dtype).removeprefix('torch.')} [{', '.join('*' if d is None else str(d) for d in dims)}]"


def check_layout(msg: Message, layout: Layout) -> None:
    """``msg``'s tensors are ``layout``'s, no more and no fewer; `ProtocolError` naming the first that is not
    and what was expected of it."""
    tensors = msg.tensors
    for name, (dtype, dims) in layout.items():
        t = tensors.get(name)
        if t is None:
            raise ProtocolError(f"{msg.kind}: tensor {name!r}: expected {_shown(dtype, dims)}, got none (the "
                                f"message has {peer_repr(sorted(tensors))})")
        if t.dtype != dtype or not fits(t.shape, dims):
            raise ProtocolError(f"{msg.kind}: tensor {name!r}: expected {_shown(dtype, dims)}, got "
                                f"{_shown(t.dtype, tuple(t.shape))}")
    if len(tensors) != len(layout):
        extra = sorted(set(tensors) - set(layout))
        raise ProtocolError(f"{msg.kind}: unexpected tensor {peer_repr(extra[0])} (expected "
                            f"{sorted(layout) or 'none'})")


class Door:
    """The messages a fleet's stage1 (``learner``) takes from an edge of ``per_edge`` envs. `check` raises a
    `ProtocolError` that names the kind, the tensor, what was expected and what came."""

    def __init__(self, learner: Learner, per_edge: int) -> None:
        self.learner, self.per_edge = learner, per_edge
        params = [(name, tuple(t.shape)) for name, t in learner.encoder_sum.start.items()]
        self.fixed: dict[str, Layout] = {
            "encoder_grad": {name: (torch.float32, shape) for name, shape in params},
            "encoder_avg": update_layout(params, learner.settings.schedule.parsed_encoder_sync().sync),
            "close": {},
        }
        """The kinds whose tensors are always the same."""
        self.read: dict[str, Callable[[Message, int | None], Layout]] = {
            "step": self._step, "rollout_end": self._rollout_end, "train_fwd": self._train_fwd,
            "encoder_state": self._encoder_state, "iter_end": self._iter_end}
        """The kinds whose tensors depend on the message (its step, its codec's metadata) or the share."""
        self.state = {f"net.{name}": spec for name, spec in learner.encoder_tensors.items()}
        """``encoder_state``'s weights; once the encoder has stepped, Adam's `moments` too."""
        self.moments = {f"{m}.{name.removeprefix(ENCODER_PREFIX)}": (torch.float32, shape)
                        for name, shape in params for m in ("exp_avg", "exp_avg_sq")}
        grad = learner.settings.schedule.parsed_encoder_sync().name == "grad"
        self.digested = {f"net.{name.removeprefix(ENCODER_PREFIX)}" for name, _ in params} | (
            set(self.moments) if grad else set())
        """The tensors ``iter_end``'s ``encoder`` digests: the parameters, and with ``--encoder-sync grad`` (where
        every edge steps with the same gradients) Adam's moments."""

    def check(self, msg: Message, rows: int | None = None) -> None:
        """``msg`` (its kind and header counters checked already: `splitrl.schedule.common.expect`) fits;
        ``rows``: a ``train_fwd``'s samples, the edge's share of the minibatch."""
        layout = self.fixed.get(msg.kind)
        if layout is None:
            read = self.read.get(msg.kind)
            if read is None:
                raise ProtocolError(f"{msg.kind}: not a message an edge of a fleet sends")
            layout = read(msg, rows)
        check_layout(msg, layout)

    # -- each kind's layout ------------------------------------------------------------------------------
    def _features(self, msg: Message, stream: str, name: str, rows: int) -> Layout:
        shape, dtype = self.learner.input_shape(rows) if stream == "rollout" else \
            ((rows, self.learner.feature_dim), torch.float32)
        try:
            return self.learner.codecs.layout(stream, name, msg.header, shape, dtype)
        except CodecError as exc:  # metadata that cannot be right
            raise ProtocolError(f"{msg.kind}: {exc}") from None

    def _outcome(self, msg: Message) -> Layout:
        """`read_outcome`'s tensors: reward and flags of the edge's envs, the truncated ones' final features."""
        n = self.per_edge
        layout: Layout = {"reward": (torch.float32, (n,)), "terminated": (torch.bool, (n,)),
                          "truncated": (torch.bool, (n,))}
        index = msg.tensors.get("final_index")
        if index is not None:
            if index.dtype != torch.int64 or index.dim() != 1 or len(index) > n:
                raise ProtocolError(f"{msg.kind}: tensor 'final_index': expected int64 [at most {n}], got "
                                    f"{_shown(index.dtype, tuple(index.shape))}")
            if len(index) and not bool(((index >= 0) & (index < n)).all()):
                raise ProtocolError(f"{msg.kind}: tensor 'final_index': expected env indices in [0, {n}), got values "
                                    f"from {int(index.min())} to {int(index.max())}")
            layout["final_index"] = (torch.int64, (len(index),))
            layout.update(self._features(msg, "rollout", "final_features", len(index)))
        return layout

    def _step(self, msg: Message, rows: int | None) -> Layout:
        if "budget" in msg.header:
            raise ProtocolError(f"{msg.kind}: header 'budget': a fleet runs without --link-budget")
        layout = self._features(msg, "rollout", "features", self.per_edge)
        if msg.header.get("t"):  # from the second step on, the outcome of the last action rides along
            layout.update(self._outcome(msg))
        return layout

    def _rollout_end(self, msg: Message, rows: int | None) -> Layout:
        return {**self._features(msg, "rollout", "features", self.per_edge), **self._outcome(msg)}

    def _train_fwd(self, msg: Message, rows: int | None) -> Layout:
        if rows is None:  # a caller's slip, not the edge's: every train_fwd has a share to be checked against
            raise ValueError("a train_fwd is checked against the edge's share of the minibatch: give its rows")
        return self._features(msg, "fwd", "features", rows)

    def _encoder_state(self, msg: Message, rows: int | None) -> Layout:
        step = msg.header.get("adam_step")
        for key in ("global_step", "adam_step"):
            value = msg.header.get(key)
            if type(value) is not int or value < 0:
                raise ProtocolError(f"{msg.kind}: header {key!r}: expected an int >= 0, got {peer_repr(value)}")
        return {**self.state, **self.moments} if step else self.state

    def _iter_end(self, msg: Message, rows: int | None) -> Layout:
        for key in ("checkpoint", "eval"):
            if type(msg.header.get(key)) is not bool:
                raise ProtocolError(f"{msg.kind}: header {key!r}: expected true or false, got "
                                    f"{peer_repr(msg.header.get(key))}")
        digests = msg.header.get("encoder")
        if not isinstance(digests, dict) or set(digests) != self.digested:
            got = sorted(digests, key=repr) if isinstance(digests, dict) else digests  # (keys: str or bytes)
            raise ProtocolError(f"{msg.kind}: header 'encoder': expected a digest of each of {len(self.digested)} "
                                f"tensors {sorted(self.digested)[:3]}..., got {peer_repr(got)}")
        for name, digest in digests.items():
            if not isinstance(digest, str) or len(digest) != DIGEST_CHARS or digest.strip(HEX):
                raise ProtocolError(f"{msg.kind}: header 'encoder': {name!r}: expected {DIGEST_CHARS} hex digits, "
                                    f"got {peer_repr(digest)}")
        return {}
