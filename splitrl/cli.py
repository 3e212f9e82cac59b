"""The `splitrl` command. Commands only build settings and call the library."""

from __future__ import annotations

import dataclasses
import functools
import logging
import signal
import sys
from pathlib import Path
from typing import Any, Callable

import click

from .settings import CODEC_NAMES, CodecSettings, EnvSettings, PPOSettings, RunOptions, TrainSettings

__all__ = ["main"]

log = logging.getLogger(__name__)

_SECTIONS: tuple[tuple[str | None, type], ...] = (
    (None, TrainSettings), ("env", EnvSettings), ("ppo", PPOSettings), ("codecs", CodecSettings)
)


def _help(f: dataclasses.Field) -> str:
    text = f.metadata["help"]
    if f.name.startswith("codec_"):
        text += f"; one of {', '.join(CODEC_NAMES)}, optionally NAME:key=value,... and +zstd (details: splitrl codecs)"
    return text


def _option_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def _click_options(cls: type) -> list[Callable]:
    out = []
    for f in dataclasses.fields(cls):
        if "help" not in f.metadata:
            continue  # nested sections get their own options
        name = _option_name(f.name)
        if f.type in (bool, "bool"):
            decl = f"{name}/--no-{name[2:]}"
            out.append(click.option(decl, f.name, default=f.default, show_default=True, help=_help(f)))
        else:
            kind = {"int": int, "float": float, "str": str}.get(f.type if isinstance(f.type, str) else f.type.__name__, str)
            out.append(click.option(name, f.name, type=kind, default=f.default, show_default=True, help=_help(f)))
    return out


def training_options(func: Callable) -> Callable:
    """Add one click option per settings field, and pass built settings objects instead."""
    options = [opt for _, cls in _SECTIONS for opt in _click_options(cls)] + _click_options(RunOptions)

    @functools.wraps(func)
    def wrapper(**kwargs: Any) -> Any:
        def take(cls: type) -> Any:
            return cls(**{f.name: kwargs.pop(f.name) for f in dataclasses.fields(cls) if "help" in f.metadata})

        env, ppo, codecs = take(EnvSettings), take(PPOSettings), take(CodecSettings)
        top = {f.name: kwargs.pop(f.name) for f in dataclasses.fields(TrainSettings) if "help" in f.metadata}
        settings = TrainSettings(env=env, ppo=ppo, codecs=codecs, **top)
        return func(settings=settings, options=take(RunOptions), **kwargs)

    for option in reversed(options):
        wrapper = option(wrapper)
    return wrapper


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def _install_signal_handlers() -> None:
    """SIGINT and SIGTERM both stop a stage the same way: tell the peer, clean up, exit 130.

    SIGINT is set explicitly because a process started in the background by a
    non-interactive shell inherits it ignored.
    """
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S"
    )


def _run_cli(what: Callable[[], Any]) -> Any:
    """Turn the library's errors into one clear line and an exit code."""
    # Imported here, not at the top: the transport pulls in torch, which `splitrl netem` does not need.
    from .transport import PeerAbort, ProtocolError, TransportTimeout

    try:
        return what()
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    except (TransportTimeout, ProtocolError, PeerAbort, ConnectionError, ImportError) as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(1)
    except KeyboardInterrupt:
        click.echo("interrupted", err=True)
        sys.exit(130)


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.option("-v", "--verbose", is_flag=True, help="debug logging")
def main(verbose: bool) -> None:
    """splitrl: PPO split across a slow link, with every byte counted."""
    _setup_logging(verbose)
    _install_signal_handlers()


@main.command()
@click.option("--connect", default="tcp://127.0.0.1:5555", show_default=True,
              help="stage1's endpoint (tcp://HOST:PORT uses PORT and PORT+1; also ipc://PATH)")
@training_options
def stage0(settings: TrainSettings, options: RunOptions, connect: str) -> None:
    """The edge: environments + encoder. Drives the schedule."""
    from .stages import run_stage0

    _run_cli(lambda: run_stage0(settings, options, connect))


