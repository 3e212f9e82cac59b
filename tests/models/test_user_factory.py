"""A factory of the user's own, in a module of their own: used by ``--model module:factory`` like a built-in.

`tiny` is such a factory; the spawned stages import it as ``tests.models.test_user_factory:tiny``. The docs'
worked example (examples/my_encoder.py) is checked here too.
"""

from __future__ import annotations

import torch
from torch import nn

from splitrl.envs import EnvSpec
from splitrl.models import ScaleObs, agent, build_agent
from splitrl.runs import load_checkpoint
from splitrl.settings import TrainSettings

from .twin import split_matches_twin

OBS = (4, 84, 84)


def tiny(observation_space, action_space, channels: int = 4, features: int = 16):
    """One strided conv, then a linear layer: (name, module) pairs in order."""
    c, h, w = observation_space.shape
    return [
        ("scale", ScaleObs()),
        ("conv", nn.Sequential(nn.Conv2d(c, channels, 8, stride=8), nn.ReLU())),
        ("flatten", nn.Flatten()),
        ("fc", nn.Sequential(nn.Linear(channels * (h // 8) * (w // 8), features), nn.ReLU())),
    ]


SPEC = EnvSpec(obs_shape=OBS, action_dim=5, action_low=(0,), action_high=(4,), discrete=True)


def test_a_user_factory_builds_as_a_builtin_does():
    settings = TrainSettings(model="tests.models.test_user_factory:tiny", model_kwargs="channels=2,features=8",
                             hidden=32, cut="flatten")
    encoder, heads = agent(settings, SPEC)
    x = torch.randint(0, 256, (3,) + OBS, dtype=torch.uint8)
    assert encoder(x).shape == (3, 2 * 10 * 10) and heads.input_dim == 200
    logits, value = heads.outputs(encoder(x))
    assert logits.shape == (3, 5) and value.shape == (3,) and heads.critic[0].out_features == 32
    again, _ = agent(settings, SPEC)  # the same seed, the same weights
    assert all(torch.equal(p, q) for p, q in zip(encoder.parameters(), again.parameters()))


def test_the_network_guides_example_factory():
    encoder, heads = build_agent(OBS, 3, "cnn", seed=1, model="examples.my_encoder:small_cnn",
                                 model_kwargs={"channels": 8, "features": 64})
    assert encoder(torch.zeros((1,) + OBS, dtype=torch.uint8)).shape == (1, 64) and len(heads.trunk) == 0
    encoder, heads = build_agent(OBS, 3, "flatten", seed=1, model="examples.my_encoder:small_cnn")
    assert heads.input_dim == 16 * 19 * 19 and len(heads.trunk) == 1


def test_a_user_factory_trains_split_as_its_twin(tmp_path, spawn):
    metrics = split_matches_twin(tmp_path, spawn, "--model", "tests.models.test_user_factory:tiny", "--cut", "flatten",
                                 "--hidden", "16")
    assert "net/train_fwd/sent_bytes" in metrics[-1]
    heads = load_checkpoint(tmp_path / "split", "stage1", 2)["heads"]
    assert heads["trunk.0.0.weight"].shape == (16, 4 * 12 * 12)  # stage1 holds 'fc', after the cut
    assert heads["critic.0.weight"].shape == (16, 16)
