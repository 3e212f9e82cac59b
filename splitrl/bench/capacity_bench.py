"""``splitrl bench capacity``: how many acting requests one stage1 serves.

Fake edges replay step traffic captured from a real stage0 against one real ``splitrl stage1
--edges N``. The capture: an `Edge` with the paper's CarRacing env and encoder steps with random
actions and keeps its ``step`` messages (features through the rollout codec, and from the second
step on the last outcome). The replay: N threads of one process, each an edge's link (handshake
included), send those messages in turn (step ``t`` the capture's ``t``, or one of its later ones
again) and wait for each ``action``: no env steps, no encoder runs. So what is measured is stage1's
acting path (receive, decode, one heads forward for the whole fleet, sample, encode, send) and the
link. stage1 is pinned to core 0 and the replaying process to core 1 (where the machine has two).

Per edge count: acting requests answered per second over the measured window (after a warm-up),
the round trip of each request from its send to its action (p50, p99), and each side's busy
fraction (CPU seconds over the window's wall seconds, 1.0: one core). The fleet answers in lock
step, so every edge waits for the slowest of a step's requests: the round trip is the time of one
step of the whole fleet.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from ..launch import free_port
from ..runner.links import open_link
from ..schedule.common import expect
from ..settings import CodecSettings, EnvSettings, PPOSettings, RunOptions, ScheduleSettings, TrainSettings
from ..stages import STAGE0, STAGE1, Edge
from ..transport import Message, PeerAbort, PeerGone
from ..transport.endpoints import slot_endpoint
from ..transport.handshake import handshake

__all__ = ["capture_steps", "run_capacity_bench", "capacity_table"]

CAPTURED_STEPS = 32
"""Step messages captured once and replayed by every fake edge."""


def bench_settings(edges: int, num_steps: int, codec: str = "fp32", bottleneck: int = 0) -> TrainSettings:
    """The fleet both sides agree on: ``edges`` edges of one env, one iteration of ``num_steps`` steps
    (never finished: the bench stops first), the rollout's features through ``codec``. CarRacing's frames: the
    settings as its stages resolve them, which the replaying edges say in their hellos."""
    return TrainSettings(total_steps=num_steps * edges, bottleneck=bottleneck, env=EnvSettings(num_envs=1),
                         ppo=PPOSettings(num_steps=num_steps, epochs=1, minibatches=1),
                         codecs=CodecSettings(codec_rollout=codec),
                         schedule=ScheduleSettings(edges=edges)).for_observation("image")


def _settings_args(settings: TrainSettings) -> list[str]:
    return ["--edges", str(settings.schedule.edges), "--num-envs", "1", "--num-steps", str(settings.ppo.num_steps),
            "--epochs", "1", "--minibatches", "1", "--total-steps", str(settings.total_steps),
            "--codec-rollout", settings.codecs.codec_rollout, "--bottleneck", str(settings.bottleneck)]


def capture_steps(settings: TrainSettings, steps: int = CAPTURED_STEPS) -> list[tuple[dict[str, torch.Tensor],
                                                                                      dict[str, Any]]]:
    """``steps`` step messages (tensors, header) of edge 0 of ``settings``' fleet, random actions between."""
    from ..envs import inspect_env

    spec = inspect_env(settings.env)
    edge = Edge(settings, spec, vector="sync")
    rng = np.random.default_rng(settings.seed)
    out = []
    edge.open_envs()
    try:
        edge.begin_rollout(1)
        for t in range(steps):
            tensors, header = edge.observe(t)
            out.append(({k: v.clone() for k, v in tensors.items()}, dict(header)))
            action = torch.as_tensor(rng.uniform(-1, 1, (1, spec.action_dim)), dtype=torch.float32)
            edge.step(Message("action", {"t": t}, {"action": action}))
    finally:
        edge.close()
    return out


