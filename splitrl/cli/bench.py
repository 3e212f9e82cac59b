"""``splitrl bench ...``: every benchmark's command (transports, end to end, codecs, learning, swap, the lab)."""

from __future__ import annotations

import dataclasses
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import click

from ..errors import SettingsError
from ..settings import RunOptions, TrainSettings
from .errors import fail, run_cli
from .options import training_options

__all__ = ["bench"]

_MIB = 1024 * 1024


def _write_json(path: str | None, data: object, indent: int = 2) -> None:
    """``--json PATH``: the rows as JSON too."""
    if path:
        Path(path).write_text(json.dumps(data, indent=indent))


@click.group()
def bench() -> None:
    """Benchmarks (not tests): transports, end to end, codecs, learning with codecs, the shaped lab."""


@bench.command("transport")
@click.option("--seconds", default=1.0, show_default=True, help="measuring time per cell")
@click.option("--quick", is_flag=True, help="tiny durations (smoke test)")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="also write the rows as JSON")
@click.option("--sizes", default="16,4096,16384,1048576", show_default=True, help="message sizes in bytes, comma-separated")
@click.option("--transports", default=",".join(("raw-zmq", "raw-torch", "zmq", "tcp", "torch-rpc")), show_default=True,
              help="comma-separated (raw-zmq is the baseline the ratios need; raw-torch the floor with tensors)")
@click.option("--endpoints", default="tcp,ipc,inproc", show_default=True, help="comma-separated")
def bench_transport(seconds: float, quick: bool, json_path: str | None, sizes: str, transports: str,
                    endpoints: str) -> None:
    """Throughput and round trip of each transport and endpoint vs raw pyzmq."""
    from ..bench.transport_bench import format_table, run_transport_bench

    try:
        size_list = [int(x) for x in sizes.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated byte counts, got {sizes!r}", param_hint="--sizes") from None
    try:
        rows = run_transport_bench(sizes=size_list, seconds=seconds, quick=quick,
                                   transports=[t.strip() for t in transports.split(",") if t.strip()],
                                   endpoints=[e.strip() for e in endpoints.split(",") if e.strip()])
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    click.echo(format_table(rows))
    _write_json(json_path, rows)


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
    from ..bench.codec_bench import DEFAULT_SPECS, PIPELINES, capture, format_codec_table, pipeline_table, run_codec_bench

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
        _write_json(json_path, rows, indent=1)

    run_cli(go)


@bench.command("learning")
@click.option("--config", "names", multiple=True, metavar="NAME",
              help="configurations to run (repeatable; default: all). Known: fp32, bf16, paper-p90, paper-p99, "
                   "ours, ours-zero-fwd, ours-ef6, ours-exact-fwd, ours-replica, ours-replica-sync, cloud-frames, "
                   "ours-bottleneck, ours-autoencoder, ours-bottleneck-128, pipelined, async, bf16-pipelined, "
                   "bf16-async, fleet-bf16-avg")
@click.option("--iterations", default=25, show_default=True, help="PPO iterations of 4096 steps per run")
@click.option("--out", "out_dir", default="runs/learning-comparison", show_default=True,
              type=click.Path(file_okay=False), help="one run directory per configuration goes here")
@click.option("--table-only", is_flag=True, help="only print the table of the run directories already in --out "
              "(without --config: every run there, e.g. docs/results/paper-length's)")
@click.option("--upto", type=int, help="with --table-only: every run as of the end of this iteration")
@click.option("--reference", default="bf16", show_default=True, help="the run the 'x fewer' column compares with")
@click.option("--by-kind", is_flag=True, help="also a table of each run's bytes per env step by message kind")
@click.argument("extra", nargs=-1, type=click.UNPROCESSED)
def bench_learning(names: tuple[str, ...], iterations: int, out_dir: str, table_only: bool, upto: int | None,
                   reference: str, by_kind: bool, extra: tuple[str, ...]) -> None:
    """Train each codec configuration with the same seed and steps; one table row each.

    Runs one after another (hours for the default 25 iterations each). Arguments after
    `--` go to every `splitrl run`, e.g. `-- --threads 2`.
    """
    from ..bench.learning_bench import CONFIGS, kind_table, learning_table, run_learning_comparison
    from ..summary import has_records

    def go() -> None:
        unknown = [n for n in names if n not in CONFIGS]
        if unknown:
            raise SettingsError(f"unknown --config {', '.join(unknown)} (known: {', '.join(CONFIGS)})")
        chosen = list(names or CONFIGS)
        out = Path(out_dir)
        if table_only:
            dirs = [out / n for n in chosen if has_records(out / n)]
            if not names and out.is_dir():  # and every other run there (e.g. bf16-seed1), by name
                dirs += sorted(d for d in out.iterdir() if d.name not in CONFIGS and has_records(d))
        else:
            dirs = run_learning_comparison(chosen, iterations * 4096, out, extra)
        if not dirs:
            raise ValueError(f"no finished runs under {out}")
        click.echo(learning_table(dirs, reference=reference, upto=upto))
        if by_kind:
            click.echo("\n" + kind_table(dirs, upto=upto))

    run_cli(go)


@bench.command("e2e")
@click.option("--iterations", default=1, show_default=True, help="PPO iterations (4096 steps each) per run")
@click.option("--repeats", default=1, show_default=True, help="runs per mode, alternating split and twin")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), help="keep the run directories here")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="also write the rows as JSON")
@click.option("--against", metavar="REV",
              help="also run every mode from a git checkout of REV, interleaved with this tree (before/after)")
