from __future__ import annotations

import pytest

from splitrl.launch import free_port_pair
from splitrl.settings import EnvSettings, PPOSettings, TrainSettings

from .peer import RawPeer

SETTINGS = TrainSettings(total_steps=64, hidden=32, env=EnvSettings(max_episode_steps=20),
                         ppo=PPOSettings(num_steps=32, epochs=2, minibatches=2)).for_observation("image")
"""The real stage runs with ``SETTINGS.to_argv()``; the raw peer says ``SETTINGS.shared()`` in its hello: the
settings as CarRacing's stages run them (``--model auto`` resolved), which is what a real stage says."""
OPTIONS = ["--threads", "1", "--timeout", "20", "--start-timeout", "60"]


@pytest.fixture
def endpoint() -> str:
    return f"tcp://127.0.0.1:{free_port_pair()}"


@pytest.fixture
def raw_peers():
    """Make `RawPeer`s; every one is closed in teardown."""
    made: list[RawPeer] = []

    def make(*args, **kwargs) -> RawPeer:
        made.append(RawPeer(*args, **kwargs))
        return made[-1]

    yield make
    for peer in made:
        peer.close()
