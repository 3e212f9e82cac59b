"""Fixtures shared by the netem tests."""

import click
import pytest

from splitrl.cli.netem import netem

from .support import netns_module, netns_ok, no_leftovers

__all__ = ["cli", "netns_module", "netns_ok", "no_leftovers"]


@pytest.fixture
def cli():
    """A bare click group carrying the netem commands, as `splitrl.cli.main` does."""

    @click.group()
    def main():
        pass

    main.add_command(netem)
    return main
