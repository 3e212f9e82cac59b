"""``--link-budget RATE``: the codecs' parameters chosen each iteration so that its bytes fit the link.

Each stream's configured codec is the richest it may be; below it, a ladder of leaner settings of the same
kind (`codec_ladder`, `exchange_ladder`), each with its nominal bytes relative to the configured one:

- dense values: fp32 -> bf16 -> int8 (4, 2, 1 bytes a value), ``relu:values=`` likewise;
- top-k codecs (``ef``, ``delta:q=topk``): the density halved, up to five times;
- the paper's codec: the share it sends, 1 - p, halved, up to five times;
- the replica exchange: its ``all_every`` and ``last_every`` doubled, up to five times (the weights it
  sends counted from the heads' shapes).

Stage0 decides (`LinkBudget.choose`): at each iteration's start, from the last measured iteration's bytes on
each stream (its meters) and its compute time (the iteration's wall time less its wait on the link), it
predicts each level's bytes as measured x nominal ratio, and per direction (the link is full duplex) takes
every stream to its richest level and, while the prediction exceeds the budget (``RATE`` x compute time),
moves the stream with the most predicted bytes one level down. The choice rides on the iteration's first
step message (header ``budget``, every group's); stage1 checks each spec is on its ladder (else a
`ProtocolError`) and both sides switch: the rollout codec at once, the training codecs and the exchange when
that iteration's training begins (so the asynchronous schedule's training of the iteration before is not
touched). A codec keeps its state across a switch (`splitrl.codecs.CodecSet.retune`). `CodecTuning` does
this on either stage.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable

from ..codecs import CODECS, CodecSet, parse_codec
from ..envs import EnvSpec
from ..models import agent
from ..units import parse_rate
from ..runs import NOT_TRAINING_KINDS
from ..settings import Exchange, TrainSettings
from ..transport import ProtocolError
from ..transport.errors import peer_repr
from .replica_plan import FIRST_LAYERS, due, replicated

__all__ = ["CodecTuning", "LinkBudget", "codec_ladder", "exchange_ladder", "STREAMS", "TRAINING"]

LEVELS = 6
"""Settings per ladder: the configured one and five leaner."""
KEPT = 8
"""Iterations whose levels `LinkBudget.applied` keeps: the record a choice measures may be a few behind."""
DENSE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "int8": 1}

STREAMS = {"rollout": ("sent", ("step",)), "fwd": ("sent", ("train_fwd", "rescore")), "bwd": ("recv", ("train_bwd",)),
           "exchange": ("recv", ("heads",))}
"""Each knob's direction as stage0's meters see it, and the message kinds whose bytes it sets (the asynchronous
schedule's ``rescore`` goes through the fwd codec too)."""
TRAINING = ("fwd", "bwd", "exchange")
"""The knobs that switch when an iteration's training begins (the rollout's switches with its first step)."""


def _respec(spec: str, stream: str, **change: Any) -> str:
    """``spec`` with parameters changed, canonical (its +zstd layer kept)."""
    base, plus, layer = spec.strip().partition("+")
    codec = parse_codec(base, stream)
    values = {k: getattr(codec, k) for k in codec.params}
    values.update(change)
    return type(codec)(**values).spec() + (plus + layer if plus else "")


def codec_ladder(spec: str, stream: str) -> list[tuple[str, float]]:
    """(spec, nominal bytes relative to ``spec``) from ``spec`` itself down to its leanest setting."""
    base = spec.strip().partition("+")[0]
    codec = parse_codec(base, stream)
    out = [(_respec(spec, stream), 1.0)]
    if codec.name in DENSE_BYTES or codec.name == "relu":
        current = codec.name if codec.name in DENSE_BYTES else codec.values
        for leaner in ("bf16", "int8"):
            if DENSE_BYTES[leaner] >= DENSE_BYTES[current]:
                continue
            if codec.name == "relu":
                out.append((_respec(spec, stream, values=leaner), DENSE_BYTES[leaner] / DENSE_BYTES[current]))
            elif stream in CODECS[leaner].streams:
                out.append((leaner + spec.strip()[len(base):], DENSE_BYTES[leaner] / DENSE_BYTES[current]))
    elif codec.name == "ef" or (codec.name == "delta" and codec.q == "topk"):
        out += [(_respec(spec, stream, density=codec.density / 2 ** k), 0.5 ** k) for k in range(1, LEVELS)]
    elif codec.name == "paper":
        out += [(_respec(spec, stream, p=1 - (1 - codec.p) / 2 ** k), 0.5 ** k) for k in range(1, LEVELS)]
    return out


def _updates(exchange: Exchange, updates: int) -> tuple[int, int]:
    """(updates of all weights, of all but the first layers) in an iteration of ``updates`` minibatches, the one
    after the rollout counted, as `splitrl.stages.replica_plan.due` sends them."""
    names = [*FIRST_LAYERS, "the rest"]
    sent = [due(exchange, 0, mb, 1, updates, names) for mb in range(updates)]
    return 1 + sum(1 for got in sent if got == names), sum(1 for got in sent if got == ["the rest"])


def exchange_spec(exchange: Exchange) -> str:
    if exchange.name != "replica":
        return exchange.name
    return f"replica:sync={exchange.sync},last_every={exchange.last_every},all_every={exchange.all_every}"


def exchange_ladder(spec: str, updates: int, weights: tuple[int, int]) -> list[tuple[str, float]]:
    """(spec, nominal bytes relative to ``spec``) of the replica exchange with its periods doubled; ``weights``:
    (all the replica's values, those outside the two first layers). Other exchanges have no ladder."""
    exchange = Exchange.parse(spec)
    if exchange.name != "replica" or not (exchange.all_every or exchange.last_every):
        return [(exchange_spec(exchange), 1.0)]
    everything, rest = weights

    def nominal(e: Exchange) -> float:
        full, last = _updates(e, updates)
        return full * everything + last * rest

    out = []
    for k in range(LEVELS):
        e = dataclasses.replace(exchange, all_every=exchange.all_every * 2 ** k, last_every=exchange.last_every * 2 ** k)
        out.append((exchange_spec(e), nominal(e) / nominal(exchange)))
    return out


class LinkBudget:
    """Stage0's choice of each stream's setting for a budget of ``rate`` bits/s (see the module's docstring);
    stage1 builds one too, to check what it is told."""

    @classmethod
    def of(cls, settings: TrainSettings, spec: EnvSpec) -> "LinkBudget | None":
        """The run's budget (None without ``--link-budget``), the replica's weights counted from the heads."""
        if not settings.codecs.link_budget:
            return None
        weights = (1, 1)
        if settings.codecs.parsed_exchange().name == "replica":
            _, heads = agent(settings, spec)
            pairs = [(name, p.numel()) for name, p in replicated(heads)]
            weights = (sum(n for _, n in pairs), sum(n for name, n in pairs if name not in FIRST_LAYERS))
        return cls(settings, parse_rate(settings.codecs.link_budget), weights)

    def __init__(self, settings: TrainSettings, rate: float, weights: tuple[int, int] = (1, 1)) -> None:
        c, ppo = settings.codecs, settings.ppo
        self.rate = rate
        self.ladders = {
            "rollout": codec_ladder(c.codec_rollout, "rollout"),
            "fwd": codec_ladder(c.codec_fwd, "fwd"),
            "bwd": codec_ladder(c.codec_bwd, "bwd"),
            "exchange": exchange_ladder(c.exchange, ppo.epochs * ppo.minibatches, weights),
        }
        self.levels = dict.fromkeys(self.ladders, 0)
        self.applied: dict[int, dict[str, int]] = {}
        """The levels each iteration ran with (what its measured bytes are the bytes of)."""

    def specs(self, levels: dict[str, int] | None = None) -> dict[str, str]:
        levels = self.levels if levels is None else levels
        return {stream: self.ladders[stream][level][0] for stream, level in levels.items()}

    def choose(self, iteration: int, record: dict[str, Any]) -> dict[str, Any]:
        """Set `levels` for ``iteration`` from the measured ``record`` of an earlier one; the metrics to log."""
        ran = self.applied.get(int(record["iteration"]), dict.fromkeys(self.ladders, 0))
        # The iteration's compute: its wall time less its wait on the link and its evaluation's episodes.
        compute = max(1e-3, float(record["time/iteration"]) - float(record.get("time/link_wait", 0.0))
                      - float(record.get("time/eval", 0.0)))
        allowed = self.rate / 8 * compute
        metrics: dict[str, Any] = {}
        levels = {}
        for direction in ("sent", "recv"):
            streams = [s for s, (d, _) in STREAMS.items() if d == direction]
            total = sum(v for k, v in record.items() if k.startswith("net/") and k.endswith(f"/{direction}_bytes")
                        and k.split("/")[1] not in NOT_TRAINING_KINDS)  # evaluation's bytes are not training's
            measured = {s: sum(float(record.get(f"net/{kind}/{direction}_bytes", 0.0)) for kind in STREAMS[s][1])
                        for s in streams}
            fixed = total - sum(measured.values())
            # Bytes at the configured setting, from what the setting it ran with measured.
            base = {s: measured[s] / self.ladders[s][ran[s]][1] for s in streams}
            chosen = dict.fromkeys(streams, 0)

            def predicted(s: str, step: int = 0) -> float:
                return base[s] * self.ladders[s][chosen[s] + step][1]

            def saving(s: str) -> float:
                return predicted(s) - predicted(s, 1) if chosen[s] + 1 < len(self.ladders[s]) else 0.0

            while fixed + sum(predicted(s) for s in streams) > allowed:
                # The step that saves the most; none that saves under 1 % of its stream (a replica's periods
                # past the iteration's length make it staler for nothing).
                movable = [s for s in streams if saving(s) > 0.01 * predicted(s)]
                if not movable:
                    break
                chosen[max(movable, key=saving)] += 1
            levels.update(chosen)
            way = "up" if direction == "sent" else "down"
            metrics[f"budget/allowed_{way}_bytes"] = allowed
            metrics[f"budget/predicted_{way}_bytes"] = fixed + sum(predicted(s) for s in streams)
        self.levels = levels
        self.applied[iteration] = dict(levels)
        for old in [i for i in self.applied if i < iteration - KEPT]:
            del self.applied[old]
        for stream, level in levels.items():
            metrics[f"budget/level/{stream}"] = level
        return metrics

    def resume(self, records: list[dict[str, Any]]) -> dict[str, Any] | None:
        """After a resume: the newest record (what the next choice measures), its levels taken as it ran."""
        if not records:
            return None
        last = records[-1]
        self.applied[int(last["iteration"])] = {s: int(last.get(f"budget/level/{s}", 0)) for s in self.ladders}
        return last

    def check(self, announced: Any) -> dict[str, str]:
        """What stage0 announced, if every spec is on its stream's ladder; else a `ProtocolError`."""
        if not isinstance(announced, dict) or set(announced) != set(self.ladders):
            raise ProtocolError(f"step: header 'budget' must map {', '.join(self.ladders)} to specs, got "
                                f"{peer_repr(announced)}")
        for stream, spec in announced.items():
            if spec not in [s for s, _ in self.ladders[stream]]:
                raise ProtocolError(f"step: header 'budget': {stream} {peer_repr(spec)} is not on the ladder of "
                                    f"--link-budget ({', '.join(s for s, _ in self.ladders[stream])})")
        return dict(announced)


def switch(codecs: CodecSet, specs: dict[str, str], streams: Iterable[str]) -> Exchange | None:
    """Carry ``streams`` with ``specs`` from now on; the exchange as it now runs if it is one of them."""
    for stream in streams:
        if stream != "exchange":
            codecs.retune(stream, specs[stream])
    return Exchange.parse(specs["exchange"]) if "exchange" in streams else None


class CodecTuning:
    """A stage's codecs iteration by iteration: the configured settings throughout without ``--link-budget``;
    with it, each iteration's settings as stage0 chooses them (`begin_rollout`) or stage1 is told them (`take`),
    switched in as the module's docstring says."""

    def __init__(self, settings: TrainSettings, spec: EnvSpec, codecs: CodecSet) -> None:
        self.codecs = codecs
        self.budget = LinkBudget.of(settings, spec)
        """``--link-budget`` (None without): stage0 chooses with it, stage1 checks what it is told."""
        self.exchange = settings.codecs.parsed_exchange()
        """The training exchange as this iteration runs it (``--link-budget`` may lengthen a replica's periods)."""
        self.announced: dict[int, dict[str, str]] = {}
        """Each iteration's settings, sent (stage0) or received (stage1) with its first step, until its training
        takes them."""
        self.metrics: dict[int, dict[str, Any]] = {}
        """Stage0: each iteration's choice, until its metrics record takes it."""
        self.last_record: dict[str, Any] | None = None
        """Stage0: the newest iteration's metrics record (`splitrl.schedule.common.IterationLog`): what the budget
        measures. Stage1 has none and never chooses."""

    def begin_rollout(self, iteration: int) -> None:
        """The rollout codec starts ``iteration``; stage0 chooses its settings, and the rollout codec switches."""
        self.codecs.new_iteration("rollout")
        if self.budget is not None and self.last_record is not None:
            metrics = self.metrics[iteration] = self.budget.choose(iteration, self.last_record)
            specs = self.announced[iteration] = self.budget.specs()
            metrics.update({f"budget/spec/{k}": v for k, v in specs.items()})
            switch(self.codecs, specs, ["rollout"])

    def take(self, iteration: int, announced: Any) -> None:
        """Stage1: stage0's choice for ``iteration``, from a first step's header: the rollout codec switches now."""
        if self.budget is None:
            raise ProtocolError("step: header 'budget' from a stage0 with --link-budget; this stage1 has none")
        specs = self.budget.check(announced)
        before = self.announced.get(iteration)
        if before is not None and before != specs:  # every group's first step says the same
            raise ProtocolError(f"step: header 'budget' differs between groups of iteration {iteration}")
        self.announced[iteration] = specs
        switch(self.codecs, specs, ["rollout"])

    def begin_training(self, iteration: int) -> None:
        """The training codecs start ``iteration``, switched with the exchange to its settings if it has any."""
        self.codecs.new_iteration("fwd", "bwd")
        if iteration in self.announced:
            self.exchange = switch(self.codecs, self.announced.pop(iteration), TRAINING)
