"""Transport-swap benchmark: one short PPO configuration, end to end, over each link.

Every link runs the very same `splitrl run` (stage1 and stage0 as two processes,
same seed, same schedule, same frames); only ``--transport`` and ``--endpoint``
change:

- ``zmq-tcp``: ZeroMQ PUSH/PULL over loopback TCP (the default link);
- ``zmq-ipc``: ZeroMQ over a Unix socket;
- ``tcp``: the second transport, plain TCP sockets carrying the same frames;
- ``torch-rpc``: PyTorch RPC (TensorPipe over TCP), the paper's link, one
  ``rpc_sync`` per message.

Figures per link come from the runs' own metrics (iteration wall time, stage0's
received messages, both stages' process CPU seconds, the byte meters). When this
process may create network namespaces (root, ``ip``), each run gets a private
one whose loopback is used by nothing else, and the kernel's byte counter of that
loopback is read before and after the whole run: our frames plus what the
transport adds around them (TCP/IP headers as the loopback device counts them,
acks, RPC's pickled calls and rendezvous), start-up and shutdown included.
Unix-socket traffic never reaches it.
"""

from __future__ import annotations

import logging
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Sequence

from ..launch import free_port_pair, supervise
from ..netem.netns import LoopbackNamespace, netns_available
from ..runs import iteration_messages, measured_records, read_metrics
from ..summary import summarise_run

__all__ = ["LINKS", "PPO_ARGS", "QUICK_PPO_ARGS", "run_swap_bench", "format_swap_table", "swap_chart", "swap_targets"]

log = logging.getLogger(__name__)

LINKS: dict[str, tuple[str, str]] = {
    "zmq-tcp": ("zmq", "tcp"),
    "zmq-ipc": ("zmq", "ipc"),
    "tcp": ("tcp", "tcp"),
    "torch-rpc": ("torch-rpc", "tcp"),
}
"""Link name -> (``--transport``, endpoint kind)."""

PPO_ARGS = ("--num-steps", "512", "--epochs", "10", "--minibatches", "4", "--threads", "1")
"""Short, with the paper's messages: a 16 KiB feature per step, minibatches of 128 (2 MiB each way)."""
QUICK_PPO_ARGS = ("--num-steps", "32", "--epochs", "2", "--minibatches", "2", "--max-episode-steps", "20", "--threads", "1")


def _tcp_endpoint() -> str:
    return f"tcp://127.0.0.1:{free_port_pair()}"  # a tcp port and the next one: ZeroMQ binds both


