"""The pipelined and asynchronous schedules: what they may change (nothing, or float sums) and what they keep."""

import dataclasses
import json

import pytest
import torch

from splitrl.launch import free_port_pair
from splitrl.runs import load_checkpoint, read_metrics
from splitrl.runner import build, train_twin
from splitrl.schedule import asynchronous, pipelined
from splitrl.schedule.pipelined import choose_groups, rollout_lag
from splitrl.settings import CodecSettings, EnvSettings, PPOSettings, RunOptions, ScheduleSettings, TrainSettings

from ..conftest import TINY, train_in_process

# Two envs, two iterations of 32 steps each, minibatches of 32 samples.
TWO_ENVS = ["--num-envs", "2", "--total-steps", "128", "--num-steps", "32", "--epochs", "2", "--minibatches", "2",
            "--max-episode-steps", "20", "--threads", "1", "--checkpoint-every", "1", "--hidden", "32"]
VOLATILE = ("time/", "cpu/", "link/")


def _states(run_dir, iteration=2):
    return {stage: load_checkpoint(run_dir, stage, iteration)[key]
            for stage, key in (("stage0", "net"), ("stage1", "heads"))}


def _metrics(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE) and k != "charts/SPS"} for r in rows]


def _assert_same_states(a, b):
    for stage in a:
        assert a[stage].keys() == b[stage].keys()
        for name in a[stage]:
            assert torch.equal(a[stage][name], b[stage][name]), f"{stage}.{name}"


def _twin(run_dir, *args):
    """``splitrl train --run-dir RUN_DIR ARGS...``, in this process: the twin has no process boundary to test."""
    done = train_in_process("--run-dir", str(run_dir), *args)
    assert done.exit_code == 0, done.output[-3000:]


def _split(run_dir, spawn, args, *stage0_args):
    """A split run over loopback tcp with ``args`` on both stages (``stage0_args`` on stage0 alone)."""
    endpoint = f"tcp://127.0.0.1:{free_port_pair()}"
    s1 = spawn("stage1", "--bind", endpoint, "--run-dir", str(run_dir), *args)
    s0 = spawn("stage0", "--connect", endpoint, "--run-dir", str(run_dir), *stage0_args, *args)
    code0, out0 = s0.finish(timeout=300)
    code1, out1 = s1.finish(timeout=30)
    assert code0 == 0 and code1 == 0, out0 + out1


