"""A network of your own for splitrl: a factory in a module of your own (docs/guides/network.md).

    splitrl train --model examples.my_encoder:small_cnn --model-kwargs channels=16,features=128 --cut fc

The factory takes the gymnasium observation and action spaces (and your ``--model-kwargs``) and returns the
encoder as (name, module) pairs in order; splitrl adds the actor-critic heads after the last one. Every
boundary is a possible ``--cut``: here 'flatten' (conv2's map, flattened, crosses the link) or 'fc'
(128 values cross), the default.
"""

from __future__ import annotations

from torch import nn

from splitrl.models import ScaleObs, layer_init

__all__ = ["small_cnn"]


def small_cnn(observation_space, action_space, channels: int = 16, features: int = 128):
    """Two strided convs and a linear layer over stacked uint8 frames (C, H, W)."""
    c, h, w = observation_space.shape
    for _ in range(2):  # each conv: kernel 4, stride 2, no padding
        h, w = (h - 4) // 2 + 1, (w - 4) // 2 + 1
    return [
        ("scale", ScaleObs()),  # uint8 pixels to [0, 1]: a cut before it ('input') sends bytes
        ("conv1", nn.Sequential(layer_init(nn.Conv2d(c, channels, 4, stride=2)), nn.ReLU())),
        ("conv2", nn.Sequential(layer_init(nn.Conv2d(channels, channels, 4, stride=2)), nn.ReLU())),
        ("flatten", nn.Flatten()),
        ("fc", nn.Sequential(layer_init(nn.Linear(channels * h * w, features)), nn.ReLU())),
    ]