def _replay_edge(g: int, connect: str, settings: TrainSettings, payloads: list, everyone: threading.Barrier,
                 window: dict[str, float], out: dict[int, Any]) -> None:
    options = RunOptions(heartbeat=0, timeout=60.0)
    link = open_link(options, slot_endpoint(connect, g), bind=False, peer=f"stage1 (edge {g})")
    rtts: list[float] = []
    try:
        handshake(link, STAGE0, STAGE1, settings.shared(), timeout=300.0, extra={"edge": g})
        everyone.wait(timeout=300.0)  # every edge in before anyone steps: one window for all
        warm, stop = window["warm"], window["stop"]
        t = 0
        while t < settings.ppo.num_steps and time.monotonic() < stop:
            tensors, header = payloads[t if t < len(payloads) else 1 + (t - 1) % (len(payloads) - 1)]
            sent = time.perf_counter()
            link.send("step", tensors, {**header, "t": t})
            expect(link, "action", t=t)
            if time.monotonic() >= warm:
                rtts.append(time.perf_counter() - sent)
            t += 1
        out[g] = rtts
    except (PeerAbort, PeerGone) as exc:
        # Each edge stops at the window's end on its own clock; in lock step stage1 then waits for it, so an
        # edge that was still waiting for an action when another stopped is told so. After the window that is the end.
        out[g] = rtts if time.monotonic() >= window["stop"] else exc
    except BaseException as exc:  # reported by the caller: one edge's failure fails the count
        out[g] = exc
    finally:
        link.close()


def replay(settings: TrainSettings, connect: str, warmup: float, seconds: float) -> dict[str, Any]:
    """The fake edges' process: capture, then one thread an edge replaying; the figures of the window."""
    edges = settings.schedule.edges
    payloads = capture_steps(settings)
    window: dict[str, float] = {}
    cpu_at_warm: list[float] = []

    def opened() -> None:  # the barrier's action: all edges are in
        window["warm"] = time.monotonic() + warmup
        window["stop"] = window["warm"] + seconds

    everyone = threading.Barrier(edges + 1, action=opened)
    out: dict[int, Any] = {}
    threads = [threading.Thread(target=_replay_edge, args=(g, connect, settings, payloads, everyone, window, out),
                                daemon=True) for g in range(edges)]
    for thread in threads:
        thread.start()
    everyone.wait(timeout=600.0)
    time.sleep(max(0.0, window["warm"] - time.monotonic()))
    cpu_at_warm.append(time.process_time())
    for thread in threads:
        thread.join(timeout=warmup + seconds + 120)
    cpu = time.process_time() - cpu_at_warm[0]
    warm, stop = window["warm"], window["stop"]
    failed = {g: repr(v) for g, v in out.items() if isinstance(v, BaseException)}
    missing = [g for g in range(edges) if g not in out]
    if failed or missing:
        raise RuntimeError(f"fake edges failed: {failed or ''} {f'never finished: {missing}' if missing else ''}")
    rtts = np.concatenate([np.asarray(v) for v in out.values()]) * 1000.0
    window = seconds  # the threads stop at ``stop``; requests after ``warm`` are counted
    return {"edges": edges, "requests": int(rtts.size), "requests_per_second": rtts.size / window,
            "rtt_p50_ms": float(np.percentile(rtts, 50)), "rtt_p99_ms": float(np.percentile(rtts, 99)),
            "busy_edges": cpu / window, "window": [warm, stop], "payload_bytes": sum(t.numel() * t.element_size()
                                                             for t in payloads[1][0].values())}


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _pin(core: int) -> Callable[[], None] | None:
    if not hasattr(os, "sched_setaffinity") or (os.cpu_count() or 1) < 2:
        return None
    return lambda: os.sched_setaffinity(0, {core})