@click.option("--history", "history", multiple=True, type=click.Path(dir_okay=False, exists=True),
              help="run nothing: one line per saved --json FILE (repeat it), this tree's split against its twin")
@click.argument("extra", nargs=-1, type=click.UNPROCESSED)
def bench_e2e(iterations: int, repeats: int, out_dir: str | None, json_path: str | None, against: str | None,
              history: tuple[str, ...], extra: tuple[str, ...]) -> None:
    """Steps/s of the paper configuration, split over loopback vs the twin, with the phase breakdown.

    EXTRA arguments (after --) go to every run, e.g. -- --threads 2.
    """
    from ..bench.e2e_bench import format_e2e_table, history_table, run_e2e_bench

    if history:
        click.echo(run_cli(lambda: history_table(history)))
        return
    rows = run_cli(lambda: run_e2e_bench(iterations=iterations, repeats=repeats, extra_args=extra, out_dir=out_dir,
                                         against=against))
    click.echo(format_e2e_table(rows))
    _write_json(json_path, rows)


@bench.command("pipeline")
@click.option("--modes", default=",".join(["sync", "+ async envs", "+ 4 envs", "+ pipelined rollout", "+ micro-batches",
                                           "+ micro-batches at once", "+ async"]),
              show_default=True, help="comma-separated rows; each adds one mechanism to the one before, and may "
                                      "carry training arguments of its own after its name ('sync --threads 1')")
@click.option("--rtt", "rtts", default="0,20", show_default=True,
              help="comma-separated round trips in ms; above 0 the runs go through the lab (needs root)")
@click.option("--rate", default="100mbit", show_default=True, help="the lab's link rate (tc units)")
@click.option("--iterations", default=3, show_default=True,
              help="paper iterations per run (the first and, with three or more, the last are left out of the "
                   "figures: start-up, and the asynchronous mode's rollout or training alone)")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), help="keep the run directories here")
@click.option("--table-only", is_flag=True, help="only print the table of the runs already in --out (all modes and "
                                                  "round trips found there, and the rows --modes names)")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="also write the rows as JSON")
@click.option("--parts-beside", is_flag=True,
              help="time the parts right before and right after each row, and set each row against those beside it "
                   "(the machine's speed moves within a bench), instead of once before all rows and once after")
