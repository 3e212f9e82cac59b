"""The rules that tie several options together, one table: when a rule applies, its message is an error.

A rule reads the training settings ``s`` (`TrainSettings`) and a process's options ``o`` (`RunOptions`), as
its ``scope`` says: ``codecs`` (the codecs and the cut alone: `CodecSettings.errors`), ``train`` (the
training settings), ``last`` (the training settings, once everything else holds: these divide by what the
others check), ``options`` (a process's options alone) and ``launch`` (both: `TrainSettings.validate`).
Each option's own range is declared with its doc and checked by `options.field_errors`; a rule may meet
values outside those ranges and must not fail on them (it is the range's message that reports them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from .specs import FLEET_CODECS, OUTPUT_CODECS, EncoderSync, Exchange, codec_base, parsed_codec

__all__ = ["Rule", "RULES", "SCOPES", "rule_errors"]

SCOPES = ("codecs", "train", "last", "options", "launch")


@dataclass(frozen=True)
class Rule:
    """One cross-option rule: ``applies(s, o)`` holds of settings it refuses, ``message`` says why (a
    `str.format` template of ``s`` and ``o``, or a function of them)."""

    scope: str
    applies: Callable[[Any, Any], Any]
    message: str | Callable[[Any, Any], str]

    def text(self, s: Any, o: Any) -> str:
        return self.message(s, o) if callable(self.message) else self.message.format(s=s, o=o)


def _codec(s: Any, stream: str) -> Any:
    """The codec of ``stream`` (None where its spec names none: its own check reports it)."""
    return parsed_codec(s.codecs.specs()[stream], stream)


def _exchange(s: Any) -> Exchange | None:
    try:
        return Exchange.parse(s.codecs.exchange)
    except ValueError:
        return None


def _robust(s: Any) -> bool:
    """Whether ``--encoder-sync`` asks for a robust sum (False where it does not parse: its own check says why)."""
    try:
        return EncoderSync.parse(s.schedule.encoder_sync).robust != "off"
    except ValueError:
        return False


def _is_replica(s: Any) -> bool:
    exchange = _exchange(s)
    return exchange is not None and exchange.name == "replica"


def _rollout_base(s: Any) -> str | None:
    codec = _codec(s, "rollout")
    return None if codec is None else getattr(codec, "inner", codec).name


def _training_spec(s: Any, stream: str) -> str | None:
    codec = _codec(s, stream)
    return None if codec is None else codec.spec()


def _groups_fit(s: Any) -> bool:
    groups = s.schedule.rollout_groups
    if groups == "auto":
        return True
    try:
        count = int(groups)
    except ValueError:
        return False
    return count >= 1 and s.env.num_envs % count == 0


def _minibatch(s: Any) -> int:
    """Samples in a training minibatch (0 where --minibatches is out of its range)."""
    return s.steps_per_iteration // s.ppo.minibatches if s.ppo.minibatches >= 1 else 0


def _fleet_odd_codecs(s: Any) -> list[str]:
    return [f"--codec-{stream} {spec}" for stream, spec in s.codecs.specs().items()
            if stream != "rollout" and codec_base(spec) not in FLEET_CODECS]


def _training_stream_rules() -> list[Rule]:
    rules = []
    for stream in ("fwd", "bwd"):
        rules += [
            Rule("codecs", lambda s, o, stream=stream: s.cut == "input"
                 and _training_spec(s, stream) not in (None, "fp32"),
                 f"--codec-{stream} {{s.codecs.codec_{stream}!r}}: with --cut input nothing crosses the link in "
                 "training"),
            Rule("codecs", lambda s, o, stream=stream: _is_replica(s) and _training_spec(s, stream) is not None
                 and _training_spec(s, stream) not in OUTPUT_CODECS,
                 f"--codec-{stream} {{s.codecs.codec_{stream}!r}}: with --exchange replica it carries 4 values a "
                 f"sample; use one of {', '.join(OUTPUT_CODECS)}"),
        ]
    return rules


def _autoencoder_every_default(s: Any) -> int:
    return type(s).__dataclass_fields__["autoencoder_every"].default


RULES: list[Rule] = [
    # -- the codecs and the cut ---------------------------------------------------------------------------
    Rule("codecs", lambda s, o: s.cut == "input" and _rollout_base(s) not in (None, "fp32", "bf16", "fp16", "frames"),
         "--codec-rollout {s.codecs.codec_rollout!r}: with --cut input the rollout carries the observations; use "
         "fp32 (as they are), bf16 or fp16 (a vector's values cast), frames (stacked images), or any of these +zstd"),
    Rule("codecs", lambda s, o: s.cut != "input" and _rollout_base(s) == "frames",
         "--codec-rollout frames needs --cut input (it sends pixels)"),
    *_training_stream_rules(),
    Rule("codecs", lambda s, o: s.cut == "input" and _exchange(s) is not None and _exchange(s).name != "features",
         "--exchange {s.codecs.exchange!r}: with --cut input nothing crosses the link in training"),
    Rule("codecs", lambda s, o: s.cut == "input" and s.codecs.link_budget,
         "--link-budget needs --cut cnn (with --cut input the rollout carries pixels as they are)"),
    # -- PPO's batch and the schedule ----------------------------------------------------------------------
    Rule("train", lambda s, o: s.ppo.minibatches >= 1 and (s.ppo.num_steps * s.total_envs) % s.ppo.minibatches,
         lambda s, o: f"the batch (num_steps x num_envs = {s.ppo.num_steps * s.total_envs}) must divide into "
                      f"--minibatches {s.ppo.minibatches}"),
    Rule("train", lambda s, o: not _groups_fit(s),
         "--rollout-groups must be 'auto' or a divisor of --num-envs {s.env.num_envs} (each group steps the same "
         "number of envs), got {s.schedule.rollout_groups!r}"),
    Rule("train", lambda s, o: s.schedule.microbatches >= 1 and _minibatch(s) >= 1
         and _minibatch(s) % s.schedule.microbatches,
         lambda s, o: f"--microbatches must be >= 1 and divide the minibatch ({_minibatch(s)} samples), "
                      f"got {s.schedule.microbatches}"),
    Rule("train", lambda s, o: s.schedule.microbatches > 1
         and any(spec.startswith("paper") for spec in s.codecs.specs().values()),
         "--microbatches > 1 cannot carry the paper codec: its accumulator is positional over a whole minibatch's "
         "rows"),
    Rule("train", lambda s, o: s.schedule.edges > 1 and s.codecs.link_budget,
         "--link-budget works with one edge (--edges 1): each edge would choose on its own"),
    Rule("train", lambda s, o: s.schedule.edges > 1 and (
        s.schedule.rollout_groups != "1" or s.schedule.microbatches != 1 or s.schedule.asynchronous),
         "--edges > 1 runs the fleet's own schedule: --rollout-groups 1, --microbatches 1, no --async (the edges "
         "themselves are the groups)"),
    Rule("train", lambda s, o: s.schedule.edges > 1 and s.codecs.exchange.partition(":")[0] != "features",
         "--edges > 1 works with --exchange features only"),
    Rule("train", lambda s, o: s.schedule.edges > 1 and _fleet_odd_codecs(s),
         lambda s, o: f"--edges > 1 takes the training codecs {', '.join(FLEET_CODECS)} only (per-sample state "
                      f"would be split across the edges): {', '.join(_fleet_odd_codecs(s))}"),
    Rule("train", lambda s, o: s.schedule.publish == "epoch"
         and (not s.schedule.asynchronous or s.schedule.max_staleness != 1),
         "--publish epoch paces an asynchronous rollout against the one training beside it: it needs --async "
         "--max-staleness 1"),
    Rule("train", lambda s, o: s.schedule.publish == "epoch" and s.cut == "input",
         "--publish epoch needs --cut cnn (with --cut input stage1 trains alone, and stage0 sees no epochs to act "
         "on)"),
    Rule("train", lambda s, o: s.schedule.rescore and not s.schedule.asynchronous,
         "--rescore works with --async only (without it no sample lags)"),
    Rule("train", lambda s, o: s.schedule.asynchronous and s.codecs.exchange.partition(":")[0] != "features",
         "--async works with --exchange features only (the replica's view and its updates belong to one rollout at "
         "a time)"),
    Rule("train", lambda s, o: s.schedule.asynchronous
         and any(spec.startswith("delta") for spec in s.codecs.specs().values()),
         "--async cannot carry the delta codec (its cache is the one rollout being trained on)"),
    # -- the bottleneck's autoencoder ----------------------------------------------------------------------
    Rule("train", lambda s, o: s.bottleneck_train == "ppo" and s.autoencoder_every != _autoencoder_every_default(s),
         "--autoencoder-every applies to --bottleneck-train autoencoder only"),
    Rule("train", lambda s, o: s.bottleneck_train == "autoencoder" and (not s.bottleneck or s.cut != "cnn"),
         "--bottleneck-train autoencoder needs --bottleneck K and --cut cnn"),
    # The fitted projection reaches stage0 with the replica's update after each rollout.
    Rule("train", lambda s, o: s.bottleneck_train == "autoencoder" and s.codecs.exchange.partition(":")[0] != "replica",
         "--bottleneck-train autoencoder needs --exchange replica (its projection travels with the replica's "
         "update after each rollout)"),
    Rule("train", lambda s, o: s.bottleneck_train == "autoencoder" and s.schedule.edges > 1,
         "--bottleneck-train autoencoder runs one edge (a fleet would average a projection that stage1 fits)"),
    Rule("train", lambda s, o: s.bottleneck_train == "autoencoder" and s.codecs.link_budget,
         "--bottleneck-train autoencoder cannot run with --link-budget yet (the budget does not count the samples "
         "and the projection's updates)"),
    # -- the length of the run -----------------------------------------------------------------------------
    Rule("last", lambda s, o: s.num_iterations < 1,
         "--total-steps {s.total_steps} is less than one iteration (num_steps x num_envs x edges = "
         "{s.steps_per_iteration})"),
    Rule("last", lambda s, o: s.num_iterations >= 1 and s.total_steps % s.steps_per_iteration,
         lambda s, o: f"--total-steps {s.total_steps} is not a whole number of iterations of {s.steps_per_iteration} "
                      f"steps (num_steps x num_envs x edges): use {s.num_iterations * s.steps_per_iteration} or "
                      f"{(s.num_iterations + 1) * s.steps_per_iteration}"),
    # -- a process's options -------------------------------------------------------------------------------
    Rule("options", lambda s, o: o.act_wait_seconds() is not None and not o.act_wait_seconds() >= 0,
         "--act-wait must be 'all' or milliseconds >= 0, got {o.act_wait!r}"),
    Rule("options", lambda s, o: o.resume and o.overwrite, "--resume and --overwrite contradict each other"),
    Rule("options", lambda s, o: o.resume and o.run_dir and o.run_dir != o.resume,
         "--resume {o.resume} continues the run there: --run-dir must be the same or not given"),
    Rule("options", lambda s, o: o.curve and o.transport != "zmq",
         "--curve needs --transport zmq (the {o.transport} transport has no encryption: it stays on this machine "
         "unless --insecure)"),
    Rule("options", lambda s, o: o.rejoin and not o.checkpoint_every,
         "--rejoin continues from a checkpoint: it needs --checkpoint-every >= 1"),
    Rule("options", lambda s, o: o.rejoin and not o.heartbeat,
         "--rejoin needs --heartbeat > 0: that is how a lost stage0 is noticed"),
    Rule("options", lambda s, o: o.capture_video and not o.eval_every,
         "--capture-video records the evaluations' episodes: it needs --eval-every N"),
    # -- a process's options against the training settings ------------------------------------------------
    Rule("launch", lambda s, o: o.edge_id >= s.schedule.edges,
         lambda s, o: f"--edge-id {o.edge_id}: the fleet has --edges {s.schedule.edges} "
                      f"(ids 0 .. {s.schedule.edges - 1})"),
    Rule("launch", lambda s, o: o.min_edges > s.schedule.edges,
         "--min-edges {o.min_edges}: the fleet has --edges {s.schedule.edges}"),
    Rule("launch", lambda s, o: o.learners > 1 and s.schedule.edges < o.learners,
         "--learners {o.learners} serve a fleet of at least as many edges, got --edges {s.schedule.edges}"),
    Rule("launch", lambda s, o: o.learners > 1 and (o.min_edges not in (0, s.schedule.edges) or o.rejoin),
         "--min-edges and --rejoin work with one learner (--learners 1): across learners an edge lost ends the "
         "run"),
    Rule("launch", lambda s, o: o.learners > 1 and _robust(s),
         "--encoder-sync ...:robust=... works with one learner (--learners 1): each coordinate's trimmed mean or "
         "median is taken over the edges one stage1 serves"),
    Rule("launch", lambda s, o: o.learners > 1 and (s.cut == "input" or s.bottleneck_train == "autoencoder"),
         "--learners > 1 needs the samples' features to stay with each learner's edges: not --cut input (stage1 "
         "would train alone on every edge's frames) nor --bottleneck-train autoencoder (its fit would see one "
         "learner's samples)"),
    Rule("launch", lambda s, o: s.schedule.edges > 1 and o.transport != "zmq",
         "--edges > 1 runs over --transport zmq only, got {o.transport}"),
]
"""Every rule that ties options together; each has a test that triggers it (tests/test_settings.py)."""


def rule_errors(scope: str, s: Any, o: Any = None) -> list[str]:
    """The messages of the rules of ``scope`` that apply to ``s`` and ``o``, in the table's order."""
    return [rule.text(s, o) for rule in RULES if rule.scope == scope and rule.applies(s, o)]
