"""Stage1's reading of a group's outcome (reward, termination, truncation, the value to bootstrap a truncated
episode from), which rides on the group's next step message."""

from __future__ import annotations

from typing import Callable

import torch

from ..transport import Message, ProtocolError
from .protocol import tensor

__all__ = ["Outcome", "read_outcome"]


Outcome = tuple[torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | None"]
"""(reward, terminated, truncated, final values or None): `read_outcome`'s."""


def read_outcome(msg: Message, envs: slice, final_values: Callable[[torch.Tensor], torch.Tensor],
                 device: torch.device | str = "cpu") -> Outcome:
    """(reward, terminated, truncated, final values) of the envs ``envs`` as ``msg`` carries them (the final values
    on ``device``, the rest in host memory, as they came); ``final_values(index)``: the values of the final
    observations of the truncated envs ``index`` (within the group), which ``msg`` carries as ``final_features``.

    The final values are None when no env needs one (most steps: the storage then writes zeros with no mask to
    work out). An env truncated and not terminated with no ``final_index`` is a `ProtocolError`: stage0 sends
    the final observation of every such env, and bootstrapping from 0 would bias each time-limited episode."""
    n = envs.stop - envs.start
    reward = tensor(msg, "reward", (n,), torch.float32)
    terminated = tensor(msg, "terminated", (n,), torch.bool)
    truncated = tensor(msg, "truncated", (n,), torch.bool)
    if "final_index" not in msg.tensors:
        cut = truncated.numpy()  # (a message's tensors are in host memory: numpy reads them, no call into torch)
        if cut.any():
            bootstrap = cut & ~terminated.numpy()
            if bootstrap.any():
                raise ProtocolError(f"{msg.kind}: envs {bootstrap.nonzero()[0].tolist()} truncated and not "
                                    "terminated, but no final_index and final_features to bootstrap from")
        return reward, terminated, truncated, None
    index = msg.tensors["final_index"]
    if index.dtype != torch.int64 or index.dim() != 1 or not bool(((index >= 0) & (index < n)).all()):
        raise ProtocolError(f"{msg.kind}: final_index: expected int64 env indices in [0, {n}), got {index}")
    values = torch.zeros(n, device=device)
    values[index] = final_values(index)
    return reward, terminated, truncated, values