def _run_logged(command: Sequence[str], log_path: Path, timeout: float) -> int:
    """Run ``command`` in its own process group, output to ``log_path``; on timeout stop the whole group."""
    with open(log_path, "w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    # `splitrl run` stops both stages on SIGINT; whatever is left after that is killed.
    if not supervise([proc], grace=20.0, timeout=timeout, first_signal=signal.SIGINT, group=True):
        raise subprocess.TimeoutExpired(command, timeout)
    return proc.returncode


def _summarise(link: str, run_dir: Path, kernel_bytes: int | None) -> dict[str, Any]:
    transport, kind = LINKS[link]
    summary = summarise_run(run_dir)  # means over measured_records: the first iteration pays for start-up
    measured = measured_records(read_metrics(run_dir))

    def mean(f: Any) -> float:
        return sum(f(r) for r in measured) / len(measured)

    def messages(r: dict[str, Any]) -> int:
        return iteration_messages(r, "recv")

    return {
        "link": link,
        "transport": transport,
        "endpoint": kind,
        "iterations": summary["iterations"],
        "measured_iterations": summary["iterations_used"],
        "steps_per_s": summary["steps_per_second"],
        "seconds_per_iteration": summary["seconds_per_iteration"],
        # Every message stage0 receives answers one it sent: one round trip each, per second of wall time
        # (the same count for every link, so this follows steps/s; the next figure isolates the link).
        "round_trips_per_s": mean(lambda r: messages(r) / r["time/iteration"]),
        "link_wait_per_iteration": summary["link_wait_per_iteration"],
        # stage0's time in send/recv beyond stage1's compute, per round trip: what the link itself costs.
        "link_us_per_round_trip": mean(lambda r: 1e6 * r.get("time/link_wait", 0.0) / max(1, messages(r))),
        "cpu_s_per_iteration": mean(lambda r: r.get("cpu/stage0", 0.0) + r.get("cpu/stage1", 0.0)),
        "app_bytes_per_iteration": summary["bytes_per_iteration"],
        # Whole run, start-up and shutdown included: the kernel counter cannot be split by iteration.
        "app_bytes_total": summary["total_bytes"],
        "kernel_bytes_total": kernel_bytes,
        "run_dir": str(run_dir),
    }


def run_swap_bench(
    links: Sequence[str] = tuple(LINKS),
    iterations: int = 3,
    repeats: int = 1,
    quick: bool = False,
    extra_args: Sequence[str] = (),
    out_dir: str | None = None,
    netns: bool | None = None,
    timeout: float = 3600.0,
) -> list[dict[str, Any]]:
    """One row per (link, repeat). Links run one at a time, in reversed order on odd repeats.

    ``netns``: run each in a private network namespace and count its loopback's bytes
    (default: when this process can).
    """
    unknown = [name for name in links if name not in LINKS]
    if unknown or not links:
        raise ValueError(f"unknown link(s) {unknown or links}; choose from {', '.join(LINKS)}")
    if iterations < 1 or repeats < 1:
        raise ValueError(f"iterations and repeats must be >= 1, got {iterations} and {repeats}")
    use_netns = netns_available() if netns is None else netns
    ppo_args = QUICK_PPO_ARGS if quick else PPO_ARGS
    num_steps = int(ppo_args[ppo_args.index("--num-steps") + 1])
    base = Path(out_dir or tempfile.mkdtemp(prefix="splitrl-swap-"))
    base.mkdir(parents=True, exist_ok=True)
    rows = []
    for repeat in range(repeats):
        for link in (links if repeat % 2 == 0 else list(reversed(links))):
            transport, kind = LINKS[link]
            run_dir = base / f"{link}-{repeat}"
            log_path = base / f"{link}-{repeat}.log"
            tmp = Path(tempfile.mkdtemp(prefix="splitrl-swap-ipc-")) if kind == "ipc" else None
            try:
                endpoint = f"ipc://{tmp}/link" if tmp else _tcp_endpoint()
                command = [sys.executable, "-m", "splitrl", "run", "--transport", transport, "--endpoint", endpoint,
                           "--run-dir", str(run_dir), "--total-steps", str(iterations * num_steps), *ppo_args, *extra_args]
                kernel = None
                if use_netns:
                    with LoopbackNamespace() as ns:
                        before = ns.lo_bytes()
                        code = _run_logged(ns.wrap(command), log_path, timeout)
                        kernel = ns.lo_bytes() - before if kind == "tcp" else None
                else:
                    code = _run_logged(command, log_path, timeout)
            finally:
                if tmp is not None:
                    shutil.rmtree(tmp, ignore_errors=True)
            if code != 0:
                raise RuntimeError(f"{link}: `{' '.join(command)}` exited {code}; its output: {log_path}:\n"
                                   f"{log_path.read_text()[-3000:]}")
            row = _summarise(link, run_dir, kernel)
            row["repeat"] = repeat
            rows.append(row)
    return rows


def _mean_by_link(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Repeats averaged (every numeric figure), in first-seen link order."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault(row["link"], []).append(row)
    out = []
    for group in groups.values():
        mean = dict(group[0], repeats=len(group))
        for key, value in group[0].items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "repeat":
                mean[key] = sum(r[key] for r in group) / len(group)
        out.append(mean)
    return out


def format_swap_table(rows: Sequence[dict[str, Any]], reference: str = "torch-rpc") -> str:
    """Markdown, one line per link (repeats averaged); 'x torch-rpc' is steps/s over the reference's."""
    means = _mean_by_link(rows)
    ref = next((r for r in means if r["link"] == reference), None)
    lines = [
        f"| link | steps/s | x {reference} | s/iteration | round trips/s (wall) | link wait us/round trip "
        "| CPU s/iteration (both stages) | frame MB/iteration | loopback bytes / frame bytes (whole run) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in means:
        ratio = f"{r['steps_per_s'] / ref['steps_per_s']:.2f}" if ref else ""
        kernel = "n/a" if r["kernel_bytes_total"] is None else f"{r['kernel_bytes_total'] / r['app_bytes_total']:.3f}"
        lines.append(
            f"| {r['link']} | {r['steps_per_s']:.1f} | {ratio} | {r['seconds_per_iteration']:.1f} "
            f"| {r['round_trips_per_s']:.0f} | {r['link_us_per_round_trip']:.0f} | {r['cpu_s_per_iteration']:.1f} "
            f"| {r['app_bytes_per_iteration'] / 1e6:.2f} | {kernel} |"
        )
    return "\n".join(lines)


def _bar_value(value: float) -> str:
    """Bar labels: whole numbers from 100 up (3,445 rather than 3.45e+03), three digits below."""
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"


def swap_chart(rows: Sequence[dict[str, Any]], path: str | Path) -> Path:
    """A PNG of four bar panels: steps/s, round trips/s, link wait per round trip, CPU s per iteration."""
    from ..report import pyplot

    plt = pyplot()
    means = _mean_by_link(rows)
    names = [r["link"] for r in means]
    panels = [("steps_per_s", "env steps / s"), ("round_trips_per_s", "round trips / s (wall)"),
              ("link_us_per_round_trip", "link wait us / round trip"),
              ("cpu_s_per_iteration", "CPU s / iteration (both stages)")]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.6))
    for ax, (key, title) in zip(axes, panels):
        values = [r[key] for r in means]
        bars = ax.bar(names, values, color=["#4c72b0", "#55a868", "#8172b2", "#c44e52"][: len(names)])
        ax.bar_label(bars, fmt=_bar_value, fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.tick_params(axis="x", labelrotation=30, labelsize=8)
    fig.suptitle("the same short PPO run over each link", fontsize=11)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


ROLLOUT_MESSAGE_BYTES = 16384
"""One env step's features: 4096 float32 values."""


def swap_targets(micro: Sequence[dict[str, Any]]) -> list[str]:
    """The issue's two targets, checked on `run_transport_bench` rows (tcp endpoint)."""

    def cell(transport: str, size: int) -> dict[str, Any] | None:
        return next((r for r in micro if r["transport"] == transport and r["endpoint"] == "tcp" and r["size"] == size), None)

    lines = []
    zmq, rpc = cell("zmq", ROLLOUT_MESSAGE_BYTES), cell("torch-rpc", ROLLOUT_MESSAGE_BYTES)
    if zmq and rpc:
        ratio = rpc["rtt_us_median"] / zmq["rtt_us_median"]
        lines.append(f"round trips of the 16 KiB rollout message, ZeroMQ tcp vs torch RPC: {ratio:.1f}x the rate "
                     f"({zmq['rtt_us_median']:.0f} us vs {rpc['rtt_us_median']:.0f} us median; target >= 10x: "
                     f"{'met' if ratio >= 10 else 'missed'})")
    for size in sorted({r["size"] for r in micro}):
        framed, raw = cell("zmq", size), cell("raw-zmq", size)
        if framed and raw:
            tput = framed["throughput_MBps"] / raw["throughput_MBps"]
            rtt = framed["rtt_us_median"] / raw["rtt_us_median"]
            met = tput >= 0.95 and rtt <= 1.05
            lines.append(f"framed ZeroMQ vs raw pyzmq at {size} B over tcp: throughput {tput:.2f}x, round trip "
                         f"{rtt:.2f}x (target within 5 %: {'met' if met else 'missed'})")
    return lines
