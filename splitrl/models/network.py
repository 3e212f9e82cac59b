"""The model interface: a factory builds a network as an ordered list of named layers, and any boundary between
two layers is a possible cut.

A factory is any callable ``factory(observation_space, action_space, **kwargs)`` of gymnasium spaces that
returns a list of ``(name, nn.Module)`` pairs, the encoder's layers in order (or a `Network`, to choose its
default cut). splitrl adds the actor-critic heads after the last layer. ``--model`` names a built-in
(`BUILTINS`) or a factory of the user's own as ``module:factory``, imported with importlib; ``--model-kwargs``
are the factory's keyword arguments.

A cut (``--cut``) is 'input' (before the first layer: the observation crosses), a layer's name (after it), a
number k (after the first k layers; 0 is 'input'), or 'cnn': the model's default cut (after the last layer
unless the factory says otherwise).

Given a Dict observation of an image and a vector, the factory is given the Dict space (``image``: (C, H, W)
uint8, ``vector``: (D,) float32) and its layers take the image; `with_vector` makes each layer up to the join
an `ImageStep` that carries the vector beside the image's activation, and the join concatenates it to the flat
output of its layer: the factory's `Network.join`, by default its last layer. A cut lies before the first layer
or at the join or after it.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
from torch import nn

from ..errors import SettingsError
from .builtin import impala, mlp, nature
from .layers import ImageStep

__all__ = ["Network", "Factory", "BUILTINS", "INPUT", "DEFAULT", "resolve_model", "make_network", "with_vector"]

Factory = Callable[..., Any]
"""``factory(observation_space, action_space, **kwargs) -> list[(name, nn.Module)] | Network``."""

BUILTINS: dict[str, Factory] = {"nature": nature, "impala": impala, "mlp": mlp}
"""The models ``--model`` names without a module (`splitrl.settings.specs.MODEL_NAMES` lists them too)."""

INPUT = "input"
"""The cut before the first layer."""
DEFAULT = "cnn"
"""The cut every model has: its default (the paper's, after the CNN, for `nature`)."""


@dataclass(frozen=True)
class Network:
    """A model's encoder as named layers in order, where its default cut lies (after ``default_cut``; empty:
    after the last layer), and, given a Dict observation, after which layer its vector is joined to the image's
    features (``join``; empty: the last)."""

    layers: tuple[tuple[str, nn.Module], ...]
    default_cut: str = ""
    model: str = "?"
    """The model's name as ``--model`` gave it, for messages."""
    join: str = ""

    @property
    def names(self) -> list[str]:
        return [name for name, _ in self.layers]

    @property
    def modules(self) -> list[nn.Module]:
        return [module for _, module in self.layers]

    def default_index(self) -> int:
        """The layers before the default cut."""
        return self.names.index(self.default_cut) + 1 if self.default_cut else len(self.layers)

    def cut_index(self, cut: str | int) -> int:
        """The number of layers before ``cut`` (`this module's doc`); SettingsError naming the model's layers."""
        text = str(cut).strip()
        if text == INPUT:
            return 0
        if text == DEFAULT:
            return self.default_index()
        if text in self.names:
            return self.names.index(text) + 1
        if text.isdigit() and int(text) <= len(self.layers):
            return int(text)
        listed = ", ".join(f"{i} {name}" for i, name in enumerate(self.names, 1))
        raise SettingsError(f"cut {text!r} is not a layer of model {self.model!r} (its layers: {listed}; or "
                            f"'{INPUT}' (0), or '{DEFAULT}', its default: {self.default_index()})")

    def join_index(self) -> int:
        """The layers up to and including the join (`join`)."""
        return self.names.index(self.join) + 1 if self.join else len(self.layers)

    def appended(self, name: str, module: nn.Module) -> "Network":
        """This network with one more layer at its end (the default cut moves with the end if it lay there)."""
        return _checked(self.model, Network(self.layers + ((name, module),), self.default_cut, self.model, self.join))

    def shapes(self, observation_space: Any) -> list[tuple[int, ...]]:
        """The shape of one sample at every boundary: the observation's, then each layer's output. Found by a
        forward pass of two zero observations that leaves the weights, buffers and random numbers as they were."""
        shape, dtype = tuple(observation_space.shape), np.dtype(observation_space.dtype)
        x = torch.from_numpy(np.zeros((2,) + shape, dtype=dtype))
        out = [shape]
        buffers = [(b, b.detach().clone()) for m in self.modules for b in m.buffers()]  # e.g. batch norm's stats
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            for name, module in self.layers:
                try:
                    x = module(x)
                except Exception as exc:  # noqa: BLE001 - any failure of a user's layer is reported the same way
                    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                    given = tuple((x[0] if isinstance(x, tuple) else x).shape[1:])
                    raise SettingsError(f"model {self.model!r}: layer {name!r} fails on a {given} input: {first}") \
                        from None
                if isinstance(module, ImageStep) and isinstance(x, tuple):
                    out.append(tuple(x[0].shape[1:]))  # the image's activation; the vector goes beside it
                    continue
                if not isinstance(x, torch.Tensor):
                    raise SettingsError(f"model {self.model!r}: layer {name!r} returns a {type(x).__name__}, "
                                        "not a tensor")
                out.append(tuple(x.shape[1:]))
            for buffer, saved in buffers:
                buffer.copy_(saved)
        return out


def resolve_model(spec: str) -> Factory:
    """The factory ``spec`` names: a built-in's name or ``module:factory``; SettingsError saying what is wrong."""
    text = spec.strip()
    if ":" not in text:
        if text not in BUILTINS:
            raise SettingsError(f"--model {spec!r}: unknown model (built-ins: {', '.join(BUILTINS)}; or a factory of "
                                "your own as module:factory)")
        return BUILTINS[text]
    module_name, _, attr = text.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - an import error of any kind says the same
        raise SettingsError(f"--model {spec!r}: cannot import {module_name!r} ({type(exc).__name__}: {exc})") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise SettingsError(f"--model {spec!r}: module {module_name!r} has no callable {attr!r}")
    return factory


def _checked(model: str, result: Any) -> Network:
    """``result`` of ``model``'s factory as a `Network`, or SettingsError naming what is unusable."""
    default = join = ""
    if isinstance(result, Network):
        default, join, result = result.default_cut, result.join, list(result.layers)
    if not isinstance(result, (list, tuple)) or not result:
        what = "an empty list" if isinstance(result, (list, tuple)) else f"a {type(result).__name__}"
        raise SettingsError(f"model {model!r}: its factory returned {what}, not a list of (name, nn.Module)")
    seen: set[str] = set()
    for i, item in enumerate(result):
        if not (isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], str)
                and isinstance(item[1], nn.Module)):
            raise SettingsError(f"model {model!r}: its factory's item {i} is a {type(item).__name__}: not a list of "
                                "(name, nn.Module)")
        name = item[0]
        if not name.isidentifier():
            raise SettingsError(f"model {model!r}: layer name {name!r} is not an identifier")
        if name in (INPUT, DEFAULT):
            raise SettingsError(f"model {model!r}: layer name {name!r} is reserved (a cut of every model)")
        if name in seen:
            raise SettingsError(f"model {model!r}: duplicate layer name {name!r}")
        seen.add(name)
    if default and default not in seen:
        raise SettingsError(f"model {model!r}: its default cut {default!r} is not one of its layers")
    if join and join not in seen:
        raise SettingsError(f"model {model!r}: its join {join!r} is not one of its layers")
    return Network(tuple((name, module) for name, module in result), default, model, join)


