"""The model interface: what a factory must return, how ``--model`` and ``--cut`` are resolved, and the one-line
errors that name what is wrong."""

from __future__ import annotations

import math
import sys
import types

import pytest
import torch
from torch import nn

from splitrl.envs import EnvSpec
from splitrl.errors import SettingsError
from splitrl.models import (BUILTINS, Network, ScaleObs, agent, build_agent, make_network, network_digest,
                            resolve_model, spaces)
from splitrl.settings import CodecSettings, TrainSettings
from splitrl.settings.specs import MODEL_NAMES

OBS = (4, 84, 84)
SPEC = EnvSpec(obs_shape=OBS, action_dim=3, action_low=(-1.0,) * 3, action_high=(1.0,) * 3)


@pytest.fixture
def user_module(monkeypatch):
    """A module of factories returning unusable things, importable as ``user_nets``."""
    module = types.ModuleType("user_nets")
    module.not_a_list = lambda obs, act: nn.Linear(2, 2)
    module.empty = lambda obs, act: []
    module.no_names = lambda obs, act: [nn.Flatten()]
    module.twice = lambda obs, act: [("a", nn.Flatten()), ("a", nn.Identity())]
    module.reserved = lambda obs, act: [("input", nn.Flatten())]
    module.bad_name = lambda obs, act: [("conv-1", nn.Flatten())]
    module.not_flat = lambda obs, act: [("scale", ScaleObs()), ("conv", nn.Conv2d(4, 2, 3))]
    module.broken = lambda obs, act: [("scale", ScaleObs()), ("flatten", nn.Flatten()), ("fc", nn.Linear(5, 2))]
    module.default_elsewhere = lambda obs, act: Network(
        (("flatten", nn.Flatten()), ("fc", nn.Linear(28224, 8))), default_cut="nope")
    module.constant = 3
    monkeypatch.setitem(sys.modules, "user_nets", module)
    return module


@pytest.mark.parametrize("factory, message", [
    ("not_a_list", "model 'user_nets:not_a_list': its factory returned a Linear, not a list of (name, nn.Module)"),
    ("empty", "model 'user_nets:empty': its factory returned an empty list, not a list of (name, nn.Module)"),
    ("no_names", "model 'user_nets:no_names': its factory's item 0 is a Flatten: not a list of (name, nn.Module)"),
    ("twice", "model 'user_nets:twice': duplicate layer name 'a'"),
    ("reserved", "model 'user_nets:reserved': layer name 'input' is reserved (a cut of every model)"),
    ("bad_name", "model 'user_nets:bad_name': layer name 'conv-1' is not an identifier"),
    ("not_flat", "model 'user_nets:not_flat' ends with a (C, H, W) activation (2, 82, 82); the heads take flat "
                 "(B, F) features: end it with a flatten"),
    ("broken", "model 'user_nets:broken': layer 'fc' fails on a (28224,) input: mat1 and mat2 shapes cannot be "
               "multiplied (2x28224 and 5x2)"),
    ("default_elsewhere", "model 'user_nets:default_elsewhere': its default cut 'nope' is not one of its layers"),
    ("constant", "--model 'user_nets:constant': module 'user_nets' has no callable 'constant'"),
    ("missing", "--model 'user_nets:missing': module 'user_nets' has no callable 'missing'"),
])
def test_a_factory_returning_something_unusable_is_one_line_naming_what(user_module, factory, message):
    with pytest.raises(SettingsError) as info:
        build_agent(OBS, 3, "cnn", seed=1, model=f"user_nets:{factory}")
    assert str(info.value) == message and "\n" not in str(info.value)


def test_a_model_that_cannot_be_found_says_so():
    with pytest.raises(SettingsError, match=r"^--model 'resnet': unknown model \(built-ins: nature, impala, mlp; or"):
        resolve_model("resnet")
    with pytest.raises(SettingsError, match=r"^--model 'no_such_module_x:f': cannot import 'no_such_module_x' "
                                            r"\(ModuleNotFoundError"):
        resolve_model("no_such_module_x:f")
    with pytest.raises(SettingsError, match=r"^--model-kwargs: model 'nature' does not take \['depth'\]"):
        build_agent(OBS, 3, "cnn", seed=1, model_kwargs={"depth": 2})


def test_the_settings_name_the_builtins_without_importing_them():
    assert MODEL_NAMES == tuple(BUILTINS)
    assert all(resolve_model(name) is BUILTINS[name] for name in MODEL_NAMES)
    assert resolve_model("examples.my_encoder:small_cnn").__name__ == "small_cnn"


def test_a_cut_is_input_a_layer_name_its_number_or_the_default():
    obs, act = spaces(OBS, 3)
    network = make_network("nature", {}, obs, act)
    assert network.names == ["scale", "conv1", "relu1", "conv2", "relu2", "conv3", "relu3", "flatten"]
    assert [network.cut_index(c) for c in ("input", "0", "conv1", "2", "flatten", "8", "cnn")] == [0, 0, 2, 2, 8, 8, 8]
    with pytest.raises(SettingsError) as info:
        network.cut_index("foo")
    assert str(info.value) == (
        "cut 'foo' is not a layer of model 'nature' (its layers: 1 scale, 2 conv1, 3 relu1, 4 conv2, 5 relu2, "
        "6 conv3, 7 relu3, 8 flatten; or 'input' (0), or 'cnn', its default: 8)")
    with pytest.raises(SettingsError, match="^cut '9' is not a layer"):
        network.cut_index("9")


