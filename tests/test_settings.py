"""Settings: every declared range is checked by the one generic routine, every cross-option rule has an example
that triggers it, and all problems are reported at once."""

from __future__ import annotations

import dataclasses
import math

import pytest
from click.testing import CliRunner

from splitrl.cli import main
from splitrl.settings import (RULES, CodecSettings, EncoderSync, EnvSettings, Exchange, PPOSettings, RunOptions,
                              ScheduleSettings, SettingsError, TrainSettings, field_errors, option_name)
from splitrl.settings.options import BOUNDS

SECTIONS = {"env": EnvSettings, "ppo": PPOSettings, "codecs": CodecSettings, "schedule": ScheduleSettings}
OPTION_CLASSES = (*SECTIONS.values(), TrainSettings, RunOptions)


def _declared(key: str) -> list[tuple[type, dataclasses.Field]]:
    return [(cls, f) for cls in OPTION_CLASSES for f in dataclasses.fields(cls) if key in f.metadata]


def _step(value: float, direction: float, kind: type) -> float:
    """The nearest value of ``kind`` beyond ``value`` in ``direction``."""
    return value + direction if kind is int else math.nextafter(float(value), direction * math.inf)


def _edges(f: dataclasses.Field) -> list[tuple[float, float]]:
    """(just outside, just inside) for each bound the field declares."""
    kind, meta = int if f.default is None else type(f.default), f.metadata  # None: an int option left unset
    out = []
    if "min" in meta:
        out.append((_step(meta["min"], -1, kind), kind(meta["min"])))
    if "max" in meta:
        out.append((_step(meta["max"], 1, kind), kind(meta["max"])))
    if "above" in meta:
        out.append((kind(meta["above"]), _step(meta["above"], 1, kind)))
    return out


def _all_errors(cls: type, f: dataclasses.Field, value: object) -> list[str]:
    """What the settings' own ``errors`` report with one field changed."""
    if cls is RunOptions:
        return RunOptions(**{f.name: value}).errors()
    if cls is TrainSettings:
        return TrainSettings(**{f.name: value}).errors()
    section = next(name for name, kind in SECTIONS.items() if kind is cls)
    return TrainSettings(**{section: cls(**{f.name: value})}).errors()


def _own(errors: list[str], f: dataclasses.Field) -> list[str]:
    return [e for e in errors if e.startswith(f"{option_name(f)} must be")]


BOUNDED = [(cls, f) for cls in OPTION_CLASSES for f in dataclasses.fields(cls) if set(BOUNDS) & set(f.metadata)]


def test_ranges_are_declared_with_the_options():
    names = {option_name(f) for _, f in BOUNDED}
    assert len(BOUNDED) >= 30
    assert {"--num-envs", "--gamma", "--init-log-std", "--lr-encoder", "--microbatches", "--edges", "--seed",
            "--timeout", "--learners", "--edge-id", "--eval-episodes"} <= names
    for cls, f in BOUNDED:  # a default lies inside its own range
        assert _own(field_errors(cls()), f) == [], f.name


@pytest.mark.parametrize("cls, f", BOUNDED, ids=[f"{c.__name__}.{f.name}" for c, f in BOUNDED])
def test_each_declared_bound_rejects_just_outside_and_accepts_just_inside(cls, f):
    for outside, inside in _edges(f):
        refused = _own(field_errors(cls(**{f.name: outside})), f)
        assert len(refused) == 1 and refused[0].endswith(f"got {outside}"), (outside, refused)
        assert refused[0] in _all_errors(cls, f, outside)  # the settings' errors run the generic check
        assert _own(field_errors(cls(**{f.name: inside})), f) == [], inside
    if isinstance(f.default, float):
        assert _own(field_errors(cls(**{f.name: math.nan})), f)
        assert bool(_own(field_errors(cls(**{f.name: math.inf})), f)) == (
            f.metadata.get("finite", False) or "max" in f.metadata)


