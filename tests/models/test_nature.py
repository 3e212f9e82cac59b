"""`nature` through the model interface builds the very network splitrl always built: every parameter and buffer
equal, bit for bit, for the same seed, at either cut, with or without a bottleneck or its autoencoder."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from splitrl.models import ActorCriticHeads, ScaleObs, build_agent, layer_init


def _reference_encoder_layers(in_channels: int) -> list[nn.Module]:
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


def _reference_build_agent(obs_shape, action_dim, cut, seed, init_log_std=0.0, discrete=False, bottleneck=0,
                           autoencoder=False):
    """The agent as splitrl built it before models were pluggable, line for line."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        layers = _reference_encoder_layers(obs_shape[0])
        with torch.no_grad():
            feature_dim = nn.Sequential(*layers)(torch.zeros((1,) + tuple(obs_shape), dtype=torch.uint8)).shape[1]
        trunk: list[nn.Module] = []
        if bottleneck:
            projection = layer_init(nn.Linear(feature_dim, bottleneck, bias=False), std=1.0)
            layers.append(projection)
            if autoencoder:
                decoder = nn.Linear(bottleneck, feature_dim)
                with torch.no_grad():
                    decoder.weight.copy_(projection.weight.t())
                    decoder.bias.zero_()
                projection.requires_grad_(False)
                trunk.append(decoder.requires_grad_(False))
            else:
                feature_dim = bottleneck
        at = {"cnn": len(layers), "input": 0}[cut]
        heads = ActorCriticHeads(nn.Sequential(*layers[at:], *trunk), feature_dim, action_dim,
                                 init_log_std=init_log_std, discrete=discrete,
                                 input_dim=bottleneck if trunk else None)
    return nn.Sequential(*layers[:at]), heads


def _same(got: nn.Module, want: nn.Module) -> None:
    assert repr(got) == repr(want)
    got_state, want_state = got.state_dict(), want.state_dict()
    assert list(got_state) == list(want_state)
    for name in want_state:
        assert got_state[name].dtype == want_state[name].dtype, name
        assert torch.equal(got_state[name], want_state[name]), name
    assert [(n, p.requires_grad) for n, p in got.named_parameters()] == \
        [(n, p.requires_grad) for n, p in want.named_parameters()]


CASES = [("cnn", 0, False), ("input", 0, False), ("cnn", 32, False), ("input", 32, False), ("cnn", 32, True)]


@pytest.mark.parametrize("obs_shape", [(4, 84, 84), (4, 96, 96)], ids=["84", "96"])
@pytest.mark.parametrize("discrete", [False, True], ids=["box", "discrete"])
@pytest.mark.parametrize("cut, bottleneck, autoencoder", CASES,
                         ids=["cnn", "input", "cnn-bottleneck", "input-bottleneck", "cnn-autoencoder"])
def test_nature_is_bit_for_bit_the_network_splitrl_always_built(obs_shape, discrete, cut, bottleneck, autoencoder):
    before = torch.random.get_rng_state()
    args = (obs_shape, 5 if discrete else 3, cut, 7, -0.5, discrete, bottleneck, autoencoder)
    encoder, heads = build_agent(*args)
    assert torch.equal(torch.random.get_rng_state(), before)  # the global RNG is left as it was
    ref_encoder, ref_heads = _reference_build_agent(*args)
    _same(encoder, ref_encoder)
    _same(heads, ref_heads)
    assert heads.input_dim == ref_heads.input_dim and heads.discrete == ref_heads.discrete
    explicit, explicit_heads = build_agent(*args, model="nature", model_kwargs={}, hidden=512)
    _same(explicit, encoder)
    _same(explicit_heads, heads)


def test_the_heads_hidden_width_is_a_setting():
    _, heads = build_agent((4, 84, 84), 3, "cnn", seed=1, hidden=64)
    assert heads.critic[0].out_features == heads.actor_mean[0].out_features == 64
    assert heads.actor_mean[2].in_features == 64 and heads.critic[0].in_features == 3136
    assert math.isclose(float(heads.critic[2].weight.detach().norm()), 1.0, rel_tol=1e-5)  # std 1 orthogonal row