def run_capacity_bench(edge_counts: Sequence[int] = (1, 8, 32, 128), seconds: float = 10.0, warmup: float = 3.0,
                       codec: str = "fp32", bottleneck: int = 0, out_dir: str | None = None,
                       echo: Callable[[str], None] = print, act_waits: Sequence[str] = ("all",)
                       ) -> list[dict[str, Any]]:
    """One row per ``--act-wait`` and edge count: a fresh stage1 on core 0, the replaying edges on core 1."""
    rows = []
    work = Path(out_dir) if out_dir else Path(tempfile.mkdtemp(prefix="splitrl-capacity-"))
    work.mkdir(parents=True, exist_ok=True)
    for act_wait, n in ((w, n) for w in act_waits for n in edge_counts):
        name = f"{n}-edges" if act_wait == "all" else f"{n}-edges-wait-{act_wait}ms"
        num_steps = max(2000, int(40_000 * (seconds + warmup) / n))  # more than the window can use
        port = free_port(count=2 * n)
        connect = f"tcp://127.0.0.1:{port}"
        settings_args = _settings_args(bench_settings(n, num_steps, codec, bottleneck))
        log = open(work / f"{name}-stage1.log", "w")
        stage1 = subprocess.Popen([sys.executable, "-m", "splitrl", "stage1", "--bind", connect, "--threads", "1",
                                   "--run-dir", str(work / name), "--overwrite", "--checkpoint-every", "0",
                                   "--start-timeout", "300", "--act-wait", act_wait, *settings_args],
                                  stdout=log, stderr=subprocess.STDOUT, preexec_fn=_pin(0))
        samples: list[tuple[float, float]] = []  # (monotonic time, stage1's CPU seconds)
        done = threading.Event()

        def sample() -> None:
            while not done.wait(0.25):
                try:
                    samples.append((time.monotonic(), _cpu_seconds(stage1.pid)))
                except (OSError, IndexError, ValueError):
                    return

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        try:
            fake = subprocess.run([sys.executable, "-m", "splitrl.bench.capacity_bench", "--connect", connect,
                                   "--edges", str(n), "--num-steps", str(num_steps), "--warmup", str(warmup),
                                   "--seconds", str(seconds), "--codec-rollout", codec, "--bottleneck", str(bottleneck)],
                                  capture_output=True, text=True, timeout=warmup + seconds + 900, preexec_fn=_pin(1))
            done.set()
            sampler.join()
            if fake.returncode != 0:
                raise RuntimeError(f"{n} edges: the replaying process failed:\n{fake.stderr[-3000:]}")
            row = json.loads(fake.stdout.strip().splitlines()[-1])
        finally:
            stage1.kill()
            stage1.wait()
            log.close()
        times, cpus = np.array([t for t, _ in samples]), np.array([c for _, c in samples])
        warm, stop = row.pop("window")
        row["busy_stage1"] = float(np.interp(stop, times, cpus) - np.interp(warm, times, cpus)) / (stop - warm)
        row["act_wait"] = act_wait
        rows.append(row)
        echo(f"{n} edges, --act-wait {act_wait}: {row['requests_per_second']:.0f} requests/s, p50 {row['rtt_p50_ms']:.2f} ms, "
             f"p99 {row['rtt_p99_ms']:.2f} ms")
    (work / "capacity.json").write_text(json.dumps(rows, indent=1))
    return rows


def capacity_table(rows: Sequence[dict[str, Any]]) -> str:
    lines = ["| --act-wait | edges | acting requests/s | round trip p50 ms | p99 ms | busy stage1 | "
             "busy replaying edges | step payload bytes |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        wait = r.get("act_wait", "all")
        lines.append(f"| {wait if wait == 'all' else wait + ' ms'} | {r['edges']} | {r['requests_per_second']:.0f} | {r['rtt_p50_ms']:.2f} | "
                     f"{r['rtt_p99_ms']:.2f} | {r['busy_stage1']:.2f} | {r['busy_edges']:.2f} | {r['payload_bytes']} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    """The replaying process (`run_capacity_bench` starts it): one JSON line of figures on stdout."""
    parser = argparse.ArgumentParser(prog="python -m splitrl.bench.capacity_bench")
    parser.add_argument("--connect", required=True)
    parser.add_argument("--edges", type=int, required=True)
    parser.add_argument("--num-steps", type=int, required=True)
    parser.add_argument("--warmup", type=float, default=3.0)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--codec-rollout", default="fp32")
    parser.add_argument("--bottleneck", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    settings = bench_settings(args.edges, args.num_steps, args.codec_rollout, args.bottleneck)
    row = replay(settings, args.connect, args.warmup, args.seconds)
    print(json.dumps(row))


if __name__ == "__main__":
    main()
