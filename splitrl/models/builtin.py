"""The built-in models: factories of (observation space, action space, **kwargs) -> the encoder's named layers.

- `nature`: the paper's network (DQN's Nature CNN, as CleanRL's PPO on pixels), cut after it by default.
- `impala`: IMPALA's ResNet encoder (Espeholt et al., as Procgen's and Cleanba's agents use it): three stacks of
  a 3x3 conv, a 3x3 stride-2 max-pool and residual blocks, then a linear layer.
- `mlp`: tanh layers for state vectors (CleanRL's continuous-control PPO).

A user's factory has the same signature (`splitrl.models.network`); the heads come after the last layer. Given a
Dict observation, `nature` and `impala` take its image (the vector is joined to their features after them).
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import torch
from torch import nn

from ..errors import SettingsError
from .layers import ScaleObs, layer_init

__all__ = ["nature", "impala", "mlp", "ResidualBlock"]

Layers = list[tuple[str, nn.Module]]


def _image_shape(model: str, observation_space: Any) -> tuple[int, int, int]:
    """The (C, H, W) of the images ``observation_space`` gives: itself, or a Dict observation's ``image``."""
    if isinstance(observation_space, gym.spaces.Dict) and "image" in observation_space.spaces:
        return _image_shape(model, observation_space["image"])
    shape = getattr(observation_space, "shape", None)
    if not isinstance(observation_space, gym.spaces.Box) or shape is None or len(shape) != 3:
        raise SettingsError(f"model {model!r} needs (C, H, W) image observations, got {observation_space}")
    return tuple(shape)  # type: ignore[return-value]


def nature(observation_space: Any, action_space: Any) -> Layers:
    """The paper's encoder: pixels scaled to [0, 1], three conv layers with ReLUs, flattened (4096 features of
    84 x 84 frames). Built in this order from the seed, so a seed gives the weights it always gave."""
    in_channels = _image_shape("nature", observation_space)[0]
    return [
        ("scale", ScaleObs()),
        ("conv1", layer_init(nn.Conv2d(in_channels, 32, 8, stride=4))),
        ("relu1", nn.ReLU()),
        ("conv2", layer_init(nn.Conv2d(32, 64, 4, stride=2))),
        ("relu2", nn.ReLU()),
        ("conv3", layer_init(nn.Conv2d(64, 64, 3, stride=1))),
        ("relu3", nn.ReLU()),
        ("flatten", nn.Flatten()),
    ]


class ResidualBlock(nn.Module):
    """x + conv(relu(conv(relu(x)))), both convs 3x3 keeping the channels and the size."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv0 = nn.Conv2d(channels, channels, 3, padding=1)
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv1(torch.relu(self.conv0(torch.relu(x))))


def _stack(in_channels: int, out_channels: int, blocks: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(in_channels, out_channels, 3, padding=1), nn.MaxPool2d(3, stride=2, padding=1),
                         *(ResidualBlock(out_channels) for _ in range(blocks)))


def impala(observation_space: Any, action_space: Any, width: int = 16, blocks: int = 2,
           features: int = 256) -> Layers:
    """IMPALA's encoder: stacks of ``width``, 2 x ``width`` and 2 x ``width`` channels (16, 32, 32 as
    published), ``blocks`` residual blocks each, then ReLU, flatten and a ``features``-wide linear layer with a
    ReLU. PyTorch's default initialisation, as CleanRL's Procgen agent."""
    for name, value in (("width", width), ("blocks", blocks), ("features", features)):
        if type(value) is not int or value < (0 if name == "blocks" else 1):
            raise SettingsError(f"model 'impala': {name} must be a whole number >= {0 if name == 'blocks' else 1}, "
                                f"got {value!r}")
    channels, height, wide = _image_shape("impala", observation_space)
    layers: Layers = [("scale", ScaleObs())]
    for i, out in enumerate((width, 2 * width, 2 * width), 1):
        layers.append((f"stack{i}", _stack(channels, out, blocks)))
        channels, height, wide = out, (height + 1) // 2, (wide + 1) // 2  # the max-pool's ceil(n / 2)
    layers += [("flatten", nn.Sequential(nn.ReLU(), nn.Flatten())),
               ("fc", nn.Sequential(nn.Linear(channels * height * wide, features), nn.ReLU()))]
    return layers


def mlp(observation_space: Any, action_space: Any, width: int = 64, depth: int = 2) -> Layers:
    """``depth`` layers of ``width`` units with tanh, orthogonally initialised, for 1-d Box observations."""
    shape = getattr(observation_space, "shape", None)
    if not isinstance(observation_space, gym.spaces.Box) or shape is None or len(shape) != 1:
        raise SettingsError(f"model 'mlp' needs a 1-d Box observation (a state vector), got {observation_space}")
    for name, value in (("width", width), ("depth", depth)):
        if type(value) is not int or value < 1:
            raise SettingsError(f"model 'mlp': {name} must be a whole number >= 1, got {value!r}")
    layers: Layers = []
    inputs = shape[0]
    for i in range(1, depth + 1):
        layers.append((f"fc{i}", nn.Sequential(layer_init(nn.Linear(inputs, width)), nn.Tanh())))
        inputs = width
    return layers