@click.argument("extra", nargs=-1, type=click.UNPROCESSED)
def bench_pipeline(modes: str, rtts: str, rate: str, iterations: int, out_dir: str | None, table_only: bool,
                   json_path: str | None, parts_beside: bool, extra: tuple[str, ...]) -> None:
    """The paper configuration under each schedule, side by side, at each round trip.

    Columns: s/iteration, steps/s, each stage's and the env workers' busy fraction (CPU s / wall s), the CPU
    seconds an iteration costs in all, link wait, MB per iteration, staleness. EXTRA arguments (after --) go to
    every run, e.g. -- --threads 1; a row's own arguments (in --modes) to that row.
    Before and after the rows, the parts of an iteration alone (`splitrl bench floor`, the paper's eager kernels
    on one thread; the mean of the two): 'x floor' is each row over their floor. Rows that compute their parts
    otherwise (--channels-last, --fused-adam, more than one intra-op thread, another env layout: --num-envs,
    --num-steps, --rollout-groups, whose acting forwards take each group apart) have those parts measured too, as
    they compute them, and their 'CPU over parts' and 'x parts' are over those. With --parts-beside, the parts
    each row needs are timed right before and right after it, and the row is set against those two.
    """
    from ..bench.pipeline_bench import MODES, PartsBeside, pipeline_rows, pipeline_table, row_arguments, row_label, \
        run_pipeline_bench

    entries = [m.strip() for m in modes.split(",") if m.strip()]
    labels = run_cli(lambda: [row_label(entry) for entry in entries])  # every row checked before any runs

    from ..bench.floor_bench import bracketed, floor_table, measure_floor

    eager = (False, False, 1, *_parts_key(())[3:])  # the floor: the paper's iteration, its kernels on one thread
    keys = {label: _parts_key((*row_arguments(label), *extra)) for label in labels}  # (and EXTRA checked)
    wanted = list(dict.fromkeys([eager, *keys.values()]))

    def timed(key: tuple) -> dict:
        fused, channels_last, threads, envs, steps, groups = key
        settings = TrainSettings()
        settings = dataclasses.replace(
            settings, env=dataclasses.replace(settings.env, num_envs=envs),
            ppo=dataclasses.replace(settings.ppo, fused_adam=fused, num_steps=steps),
            schedule=dataclasses.replace(settings.schedule, rollout_groups=str(groups)))
        return run_cli(lambda: measure_floor(settings, channels_last=channels_last, threads=threads))

    beside = PartsBeside(timed, lambda mode: [eager, keys[mode]]) if parts_beside and not table_only else None

    def go() -> list:
        rtt_list = [float(x) for x in rtts.split(",") if x.strip()]
        if table_only:
            if not out_dir:
                raise SettingsError("--table-only reads the runs in --out: give --out")
            return pipeline_rows(out_dir, [*MODES, *labels], sorted({0.0, 20.0, *rtt_list}))
        return run_pipeline_bench(labels, rtt_list, iterations=iterations, rate=rate, extra_args=extra,
                                  out_dir=out_dir, echo=lambda line: click.echo(line, err=True),
                                  around=None if beside is None else beside.around)

    def measured() -> dict[tuple, dict]:
        """The parts alone: the floor's, and each of the rows' own where they compute them otherwise."""
        return {key: timed(key) for key in wanted}

    # The parts alone, in the same run as the rows they are the floor of: before and after them (or, with
    # --parts-beside, beside each row), so that a machine whose speed moves during the runs moves the floor with it.
    before = None if table_only or beside is not None else measured()
    rows = run_cli(go)
    floor = None
    if beside is not None:
        click.echo(_beside_table(beside, eager) + "\n")
        row_parts = [beside.rows[(row["rtt_ms"], row["mode"])] for row in rows]
    elif before is not None:
        after = measured()
        parts = {key: bracketed(before[key], after[key]) for key in wanted}
        click.echo(floor_table(parts[eager]) + "\n")
        for key in wanted[1:]:  # the rows' own parts too: their CPU over the parts is over these
            click.echo(f"The parts {_parts_name(key, eager)}, as the rows with them compute them:\n\n"
                       + floor_table(parts[key]) + "\n")
        row_parts = [parts] * len(rows)
    if beside is not None or before is not None:  # each row: its floor, and its own parts where they differ
        rows = [dict(row, floor=by_kind[eager], **({"parts": by_kind[keys[row["mode"]]]} if keys[row["mode"]] != eager
                                                   else {})) for row, by_kind in zip(rows, row_parts)]
        floor = rows[0]["floor"] if rows else None
    click.echo(pipeline_table(rows, floor))
    _write_json(json_path, rows)


PartsKey = tuple[bool, bool, int, int, int, int]
"""How a row computes the parts of its iteration: (``--fused-adam``, ``--channels-last``, torch's intra-op threads a
stage, the envs, their steps an iteration, the env groups each step acts on apart)."""


def _beside_table(beside: Any, eager: PartsKey) -> str:
    """Markdown: every timing of the parts beside the rows (a `splitrl.bench.pipeline_bench.PartsBeside`'s), in
    order."""
    lines = ["The parts timed beside each row, in order (CPU s an iteration, all parts):", "",
             "| when | parts | CPU s |", "|---|---|---:|"]
    for where, kind, total in beside.timings:
        name = "the floor (eager, one thread)" if kind == eager else _parts_name(kind, eager)
        lines.append(f"| {where} | {name} | {total:.2f} |")
    return "\n".join(lines)


