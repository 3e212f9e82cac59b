"""The heads' replica: training sends the change in the heads' outputs, not the features.

With the cut after the CNN, the loss depends on a sample's 4,096 features only
through the heads' outputs: the actor's mean (one value per action dimension)
and the critic's value. Stage0 keeps a replica of the heads, brought up to date
after each rollout (``heads``) and, if asked, during training (see below). In
each training minibatch:

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
float32, and the replica costs one quantised weight update per iteration (plus
those asked for during training). What is not exact: the heads' own gradients
are taken at the rollout's features, and the encoder's gradient goes through
weights up to one iteration (or ``all_every`` minibatches; its output layers
``last_every``) old.

`HeadsSync` sends the heads' weights as the quantised change against the
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
as ``heads`` messages after the ``train_bwd`` of that minibatch.

``sync``, ``last_every`` and ``all_every`` are read from the fwd spec; setting them only
on the bwd spec is a settings error.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

from .base import Codec, CodecError, Context, Encoded, Param, part
from .delta import RolloutView
from .dense import VALUE_DTYPES, Bf16, Fp32, Int8

__all__ = ["Replica", "HeadsSync", "SYNC_MODES", "FIRST_LAYERS"]

SYNC_MODES = ("fp32", "bf16", "int8")
FIRST_LAYERS = ("critic.0.weight", "actor_mean.0.weight")
"""The heads' two feature-wide weights (`splitrl.models.ActorCriticHeads`): 99.9 % of the
replica's values, sent by ``all_every`` but not by ``last_every``."""
CODECS_BY_MODE = {c.name: c for c in (Fp32, Bf16, Int8)}


class Replica(Codec):
    """Both ends of the outputs stream: the rollout view (fwd) and plain small tensors."""

    name = "replica"
    help = ("stage0 keeps a replica of the heads (synced after each rollout and, with last_every/all_every, "
            "every N training minibatches); training sends the change of the "
            "heads' outputs (fwd) and the loss gradient w.r.t. them (bwd); use on both streams")
    streams = ("fwd", "bwd")
    params = {
        "sync": Param(str, "int8", "how the heads' weight updates travel (read from the fwd spec)", SYNC_MODES),
        "values": Param(str, "fp32", "dtype of the per-sample outputs or gradients", ("fp32", "bf16")),
        "last_every": Param(int, 0, "also send the change of all weights but the first layers after every N-th "
                                    "training minibatch of an iteration (0: only after the rollout)"),
        "all_every": Param(int, 0, "also send the change of all weights after every N-th training minibatch "
                                   "(0: only after the rollout)"),
    }

    from_fwd = ("sync", "last_every", "all_every")
    """The parameters both stages read from the fwd spec (the bwd spec's must be left alone)."""

    def __init__(self, **values: Any) -> None:
        super().__init__(**values)
        for key in ("last_every", "all_every"):
            if getattr(self, key) < 0:
                raise ValueError(f"codec 'replica': {key} must be >= 0, got {getattr(self, key)}")
        self.cache = RolloutView(self.name)

    def due(self, epoch: int, mb: int, epochs: int, minibatches: int, names: Iterable[str]) -> list[str]:
        """The weights whose change follows the ``train_bwd`` of minibatch (epoch, mb); [] if none.

        Both stages call this with the same arguments, so each knows what comes. Never after
        the iteration's last minibatch: the next rollout's update follows it anyway.
        """
        done = epoch * minibatches + mb + 1
        if done >= epochs * minibatches:
            return []
        if self.all_every and done % self.all_every == 0:
            return list(names)
        if self.last_every and done % self.last_every == 0:
            return [name for name in names if name not in FIRST_LAYERS]
        return []

    def observe(self, idx: torch.Tensor, x: torch.Tensor) -> None:
        self.cache.observe(idx, x)

    def view_rows(self, idx: torch.Tensor, feature_dim: int) -> torch.Tensor:
        """The rollout features of samples ``idx`` as stage1 has them."""
        return self.cache.rows(idx, (len(idx), feature_dim))

    def encode(self, x: torch.Tensor, ctx: Context) -> Encoded:
        sent = x.detach().to(VALUE_DTYPES[self.values])
        return Encoded({"": sent}, recon=sent.float())

    def decode(self, parts, meta, ctx, shape, dtype) -> torch.Tensor:
        x = part(parts, "", VALUE_DTYPES[self.values], shape=shape, codec=self.name).float()
        if not bool(torch.isfinite(x).all()):
            raise CodecError("codec 'replica': non-finite values")
        return x.to(dtype)


class HeadsSync:
    """The heads' weights as the replica has them, and the messages that update it.

    Both sides start from the same named tensors (the heads as built from the
    seed). The sender calls `encode` with the current weights, the receiver
    `decode` with what arrived; afterwards both views are bit-identical. Each
    tensor's change travels through the dense codec named by ``mode`` (``int8``:
    one scale per row, a bias being one row), its parts named ``NAME[.part]``.
    """

    def __init__(self, initial: Iterable[tuple[str, torch.Tensor]], mode: str = "int8") -> None:
        if mode not in SYNC_MODES:
            raise ValueError(f"heads sync: mode must be one of {', '.join(SYNC_MODES)}, got {mode!r}")
        self.codec = CODECS_BY_MODE[mode]()
        self.view = {name: t.detach().float().clone() for name, t in initial}

    def encode(self, current: Iterable[tuple[str, torch.Tensor]],
               names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
        """Parts that bring the receiver's view of ``names`` (default: all) to ``current``
        (up to quantisation); updates ours."""
        current = dict(current)
        if set(current) != set(self.view):
            raise ValueError(f"heads sync: expected tensors {sorted(self.view)}, got {sorted(current)}")
        parts: dict[str, torch.Tensor] = {}
        for name, base in self._selected(names).items():
            enc = self.codec.encode(current[name].detach().float() - base, Context())
            parts.update({f"{name}.{key}" if key else name: t for key, t in enc.tensors.items()})
            base += enc.recon
        return parts

    def _selected(self, names: Iterable[str] | None) -> dict[str, torch.Tensor]:
        if names is None:
            return self.view
        names = list(names)
        unknown = sorted(set(names) - set(self.view))
        if unknown:
            raise ValueError(f"heads sync: no weights named {unknown}")
        return {name: self.view[name] for name in names}

    def decode(self, parts: dict[str, torch.Tensor], names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
        """Apply a received update of ``names`` (default: all); returns the view.
        `CodecError` (nothing changed) if it does not fit."""
        updated, used = {}, 0
        for name, base in self._selected(names).items():
            mine = {key[len(name) + 1:]: t for key, t in parts.items() if key.startswith(name + ".")}
            if name in parts:
                mine[""] = parts[name]
            used += len(mine)
            try:
                change = self.codec.decode(mine, {}, Context(), tuple(base.shape), torch.float32)
            except CodecError as exc:
                raise CodecError(f"heads sync: {name!r}: {exc}") from None
            updated[name] = base + change
            # A finite but huge scale overflows here: refuse it before the view changes.
            if not bool(torch.isfinite(updated[name]).all()):
                raise CodecError(f"heads sync: the update makes {name!r} non-finite")
        if used != len(parts):
            raise CodecError(f"heads sync: {len(parts) - used} tensor(s) name no weight of the heads")
        self.view.update(updated)
        return self.view
