"""Building blocks the built-in models and the heads share: CleanRL's initialisation and pixel scaling."""

from __future__ import annotations

import math

import torch
from torch import nn

__all__ = ["layer_init", "ScaleObs"]


def layer_init(layer: nn.Module, std: float = math.sqrt(2), bias: float = 0.0) -> nn.Module:
    """Orthogonal weights and constant bias, as in CleanRL's PPO."""
    nn.init.orthogonal_(layer.weight, std)
    if layer.bias is not None:
        nn.init.constant_(layer.bias, bias)
    return layer


class ScaleObs(nn.Module):
    """uint8 pixels to float32 in [0, 1]; the first layer, so a cut before it sends bytes."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.float().div_(255.0)
