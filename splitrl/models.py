"""The paper's agent, built whole and cut in two.

The full network is one list of layers: observation scaling, the CNN encoder,
then the actor-critic heads. Stage0 keeps the layers before the cut and stage1
the rest, so every cut starts from the same initial weights as the unsplit agent.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .ppo import TanhGaussian, clamp_log_std

__all__ = ["ScaleObs", "ActorCriticHeads", "build_agent", "layer_init"]


def layer_init(layer: nn.Module, std: float = math.sqrt(2), bias: float = 0.0) -> nn.Module:
    """Orthogonal weights and constant bias, as in CleanRL's PPO."""
    nn.init.orthogonal_(layer.weight, std)
    nn.init.constant_(layer.bias, bias)
    return layer


class ScaleObs(nn.Module):
    """uint8 pixels to float32 in [0, 1]; the first layer, so a cut before it sends bytes."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.float().div_(255.0)


def _encoder_layers(in_channels: int) -> list[nn.Module]:
    return [
        ScaleObs(),
        layer_init(nn.Conv2d(in_channels, 32, 8, stride=4)),
        nn.ReLU(),
        layer_init(nn.Conv2d(32, 64, 4, stride=2)),
        nn.ReLU(),
        layer_init(nn.Conv2d(64, 64, 3, stride=1)),
        nn.ReLU(),
        nn.Flatten(),
    ]


class ActorCriticHeads(nn.Module):
    """Stage1's network: an optional trunk (the layers after the cut), actor and critic.

    The actor is a tanh-squashed Gaussian with a state-independent log-std
    clamped to [-5, 2]; actions are handled pre-tanh (see `TanhGaussian`).
    """

    def __init__(self, trunk: nn.Module, feature_dim: int, action_dim: int, hidden: int = 512, init_log_std: float = 0.0) -> None:
        super().__init__()
        self.trunk = trunk
        self.critic = nn.Sequential(
            layer_init(nn.Linear(feature_dim, hidden)), nn.Tanh(), layer_init(nn.Linear(hidden, 1), std=1.0)
        )
        self.actor_mean = nn.Sequential(
            layer_init(nn.Linear(feature_dim, hidden)), nn.Tanh(), layer_init(nn.Linear(hidden, action_dim), std=0.01)
        )
        self.actor_logstd = nn.Parameter(torch.full((action_dim,), float(init_log_std)))

    def get_value(self, x: torch.Tensor) -> torch.Tensor:
        return self.critic(self.trunk(x)).squeeze(-1)

    def outputs(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Everything the loss takes from the features: (actor mean (B, A), value (B,))."""
        hidden = self.trunk(x)
        return self.actor_mean(hidden), self.critic(hidden).squeeze(-1)

    def evaluate(
        self, mean: torch.Tensor, value: torch.Tensor, action: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(pre-tanh action u, log-prob, entropy, value) from `outputs`; samples u when ``action`` is None."""
        dist = TanhGaussian(mean, clamp_log_std(self.actor_logstd))
        if action is None:
            action = dist.sample(generator)
        return action, dist.log_prob(action), dist.entropy(), value

    def get_action_and_value(
        self, x: torch.Tensor, action: torch.Tensor | None = None, generator: torch.Generator | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """CleanRL's call: (pre-tanh action u, log-prob, entropy, value) for features ``x``."""
        return self.evaluate(*self.outputs(x), action, generator)


def build_agent(
    obs_shape: tuple[int, ...], action_dim: int, cut: str, seed: int, init_log_std: float = 0.0
) -> tuple[nn.Sequential, ActorCriticHeads]:
    """(stage0 module, stage1 heads) for the cut 'cnn' or 'input', initialised from ``seed``.

    The global RNG is left as it was, so building one stage in a process that also
    runs the other changes nothing.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        layers = _encoder_layers(obs_shape[0])
        with torch.no_grad():
            feature_dim = nn.Sequential(*layers)(torch.zeros((1,) + tuple(obs_shape), dtype=torch.uint8)).shape[1]
        at = {"cnn": len(layers), "input": 0}[cut]
        heads = ActorCriticHeads(nn.Sequential(*layers[at:]), feature_dim, action_dim, init_log_std=init_log_std)
    return nn.Sequential(*layers[:at]), heads
