"""Codec benchmark: every codec on real CarRacing activations and gradients.

`capture` runs a short single-process training (the paper's networks, fp32 on
the link) and keeps what crossed it: the rollout features, every training
minibatch's features with its sample indices, and the gradients stage1 sent
back. `run_codec_bench` replays those streams through a sender and a receiver
of each codec, as the two stages would, and measures the real wire bytes
(`wire.encode` of the parts, headers included), the encode+decode time, and the
error of what the receiver got. For gradients the error is measured after
stage0's ReLU (entries where the feature is zero never reach the encoder), per
message and, since error feedback trades one for the other, also on each
sample's sum over all epochs.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import torch

from ..codecs import CodecSet, Context
from ..envs import inspect_env
from ..runs import checkpoint_iterations, load_checkpoint
from ..settings import EnvSettings, PPOSettings, TrainSettings
from ..stages import LIMITS, Edge, FeaturesEdge, FeaturesLearner, Learner, Payload
from ..transport import wire
from ..transport.fastwire import FastWire

__all__ = ["Capture", "capture", "run_codec_bench", "format_codec_table", "pipeline_table", "cloud_bytes_per_step", "DEFAULT_SPECS", "PIPELINES"]

DEFAULT_SPECS: dict[str, tuple[str, ...]] = {
    "rollout": ("fp32", "bf16", "fp16", "int8", "relu", "relu:values=bf16", "relu:values=int8", "int8+zstd",
                "relu:values=int8+zstd"),
    "fwd": ("fp32", "bf16", "int8", "relu:values=int8", "delta", "delta:q=topk,density=0.05",
            "delta:q=topk,density=0.02", "delta+zstd", "delta:q=none"),
    "bwd": ("fp32", "bf16", "int8", "paper:warm=0", "paper:p=0.99,warm=0", "ef:density=0.1",
            "ef:density=0.05", "ef:density=0.02,values=int8", "ef:density=0.01,values=int8",
            "ef:density=0.02,values=int8+zstd"),
}


@dataclass
class Capture:
    rollout: list[torch.Tensor]
    """Features of each rollout step, (num_envs, d)."""
    idx: list[torch.Tensor]
    """Sample indices of each training minibatch, in order."""
    fwd: list[torch.Tensor]
    """Features of each training minibatch (fp32, as stage0 computed them)."""
    bwd: list[torch.Tensor]
    """The gradient stage1 sent back for each minibatch."""
    obs: torch.Tensor
    """The rollout's observations, (num_steps, num_envs, stack, H, W) uint8 (the cloud setup's input)."""
    num_envs: int
    steps_per_iteration: int


def capture(num_steps: int = 512, epochs: int = 3, minibatches: int = 4, seed: int = 1,
            checkpoint_dir: str | None = None) -> Capture:
    """Train one iteration in this process and keep the streams (see the module doc).

    The stages' compute objects run in the synchronous schedule's order with no link
    at all (fp32 crosses unchanged, so nothing is lost by skipping the wire). With
    ``checkpoint_dir`` (a run directory) both stages start from its newest
    checkpoints, so the streams are those of a trained agent.
    """
    settings = TrainSettings(
        seed=seed, total_steps=num_steps, env=EnvSettings(),
        ppo=PPOSettings(num_steps=num_steps, epochs=epochs, minibatches=minibatches),
    ).validate()
    spec = inspect_env(settings.env)
    edge, learner = Edge(settings, spec), Learner(settings, spec)
    if checkpoint_dir:
        _load_newest(Path(checkpoint_dir), edge, learner)
    sender, receiver = FeaturesEdge(edge), FeaturesLearner(learner)
    out = Capture([], [], [], [], torch.empty(0), settings.env.num_envs, settings.steps_per_iteration)

    def message(kind: str, payload: Payload) -> wire.Message:
        tensors, header = payload
        return wire.Message(kind, header, tensors)

    edge.open_envs()
    try:
        edge.begin_rollout(1)
        learner.begin_rollout(1)
        for t in range(num_steps):
            step = message("step", edge.observe(t))
            out.rollout.append(step.tensors["features"].clone())
            edge.step(message("action", learner.act(t, step)))
        learner.end_rollout(message("rollout_end", edge.end_rollout()))
    finally:
        edge.close()
    learner.begin_training(1)
    for minibatch in edge.begin_training(1):
        for idx in minibatch:
            sent, payload = sender.send(edge.forward(idx), idx)
            out.idx.append(idx.clone())
            out.fwd.append(payload[0]["features"].clone())
            reply = receiver.learn(message("train_fwd", payload), idx)
            learner.optimizer_step()
            out.bwd.append(reply[0]["grad"].clone())
            edge.backward(sent.out, sender.grad(sent, message("train_bwd", reply)))
            edge.optimizer_step()
    out.obs = edge.obs.clone()
    return out


def _load_newest(run_dir: Path, edge: Edge, learner: Learner) -> None:
    for role, load in (("stage0", lambda d: edge.net.load_state_dict(d["net"])),
                       ("stage1", lambda d: learner.heads.load_state_dict(d["heads"]))):
        iterations = checkpoint_iterations(run_dir, role)
        if not iterations:
            raise FileNotFoundError(f"no complete {role} checkpoint in {run_dir / 'checkpoints'}")
        load(load_checkpoint(run_dir, role, iterations[-1]))


def _payload_bytes(frames: list[Any]) -> int:
    """Bytes of an encoded message beyond the envelope every message pays (kind, seq, empty maps)."""
    return sum(wire.frame_nbytes(f) for f in frames) - _ENVELOPE


_ENVELOPE = sum(wire.frame_nbytes(f) for f in wire.encode("train_fwd", 0, {}, {}))
_WIRE = FastWire(LIMITS)
"""Encodes as a transport does (`FastWire`: the frame-0 prefix packed once per layout)."""


def _specs(stream: str, spec: str) -> dict[str, str]:
    out = {"rollout": "fp32", "fwd": "fp32", "bwd": "fp32"}
    out[stream] = spec
    return out


def _replay(cap: Capture, stream: str, spec: str) -> dict[str, Any]:
    """Send the captured stream through a sender and a receiver of ``spec``."""
    sender, receiver = CodecSet(**_specs(stream, spec)), CodecSet(**_specs(stream, spec))
    n = cap.num_envs
    step = cap.steps_per_iteration
    if stream == "rollout":
        items = [(x, Context(idx=t * n + torch.arange(n), envs=torch.arange(n))) for t, x in enumerate(cap.rollout)]
    else:
        for t, x in enumerate(cap.rollout):  # fill both delta caches, as the rollout does
            ctx = Context(idx=t * n + torch.arange(n), envs=torch.arange(n))
            sender.pack("rollout", "features", x, ctx, {}, {})
            receiver.observe_rollout(ctx, x)
        source = cap.fwd if stream == "fwd" else cap.bwd
        items = [(x, Context(idx=i, mask=(f != 0) if stream == "bwd" else None, global_step=step))
                 for x, i, f in zip(source, cap.idx, cap.fwd)]
    name = "grad" if stream == "bwd" else "features"
    nbytes = seconds = 0.0
    err2 = ref2 = 0.0
    sent_sum: dict[int, torch.Tensor] = {}
    true_sum: dict[int, torch.Tensor] = {}
    for x, ctx in items:
        tensors: dict[str, torch.Tensor] = {}
        header: dict[str, Any] = {}
        start = time.perf_counter()
        sender.pack(stream, name, x, ctx, tensors, header)
        frames = _WIRE.encode("train_fwd", 0, header, tensors)
        got = receiver.unpack(stream, name, wire.decode(frames, LIMITS).tensors, header, ctx, tuple(x.shape), x.dtype)
        seconds += time.perf_counter() - start
        nbytes += _payload_bytes(frames)
        if stream == "bwd":  # what reaches the encoder: stage0's ReLU zeroes the rest
            got, x = got * ctx.mask, x * ctx.mask
            for row, j in enumerate(ctx.idx.tolist()):
                sent_sum[j] = sent_sum.get(j, 0) + got[row]
                true_sum[j] = true_sum.get(j, 0) + x[row]
        err2 += float((got - x).pow(2).sum())
        ref2 += float(x.pow(2).sum())
    elements = sum(x.numel() for x, _ in items)
    row: dict[str, Any] = {
        "stream": stream,
        "codec": spec,
        "bytes_per_element": nbytes / elements,
        "ms_per_mib": 1000 * seconds / (elements * 4 / 2**20),
        "rel_error": math.sqrt(err2 / ref2) if ref2 else 0.0,
    }
    if stream == "bwd":
        e = sum(float((sent_sum[j] - true_sum[j]).pow(2).sum()) for j in true_sum)
        r = sum(float(true_sum[j].pow(2).sum()) for j in true_sum)
        row["rel_error_sum"] = math.sqrt(e / r) if r else 0.0
    return row


def run_codec_bench(cap: Capture, specs: dict[str, Iterable[str]] | None = None) -> list[dict[str, Any]]:
    """One row per (stream, codec); ratios against fp32 and bf16 of the same stream."""
    rows = []
    for stream, names in (specs or DEFAULT_SPECS).items():
        stream_rows = [_replay(cap, stream, spec) for spec in names]
        base = {r["codec"]: r["bytes_per_element"] for r in stream_rows}
        for r in stream_rows:
            r["x_fewer_than_fp32"] = 4.0 / r["bytes_per_element"] if r["bytes_per_element"] else math.inf
            r["x_fewer_than_bf16"] = 2.0 / r["bytes_per_element"] if r["bytes_per_element"] else math.inf
            r["fp32_measured"] = base.get("fp32")
        rows += stream_rows
    return rows


def format_codec_table(rows: list[dict[str, Any]]) -> str:
    head = ("| stream | codec | bytes/element | x fewer than bf16 | enc+dec ms/MiB | rel. error "
            "| rel. error of per-sample sums |\n|---|---|---:|---:|---:|---:|---:|")
    lines = [head]
    for r in rows:
        sums = f"{r['rel_error_sum']:.3f}" if "rel_error_sum" in r else ""
        lines.append(
            f"| {r['stream']} | `{r['codec']}` | {r['bytes_per_element']:.3f} | {r['x_fewer_than_bf16']:.1f} "
            f"| {r['ms_per_mib']:.2f} | {r['rel_error']:.4f} | {sums} |"
        )
    return "\n".join(lines)



def cloud_bytes_per_step(cap: Capture, spec: str = "frames") -> float:
    """Wire bytes per env step of the cloud setup (cut before the first layer): the
    observations through a sender and a receiver of ``spec``; training sends nothing."""
    sender, receiver = CodecSet(rollout=spec), CodecSet(rollout=spec)
    n = cap.num_envs
    envs = torch.arange(n)
    nbytes = 0
    for t in range(cap.obs.shape[0]):
        x = cap.obs[t]
        ctx = Context(idx=t * n + envs, envs=envs)
        tensors: dict[str, torch.Tensor] = {}
        header: dict[str, Any] = {}
        sender.pack("rollout", "features", x, ctx, tensors, header)
        frames = _WIRE.encode("step", 0, header, tensors)
        got = receiver.unpack("rollout", "features", wire.decode(frames, LIMITS).tensors, header, ctx, tuple(x.shape), x.dtype)
        if not torch.equal(got, x):
            raise AssertionError(f"cloud codec {spec!r} did not reproduce the observations")
        nbytes += _payload_bytes(frames)
    return nbytes / (cap.obs.shape[0] * n)


PIPELINES: dict[str, dict[str, str]] = {
    "split, fp32 (the paper's baseline)": {"rollout": "fp32", "fwd": "fp32", "bwd": "fp32"},
    "split, bf16": {"rollout": "bf16", "fwd": "bf16", "bwd": "bf16"},
    "split, paper p90": {"rollout": "fp32", "fwd": "fp32", "bwd": "paper:warm=0"},
    "split, paper p99": {"rollout": "fp32", "fwd": "fp32", "bwd": "paper:p=0.99,warm=0"},
    "split, ours": {"rollout": "int8+zstd", "fwd": "delta:q=topk,density=0.02",
                    "bwd": "ef:density=0.02,values=int8"},
    "split, ours (zero-budget forward)": {"rollout": "int8+zstd", "fwd": "delta:q=none",
                                          "bwd": "ef:density=0.02,values=int8"},
}


def pipeline_table(cap: Capture, rows: list[dict[str, Any]], epochs: int = 10, feature_dim: int = 4096) -> str:
    """Bytes per env step over a whole iteration of ``epochs`` epochs, per pipeline,
    from the per-element rates measured in ``rows``; plus the cloud setup, measured."""
    rate = {(r["stream"], r["codec"]): r["bytes_per_element"] for r in rows}
    lines = ["| configuration | rollout | training fwd | training bwd | bytes per env step | x fewer than bf16 |",
             "|---|---|---|---|---:|---:|"]
    table: list[tuple[str, str, str, str, float]] = []
    for name, streams in PIPELINES.items():
        try:
            per_step = feature_dim * (rate[("rollout", streams["rollout"])]
                                      + epochs * (rate[("fwd", streams["fwd"])] + rate[("bwd", streams["bwd"])]))
        except KeyError:
            continue  # a pipeline whose codecs were not measured in this run
        table.append((name, streams["rollout"], streams["fwd"], streams["bwd"], per_step))
    for spec in ("fp32", "frames"):
        label = "cloud (cut before the first layer), " + ("whole uint8 stacks" if spec == "fp32" else "newest frame, zstd")
        table.append((label, spec, "-", "-", cloud_bytes_per_step(cap, spec)))
    bf16 = next((t[4] for t in table if t[0] == "split, bf16"), None)
    for name, rollout, fwd, bwd, per_step in table:
        ratio = f"{bf16 / per_step:.1f}" if bf16 and per_step else ""
        lines.append(f"| {name} | `{rollout}` | `{fwd}` | `{bwd}` | {per_step:,.0f} | {ratio} |")
    return "\n".join(lines)
