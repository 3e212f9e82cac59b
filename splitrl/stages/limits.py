"""What stage1 takes from stage0, held against limits on its values: no edge of a fleet stalls or steers it.

The door (`splitrl.stages.door`) checks what a message is made of; the wire refuses NaN and infinity in any
tensor (`splitrl.transport.wire.WireLimits.finite`). What is left is a finite value of any size: rewards of
1e30 make the value loss infinite, and the heads' gradient clipping then turns every update into zeros, so
that a whole fleet stops learning and still exits 0. So stage1 holds, as each message is read:

- each reward: ``|r| <= --edge-reward-limit``;
- the features, as decoded (an int8 code times a finite scale can still overflow): ``|x| <=
  --edge-feature-limit``, in the rollout and in training;
- an edge's encoder gradient (``encoder_grad``) or change (``encoder_avg``): an L2 norm ``<= --edge-grad-limit``
  (then, with ``--encoder-sync ...:clip=NORM``, scaled down to at most NORM).

A value beyond is a `ProtocolError` naming the kind, the tensor and the limit's option; a fleet's stage1
drops that edge and names it (`splitrl.schedule.roster.Roster.judge`), a single stage1 stops with it. The
defaults (1e6) lie far above what an honest run sends: a CarRacing step's reward is a few units (-100 at
worst), CartPole's 1, and the encoders' features and gradients are orders of magnitude below.

Each check is one reduction over the tensor (``aminmax``, or a float32 norm per tensor) and one number read
back; the exact norm in float64, and which tensor is to blame, are worked out only when a check fails.
"""

from __future__ import annotations

import math

import torch

from ..settings import ScheduleSettings
from ..transport import ProtocolError

__all__ = ["EdgeLimits"]

_NUMPY_FLOATS = (torch.float32, torch.float64, torch.float16)
"""The float dtypes numpy holds as they are (bfloat16 it has not)."""
_NUMPY_MOST = 1 << 16
"""Most values a check reads with numpy (`EdgeLimits.bounded`)."""


class EdgeLimits:
    """The limits of `ScheduleSettings` (``--edge-reward-limit``, ``--edge-feature-limit``,
    ``--edge-grad-limit``) and the clip of ``--encoder-sync``."""

    def __init__(self, schedule: ScheduleSettings) -> None:
        self.reward = schedule.edge_reward_limit
        self.feature = schedule.edge_feature_limit
        self.grad = schedule.edge_grad_limit
        self.clip = schedule.parsed_encoder_sync().clip

    @staticmethod
    def bounded(kind: str, name: str, x: torch.Tensor, limit: float, option: str) -> torch.Tensor:
        """``x`` if every value lies within ``[-limit, limit]`` (NaN does not), else `ProtocolError` naming the
        tensor and the option; tensors that are not floating point pass as they are."""
        if limit == math.inf or not x.is_floating_point() or x.numel() == 0:
            return x
        if x.numel() <= _NUMPY_MOST and x.device.type == "cpu" and not x.requires_grad and x.dtype in _NUMPY_FLOATS:
            # A step's few values: numpy's two reductions cost less than torch's calls (a training minibatch's
            # are read in one pass by torch's aminmax, where numpy's min and max would take two)
            values = x.numpy()
            low, high = float(values.min()), float(values.max())
        else:
            low, high = torch.stack(x.aminmax()).tolist()  # (one read back from a device)
        if not (-limit <= low and high <= limit):
            top = high if math.isnan(high) or math.isnan(low) or high >= -low else low
            raise ProtocolError(f"{kind}: tensor {name!r}: a value of {top:.3g}, beyond {option} {limit:g}")
        return x

    def outcome(self, kind: str, outcome: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """A step's outcome (`splitrl.stages.outcomes.read_outcome`: the reward first), its rewards checked."""
        self.bounded(kind, "reward", outcome[0], self.reward, "--edge-reward-limit")
        return outcome

    def features(self, kind: str, name: str, x: torch.Tensor) -> torch.Tensor:
        return self.bounded(kind, name, x, self.feature, "--edge-feature-limit")

    def gradient(self, kind: str, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """An edge's encoder gradient or change (named tensors), its L2 norm checked against
        ``--edge-grad-limit`` and, with a clip, scaled down to at most the clip's norm (the tensors themselves
        otherwise). `ProtocolError` naming the tensor of the largest norm."""
        norms = [torch.linalg.vector_norm(t) for t in tensors.values()]
        norm = float(torch.linalg.vector_norm(torch.stack(norms))) if norms else 0.0
        if not (norm <= self.grad and math.isfinite(norm)):  # a huge one's float32 norm overflows: in float64
            exact = {name: float(torch.linalg.vector_norm(t, dtype=torch.float64)) for name, t in tensors.items()}
            norm = math.sqrt(sum(v * v for v in exact.values()))
            if not norm <= self.grad:
                worst = max(exact, key=lambda name: exact[name])
                raise ProtocolError(f"{kind}: tensor {worst!r}: an L2 norm of {exact[worst]:.3g} (of all "
                                    f"{len(exact)}: {norm:.3g}), beyond --edge-grad-limit {self.grad:g}")
        if self.clip and norm > self.clip:  # (in float64: the scale of a huge one is below float32's range)
            scale = self.clip / norm
            return {name: (t.double() * scale).to(t.dtype) for name, t in tensors.items()}
        return tensors
