"""Fixtures of the lab's tests: a lab needs root and ``ip netns``."""

from ..netem.support import netns_module, netns_ok, no_leftovers

__all__ = ["netns_module", "netns_ok", "no_leftovers"]