@main.command()
@click.option("--bind", default="tcp://0.0.0.0:5555", show_default=True,
              help="where to listen (tcp://HOST:PORT binds PORT and PORT+1; also ipc://PATH)")
@training_options
def stage1(settings: TrainSettings, options: RunOptions, bind: str) -> None:
    """The server: actor-critic heads + PPO learner. Serves one stage0 session."""
    from .stages import run_stage1

    _run_cli(lambda: run_stage1(settings, options, bind))


@main.command()
@training_options
def train(settings: TrainSettings, options: RunOptions) -> None:
    """Both stages in one process over an in-process link (the single-process twin)."""
    from .stages import train_twin

    _run_cli(lambda: train_twin(settings, options))


@main.command()
@click.option("--endpoint", default=None,
              help="where stage1 binds and stage0 connects, e.g. ipc:///tmp/link  [default: a free loopback tcp port pair]")
@training_options
def run(settings: TrainSettings, options: RunOptions, endpoint: str | None) -> None:
    """Split training on this machine: stage1 and stage0 as two processes over loopback."""
    from .launch import launch_split

    code = _run_cli(lambda: launch_split(settings, options, endpoint=endpoint))
    sys.exit(code)


@main.command()
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False))
def curve(run_dir: str) -> None:
    """Print a run's learning curve (per iteration) as a markdown table."""
    from .stages.curve import curve_table

    click.echo(_run_cli(lambda: curve_table(run_dir)))


@main.command("codecs")
def codecs_cmd() -> None:
    """List the wire codecs, the streams each can carry, and their parameters."""
    from .codecs import catalogue

    click.echo(catalogue())


@main.group()
def bench() -> None:
    """Benchmarks (not tests): transports, end to end, codecs, learning with codecs, the shaped lab."""


@bench.command("transport")
@click.option("--seconds", default=1.0, show_default=True, help="measuring time per cell")
@click.option("--quick", is_flag=True, help="tiny durations (smoke test)")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="also write the rows as JSON")
def bench_transport(seconds: float, quick: bool, json_path: str | None) -> None:
    """Throughput and round trip of each transport and endpoint vs raw pyzmq."""
    import json

    from .bench.transport_bench import format_table, run_transport_bench

    rows = run_transport_bench(seconds=seconds, quick=quick)
    click.echo(format_table(rows))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(rows, f, indent=2)


@bench.command("codecs")
@click.option("--num-steps", default=512, show_default=True, help="rollout length of the captured iteration")
@click.option("--epochs", default=3, show_default=True, help="training epochs captured")
@click.option("--minibatches", default=4, show_default=True, help="minibatches per epoch (512 / 4 = the paper's 128)")
@click.option("--from", "from_run", type=click.Path(exists=True, file_okay=False),
              help="start both stages from this run directory's newest checkpoints (a trained agent)")
@click.option("--codec", "extra", multiple=True, metavar="STREAM=SPEC",
              help="measure only these (repeatable), e.g. bwd=ef:density=0.02")
@click.option("--threads", default=0, show_default=True, help="torch intra-op threads (0: torch's default)")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="also write the rows as JSON")
def bench_codecs(num_steps: int, epochs: int, minibatches: int, from_run: str | None, extra: tuple[str, ...],
                 threads: int, json_path: str | None) -> None:
    """Every codec on activations and gradients captured from a short CarRacing training."""
    from .bench.codec_bench import DEFAULT_SPECS, PIPELINES, capture, format_codec_table, pipeline_table, run_codec_bench

    def go() -> None:
        specs: dict[str, list[str]] | None = None
        if extra:
            specs = {}
            for item in extra:
                stream, eq, spec = item.partition("=")
                if not eq or stream not in ("rollout", "fwd", "bwd"):
                    raise click.BadParameter(f"{item!r}: expected STREAM=SPEC with STREAM rollout, fwd or bwd")
                specs.setdefault(stream, []).append(spec)
        if threads:
            import torch

            torch.set_num_threads(threads)
        cap = capture(num_steps, epochs, minibatches, checkpoint_dir=from_run)
        if specs is None:  # the full table also covers every pipeline's codecs
            specs = {stream: list(names) for stream, names in DEFAULT_SPECS.items()}
            for streams in PIPELINES.values():
                for stream, spec in streams.items():
                    if spec not in specs[stream]:
                        specs[stream].append(spec)
        rows = run_codec_bench(cap, specs)
        click.echo(format_codec_table(rows))
        click.echo(f"\nPer env step over a whole iteration ({10} epochs, 4096 features), from the rates above:\n")
        click.echo(pipeline_table(cap, rows))
        if json_path:
            import json

            with open(json_path, "w") as fh:
                json.dump(rows, fh, indent=1)

    _run_cli(go)


