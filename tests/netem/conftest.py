"""Fixtures shared by the netem tests."""

import click
import pytest

from splitrl.netem.cli import register


@pytest.fixture
def cli():
    """A bare click group carrying the netem commands, as `splitrl.cli.main` does."""

    @click.group()
    def main():
        pass

    register(main)
    return main
