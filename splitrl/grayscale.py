"""gymnasium's grayscale frames for less CPU, byte for byte.

`gymnasium.wrappers.GrayscaleObservation` turns each RGB frame into luminance as ``np.sum(np.multiply(obs,
WEIGHTS), axis=-1).astype(np.uint8)``: every pixel's three channels made float64 and multiplied, the products
summed, the sum truncated to a byte. That is about 200 us of a CarRacing step's 2.7 ms for a 96x96 frame.
`grayscale` takes each product from a table of the 256 a channel can give (the same float64 products: a byte is
exact as a float64) and adds them in numpy's order for three values, red and green first, then blue: the bytes
are the wrapper's for every one of the 2**24 colours (tests/test_grayscale.py checks them all), in about a
quarter of the time (`python benchmarks/grayscale.py`). `faster_grayscale` gives it to a wrapper where the
gymnasium release is one that was checked.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

__all__ = ["CHECKED_GYMNASIUM", "WEIGHTS", "faster_grayscale", "grayscale"]

CHECKED_GYMNASIUM = ("1.4.",)
"""gymnasium releases whose `GrayscaleObservation` `grayscale` reproduces (prefixes of ``gymnasium.__version__``;
checked on its own, as `splitrl.carracing`'s passes are)."""
WEIGHTS = (0.2125, 0.7154, 0.0721)
"""gymnasium's luminance weights of red, green and blue (`GrayscaleObservation`, the releases checked)."""


@functools.cache
def _tables() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each channel's 256 products with its weight, in float64 as numpy multiplies a byte by a float64."""
    values = np.arange(256, dtype=np.float64)
    red, green, blue = (values * weight for weight in WEIGHTS)
    return red, green, blue


def grayscale(obs: np.ndarray) -> np.ndarray:
    """(..., 3) uint8 RGB -> (...) uint8 luminance, as `GrayscaleObservation` with ``keep_dim=False`` computes it."""
    red, green, blue = _tables()
    return ((red[obs[..., 0]] + green[obs[..., 1]]) + blue[obs[..., 2]]).astype(np.uint8)


def faster_grayscale(wrapper: Any) -> bool:
    """Give a `GrayscaleObservation` without ``keep_dim`` `grayscale` as its function, where its gymnasium
    release was checked; whether it did."""
    import gymnasium

    if (not gymnasium.__version__.startswith(CHECKED_GYMNASIUM)
            or type(wrapper) is not gymnasium.wrappers.GrayscaleObservation or wrapper.keep_dim):
        return False
    wrapper.func = grayscale
    return True