def _parts_key(args: tuple[str, ...]) -> PartsKey:
    """How the training arguments ``args`` compute the parts of an iteration (`PartsKey`): the threads are
    ``--threads`` or torch's default; the groups the floor's (`splitrl.bench.floor_bench.acting_groups`)."""
    import torch

    from ..bench.floor_bench import acting_groups

    @click.command()
    @training_options
    def parse(settings: TrainSettings, options: RunOptions) -> PartsKey:
        return (settings.ppo.fused_adam, options.channels_last, options.threads or torch.get_num_threads(),
                settings.env.num_envs, settings.ppo.num_steps, acting_groups(settings))

    return parse.main(list(args), standalone_mode=False)


def _parts_name(key: PartsKey, paper: PartsKey) -> str:
    """What sets the parts ``key`` apart (``paper``: the paper's iteration's key, whose env layout goes unnamed)."""
    fused, channels_last, threads, envs, steps, groups = key
    flags = " ".join(name for name, on in (("--fused-adam", fused), ("--channels-last", channels_last)) if on)
    pieces = [flags] if flags else []
    if threads > 1:
        pieces.append(f"{threads} intra-op threads")
    if (envs, steps, groups) != paper[3:]:
        pieces.append(f"{envs} envs x {steps} steps" + (f" acting in {groups} groups" if groups > 1 else ""))
    return "with " + (f"{', '.join(pieces[:-1])} and {pieces[-1]}" if len(pieces) > 1 else pieces[0])


@bench.command("vector")
@click.option("--envs", default="1,4,8", show_default=True, help="comma-separated env counts")
@click.option("--samples", default=512, show_default=True, help="env steps timed per configuration (all envs)")
@click.option("--env-id", default="CarRacing-v3", show_default=True)
@click.option("--threads", default=2, show_default=True, help="torch intra-op threads of the one process")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="also write the rows as JSON")
def bench_vector(envs: str, samples: int, env_id: str, threads: int, json_path: str | None) -> None:
    """Rollout samples/s of the paper network with --vector sync and --vector async, per env count."""
    from ..bench.vector_bench import run_vector_bench, vector_table

    def go() -> list:
        counts = _counts("--envs", envs)
        return run_vector_bench(counts, samples, env_id, threads, progress=lambda row: click.echo(
            f"{row['num_envs']} envs, {row['vector']}: {row['samples_per_s']:.1f} samples/s", err=True))

    rows = run_cli(go)
    click.echo(vector_table(rows))
    _write_json(json_path, rows)


def _counts(option: str, text: str) -> list[int]:
    """``1,2,4`` as [1, 2, 4]; `SettingsError` unless they are counts >= 1."""
    try:
        counts = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise SettingsError(f"{option}: comma-separated counts >= 1, got {text!r}")
    return counts


@bench.command("fleet")
@click.option("--edges", "edge_counts", default="1,2,4", show_default=True, help="comma-separated edge counts")
@click.option("--iterations", default=3, show_default=True, help="iterations per run (the first is left out)")
@click.option("--num-steps", default=1024, show_default=True, help="each edge's env steps an iteration")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), help="keep the run directories here")
@click.option("--table-only", is_flag=True, help="only print the table of the runs already in --out")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="also write the rows as JSON")
@click.argument("extra", nargs=-1, type=click.UNPROCESSED)
def bench_fleet(edge_counts: str, iterations: int, num_steps: int, out_dir: str | None, table_only: bool,
                json_path: str | None, extra: tuple[str, ...]) -> None:
    """Real edges on loopback, one stage1: samples/s at the learner, each process's busy fraction, bytes per edge.

    Each edge steps one env; EXTRA arguments (after --) go to every run."""
    from ..bench.fleet_bench import fleet_rows, fleet_table, run_fleet_bench

    def go() -> list:
        counts = _counts("--edges", edge_counts)
        if table_only:
            if not out_dir:
                raise SettingsError("--table-only reads the runs in --out: give --out")
            return fleet_rows(out_dir, counts)
        return run_fleet_bench(counts, iterations, num_steps, extra, out_dir,
                               echo=lambda line: click.echo(line, err=True))

    rows = run_cli(go)
    click.echo(fleet_table(rows))
    _write_json(json_path, rows)


