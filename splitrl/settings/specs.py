"""Spec parsers: the options whose value is a small language of its own (``NAME[:key=value,...]``, a codec
spec, ``key=value`` keyword arguments, a link rate), read into values, each error naming the option.

The codecs' and the built-in models' names live here too, so --help needs no torch import; their parsers are
imported only when a spec is checked (the codecs import the transport; the settings stay import-light).
"""

from __future__ import annotations

import ast
import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any, Callable

from ..errors import SettingsError
from ..units import parse_rate
from .options import bound_error

__all__ = ["CODEC_NAMES", "CODEC_STREAMS", "EXCHANGES", "ENCODER_SYNCS", "SYNC_MODES", "OUTPUT_CODECS",
           "FLEET_CODECS", "MODEL_NAMES", "GREEDY_RULES", "DEFAULT_GREEDY", "AUTO_MODEL", "AUTO_MODELS",
           "ROBUST_SUMS", "EncoderSync", "Exchange", "parse_kwargs", "parse_env_kwargs",
           "parse_model_kwargs", "check_model", "codec_spec", "parse_link_budget",
           "parsed_codec", "codec_base"]

CODEC_NAMES = ("fp32", "bf16", "fp16", "int8", "relu", "delta", "paper", "ef", "frames")
"""The codecs of `splitrl.codecs.CODECS`, named here so --help needs no torch import."""
CODEC_STREAMS = {
    "rollout": ("fp32", "bf16", "fp16", "int8", "relu", "frames"),
    "fwd": ("fp32", "bf16", "fp16", "int8", "relu", "delta"),
    "bwd": ("fp32", "bf16", "fp16", "int8", "paper", "ef"),
}
"""Which codecs each stream accepts (each codec's ``streams``), for --help; a test keeps it in step."""
MODEL_NAMES = ("nature", "impala", "mlp")
"""The built-in models of `splitrl.models.BUILTINS`, named here so --help needs no torch import; a test keeps
them in step."""
AUTO_MODEL = "auto"
"""``--model``'s default: the built-in for the kind of observations the env gives (`AUTO_MODELS`)."""
AUTO_MODELS = {"image": "nature", "vector": "mlp", "dict": "nature"}
"""What ``--model auto`` is for each kind of observation (a Dict's image goes through the model, its vector is
joined to the features after it)."""
GREEDY_RULES = ("expected", "mode", "mean")
"""The deterministic actions of a Box policy (`splitrl.models.greedy.GreedyAction`), named here so --help needs no
torch import."""
DEFAULT_GREEDY = "expected"
"""The rule `splitrl eval` and export use unless told: the policy's own average env action, the one rule that acts
on every draw's part (a brake the mean never reaches included); `splitrl bench greedy` plays the rules against each
other and the sampled policy on held-out seeds: on the paper-length runs it played best of the three
(docs/benchmarks/after-training.md)."""
EXCHANGES = ("features", "replica")
ENCODER_SYNCS = ("grad", "avg")
ROBUST_SUMS = ("off", "trimmed", "median")
"""How stage1 combines a fleet's encoder gradients or changes (`EncoderSync.robust`)."""
SYNC_MODES = ("fp32", "bf16", "int8")
OUTPUT_CODECS = ("fp32", "bf16", "fp16", "int8")
"""The dense codecs that carry the replica exchange's per-sample outputs and their gradient."""
FLEET_CODECS = ("fp32", "bf16", "fp16", "int8", "relu")
"""What a fleet's training features and gradients may go through: codecs without per-sample state, which
would be split across the edges (the rollout stream takes any codec: its state is per env)."""


def parse_kwargs(text: str, option: str) -> dict[str, Any]:
    """``option``'s 'key=value,key=value' as a dict: numbers, True/False and None as in Python, anything else a
    string; SettingsError naming the option and a malformed item."""
    out: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, eq, raw = (part.strip() for part in item.partition("="))
        if not eq or not key.isidentifier():
            raise SettingsError(f"{option} {text!r}: {item!r} is not key=value")
        try:
            out[key] = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            out[key] = raw
    return out