@bench.command("learning")
@click.option("--config", "names", multiple=True, metavar="NAME",
              help="configurations to run (repeatable; default: all). Known: fp32, bf16, paper-p90, paper-p99, "
                   "ours, ours-zero-fwd, ours-ef6, ours-exact-fwd, ours-replica, ours-replica-sync, cloud-frames")
@click.option("--iterations", default=25, show_default=True, help="PPO iterations of 4096 steps per run")
@click.option("--out", "out_dir", default="runs/learning-comparison", show_default=True,
              type=click.Path(file_okay=False), help="one run directory per configuration goes here")
@click.option("--table-only", is_flag=True, help="only print the table of the run directories already in --out")
@click.option("--upto", type=int, help="with --table-only: every run as of the end of this iteration")
@click.option("--reference", default="bf16", show_default=True, help="the run the 'x fewer' column compares with")
@click.argument("extra", nargs=-1, type=click.UNPROCESSED)
def bench_learning(names: tuple[str, ...], iterations: int, out_dir: str, table_only: bool, upto: int | None,
                   reference: str, extra: tuple[str, ...]) -> None:
    """Train each codec configuration with the same seed and steps; one table row each.

    Runs one after another (hours for the default 25 iterations each). Arguments after
    `--` go to every `splitrl run`, e.g. `-- --threads 2`.
    """
    from pathlib import Path

    from .bench.learning_bench import CONFIGS, learning_table, run_learning_comparison

    def go() -> None:
        unknown = [n for n in names if n not in CONFIGS]
        if unknown:
            raise ValueError(f"unknown --config {', '.join(unknown)} (known: {', '.join(CONFIGS)})")
        chosen = list(names or CONFIGS)
        out = Path(out_dir)
        if table_only:
            dirs = [out / n for n in chosen if (out / n / "metrics.jsonl").exists()]
        else:
            dirs = run_learning_comparison(chosen, iterations * 4096, out, extra)
        if not dirs:
            raise ValueError(f"no finished runs under {out}")
        click.echo(learning_table(dirs, reference=reference, upto=upto))

    _run_cli(go)


@bench.command("e2e")
@click.option("--iterations", default=1, show_default=True, help="PPO iterations (4096 steps each) per run")
@click.option("--repeats", default=1, show_default=True, help="runs per mode, alternating split and twin")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), help="keep the run directories here")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="also write the rows as JSON")
@click.argument("extra", nargs=-1, type=click.UNPROCESSED)
def bench_e2e(iterations: int, repeats: int, out_dir: str | None, json_path: str | None, extra: tuple[str, ...]) -> None:
    """Steps/s of the paper configuration, split over loopback vs the twin, with the phase breakdown.

    EXTRA arguments (after --) go to both runs, e.g. -- --threads 2.
    """
    import json

    from .bench.e2e_bench import format_e2e_table, run_e2e_bench

    rows = run_e2e_bench(iterations=iterations, repeats=repeats, extra_args=extra, out_dir=out_dir)
    click.echo(format_e2e_table(rows))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(rows, f, indent=2)