def test_a_factory_may_choose_its_default_cut(user_module):
    user_module.early = lambda obs, act: Network((("scale", ScaleObs()), ("flatten", nn.Flatten()),
                                                   ("fc", nn.Linear(28224, 8)),
                                                   ("fc2", nn.Linear(8, 4))), default_cut="fc")
    encoder, heads = build_agent(OBS, 3, "cnn", seed=1, model="user_nets:early")
    assert len(encoder) == 3 and len(heads.trunk) == 1 and heads.input_dim == 8 and heads.critic[0].in_features == 4


@pytest.mark.parametrize("cut", ["conv1", "relu1", "conv2", "relu2", "conv3", "relu3", "flatten"])
def test_a_feature_map_crosses_as_flat_rows_and_the_two_halves_are_the_whole(cut):
    encoder, heads = build_agent(OBS, 3, cut, seed=1)
    whole_encoder, whole_heads = build_agent(OBS, 3, "input", seed=1)
    x = torch.randint(0, 256, (2, *OBS), dtype=torch.uint8)
    crossing = encoder(x)
    shapes = {"conv1": (32, 20, 20), "relu1": (32, 20, 20), "conv2": (64, 9, 9), "relu2": (64, 9, 9),
              "conv3": (64, 7, 7), "relu3": (64, 7, 7), "flatten": (3136,)}
    assert crossing.shape == (2, math.prod(shapes[cut])) and heads.input_dim == math.prod(shapes[cut])
    for got, want in zip(heads.outputs(crossing), whole_heads.outputs(x)):
        assert torch.equal(got, want)
    reshaped = cut != "flatten"  # stage0 flattens the map for the link, stage1 gives it its shape back
    assert len(encoder) == ["scale", *shapes].index(cut) + 1 + reshaped and isinstance(encoder[-1], nn.Flatten)
    assert any(isinstance(layer, nn.Unflatten) for layer in heads.trunk) == reshaped


def test_stage0_must_hold_parameters(user_module):
    user_module.flat_first = lambda obs, act: [("scale", ScaleObs()), ("flatten", nn.Flatten()),
                                               ("fc", nn.Linear(28224, 8))]
    with pytest.raises(SettingsError, match=r"^cut 'flatten' of model 'user_nets:flat_first' leaves stage0 no "
                                            r"parameters; use --cut input$"):
        build_agent(OBS, 3, "flatten", seed=1, model="user_nets:flat_first")


def test_the_cut_is_checked_against_the_model_when_the_agent_is_built():
    assert TrainSettings(cut="middle").errors() == []  # any string: the settings do not know the env's shape
    with pytest.raises(SettingsError, match=r"^cut 'middle' is not a layer of model 'nature' \(its layers: 1 scale"):
        agent(TrainSettings(cut="middle"), SPEC)
    with pytest.raises(SettingsError, match=r"^--model-kwargs 'width': 'width' is not key=value$"):
        agent(TrainSettings(model="impala", model_kwargs="width"), SPEC)


def test_a_bottleneck_ends_any_model_and_is_a_layer_to_cut_at():
    encoder, heads = build_agent(OBS, 3, "cnn", seed=1, bottleneck=16, model="impala",
                                 model_kwargs={"width": 2, "blocks": 0, "features": 24})
    assert isinstance(encoder[-1], nn.Linear) and encoder[-1].out_features == 16 and heads.input_dim == 16
    encoder, heads = build_agent(OBS, 3, "fc", seed=1, bottleneck=16, model="impala",
                                 model_kwargs={"width": 2, "blocks": 0, "features": 24})
    assert heads.input_dim == 24 and len(heads.trunk) == 1 and heads.critic[0].in_features == 16
    with pytest.raises(SettingsError, match="^--bottleneck-train autoencoder needs the cut after the projection"):
        build_agent(OBS, 3, "fc", seed=1, bottleneck=16, autoencoder=True, model="impala")


def test_the_replica_exchange_needs_the_cut_at_the_encoders_end():
    settings = TrainSettings(model="impala", model_kwargs="width=2,blocks=0,features=24", cut="flatten",
                             codecs=CodecSettings(exchange="replica", codec_rollout="int8"))
    with pytest.raises(SettingsError, match=r"^--exchange replica needs the cut at the end of the encoder of model "
                                            r"'impala' \(stage0's replica holds the heads alone\); cut 'flatten' "
                                            r"leaves stage1 1 of its layers$"):
        agent(settings, SPEC)
    agent(TrainSettings(model="impala", model_kwargs="width=2,blocks=0,features=24", codecs=settings.codecs), SPEC)


def test_the_digest_names_the_layout_not_the_weights():
    a = build_agent(OBS, 3, "cnn", seed=1)
    assert network_digest(*a) == network_digest(*build_agent(OBS, 3, "cnn", seed=2))
    assert network_digest(*a) != network_digest(*build_agent(OBS, 3, "cnn", seed=1, hidden=256))
    assert network_digest(*a) != network_digest(*build_agent(OBS, 3, "input", seed=1))


def test_the_shape_probe_leaves_buffers_and_random_numbers_as_they_were():
    obs, act = spaces(OBS, 3)
    norm = nn.BatchNorm1d(28224)
    network = Network((("scale", ScaleObs()), ("flatten", nn.Flatten()), ("norm", norm)), model="t")
    rng = torch.random.get_rng_state()
    assert network.shapes(obs) == [OBS, OBS, (28224,), (28224,)]
    assert torch.equal(norm.running_mean, torch.zeros(28224)) and int(norm.num_batches_tracked) == 0
    assert torch.equal(torch.random.get_rng_state(), rng)