@bench.command("capacity")
@click.option("--edges", "edge_counts", default="1,8,32,128", show_default=True, help="comma-separated edge counts")
@click.option("--seconds", default=10.0, show_default=True, help="measured seconds per edge count (after --warmup)")
@click.option("--warmup", default=3.0, show_default=True, help="seconds of requests not counted first")
@click.option("--codec-rollout", "codec", default="fp32", show_default=True, help="the step messages' features codec")
@click.option("--bottleneck", default=0, show_default=True, help="features of the network with --bottleneck K")
@click.option("--act-wait", "act_waits", default="all", show_default=True,
              help="comma-separated stage1 --act-wait values ('all': lock step; milliseconds: as the edges come)")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), help="keep stage1's logs and capacity.json here")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="also write the rows as JSON")
def bench_capacity(edge_counts: str, seconds: float, warmup: float, codec: str, bottleneck: int, act_waits: str,
                   out_dir: str | None, json_path: str | None) -> None:
    """One stage1 (on one core) against fake edges replaying captured step messages (on the other): acting
    requests answered per second and their round trip, p50 and p99, per edge count."""
    from ..bench.capacity_bench import capacity_table, run_capacity_bench

    def go() -> list:
        counts = _counts("--edges", edge_counts)
        return run_capacity_bench(counts, seconds, warmup, codec, bottleneck, out_dir,
                                  echo=lambda line: click.echo(line, err=True),
                                  act_waits=[w.strip() for w in act_waits.split(",") if w.strip()])

    rows = run_cli(go)
    click.echo(capacity_table(rows))
    _write_json(json_path, rows)


@bench.command("plan")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="also write the rows as JSON")
def bench_plan(json_path: str | None) -> None:
    """`splitrl plan` against the measured runs in docs/results/ (run from the repository's root, on an idle
    machine: it times the networks): each bench's rows predicted from its synchronous row at 0 ms."""
    from ..bench.plan_bench import check_plan, plan_table

    rows = run_cli(lambda: check_plan(echo=lambda line: click.echo(line, err=True)))
    click.echo(plan_table(rows))
    _write_json(json_path, rows)


@bench.command("fuzz")
@click.option("--cases", default=100_000, show_default=True, help="mutated messages fed to the decoder")
@click.option("--live", default=300, show_default=True,
              help="sessions replayed to a live stage1 loop, one mutated message in each")
@click.option("--seed", default=0, show_default=True, help="a case is reproducible from (seed, its index)")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="also write the counts as JSON")
def bench_fuzz(cases: int, live: int, seed: int, json_path: str | None) -> None:
    """Mutate frames captured from a real session (byte-level, frame-level, structure-aware) and feed them to
    the decoder and to a live stage1. Exit 1 if any case ended other than in a message, a ProtocolError, a
    clean stop or a timeout."""
    from ..bench.fuzz import capture_session, fuzz_decoder, fuzz_stage1

    def go() -> dict:
        captured = capture_session()
        corpus = [m for sender in captured.values() for m in sender]
        click.echo(f"captured {len(corpus)} messages from a two-iteration session", err=True)
        decoder = fuzz_decoder(corpus, cases, seed)
        click.echo(f"decoder: {decoder.as_dict()}", err=True)
        stage1 = fuzz_stage1(captured, live, seed) if live else None
        if stage1 is not None:
            click.echo(f"live stage1: {stage1.as_dict()}", err=True)
        return {"seed": seed, "corpus_messages": len(corpus), "decoder": decoder.as_dict(),
                "live_stage1": stage1.as_dict() if stage1 else None}

    result = run_cli(go)
    _write_json(json_path, result)
    findings = result["decoder"]["findings"] + (result["live_stage1"] or {}).get("findings", [])
    for line in findings:
        click.echo(f"finding: {line}", err=True)
    sys.exit(1 if findings else 0)


@bench.command("reliability")
@click.option("--heartbeat", default=2.0, show_default=True, help="--heartbeat of the split runs whose peer is killed")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="also write the rows as JSON")
def bench_reliability(heartbeat: float, json_path: str | None) -> None:
    """What a hostile peer can make a stage hold (RSS and peak of a victim process), and how soon a dead or
    silent peer is noticed (a split run whose stage0 or stage1 gets SIGSTOP or SIGKILL). A few minutes."""
    from ..bench.reliability import run_reliability

    rows = run_cli(lambda: run_reliability(heartbeat, echo=lambda line: click.echo(line, err=True)))
    _write_json(json_path, rows)


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
        from ..bench.swap_bench import format_swap_table, run_swap_bench, swap_chart, swap_targets
        from ..bench.transport_bench import TRANSPORTS, format_table, run_transport_bench

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

    run_cli(go)


