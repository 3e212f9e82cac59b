"""Fixtures shared by the benchmark tests: those of the lab need root and ``ip netns``."""

from ..netem.support import netns_module, netns_ok, no_leftovers

__all__ = ["netns_module", "netns_ok", "no_leftovers"]
