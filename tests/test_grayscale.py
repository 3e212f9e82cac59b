"""`splitrl.grayscale`: gymnasium's grayscale frames, byte for byte, for every colour."""

import gymnasium as gym
import numpy as np

from splitrl import grayscale as gray
from splitrl.envs import make_single_env
from splitrl.settings import EnvSettings


def _gymnasium_func() -> object:
    return gym.wrappers.GrayscaleObservation(gym.make("CarRacing-v3"), keep_dim=False).func  # gymnasium's own


def test_every_colour_gets_gymnasiums_byte():
    stock = _gymnasium_func()
    channel = np.arange(256, dtype=np.uint8)
    green, blue = np.meshgrid(channel, channel, indexing="ij")
    for red in range(256):  # 2**16 colours at a time: all 2**24 in all
        rgb = np.stack([np.full_like(green, red), green, blue], axis=-1)
        want = stock(rgb)
        assert want.dtype == np.uint8 and np.array_equal(gray.grayscale(rgb), want), red


def test_the_order_of_the_sums_matters():
    """Green and blue summed first, some colours come out one lower: the order is what makes the bytes equal."""
    red, green, blue = gray._tables()
    colour = np.array([[18, 4, 254]], dtype=np.uint8)  # the first such colour, by red, green, blue
    assert _gymnasium_func()(colour)[0] == gray.grayscale(colour)[0] == 25
    assert int(red[18] + (green[4] + blue[254])) == 24


def test_the_run_s_pipeline_grays_with_it_where_checked(monkeypatch):
    env = make_single_env(EnvSettings(env_id="CarRacing-v3"))
    wrappers = []
    while isinstance(env, gym.Wrapper):
        wrappers.append(env)
        env = env.env
    grays = [w for w in wrappers if isinstance(w, gym.wrappers.GrayscaleObservation)]
    assert len(grays) == 1 and grays[0].func is gray.grayscale
    wrappers[0].close()
    kept = gym.wrappers.GrayscaleObservation(gym.make("CarRacing-v3"), keep_dim=True)
    assert not gray.faster_grayscale(kept) and kept.func is not gray.grayscale  # (H, W, 1): not this function
    monkeypatch.setattr(gym, "__version__", "9.0.0")
    other = gym.wrappers.GrayscaleObservation(gym.make("CarRacing-v3"), keep_dim=False)
    assert not gray.faster_grayscale(other) and other.func is not gray.grayscale
