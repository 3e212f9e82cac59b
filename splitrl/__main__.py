"""Entry point of the `splitrl` command (also `python -m splitrl`)."""

import os


def main() -> None:
    # Two stages on one machine take turns: OpenMP threads that spin after each
    # parallel region (libgomp's default) steal the cores the other stage needs,
    # which makes a split iteration on few cores about twice as slow (docs/benchmarks/e2e.md);
    # the twin is unaffected. Must be set before torch loads.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from .cli import main as cli_main

    cli_main()


if __name__ == "__main__":
    main()