@bench.command("swap")
@click.option("--links", default="zmq-tcp,zmq-ipc,tcp,torch-rpc", show_default=True,
              help="comma-separated links to run the same training over")
@click.option("--iterations", default=3, show_default=True,
              help="iterations per run (the first, which pays for start-up, is left out of the figures)")
@click.option("--repeats", default=1, show_default=True, help="runs per link, in reversed order on odd repeats")
@click.option("--seconds", default=1.0, show_default=True, help="measuring time per cell of the micro-benchmark")
@click.option("--quick", is_flag=True, help="smoke test: a 32-step training and a few ms per micro-benchmark cell")
@click.option("--out", "out_dir", type=click.Path(file_okay=False),
              help="keep run directories, logs, swap.png and swap.json here [default: a new temporary directory]")
@click.option("--no-netns", is_flag=True, help="do not run each link in a private network namespace (no kernel bytes)")
@click.argument("extra", nargs=-1, type=click.UNPROCESSED)
def bench_swap(links: str, iterations: int, repeats: int, seconds: float, quick: bool, out_dir: str | None,
               no_netns: bool, extra: tuple[str, ...]) -> None:
    """The same short PPO run over ZeroMQ tcp, ZeroMQ ipc, plain TCP and torch RPC; then the transport micro-benchmark.

    The training is 512 CarRacing steps per iteration, 10 epochs of 4 minibatches of 128
    (the paper's message sizes), --threads 1; EXTRA arguments (after --) go to every run.
    As root, each run gets a private network namespace whose loopback bytes are counted.
    Prints the table, writes swap.png (bar chart) and swap.json; about 10 minutes on 2 idle cores.
    """

    def go() -> None:
        import json
        import tempfile
        from pathlib import Path

        from .bench.swap_bench import format_swap_table, run_swap_bench, swap_chart, swap_targets
        from .bench.transport_bench import TRANSPORTS, format_table, run_transport_bench

        out = Path(out_dir or tempfile.mkdtemp(prefix="splitrl-swap-"))
        names = [name.strip() for name in links.split(",") if name.strip()]
        rows = run_swap_bench(names, iterations=iterations, repeats=repeats, quick=quick, extra_args=extra,
                              out_dir=str(out), netns=False if no_netns else None)
        click.echo(format_swap_table(rows))
        chart = swap_chart(rows, out / "swap.png")
        micro = run_transport_bench(sizes=(16384, 1 << 20), transports=TRANSPORTS, endpoints=("tcp", "ipc"),
                                    seconds=seconds, quick=quick)
        click.echo("\n" + format_table(micro) + "\n")
        for line in swap_targets(micro):
            click.echo(f"- {line}")
        (out / "swap.json").write_text(json.dumps({"runs": rows, "micro": micro}, indent=2))
        click.echo(f"\nchart: {chart}\nruns, logs and swap.json: {out}")

    _run_cli(go)


@main.command()
@click.argument("run_dirs", nargs=-1, required=True, type=click.Path(exists=True, file_okay=False))
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False),
              help="where return.png, bytes.png and report.md go")
@click.option("--tensorboard", is_flag=True, help="also write TensorBoard event files under OUT/tensorboard/")
def report(run_dirs: tuple[str, ...], out_dir: str, tensorboard: bool) -> None:
    """The paper's two figures (return and bytes on the link against env steps) and a table, for RUN_DIRS."""
    from .report import make_report

    paths = _run_cli(lambda: make_report(run_dirs, out_dir, tensorboard=tensorboard))
    click.echo(paths["table"])
    click.echo(f"\nfigures: {paths['return']}, {paths['bytes']}; table: {paths['markdown']}")
    if tensorboard:
        click.echo(f"tensorboard --logdir {Path(out_dir) / 'tensorboard'}")


from .netem.cli import register as _register_netem  # noqa: E402  (it uses training_options from above)

_register_netem(main)

from .bench.lab_cli import register as _register_bench_lab  # noqa: E402

_register_bench_lab(bench)
