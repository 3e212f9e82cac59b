"""Units people type and read: link rates, times and loss in tc's syntax, and sizes, for every layer.

tc's grammar (tc(8), "RATES" and "TIMES") is the one a user of `splitrl netem` already knows, so
`--link-budget 2mbit`, `--rate 20mbit` and `splitrl plan --rate` read the same way; the parsers
raise ValueError naming what was typed and what was expected.
"""

from __future__ import annotations

import re

__all__ = ["parse_rate", "parse_time", "parse_loss", "format_rate", "format_size", "format_time"]

_NUMBER = r"(?P<num>\d+(?:\.\d*)?|\.\d+)"
# tc's rate units (tc(8), "RATES"): bit units are SI (kbit = 1000 bit), the i-forms
# binary (kibit = 1024 bit); "bps" units are bytes per second.
_RATE_UNITS = {
    "bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12,
    "kibit": 2**10, "mibit": 2**20, "gibit": 2**30, "tibit": 2**40,
    "bps": 8, "kbps": 8 * 10**3, "mbps": 8 * 10**6, "gbps": 8 * 10**9, "tbps": 8 * 10**12,
    "kibps": 8 * 2**10, "mibps": 8 * 2**20, "gibps": 8 * 2**30, "tibps": 8 * 2**40,
}
_TIME_UNITS = {
    "s": 1.0, "sec": 1.0, "secs": 1.0,
    "ms": 1e-3, "msec": 1e-3, "msecs": 1e-3,
    "us": 1e-6, "usec": 1e-6, "usecs": 1e-6,
}


def parse_rate(text: str) -> int:
    """A tc rate such as ``20mbit``, ``500kbit``, ``1gbit`` or ``2mbps`` (bytes/s), in bits per second.

    A unit is required: tc reads a bare number as bits per second, which is
    almost never what was meant by ``--rate 20``.
    """
    bits = round(_scaled(text, "rate", _RATE_UNITS, "a tc unit, e.g. 20mbit, 500kbit, 1gbit", ", ".join(_RATE_UNITS)))
    if bits < 8:
        raise ValueError(f"rate {text!r}: must be at least 8bit (one byte per second)")
    if bits >= 2**64 * 8:
        raise ValueError(f"rate {text!r}: too large for tc")
    return bits


def _scaled(text: str, what: str, units: dict[str, float], example: str, known: str) -> float:
    """``text`` as a number times its (required, case-insensitive) unit's scale from ``units``."""
    m = re.fullmatch(_NUMBER + r"\s*(?P<unit>[a-zA-Z]*)", text.strip())
    if not m or not m["unit"]:
        raise ValueError(f"{what} {text!r}: expected a number and {example}")
    unit = m["unit"].lower()
    if unit not in units:
        raise ValueError(f"{what} {text!r}: unknown unit {m['unit']!r}; use {known}")
    return float(m["num"]) * units[unit]


def parse_time(text: str, what: str = "time") -> float:
    """A tc time such as ``20ms``, ``500us`` or ``1s``, in seconds. A unit is required."""
    seconds = _scaled(text, what, _TIME_UNITS, "a unit, e.g. 20ms, 500us, 1s", "s, ms or us")
    if seconds > 3600:
        raise ValueError(f"{what} {text!r}: more than an hour")
    return seconds


def parse_loss(text: str) -> float:
    """A loss probability such as ``0.1%`` (or ``0.1``, also percent, as tc reads it), in percent."""
    m = re.fullmatch(_NUMBER + r"\s*(?P<pct>%?)", text.strip())
    if not m:
        raise ValueError(f"loss {text!r}: expected a percentage, e.g. 0.1%")
    percent = float(m["num"])
    if not 0.0 <= percent <= 100.0:
        raise ValueError(f"loss {text!r}: must be between 0% and 100%")
    return percent


def format_rate(bits_per_s: float) -> str:
    """``20000000`` -> ``20 Mbit/s``."""
    for unit, scale in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bits_per_s >= scale:
            return f"{bits_per_s / scale:.4g} {unit}"
    return f"{bits_per_s:.4g} bit/s"


def format_size(nbytes: float) -> str:
    """``32768`` -> ``32 KiB``."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.4g} {unit}"
    return f"{nbytes:.0f} B"


def format_time(seconds: float) -> str:
    """``0.02`` -> ``20 ms``."""
    if seconds >= 1:
        return f"{seconds:.4g} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.4g} ms"
    return f"{seconds * 1e6:.4g} us"
