"""The agent built whole from a seed and cut in two.

The full network is one list of layers: the model's encoder (`splitrl.models.network`), an optional
``--bottleneck`` projection at its end, then the actor-critic heads. Stage0 keeps the layers before the cut and
stage1 the rest, so every cut starts from the same initial weights as the unsplit agent. Both stages' modules
are `nn.Sequential` with numbered layers, whatever the layers' names: checkpoints and the weight exchanges name
parameters by position.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from typing import TYPE_CHECKING, Any

import gymnasium as gym
import numpy as np
import torch
from torch import nn

from ..errors import SettingsError
from ..settings.specs import codec_base, parse_kwargs
from .heads import ActorCriticHeads
from .layers import layer_init
from .network import INPUT, make_network, with_vector

if TYPE_CHECKING:
    from ..envs import EnvSpec
    from ..settings import TrainSettings

__all__ = ["build_agent", "agent", "spaces", "network_digest", "cuts", "crossing"]


def spaces(obs_shape: tuple[int, ...], action_dim: int, discrete: bool = False, *, observation: str = "image",
           vector_dim: int = 0) -> tuple[gym.Space, gym.Space]:
    """What a factory is given (`splitrl.envs.EnvSpec`): image observations as uint8 of ``obs_shape`` (the env
    pipeline's, channels first), vectors as float32 of ``obs_shape``, a Dict as ``image`` (uint8 of
    ``obs_shape``) and ``vector`` (float32, ``vector_dim`` long); and the actions as the policy gives them:
    ``action_dim`` indices, or a Box in [-1, 1] (stage0 maps it onto the env's bounds)."""
    image = gym.spaces.Box(0, 255, tuple(obs_shape), np.uint8)
    if observation == "vector":
        space: gym.Space = gym.spaces.Box(-np.inf, np.inf, tuple(obs_shape), np.float32)
    elif observation == "dict":
        space = gym.spaces.Dict({"image": image, "vector": gym.spaces.Box(-np.inf, np.inf, (vector_dim,), np.float32)})
    else:
        space = image
    action = (gym.spaces.Discrete(action_dim) if discrete
              else gym.spaces.Box(-1.0, 1.0, (action_dim,), np.float32))
    return space, action


def _rows(obs_shape: tuple[int, ...], observation: str, vector_dim: int) -> gym.Space:
    """What the first layer is given: the observation, or a Dict's as one row (`splitrl.envs.EnvSpec.rows`)."""
    if observation == "dict":
        return gym.spaces.Box(0, 255, (int(np.prod(obs_shape)) + 4 * vector_dim,), np.uint8)
    return spaces(obs_shape, 2, observation=observation)[0]


def _dims(shape: tuple[int, ...]) -> str:
    return "(C, H, W)" if len(shape) == 3 else f"{len(shape)}-d"


def build_agent(
    obs_shape: tuple[int, ...], action_dim: int, cut: str, seed: int, init_log_std: float = 0.0,
    discrete: bool = False, bottleneck: int = 0, autoencoder: bool = False, *, model: str = "nature",
    model_kwargs: dict[str, Any] | None = None, hidden: int = 512, observation: str = "image", vector_dim: int = 0,
) -> tuple[nn.Sequential, ActorCriticHeads]:
    """(stage0 module, stage1 heads) of ``model`` cut at ``cut`` (`splitrl.models.network`), from ``seed``.

    ``discrete``: the heads' actor gives ``action_dim`` logits (a Discrete action space
    of that many actions) instead of a Gaussian's mean (`ActorCriticHeads`); ``hidden``: the width of
    the heads' hidden layer.
    ``bottleneck`` K > 0: the encoder ends with a learned linear projection of its
    features to K values (orthogonal rows, no bias, no activation), so the heads' first
    layers take K inputs: what crosses the default cut, and the heads' first layers, shrink
    with K. Trained end to end by PPO's loss like every other layer, or, with ``autoencoder``,
    not by the loss at all (``requires_grad`` off): stage1 fits it and a decoder to reconstruct
    the features (`splitrl.stages.autoencoder`). The decoder (K to the feature width, started
    as the projection's transpose: an orthogonal projection's best linear inverse) is then the
    heads' trunk, so the heads see the features as reconstructed.
    ``observation``: 'image', 'vector' or 'dict' (then ``vector_dim`` long, joined to the image's features:
    `splitrl.models.network.with_vector`).
    A cut after the first layer must leave stage0 parameters (SettingsError otherwise); an activation of any
    shape crosses it as flat (B, F) rows, stage0 ending with a flatten and stage1's layers starting with its
    inverse. The global RNG is left as it was, so building one stage in a process that also
    runs the other changes nothing.
    """
    observation_space, action_space = spaces(obs_shape, action_dim, discrete, observation=observation,
                                             vector_dim=vector_dim)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        network = make_network(model, dict(model_kwargs or {}), observation_space, action_space)
        if observation == "dict":
            network = with_vector(network, tuple(obs_shape), vector_dim)
        elif network.join:
            raise SettingsError(f"model {model!r} joins a vector after layer {network.join!r}, but the observations "
                                f"are {observation}s: only a Dict observation has a vector to join")
        shapes = network.shapes(_rows(tuple(obs_shape), observation, vector_dim))
        if len(shapes[-1]) != 1:
            raise SettingsError(f"model {model!r} ends with a {_dims(shapes[-1])} activation {shapes[-1]}; the heads "
                                "take flat (B, F) features: end it with a flatten")
        feature_dim = shapes[-1][0]
        trunk: list[nn.Module] = []
        if bottleneck:
            projection = layer_init(nn.Linear(feature_dim, bottleneck, bias=False), std=1.0)
            network = network.appended("projection", projection)
            shapes.append((bottleneck,))
            if autoencoder:
                decoder = nn.Linear(bottleneck, feature_dim)
                with torch.no_grad():
                    decoder.weight.copy_(projection.weight.t())
                    decoder.bias.zero_()
                projection.requires_grad_(False)
                trunk.append(decoder.requires_grad_(False))
            else:
                feature_dim = bottleneck
        layers = network.modules
        at = network.cut_index(cut)
        if observation == "dict" and 0 < at < network.join_index():
            raise SettingsError(f"cut {str(cut).strip()!r} of model {model!r} lies before the Dict observation's "
                                f"vector joins the image's features (after layer {network.join!r}); cut at 'input', "
                                "at the join or after it")
        crossing = tuple(shapes[at])
        if at:
            if autoencoder and at != len(layers):
                raise SettingsError(f"--bottleneck-train autoencoder needs the cut after the projection at the end of "
                                    f"model {model!r}'s encoder, got {str(cut).strip()!r}")
            if not any(True for layer in layers[:at] for _ in layer.parameters()):
                raise SettingsError(f"cut {str(cut).strip()!r} of model {model!r} leaves stage0 no parameters; "
                                    "use --cut input")
        # A feature map crosses as flat rows (B, C*H*W): the wire, the codecs, the storage and the budget see the
        # (B, F) they see at any cut, and stage1 gives its layers their shape back (both know it from the model).
        reshaped = at and len(crossing) != 1
        unflatten = [nn.Unflatten(1, crossing)] if reshaped else []
        heads = ActorCriticHeads(nn.Sequential(*unflatten, *layers[at:], *trunk), feature_dim, action_dim, hidden,
                                 init_log_std=init_log_std, discrete=discrete,
                                 input_dim=math.prod(crossing) if at else None)
    return nn.Sequential(*layers[:at], *([nn.Flatten()] if reshaped else [])), heads


def agent(settings: "TrainSettings", spec: "EnvSpec") -> tuple[nn.Sequential, ActorCriticHeads]:
    """`build_agent` for a run's settings and its environment (``--model auto``: the built-in for its kind of
    observations, `TrainSettings.for_observation`); SettingsError where the settings' model, cut, codecs and
    exchange do not fit together or the env."""
    settings = settings.for_observation(spec.observation)
    if codec_base(settings.codecs.codec_rollout) == "frames" and spec.observation != "image":
        raise SettingsError(f"--codec-rollout frames sends stacked frames; --env-id {settings.env.env_id!r} gives "
                            f"{spec.observation} observations")
    encoder, heads = build_agent(
        spec.obs_shape, spec.action_dim, settings.cut, settings.seed, settings.ppo.init_log_std,
        discrete=spec.discrete, bottleneck=settings.bottleneck, autoencoder=settings.bottleneck_train == "autoencoder",
        model=settings.model, model_kwargs=parse_kwargs(settings.model_kwargs, "--model-kwargs"),
        hidden=settings.hidden, observation=spec.observation, vector_dim=spec.vector_dim)
    decoder = 1 if settings.bottleneck_train == "autoencoder" else 0
    past_cut = sum(not isinstance(layer, nn.Unflatten) for layer in heads.trunk) - decoder
    if len(encoder) and past_cut and settings.codecs.exchange.partition(":")[0] == "replica":
        raise SettingsError(f"--exchange replica needs the cut at the end of the encoder of model {settings.model!r} "
                            f"(stage0's replica holds the heads alone); cut {settings.cut!r} leaves stage1 "
                            f"{past_cut} of its layers")
    return encoder, heads


def cuts(settings: "TrainSettings", spec: "EnvSpec") -> list[tuple[str, int]]:
    """Every cut of the run's model an agent can be built at (`agent`; the others, such as one that leaves stage0
    no parameters, are left out), in order, with the values a sample sends across it: 'input' (the observation's
    own), then each layer's name."""
    resolved = settings.for_observation(spec.observation)
    observation_space, action_space = spaces(spec.obs_shape, spec.action_dim, spec.discrete,
                                             observation=spec.observation, vector_dim=spec.vector_dim)
    with torch.random.fork_rng(devices=[]):
        network = make_network(resolved.model, parse_kwargs(resolved.model_kwargs, "--model-kwargs"),
                               observation_space, action_space)
    names = [INPUT, *network.names, *(["projection"] if settings.bottleneck else [])]
    out = []
    for name in names:
        try:
            out.append((name, crossing(settings, name, spec)[0]))
        except SettingsError:
            continue
    return out


def crossing(settings: "TrainSettings", cut: str, spec: "EnvSpec") -> tuple[int, bool]:
    """(the values a sample sends across ``cut``, whether they are the observation's own: a cut at the input)
    for any spelling ``--cut`` takes; SettingsError where the model has no such cut."""
    encoder, heads = agent(dataclasses.replace(settings, cut=cut), spec)
    return (heads.input_dim, False) if len(encoder) else (math.prod(spec.row_shape), True)


def network_digest(*modules: nn.Module) -> str:
    """SHA-256 (hex) of the parameters' and buffers' names and shapes of ``modules`` in order: equal where two
    processes built the same network, whatever its weights."""
    layout = [[i, name, list(t.shape)] for i, module in enumerate(modules)
              for name, t in (*module.named_parameters(), *module.named_buffers())]
    return hashlib.sha256(json.dumps(layout, separators=(",", ":")).encode()).hexdigest()