@pytest.mark.parametrize("cls", [Exchange, EncoderSync])
def test_the_ranges_of_a_specs_parameters_are_declared_and_checked(cls):
    option = "--exchange" if cls is Exchange else "--encoder-sync"
    name = "replica" if cls is Exchange else "avg"
    bounded = [f for f in dataclasses.fields(cls) if "min" in f.metadata]
    assert bounded
    for f in bounded:
        low = f.metadata["min"]
        assert getattr(cls.parse(f"{name}:{f.name}={low}"), f.name) == low
        with pytest.raises(SettingsError, match=f"{option} .*: {f.name} must be >= {low:g}, got {low - 1}"):
            cls.parse(f"{name}:{f.name}={low - 1}")


@pytest.mark.parametrize("cls, f", _declared("choices"), ids=[f.name for _, f in _declared("choices")])
def test_each_declared_choice_is_checked(cls, f):
    choices = f.metadata["choices"]
    assert _own(_all_errors(cls, f, "bogus"), f) == [f"{option_name(f)} must be one of {', '.join(choices)}, "
                                                     "got 'bogus'"]
    for choice in choices:
        assert _own(field_errors(cls(**{f.name: choice})), f) == []


@pytest.mark.parametrize("cls, f, bad", [
    (EnvSettings, "env_kwargs", "a=1,b"), (CodecSettings, "codec_rollout", "gzip"),
    (CodecSettings, "codec_fwd", "paper"), (CodecSettings, "codec_bwd", "replica"), (CodecSettings, "exchange", "copy"),
    (CodecSettings, "link_budget", "fast"), (ScheduleSettings, "encoder_sync", "avg:every=0"),
    (ScheduleSettings, "encoder_sync", "grad:robust=mean"), (ScheduleSettings, "encoder_sync", "grad:every=2"),
])
def test_each_spec_option_reports_what_is_wrong_naming_itself(cls, f, bad):
    field = next(g for g in dataclasses.fields(cls) if g.name == f)
    assert "spec" in field.metadata
    errors = field_errors(cls(**{f: bad}))
    assert len(errors) == 1 and errors[0].startswith(option_name(field)), errors
    assert field_errors(cls()) == []


