"""Building blocks the built-in models and the heads share: CleanRL's initialisation and pixel scaling; the
steps of a model given a Dict observation (`ImageStep`)."""

from __future__ import annotations

import math

import torch
from torch import nn

__all__ = ["layer_init", "ScaleObs", "ImageStep", "unpack_rows"]


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


def unpack_rows(rows: torch.Tensor, image_shape: tuple[int, ...], vector_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A Dict observation's rows as `splitrl.envs.EnvSpec.rows` packs them (uint8: the image's bytes, then the
    vector's float32 values as bytes) back to (the images (B, C, H, W) uint8, the vectors (B, D) float32)."""
    n = math.prod(image_shape)
    if rows.dtype != torch.uint8 or rows.dim() != 2 or rows.shape[1] != n + 4 * vector_dim:
        raise ValueError(f"expected rows of {n} image bytes and {vector_dim} float32 values (uint8 [B, "
                         f"{n + 4 * vector_dim}]), got {rows.dtype} {list(rows.shape)}")
    # A copy of its own starts at an offset of 0, which a float32 view needs (4-byte aligned).
    vector = rows[:, n:].clone(memory_format=torch.contiguous_format).view(torch.float32)
    return rows[:, :n].reshape((-1, *image_shape)), vector


class ImageStep(nn.Module):
    """A layer of a model given a Dict observation: it runs ``layer`` on the image part and carries the vector
    beside it, as an (image activation, vector) pair. The ``first`` also unpacks the observation's rows
    (`unpack_rows`); the ``join`` returns the flat (B, F) output of ``layer`` with the vector concatenated,
    (B, F + D), which the layers after it and the heads take."""

    def __init__(self, layer: nn.Module, image_shape: tuple[int, ...], vector_dim: int, *, first: bool,
                 join: bool) -> None:
        super().__init__()
        self.layer, self.image_shape, self.vector_dim = layer, tuple(image_shape), vector_dim
        self.first, self.join = first, join

    def forward(self, x: torch.Tensor | tuple[torch.Tensor, torch.Tensor]):
        image, vector = unpack_rows(x, self.image_shape, self.vector_dim) if self.first else x
        out = self.layer(image)
        if not self.join:
            return out, vector
        if out.dim() != 2:
            raise ValueError(f"the vector joins a flat (B, F) activation; this layer gives {tuple(out.shape[1:])}")
        return torch.cat([out, vector.to(out.dtype)], dim=1)
