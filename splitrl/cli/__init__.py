"""The `splitrl` command. Commands only build settings, call down into the library and print.

``main`` is the group; the commands live in one module per area and are attached
here: `train` (stage0, stage1, train, run, curve), `bench` (``splitrl bench ...``),
`netem` (``splitrl netem ...``, ``splitrl lab``) and `tools` (codecs, report, keys, upgrade-checkpoints), `evaluate` (eval).
Their options come from the settings dataclasses (`options`); how they end on an
error is `errors`; `fork` starts the stages of ``splitrl run``. Every command imports torch lazily, so ``--help`` and
``splitrl netem`` start quickly. Every command first raises the C allocator's thresholds for its process
(`splitrl.allocator`).
"""

from __future__ import annotations

import logging

import click

from ..allocator import keep_freed_memory
from ..stops import install as install_stops
from .bench import bench
from .bench_cuts import bench_cuts
from .bench_greedy import bench_greedy
from .errors import run_cli
from .evaluate import eval_cmd, export_cmd
from .netem import lab, netem
from .options import training_options
from .plan import plan
from .tools import codecs_cmd, keys, report, upgrade_checkpoints
from .train import curve, run, stage0, stage1, train

__all__ = ["main", "run_cli", "training_options"]


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S"
    )


_ENVIRONMENT = """\b
Environment:
  SPLITRL_PROGRESS=0|1        the progress bar within an iteration: never, or also off a terminal
  SPLITRL_ALLOCATOR=default   leave glibc's malloc thresholds as they are (every command raises them so
                              that freed buffers are reused, not mapped again: docs/benchmarks/floor.md)
  SPLITRL_TIMELINE=DIR        each stage process appends its phases' spans, with their CPU seconds, to
                              DIR/timeline-PID.jsonl (benchmarks/timeline.py draws them, and with --cpu
                              sets each stage's CPU against the parts `splitrl bench floor` times alone)"""


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110},
             epilog=_ENVIRONMENT)
@click.version_option(package_name="splitrl", prog_name="splitrl", message="%(prog)s %(version)s")
@click.option("-v", "--verbose", is_flag=True, help="debug logging")
def main(verbose: bool) -> None:
    """splitrl: PPO split across a slow link, with every byte counted."""
    _setup_logging(verbose)
    install_stops()
    keep_freed_memory()


bench.add_command(bench_cuts)  # commands of that group in files of their own
bench.add_command(bench_greedy)
for _command in (stage0, stage1, train, run, curve, eval_cmd, export_cmd, codecs_cmd, bench, report, keys,
                 upgrade_checkpoints, netem, lab, plan):
    main.add_command(_command)