@bench.command("lab")
@click.option("--rates", default="5mbit,20mbit,100mbit", show_default=True,
              help="comma-separated link rates in tc units; one lab per rate")
@click.option("--quick", is_flag=True,
              help="smoke test: one rate (20mbit unless --rates is given), a 2 MiB throughput payload and a tiny "
                   "training (--total-steps 64 --num-steps 32 --epochs 2 --minibatches 2 --max-episode-steps 20)")
@click.option("--measure", "measure_mib", type=click.FloatRange(min=1), default=None,
              help="MiB for each throughput measurement [default: about 10 s of the rate, 4 to 64 MiB]")
@click.option("--out", "out_dir", type=click.Path(file_okay=False),
              help="keep the run directories (and each stage's log) here [default: a new temporary directory]")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="also write the rows as JSON")
@click.option("--budget", is_flag=True,
              help="instead of fp32 against the best codecs: rich codecs as given against the same with --link-budget "
                   "at the lab's rate (2, 5 and 20 Mbit/s unless --rates; three iterations a run)")
@click.argument("extra", nargs=-1, type=click.UNPROCESSED)
@click.pass_context
def bench_lab(ctx: click.Context, rates: str, quick: bool, measure_mib: float | None, out_dir: str | None,
              json_path: str | None, budget: bool, extra: tuple[str, ...]) -> None:
    """Per link rate, in the lab: achieved throughput, and a short PPO run's s/iteration with fp32 and the best codecs.

    The short run is 2 iterations of 512 CarRacing steps, 2 epochs of 4 minibatches,
    --threads 1. EXTRA arguments (after --) go to both stages of every run, e.g.
    -- --timeout 120. Needs root. Roughly 10-20 minutes on an idle 2-core machine: fp32 moves
    about 42 MB per iteration, over a minute of link time per iteration at 5 Mbit/s.
    """
    from ..bench.lab_bench import (BUDGET_PPO_ARGS, BUDGET_RATES, PPO_ARGS, QUICK_MEASURE_BYTES, QUICK_PPO_ARGS,
                                   QUICK_RATES, budget_configs, lab_bench_table, run_lab_bench)
    from ..netem.tc import ShapingError, parse_rate

    rate_given = ctx.get_parameter_source("rates") is not click.core.ParameterSource.DEFAULT
    rate_list = [r.strip() for r in rates.split(",") if r.strip()] if (rate_given or not quick) else list(QUICK_RATES)
    if budget and not rate_given:
        rate_list = list(BUDGET_RATES)
    if not rate_list:
        raise click.BadParameter("no rate given", param_hint="--rates")
    for rate in rate_list:
        try:
            parse_rate(rate)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--rates") from None
    if measure_mib is not None:
        measure_bytes: int | None = int(measure_mib * _MIB)
    else:
        measure_bytes = QUICK_MEASURE_BYTES if quick else None
    try:
        ppo_args = QUICK_PPO_ARGS if quick else BUDGET_PPO_ARGS if budget else PPO_ARGS
        rows = run_lab_bench(rate_list, ppo_args, measure_bytes=measure_bytes, configs=budget_configs if budget else None,
                             extra_args=extra, out_dir=out_dir, echo=lambda line: click.echo(line, err=True))
    except (ShapingError, RuntimeError, ValueError) as exc:
        fail(exc)
    except KeyboardInterrupt:
        click.echo("interrupted; the lab was removed", err=True)
        sys.exit(130)
    click.echo(lab_bench_table(rows))
    _write_json(json_path, rows)


@bench.command("floor")
@click.option("--cores", type=int, default=0, show_default=True, help="cores the floor spreads the parts over "
              "(0: this machine's)")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="also write the figures as JSON")
@training_options(link=False)
def bench_floor(settings: TrainSettings, options: RunOptions, cores: int, json_path: str | None) -> None:
    """One iteration's parts, each alone on one thread (the run's env pipeline and network, no link, codec or
    schedule): the envs' steps, the acting forwards, the training's forward, backward and steps on each side;
    and the floor they imply: their sum over the cores, and the larger side on an edge and a server of their
    own. Takes the training options (the paper's by default); with --threads N, the parts as a run on N intra-op
    threads computes them (their CPU above one thread's is what the threads cost)."""
    from ..bench.floor_bench import floor_table, measure_floor

    def go() -> dict:
        settings.validate(options)
        return measure_floor(settings, cores or None, options.channels_last, options.threads or 1)

    floor = run_cli(go)
    click.echo(floor_table(floor))
    _write_json(json_path, floor)