def parse_env_kwargs(text: str) -> dict[str, Any]:
    """``--env-kwargs`` as the dict gym.make takes (`parse_kwargs`)."""
    return parse_kwargs(text, "--env-kwargs")


def parse_model_kwargs(text: str) -> dict[str, Any]:
    """``--model-kwargs`` as the keyword arguments of the model's factory (`parse_kwargs`)."""
    return parse_kwargs(text, "--model-kwargs")


_FACTORY = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*")


def check_model(spec: str) -> str:
    """``--model``: a built-in's name (`MODEL_NAMES`) or ``module:factory``; SettingsError if it is neither. The
    factory's module is imported only when the network is built (`splitrl.models.network.resolve_model`)."""
    if spec in MODEL_NAMES or spec == AUTO_MODEL or _FACTORY.fullmatch(spec):
        return spec
    raise SettingsError(f"--model {spec!r}: unknown model (built-ins: {', '.join(MODEL_NAMES)}; {AUTO_MODEL}; or a "
                        "factory of your own as module:factory)")


def _named_params(cls: type, spec: str, option: str, names: tuple[str, ...],
                  with_params: dict[str, tuple[str, ...] | None]) -> Any:
    """``NAME[:key=value,...]`` read against the fields of ``cls`` (all but ``name``) into an instance; only
    the names in ``with_params`` take parameters (the fields it lists for the name; None: every one), a
    ``sync`` parameter names a dense codec (`SYNC_MODES`), a field that declares ``choices`` takes one of them,
    and each parameter lies in the range its field declares. SettingsError naming what is wrong."""
    name, _, params = spec.strip().partition(":")
    if name not in names:
        raise SettingsError(f"{option} {spec!r}: unknown {option[2:].replace('-', ' ')} {name!r} "
                            f"(one of {', '.join(names)})")
    taken = with_params.get(name, ())
    fields = {f.name: f for f in dataclasses.fields(cls) if f.name != "name" and (taken is None or f.name in taken)}
    values: dict[str, Any] = {}
    for item in filter(None, params.split(",")):
        key, eq, raw = (part.strip() for part in item.partition("="))
        if not eq or key not in fields:
            raise SettingsError(f"{option} {spec!r}: unknown parameter {item!r} for {name!r} "
                                f"(parameters: {', '.join(fields) or 'none'})")
        kind = fields[key].type
        whole = kind in (int, "int")
        try:
            values[key] = int(raw) if whole else float(raw) if kind in (float, "float") else raw
        except ValueError:
            raise SettingsError(f"{option} {spec!r}: {key}={raw!r} is not a {'whole ' if whole else ''}number") \
                from None
        choices = fields[key].metadata.get("choices")
        if choices and values[key] not in choices:
            raise SettingsError(f"{option} {spec!r}: {key} must be one of {', '.join(choices)}, got {raw!r}")
    if values.get("sync", SYNC_MODES[-1]) not in SYNC_MODES:  # a weight sync's codec (`WeightSync`)
        raise SettingsError(f"{option} {spec!r}: sync must be one of {', '.join(SYNC_MODES)}")
    parsed = cls(name, **values)
    for f in fields.values():
        message = bound_error(f.name, getattr(parsed, f.name), f.metadata)
        if message:
            raise SettingsError(f"{option} {spec!r}: {message}")
    return parsed