def make_network(model: str, kwargs: dict[str, Any], observation_space: Any, action_space: Any) -> Network:
    """Call ``model``'s factory (`resolve_model`) with the spaces and ``kwargs`` and check what it returns."""
    factory = resolve_model(model)
    try:
        inspect.signature(factory).bind(observation_space, action_space, **kwargs)
    except TypeError as exc:
        raise SettingsError(f"--model-kwargs: model {model!r} does not take {sorted(kwargs)}: {exc}") from None
    except ValueError:  # no signature to read (a builtin callable): its call says what is wrong
        pass
    try:
        result = factory(observation_space, action_space, **kwargs)
    except SettingsError:
        raise
    except Exception as exc:  # noqa: BLE001 - a user's factory that cannot take the spaces, whatever it raises
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise SettingsError(f"model {model!r}: its factory fails on the observation space {observation_space}: "
                            f"{type(exc).__name__}: {first}") from None
    return _checked(model, result)


def with_vector(network: Network, image_shape: tuple[int, ...], vector_dim: int) -> Network:
    """``network``, given a Dict observation: its layers up to the join as `ImageStep`s (the first unpacks the
    observation's rows, the join concatenates the vector to its flat output), the layers after it as they are."""
    at = network.join_index()
    layers = tuple((name, ImageStep(module, image_shape, vector_dim, first=i == 0, join=i == at - 1) if i < at
                    else module) for i, (name, module) in enumerate(network.layers))
    return Network(layers, network.default_cut, network.model, network.names[at - 1])
