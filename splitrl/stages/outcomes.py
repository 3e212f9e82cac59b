"""Stage1's reading of a group's outcome (reward, termination, truncation, the value to bootstrap a truncated
episode from), which rides on the group's next step message."""

from __future__ import annotations

from typing import Callable

import torch

from ..transport import Message, ProtocolError
from .protocol import tensor

__all__ = ["read_outcome"]


def read_outcome(msg: Message, envs: slice, final_values: Callable[[torch.Tensor], torch.Tensor],
                 device: torch.device | str = "cpu") -> tuple[torch.Tensor, ...]:
    """(reward, terminated, truncated, final values) of the envs ``envs`` as ``msg`` carries them (the final values
    on ``device``, the rest in host memory, as they came); ``final_values(index)``: the values of the final
    observations of the truncated envs ``index`` (within the group), which ``msg`` carries as ``final_features``."""
    n = envs.stop - envs.start
    reward = tensor(msg, "reward", (n,), torch.float32)
    terminated = tensor(msg, "terminated", (n,), torch.bool)
    truncated = tensor(msg, "truncated", (n,), torch.bool)
    values = torch.zeros(n, device=device)
    if "final_index" in msg.tensors:
        index = msg.tensors["final_index"]
        if index.dtype != torch.int64 or index.dim() != 1 or not bool(((index >= 0) & (index < n)).all()):
            raise ProtocolError(f"{msg.kind}: final_index: expected int64 env indices in [0, {n}), got {index}")
        values[index] = final_values(index)
    return reward, terminated, truncated, values