def test_pipelined_split_matches_its_twin_bit_for_bit(tmp_path, spawn):
    """Two env groups and two micro-batches, envs in worker processes on the split's edge: the twin,
    with the same groups and micro-batches but envs stepped in-process, computes the same numbers."""
    args = TWO_ENVS + ["--rollout-groups", "2", "--microbatches", "2", "--timeout", "60", "--start-timeout", "60"]
    split = tmp_path / "split"
    _split(split, spawn, args, "--vector", "async")
    _twin(tmp_path / "twin", *args)
    _assert_same_states(_states(split), _states(tmp_path / "twin"))
    assert _metrics(split) == _metrics(tmp_path / "twin")
    rows = [json.loads(line) for line in (split / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["schedule/rollout_groups"] == 2 and rows[-1]["link/rtt_ms"] > 0
    # Micro-batches: 2 epochs x 2 minibatches x 2 micro-batches a training message each, an iteration.
    assert rows[-1]["net/train_fwd/sent_messages"] == rows[-1]["net/train_bwd/recv_messages"] == 2 * 2 * 2
    # The env workers' CPU seconds, apart from stage0's (the bench's floor); none in the twin, whose envs are its own.
    twin = [json.loads(line) for line in (tmp_path / "twin" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["cpu/envs"] > 0 for r in rows) and all(r["cpu/envs"] == 0 for r in twin)


def _train_in_process(run_dir, settings, monkeypatch=None, mode=None):
    if mode is not None:
        monkeypatch.setitem(build.SCHEDULES, "sync", mode)
    train_twin(settings, RunOptions(run_dir=str(run_dir), threads=1, checkpoint_every=1))


def _tiny(**schedule):
    return TrainSettings(total_steps=64, env=EnvSettings(max_episode_steps=20),
                         ppo=PPOSettings(num_steps=32, epochs=2, minibatches=2),
                         schedule=ScheduleSettings(**schedule))


def test_with_one_group_and_one_micro_batch_the_pipelined_loops_are_the_synchronous_ones(tmp_path, monkeypatch):
    _train_in_process(tmp_path / "sync", _tiny())
    _train_in_process(tmp_path / "pipelined", _tiny(), monkeypatch, pipelined)
    _assert_same_states(_states(tmp_path / "sync"), _states(tmp_path / "pipelined"))
    sync, piped = _metrics(tmp_path / "sync"), _metrics(tmp_path / "pipelined")
    # The same numbers and the same messages; only the bytes differ, by the headers' g and j and the pings.
    learning = [{k: v for k, v in r.items() if not k.startswith(("net", "schedule/"))} for r in sync]
    assert learning == [{k: v for k, v in r.items() if not k.startswith(("net", "schedule/"))} for r in piped]
    for a, b in zip(sync, piped):
        for key in (k for k in a if k.startswith("net/") and k.endswith("_messages")):
            assert a[key] == b[key], key


@pytest.mark.parametrize("exchange", ["features", "replica:sync=fp32,all_every=1"])
def test_micro_batches_change_the_update_only_by_the_order_of_float_sums(tmp_path, exchange):
    codecs = CodecSettings(exchange=exchange)
    _train_in_process(tmp_path / "m1", dataclasses.replace(_tiny(), codecs=codecs))
    _train_in_process(tmp_path / "m4", dataclasses.replace(_tiny(microbatches=4), codecs=codecs))
    from splitrl.models import build_agent

    initial = dict(zip(("stage0", "stage1"), (m.state_dict() for m in build_agent((4, 96, 96), 3, "cnn", 1, -0.5))))
    one, four = _states(tmp_path / "m1", 1), _states(tmp_path / "m4", 1)
    for stage in one:
        diff = sum(float(((four[stage][k] - one[stage][k]) ** 2).sum()) for k in one[stage])
        move = sum(float(((one[stage][k] - initial[stage][k]) ** 2).sum()) for k in one[stage])
        assert move > 0 and (diff / move) ** 0.5 < 1e-4, stage
    # ... and the four micro-batches did cross the link: four forward messages where one run sent one
    sent = [read_metrics(tmp_path / run)[-1]["net/train_fwd/sent_messages"] for run in ("m1", "m4")]
    assert sent[1] == 4 * sent[0] > 0


def test_asynchronous_with_no_staleness_computes_what_the_pipelined_schedule_does(tmp_path):
    """With --max-staleness 0 the rollout waits for training: the acting copies always hold the
    trained weights, nothing lags, so the numbers are the pipelined schedule's, bit for bit."""
    args = TWO_ENVS + ["--rollout-groups", "2", "--microbatches", "2"]
    _twin(tmp_path / "pipelined", *args)
    _twin(tmp_path / "async", *args, "--async", "--max-staleness", "0")
    _assert_same_states(_states(tmp_path / "pipelined"), _states(tmp_path / "async"))
    piped = _metrics(tmp_path / "pipelined")
    asynchronous = [{k: v for k, v in r.items() if not k.startswith("async/")} for r in _metrics(tmp_path / "async")]
    assert [{k: v for k, v in r.items() if not k.startswith("net")} for r in piped] == \
        [{k: v for k, v in r.items() if not k.startswith("net")} for r in asynchronous]


def test_a_rescored_asynchronous_split_matches_its_twin_bit_for_bit(tmp_path, spawn):
    """--rescore over the wire: stage0 sends the rollout's features once more before each training (bf16, as
    train_fwd's are) and stage1 scores them; with --max-staleness 0 the run is deterministic, so the split
    and the twin compute the same numbers, and the rescore's bytes are metered under their own kind."""
    args = TWO_ENVS + ["--rollout-groups", "2", "--async", "--max-staleness", "0", "--rescore", "--codec-fwd", "bf16",
                       "--timeout", "60", "--start-timeout", "60"]
    split = tmp_path / "split"
    _split(split, spawn, args)
    _twin(tmp_path / "twin", *args)
    _assert_same_states(_states(split), _states(tmp_path / "twin"))
    split_rows, twin_rows = _metrics(split), _metrics(tmp_path / "twin")
    # Which iteration's record counts a rollout message depends on the threads' timing; the totals do not.
    assert [{k: v for k, v in r.items() if not k.startswith("net")} for r in split_rows] == \
        [{k: v for k, v in r.items() if not k.startswith("net")} for r in twin_rows]
    assert {k: v for k, v in split_rows[-1].items() if k.startswith("net_total/")} == \
        {k: v for k, v in twin_rows[-1].items() if k.startswith("net_total/")}
    rows = [json.loads(line) for line in (split / "metrics.jsonl").read_text().splitlines()]
    # 64 samples an iteration in one message of 64 x 4096 bfloat16 features, and its header.
    assert all(r["net/rescore/sent_messages"] == 1 for r in rows)
    assert all(64 * 4096 * 2 < r["net/rescore/sent_bytes"] < 64 * 4096 * 2 + 1024 for r in rows)


def test_an_epoch_paced_asynchronous_split_matches_its_twin_bit_for_bit(tmp_path, spawn):
    """--publish epoch: both stages publish after every epoch and step t of a rollout acts with the weights after
    floor(t * E / T) epochs of the training beside it, whatever the machines' speed, so the split (envs in worker
    processes) and the twin compute the same numbers at --max-staleness 1. With E = 2 epochs and T = 32 steps, the
    second rollout's first 16 steps act with the weights before that training (2 epochs behind the weights that
    train on them), the last 16 with those after its first epoch (1 behind): 0.75 of an iteration on average."""
    args = TWO_ENVS + ["--rollout-groups", "2", "--async", "--max-staleness", "1", "--publish", "epoch",
                       "--timeout", "60", "--start-timeout", "60"]
    split = tmp_path / "split"
    _split(split, spawn, args, "--vector", "async")
    _twin(tmp_path / "twin", *args)
    _assert_same_states(_states(split), _states(tmp_path / "twin"))
    split_rows, twin_rows = _metrics(split), _metrics(tmp_path / "twin")
    assert [{k: v for k, v in r.items() if not k.startswith("net")} for r in split_rows] == \
        [{k: v for k, v in r.items() if not k.startswith("net")} for r in twin_rows]
    assert [(r["async/staleness_mean"], r["async/staleness_max"]) for r in split_rows] == [(0.0, 0.0), (0.75, 1.0)]


def test_an_early_stop_publishes_the_epochs_it_skips_for_the_paced_rollout(tmp_path):
    """With --target-kl ending each training after its first epoch, the weights after it stand for the epochs
    skipped (`epoch_versions`), so the paced rollout finds every version it asks for (rollout 3 starts with
    version 2, which only the alias names), and a sample acted on by an alias lags by the training it missed."""
    args = TWO_ENVS + ["--rollout-groups", "2", "--async", "--max-staleness", "1", "--publish", "epoch",
                       "--target-kl", "1e-9", "--total-steps", "192"]
    _twin(tmp_path / "early", *args)
    rows = _metrics(tmp_path / "early")
    assert [r["iteration"] for r in rows] == [1, 2, 3]
    assert all(r["losses/early_stop"] == 1.0 for r in rows)
    # Training i leaves versions 2i - 1 and 2i, one copy. Rollout i's first 16 steps act with 2i - 4 (the
    # weights before training i - 1: it lags one training), its last 16 with 2i - 3 = the weights training i
    # starts from (no lag): 0.5 of an iteration on average.
    assert [(r["async/staleness_mean"], r["async/staleness_max"]) for r in rows] == [(0.0, 0.0), (0.5, 1.0),
                                                                                      (0.5, 1.0)]


@pytest.mark.parametrize("publish", ["iteration", "epoch"])
def test_an_asynchronous_run_resumes(tmp_path, publish):
    """Stopped after iteration 2 and resumed to 3: the first rollout after the resume acts with the weights the
    checkpoint holds, the newest there are (no lag), in versions of either kind."""
    args = TWO_ENVS + ["--rollout-groups", "2", "--async", "--max-staleness", "1", "--publish", publish]
    run = tmp_path / "run"
    _twin(run, *args)
    done = train_in_process("--resume", str(run), *args, "--total-steps", "192")
    assert done.exit_code == 0, done.output[-3000:]
    rows = _metrics(run)
    assert [r["iteration"] for r in rows] == [1, 2, 3]
    assert rows[2]["async/staleness_max"] == 0.0
    if publish == "epoch":  # (free-running, iteration 2's lag depends on the threads' timing)
        assert rows[1]["async/staleness_max"] == 1.0


def test_a_resumed_pipelined_run_counts_the_bytes_an_uninterrupted_one_does(tmp_path):
    """The resumed session's pings and plan, like its hellos, are its opening: left out of the run's byte counters,
    and numbered before its sequence numbers go on from the checkpoint's."""
    args = TWO_ENVS + ["--rollout-groups", "2", "--microbatches", "2"]
    _twin(tmp_path / "straight", *args, "--total-steps", "192")
    _twin(tmp_path / "run", *args)
    done = train_in_process("--resume", str(tmp_path / "run"), *args, "--total-steps", "192")
    assert done.exit_code == 0, done.output[-3000:]
    straight, resumed = read_metrics(tmp_path / "straight")[-1], read_metrics(tmp_path / "run")[-1]
    counters = sorted(k for k in straight if k.startswith(("net/", "net_total/")))
    assert counters and counters == sorted(k for k in resumed if k.startswith(("net/", "net_total/")))
    assert {k: resumed[k] for k in counters} == {k: straight[k] for k in counters}


def test_epoch_versions_and_the_pace():
    # P = 1: only an iteration's end publishes, as its number.
    assert asynchronous.epoch_versions(3, 0, False, 1) == [] and asynchronous.epoch_versions(3, 9, True, 1) == [3]
    # P = 10: one version an epoch; the last also every number after it, when training stopped early.
    assert asynchronous.epoch_versions(3, 0, False, 10) == [21]
    assert asynchronous.epoch_versions(3, 9, True, 10) == [30]
    assert asynchronous.epoch_versions(3, 3, True, 10) == list(range(24, 31))
    # Rollout 3 of T = 1024 steps at P = 10: steps 0-102 act with version 10 (iteration 1's end), the last with
    # 19 (iteration 2 minus its last epoch); a run resumed at iteration 3 acts with 20 throughout its first.
    paced = [asynchronous.paced_version(3, t, 1024, 10, 1) for t in range(1024)]
    assert paced[0] == paced[102] == 10 and paced[103] == 11 and paced[-1] == 19
    assert paced == sorted(paced) and set(paced) == set(range(10, 20))
    assert {asynchronous.paced_version(3, t, 1024, 10, 3) for t in range(1024)} == {20}
    assert [asynchronous.paced_version(1, t, 4, 2, 1) for t in range(4)] == [0, 0, 0, 0]


def test_a_rescore_goes_through_the_fwd_codec_a_link_budget_chose(tmp_path):
    """--link-budget switches the fwd codec when an iteration's training begins: the rescore that opens it is
    encoded and decoded with the new one on both sides (bf16 -> int8 here: half the bytes). The budget chooses
    at a rollout's start from the newest record; rollout 4 starts after iteration 2 trained, so after record 1
    (rollout 3 may start before record 1 is written: four iterations, not three)."""
    args = ["--num-envs", "2", "--num-steps", "16", "--total-steps", "128", "--epochs", "2", "--minibatches", "2",
            "--max-episode-steps", "20", "--threads", "1", "--hidden", "32", "--async", "--rescore", "--codec-fwd",
            "bf16", "--link-budget", "1kbit"]
    _twin(tmp_path / "twin", *args)
    rows = [json.loads(line) for line in (tmp_path / "twin" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["budget/spec/fwd"] == "int8" and "budget/spec/fwd" not in rows[0]
    assert rows[-1]["net/rescore/sent_bytes"] < 0.6 * rows[0]["net/rescore/sent_bytes"]


def test_rescore_is_refused_without_async():
    settings = TrainSettings(schedule=ScheduleSettings(rescore=True))
    assert any("--rescore works with --async only" in e for e in settings.errors())


def test_auto_groups_hide_the_round_trip_with_the_fewest_groups():
    # Worker envs (lag 1): K >= 2 + RTT / step.
    assert choose_groups(8, rtt=0.020, step_seconds=0.005) == 8  # 6 wanted: the next divisor up
    assert choose_groups(6, rtt=0.012, step_seconds=0.005) == 6  # 4.4 wanted, 6 is the next divisor
    assert choose_groups(4, rtt=0.002, step_seconds=0.005) == 4  # 2.4 wanted
    # In-process envs (lag 0, a group steps its envs one after another): K >= 1 + RTT / (N/K x step).
    assert choose_groups(8, rtt=0.020, step_seconds=0.005, parallel=False) == 2  # 2 groups of 4: 20 ms a turn
    assert choose_groups(8, rtt=0.030, step_seconds=0.005, parallel=False) == 4  # 4 groups of 2: 10 ms a turn
    assert choose_groups(8, rtt=0.050, step_seconds=0.005, parallel=False) == 8  # 40 ms of steps cannot hide 50
    assert choose_groups(1, rtt=0.5, step_seconds=0.005) == 1  # one env: one group, whatever the link
    assert choose_groups(4, rtt=0.0, step_seconds=0.005) == 1  # no latency to hide
    assert choose_groups(8, rtt=0.0002, step_seconds=0.005) == 1  # a round trip of 4 % of a step is not worth it


def test_rollout_lag_leaves_a_group_on_the_link():
    assert [rollout_lag(k, "async") for k in (1, 2, 4)] == [0, 1, 1]
    assert [rollout_lag(k, "sync") for k in (1, 2, 4)] == [0, 0, 0]


def test_auto_groups_are_chosen_and_recorded(tmp_path, monkeypatch):
    # An env step of a microsecond: the in-process link's round trip is then many steps, which two
    # groups (all two envs allow) hide as well as they can.
    monkeypatch.setattr(pipelined, "_env_step_seconds", lambda edge: 1e-6)
    settings = TrainSettings(total_steps=128, env=EnvSettings(num_envs=2, max_episode_steps=20),
                             ppo=PPOSettings(num_steps=32, epochs=1, minibatches=2),
                             schedule=ScheduleSettings(rollout_groups="auto"))
    _train_in_process(tmp_path / "auto", settings)
    rows = [json.loads(line) for line in (tmp_path / "auto" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["link/rtt_ms"] > 0 and rows[-1]["schedule/rollout_groups"] == 2
    assert rows[-1]["global_step"] == 128


@pytest.mark.parametrize("bound, link", [(0, "twin"), (1, "split")])
def test_asynchronous_runs_run_within_their_staleness_bound(tmp_path, spawn, bound, link):
    """Free-running over a real link (envs in worker processes), as far ahead as --max-staleness 1 lets it; at
    --max-staleness 0 the rollout waits for training whatever the link, so the twin shows it (and the rescored
    split matches its twin at 0, `test_a_rescored_asynchronous_split_matches_its_twin_bit_for_bit`)."""
    args = TINY + ["--total-steps", "96", "--async", "--max-staleness", str(bound), "--timeout", "60",
                   "--start-timeout", "60"]
    run = tmp_path / link
    if link == "split":
        _split(run, spawn, args, "--vector", "async")
    else:
        _twin(run, *args, "--vector", "async")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [1, 2, 3] and rows[-1]["global_step"] == 96
    assert all(r["async/staleness_max"] <= bound for r in rows)  # how far below depends on the machine's timing
    assert rows[0]["async/staleness_max"] == 0  # the first rollout acts with the initial weights it trains
    assert [r["global_step"] for r in rows] == [32, 64, 96]  # each row speaks of its own rollout
    for stage in ("stage0", "stage1"):
        assert (run / "checkpoints" / f"{stage}-iter00003.pt").exists()
    episodes = (run / "episodes.jsonl").read_text().splitlines()
    assert len(episodes) == 4  # 96 steps, time limit 20


def test_asynchronous_twin_runs_with_the_cut_before_the_first_layer(tmp_path):
    _twin(tmp_path / "twin", *TINY, "--cut", "input", "--async", "--total-steps", "96")
    rows = [json.loads(line) for line in (tmp_path / "twin" / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [1, 2, 3]
    assert all(r["async/staleness_max"] <= 1 for r in rows)


def test_schedule_settings_are_checked_with_the_others():
    def errors(**kw):
        codecs = kw.pop("codecs", CodecSettings())
        return " ".join(TrainSettings(env=EnvSettings(num_envs=kw.pop("num_envs", 4)), codecs=codecs,
                                      ppo=PPOSettings(num_steps=32, minibatches=4),
                                      schedule=ScheduleSettings(**kw)).errors())

    assert errors(rollout_groups="2", microbatches=4) == ""
    assert "--rollout-groups" in errors(rollout_groups="3")
    assert "--rollout-groups" in errors(rollout_groups="many")
    assert "--microbatches" in errors(microbatches=3)  # minibatches of 32 samples
    assert "paper" in errors(microbatches=2, codecs=CodecSettings(codec_bwd="paper"))
    assert "--exchange features only" in errors(asynchronous=True, codecs=CodecSettings(exchange="replica"))
    assert "delta" in errors(asynchronous=True, codecs=CodecSettings(codec_fwd="delta"))
    assert "--max-staleness" in errors(max_staleness=-1)
    assert errors(asynchronous=True, publish="epoch") == ""
    assert "--publish epoch" in errors(publish="epoch")  # without --async
    assert "--publish epoch" in errors(asynchronous=True, max_staleness=0, publish="epoch")
    assert "--publish must be one of iteration, epoch" in errors(asynchronous=True, publish="often")
    assert ScheduleSettings().mode == "sync" and ScheduleSettings(microbatches=2).mode == "pipelined"
    assert ScheduleSettings(rollout_groups="auto").mode == "pipelined"
    assert ScheduleSettings(asynchronous=True, microbatches=2).mode == "async"


# -- CleanRL's --anneal-lr and --target-kl, in every loop -----------------------------------------------------


def _optimizer_lr(run_dir, stage, iteration):
    return load_checkpoint(run_dir, stage, iteration)["optimizer"]["param_groups"][0]["lr"]


def test_target_kl_ends_the_epochs_on_both_stages_and_anneal_lr_lowers_both_rates(tmp_path, spawn):
    """Pipelined with micro-batches over a real link, then its twin: a target KL no update stays under ends
    every iteration after its first epoch (half the training messages), the split still computes what the
    twin does, and both learning rates go down linearly (CleanRL: lr x (1 - (iteration - 1) / iterations))."""
    args = TWO_ENVS + ["--rollout-groups", "2", "--microbatches", "2", "--timeout", "60", "--start-timeout", "60",
                       "--target-kl", "1e-12", "--anneal-lr"]
    split = tmp_path / "split"
    _split(split, spawn, args)
    _twin(tmp_path / "twin", *args)
    _assert_same_states(_states(split), _states(tmp_path / "twin"))
    assert _metrics(split) == _metrics(tmp_path / "twin")
    for row in (json.loads(line) for line in (split / "metrics.jsonl").read_text().splitlines()):
        # One epoch of 2 minibatches x 2 micro-batches, not 2 epochs.
        assert row["net/train_fwd/sent_messages"] == row["net/train_bwd/recv_messages"] == 1 * 2 * 2
        assert row["losses/early_stop"] == 1.0
    defaults = PPOSettings()
    for stage, base in (("stage0", defaults.lr_encoder), ("stage1", defaults.lr_heads)):
        assert _optimizer_lr(split, stage, 1) == pytest.approx(base)
        assert _optimizer_lr(split, stage, 2) == pytest.approx(base * 0.5)


@pytest.mark.parametrize("cut", ["cnn", "input"])
def test_the_synchronous_loops_stop_where_the_kl_passes_the_target(tmp_path, cut):
    """The synchronous schedule (the twin, in process) and stage1 training alone (the cut before the first
    layer): one epoch of two when the target is tiny; two when it is off, and no early_stop key."""
    for target, name in ((1e-12, "tiny"), (0.0, "off")):
        settings = dataclasses.replace(_tiny(), cut=cut, ppo=dataclasses.replace(_tiny().ppo, target_kl=target))
        _train_in_process(tmp_path / name, settings)
    tiny, off = _metrics(tmp_path / "tiny"), _metrics(tmp_path / "off")
    assert all(r["losses/early_stop"] == 1.0 for r in tiny) and not any("losses/early_stop" in r for r in off)
    if cut == "cnn":
        assert [r["net/train_fwd/sent_messages"] for r in tiny] == [2, 2]
        assert [r["net/train_fwd/sent_messages"] for r in off] == [4, 4]
    else:
        assert [r["net/progress/recv_messages"] for r in tiny] == [1, 1]
        assert [r["net/progress/recv_messages"] for r in off] == [2, 2]
    assert tiny[0]["losses/approx_kl"] != off[0]["losses/approx_kl"]  # fewer updates: other numbers