FLEET = ScheduleSettings(edges=2)
AE = {"bottleneck_train": "autoencoder", "bottleneck": 8, "codecs": CodecSettings(exchange="replica")}
EXAMPLES: list[tuple[str, TrainSettings, RunOptions]] = [
    # (a piece of the message, settings, options): each triggers the rule whose message has that piece
    ("rollout carries the observations", TrainSettings(cut="input", codecs=CodecSettings(codec_rollout="relu")),
     RunOptions()),
    ("frames needs --cut input", TrainSettings(codecs=CodecSettings(codec_rollout="frames")), RunOptions()),
    ("--codec-fwd 'bf16': with --cut input", TrainSettings(cut="input", codecs=CodecSettings(codec_fwd="bf16")),
     RunOptions()),
    ("--codec-bwd 'ef': with --cut input", TrainSettings(cut="input", codecs=CodecSettings(codec_bwd="ef")),
     RunOptions()),
    ("--codec-fwd 'relu': with --exchange replica",
     TrainSettings(codecs=CodecSettings(exchange="replica", codec_fwd="relu")), RunOptions()),
    ("--codec-bwd 'paper': with --exchange replica",
     TrainSettings(codecs=CodecSettings(exchange="replica", codec_bwd="paper")), RunOptions()),
    ("--exchange 'replica': with --cut input", TrainSettings(cut="input", codecs=CodecSettings(exchange="replica")),
     RunOptions()),
    ("--link-budget needs --cut cnn", TrainSettings(cut="input", codecs=CodecSettings(link_budget="2mbit")),
     RunOptions()),
    ("must divide into --minibatches 32", TrainSettings(ppo=PPOSettings(num_steps=100)), RunOptions()),
    ("--rollout-groups must be 'auto' or a divisor", TrainSettings(schedule=ScheduleSettings(rollout_groups="3")),
     RunOptions()),
    ("--microbatches must be >= 1 and divide the minibatch (128 samples), got 3",
     TrainSettings(schedule=ScheduleSettings(microbatches=3)), RunOptions()),
    ("cannot carry the paper codec", TrainSettings(schedule=ScheduleSettings(microbatches=2),
                                                   codecs=CodecSettings(codec_bwd="paper")), RunOptions()),
    ("--link-budget works with one edge", TrainSettings(total_steps=8192, schedule=FLEET,
                                                        codecs=CodecSettings(link_budget="2mbit")), RunOptions()),
    ("the fleet's own schedule", TrainSettings(schedule=ScheduleSettings(edges=2, microbatches=2)), RunOptions()),
    ("--edges > 1 works with --exchange features only",
     TrainSettings(schedule=FLEET, codecs=CodecSettings(exchange="replica")), RunOptions()),
    ("takes the training codecs", TrainSettings(schedule=FLEET, codecs=CodecSettings(codec_bwd="ef")), RunOptions()),
    ("it needs --async --max-staleness 1", TrainSettings(schedule=ScheduleSettings(publish="epoch")), RunOptions()),
    ("--publish epoch needs --cut cnn",
     TrainSettings(cut="input", schedule=ScheduleSettings(asynchronous=True, publish="epoch")), RunOptions()),
    ("--rescore works with --async only", TrainSettings(schedule=ScheduleSettings(rescore=True)), RunOptions()),
    ("--async works with --exchange features only", TrainSettings(
        schedule=ScheduleSettings(asynchronous=True), codecs=CodecSettings(exchange="replica")), RunOptions()),
    ("--async cannot carry the delta codec", TrainSettings(
        schedule=ScheduleSettings(asynchronous=True), codecs=CodecSettings(codec_fwd="delta")), RunOptions()),
    ("applies to --bottleneck-train autoencoder only", TrainSettings(autoencoder_every=8), RunOptions()),
    ("needs --bottleneck K and --cut cnn", TrainSettings(**{**AE, "bottleneck": 0}), RunOptions()),
    ("autoencoder needs --exchange replica", TrainSettings(**{**AE, "codecs": CodecSettings()}), RunOptions()),
    ("autoencoder runs one edge", TrainSettings(**AE, schedule=FLEET, total_steps=8192), RunOptions()),
    ("autoencoder cannot run with --link-budget",
     TrainSettings(**{**AE, "codecs": CodecSettings(exchange="replica", link_budget="2mbit")}), RunOptions()),
    ("--total-steps 4095 is less than one iteration", TrainSettings(total_steps=4095), RunOptions()),
    ("use 405504 or 409600", TrainSettings(total_steps=409599), RunOptions()),
    ("--act-wait must be 'all' or milliseconds >= 0, got '-1'", TrainSettings(), RunOptions(act_wait="-1")),
    ("contradict each other", TrainSettings(), RunOptions(resume="runs/a", overwrite=True)),
    ("--run-dir must be the same", TrainSettings(), RunOptions(resume="runs/a", run_dir="runs/b")),
    ("--curve needs --transport zmq", TrainSettings(), RunOptions(curve="keys", transport="tcp")),
    ("it needs --checkpoint-every >= 1", TrainSettings(), RunOptions(rejoin=5, checkpoint_every=0)),
    ("--rejoin needs --heartbeat > 0", TrainSettings(), RunOptions(rejoin=5, heartbeat=0)),
    ("--capture-video records the evaluations' episodes", TrainSettings(), RunOptions(capture_video=True)),
    ("--edge-id 2: the fleet has --edges 2 (ids 0 .. 1)", TrainSettings(total_steps=8192, schedule=FLEET),
     RunOptions(edge_id=2)),
    ("--min-edges 3: the fleet has --edges 2", TrainSettings(total_steps=8192, schedule=FLEET),
     RunOptions(min_edges=3)),
    ("serve a fleet of at least as many edges", TrainSettings(), RunOptions(learners=2)),
    ("work with one learner", TrainSettings(total_steps=8192, schedule=FLEET), RunOptions(learners=2, rejoin=5)),
    ("robust=... works with one learner",
     TrainSettings(total_steps=8192, schedule=ScheduleSettings(edges=2, encoder_sync="grad:robust=median")),
     RunOptions(learners=2)),
    ("--learners > 1 needs the samples' features", TrainSettings(cut="input", total_steps=8192, schedule=FLEET),
     RunOptions(learners=2)),
    ("runs over --transport zmq only, got tcp", TrainSettings(total_steps=8192, schedule=FLEET),
     RunOptions(transport="tcp")),
]