@dataclass(frozen=True)
class EncoderSync:
    """How a fleet's edges keep one encoder, parsed from ``--encoder-sync NAME[:key=value,...]``.

    ``grad``: every minibatch, the edges' encoder gradients are summed through stage1 and every edge
    steps with the sum (exact). ``avg``: each edge steps with its own share's gradient, and after every
    ``every``-th minibatch (and each epoch's last) the edges' weights are averaged through stage1, their
    changes since the last average travelling as ``sync`` (`splitrl.stages.weights.WeightSync`).
    """

    name: str = "grad"
    every: int = field(default=8, metadata={"min": 1})
    """avg: minibatches between averages (counted over the iteration; each epoch's last averages too)."""
    sync: str = "int8"
    """avg: how the weight changes travel (fp32, bf16 or int8 with one scale per row)."""
    clip: float = field(default=0.0, metadata={"min": 0.0, "finite": True})
    """Each edge's encoder gradient (grad) or change (avg) scaled down to at most this L2 norm before stage1 adds
    them up (0, the default: off, so the sum is the edges' own, what one edge with every edge's envs computes)."""
    robust: str = field(default="off", metadata={"choices": ROBUST_SUMS})
    """How stage1 combines the edges' gradients (grad) or changes (avg): 'off' adds them up (avg: their mean);
    'trimmed' or 'median' takes each coordinate's mean without its largest and smallest value, or its median,
    times the number of edges (avg: once), so that one of three or more edges cannot move the encoder far
    (`splitrl.stages.robust`)."""

    @classmethod
    def parse(cls, spec: str) -> "EncoderSync":
        """SettingsError naming what is wrong."""
        return _named_params(cls, spec, "--encoder-sync", ENCODER_SYNCS,
                             with_params={"grad": ("clip", "robust"), "avg": None})

    def due(self, epoch: int, mb: int, minibatches: int) -> bool:
        """Whether the edges average after minibatch (epoch, mb)."""
        return mb == minibatches - 1 or (epoch * minibatches + mb + 1) % self.every == 0


@dataclass(frozen=True)
class Exchange:
    """What crosses the cut in training, parsed from ``--exchange NAME[:key=value,...]``.

    ``features``: the encoder's output and the loss gradient with respect to it.
    ``replica``: stage0 keeps a replica of the heads; the change of the heads' outputs
    since the rollout and the gradient with respect to them (`splitrl.stages.replica`).
    """

    name: str = "features"
    sync: str = "int8"
    """replica: how the heads' weight updates travel (fp32, bf16 or int8 with one scale per row)."""
    last_every: int = field(default=0, metadata={"min": 0})
    """replica: also update all weights but the two first layers after every N-th training minibatch (0: never)."""
    all_every: int = field(default=0, metadata={"min": 0})
    """replica: also update all weights after every N-th training minibatch (0: never)."""

    @classmethod
    def parse(cls, spec: str) -> "Exchange":
        """SettingsError (a ValueError) naming what is wrong."""
        return _named_params(cls, spec, "--exchange", EXCHANGES, with_params={"replica": None})


def codec_spec(stream: str) -> Callable[[str], Any]:
    """The check of ``--codec-STREAM``: the codec it names, or ValueError naming the option and what is wrong."""

    def check(spec: str) -> Any:
        if codec_base(spec) == "replica":
            raise SettingsError(f"--codec-{stream} {spec!r}: replica is an exchange, not a codec: use --exchange "
                                "replica[:sync=...,last_every=N,all_every=N] with --codec-fwd/--codec-bwd "
                                f"{', '.join(OUTPUT_CODECS)}")
        from ..codecs import parse_codec

        try:
            return parse_codec(spec, stream)
        except ValueError as exc:
            raise SettingsError(f"--codec-{stream}: {exc}") from None

    return check


def parsed_codec(spec: str, stream: str) -> Any:
    """The codec ``spec`` names for ``stream``, or None where it names none (`codec_spec` says why)."""
    try:
        return codec_spec(stream)(spec)
    except ValueError:
        return None


def codec_base(spec: str) -> str:
    """The codec a spec names before its parameters and layers: 'ef' of 'ef:density=0.1+zstd'."""
    return spec.strip().partition(":")[0].partition("+")[0]


def parse_link_budget(text: str) -> int | None:
    """``--link-budget`` in bits per second, None when empty (no budget); SettingsError naming the option."""
    if not text:
        return None
    try:
        return parse_rate(text)
    except ValueError as exc:
        raise SettingsError(f"--link-budget: {exc}") from None