def _reported(settings: TrainSettings, options: RunOptions) -> str:
    with pytest.raises(SettingsError, match="invalid settings") as info:
        settings.validate(options)
    return str(info.value)


@pytest.mark.parametrize("piece, settings, options", EXAMPLES, ids=[p for p, _, _ in EXAMPLES])
def test_each_example_triggers_its_rule_and_is_reported(piece, settings, options):
    texts = [rule.text(settings, options) for rule in RULES if rule.applies(settings, options)]
    mine = [text for text in texts if piece in text]
    assert len(mine) == 1, texts
    assert mine[0] in _reported(settings, options)


def test_every_rule_has_an_example_that_triggers_it():
    untested = [rule.text(TrainSettings(), RunOptions()) for rule in RULES
                if not any(rule.applies(s, o) and piece in rule.text(s, o) for piece, s, o in EXAMPLES)]
    assert untested == []


def test_the_defaults_break_no_rule():
    assert TrainSettings().errors() == [] and RunOptions().errors() == []
    assert not [rule for rule in RULES if rule.applies(TrainSettings(), RunOptions())]


def test_the_codecs_own_check_holds_their_rules_with_the_cut():
    codecs = CodecSettings(exchange="replica", codec_fwd="relu", link_budget="fast")
    errors = codecs.errors("cnn")
    assert any("4 values a sample" in e for e in errors) and any(e.startswith("--link-budget:") for e in errors)
    assert errors == [e for e in TrainSettings(codecs=codecs).errors() if e in errors]


def test_the_run_length_is_checked_only_once_all_else_holds():
    """It divides by the rollout's size, which the other checks vouch for."""
    assert TrainSettings(total_steps=100, ppo=PPOSettings(num_steps=0)).errors() == ["--num-steps must be >= 1, got 0"]


def test_all_errors_are_reported_at_once():
    settings = TrainSettings(seed=-1, cut="", env=EnvSettings(env_id="", frame_stack=0),
                             ppo=PPOSettings(gamma=2.0, lr_heads=math.inf),
                             codecs=CodecSettings(codec_bwd="gzip"),
                             schedule=ScheduleSettings(rescore=True, encoder_sync="avg:every=0"))
    options = RunOptions(timeout=0.0, resume="runs/a", overwrite=True, learners=2)
    expected = ["--seed must be >= 0, got -1", "--cut must not be empty",
                "--env-id must not be empty", "--frame-stack must be >= 1, got 0", "--gamma must be in [0, 1], got 2.0",
                "--lr-heads must be > 0, got inf", "--codec-bwd: codec 'gzip'", "every must be >= 1, got 0",
                "--rescore works with --async only", "--timeout must be > 0, got 0.0",
                "--resume and --overwrite contradict each other", "serve a fleet of at least as many edges"]
    message = _reported(settings, options)
    for piece in expected:
        assert piece in message, piece
    assert message.count("\n  - ") == len(expected)


def test_the_command_line_refuses_every_problem_at_once_before_any_socket_opens():
    # The endpoint is unreachable: had stage0 tried the link, it would wait --start-timeout for it.
    result = CliRunner().invoke(main, ["stage0", "--connect", "tcp://127.0.0.1:9", "--start-timeout", "600",
                                       "--gamma", "2", "--timeout", "0", "--edges", "0", "--rescore"])
    assert result.exit_code == 2, result.output
    for piece in ("--gamma must be in [0, 1]", "--timeout must be > 0", "--edges must be >= 1", "--rescore works"):
        assert piece in result.output, result.output


def test_the_model_its_kwargs_the_cut_and_the_heads_width_are_shared_and_checked():
    shared = TrainSettings(model="impala", model_kwargs="width=8", hidden=256, cut="fc").shared()
    assert (shared["model"], shared["model_kwargs"], shared["hidden"], shared["cut"]) == ("impala", "width=8", 256, "fc")
    assert TrainSettings(model="my_pkg.nets:encoder", cut="3").errors() == []
    errors = TrainSettings(model="resnet", model_kwargs="width", hidden=0).errors()
    assert errors == ["--model 'resnet': unknown model (built-ins: nature, impala, mlp; auto; or a factory of your "
                      "own as module:factory)", "--model-kwargs 'width': 'width' is not key=value", "--hidden must be >= 1, got 0"]
