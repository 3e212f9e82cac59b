"""The planner: its schedules' arithmetic, its calibration on a committed run, its refusals, its command."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from splitrl.cli import main
from splitrl.errors import SettingsError
from splitrl.plan import TCP_GOODPUT, Link, Rates, Timings, calibrate, layouts, load_run, minibatch_seconds, predict
from splitrl.runs import iteration_bytes, measured_records, read_metrics
from splitrl.settings import TrainSettings

ROOT = Path(__file__).resolve().parent.parent
SYNC_RUN = ROOT / "docs/results/pipeline-latency/0ms-sync"
"""A committed synchronous run of the paper configuration (1 env x 4096, float32, 2 threads)."""

RATES = Rates(env_step=0.008, act0=0.0005, act1=0.001, train0=0.1, train1=0.05, up_step=16_384.0, down_step=68.0,
              up_sample=16_384.0, down_sample=16_384.0, other=20_000.0)


def _settings(**schedule) -> TrainSettings:
    base = TrainSettings()
    env = dataclasses.replace(base.env, num_envs=4)
    ppo = dataclasses.replace(base.ppo, num_steps=1024)
    return dataclasses.replace(base, env=env, ppo=ppo, schedule=dataclasses.replace(base.schedule, **schedule))


class FixedTimings(Timings):
    """Timings without the clock: act at a cost per call plus per env, train at a cost per minibatch; one thread
    is ``slower`` times the default's."""

    def __init__(self, slower: float = 1.5) -> None:
        self.slower = slower

    def act(self, threads: int, batch: int) -> tuple[float, float]:
        f = self.slower if threads == 1 else 1.0
        return f * (0.0003 + 0.0001 * batch), f * (0.0009 + 0.0001 * batch)

    def train(self, threads: int, minibatch: int) -> tuple[float, float]:
        f = self.slower if threads == 1 else 1.0
        return f * 0.001 * minibatch, f * 0.0006 * minibatch


def test_sync_is_the_sum_of_its_parts():
    s = _settings()
    link = Link(rate=100e6, rtt=0.02)
    plan = predict(s, RATES, link, vector="sync")
    bps = 100e6 * TCP_GOODPUT / 8
    step = 4 * 0.008 + 0.0005 + 0.001 + 0.02 + 4 * (16_384 + 68) / bps
    update = 0.1 + 0.05 + 0.02 + 128 * 2 * 16_384 / bps
    assert plan.rollout == pytest.approx(1024 * step)
    assert plan.training == pytest.approx(320 * update)
    assert plan.seconds == pytest.approx(1024 * step + 320 * update + 20_000 / bps)
    assert plan.staleness == 0
    assert plan.bytes_per_step == pytest.approx(16_384 + 68 + 10 * 2 * 16_384 + 20_000 / 4096)


def test_round_trips_cost_sync_each_and_the_overlapping_schedules_less():
    plans = {}
    for name, schedule in {"sync": {}, "groups": {"rollout_groups": "4"},
                           "micro": {"rollout_groups": "4", "microbatches": 2},
                           "async": {"rollout_groups": "4", "microbatches": 2, "asynchronous": True}}.items():
        plans[name] = [predict(_settings(**schedule), RATES, Link(rate=1e9, rtt=rtt), vector="async")
                       for rtt in (0.0, 0.02)]
    extra = plans["sync"][1].seconds - plans["sync"][0].seconds
    assert extra == pytest.approx((1024 + 320) * 0.02)  # every env step and every minibatch pays one
    # (At 0 ms four groups' calls at one group's cost each are no gain over one call: only at 20 ms for them.)
    for later, earlier, ats in (("groups", "sync", (1,)), ("micro", "groups", (0, 1)), ("async", "micro", (0, 1))):
        for at in ats:
            assert plans[later][at].seconds < plans[earlier][at].seconds, (later, at)
    # Four groups of one env: a vector step is one group's cycle (its env, both stages, the trip: 29.5 ms),
    # longer than the 4 envs' CPU on 2 cores (16 ms) and the acting; sync pays 2 envs a core and the trip.
    bps = 1e9 * TCP_GOODPUT / 8
    assert plans["groups"][1].rollout == pytest.approx(1024 * (0.008 + 0.0015 + 0.02 + (16_384 + 68) / bps))
    assert plans["sync"][1].rollout == pytest.approx(1024 * (0.016 + 0.0015 + 0.02 + 4 * (16_384 + 68) / bps))
    # The minibatches keep theirs.
    assert plans["micro"][1].training - plans["micro"][0].training == pytest.approx(320 * 0.02)
    assert plans["async"][1].staleness == 1 and plans["micro"][1].staleness == 0
    # Publishing every epoch, the paced rollout's samples lag 10 down to 1 of the 10 epochs: 0.55 on average.
    paced = predict(_settings(rollout_groups="4", microbatches=2, asynchronous=True, publish="epoch"), RATES,
                    Link(rate=1e9, rtt=0.02), vector="async")
    assert paced.staleness == pytest.approx(0.55) and paced.seconds == plans["async"][1].seconds
    longer = max(plans["async"][1].rollout, plans["async"][1].training)
    assert plans["async"][1].seconds == pytest.approx(longer + 20_000 / bps)


def test_a_thin_link_makes_bytes_the_bound():
    s = _settings(rollout_groups="4", microbatches=4)
    thin = predict(s, RATES, Link(rate=2e6), vector="async")
    bps = 2e6 * TCP_GOODPUT / 8
    # Up and down are separate directions: with many micro-batches training tends to the larger direction's time.
    assert thin.training >= 320 * 128 * 16_384 / bps
    assert thin.training < 320 * 128 * 2 * 16_384 / bps
    assert thin.seconds > 10 * predict(s, RATES, Link(), vector="async").seconds


def test_separate_machines_lift_the_shared_cores_bound():
    s = _settings(rollout_groups="4", microbatches=2, asynchronous=True)
    slow_env = dataclasses.replace(RATES, env_step=0.05)
    shared = predict(s, slow_env, Link(cores=2), vector="async")
    apart = predict(s, slow_env, Link(cores=2, shared=False), vector="async")
    assert apart.seconds < shared.seconds


def test_calibration_reproduces_its_own_run():
    """Calibrated on a measured sync run, the plan of that run's own settings gives back its phases."""
    run = load_run(SYNC_RUN)
    rates = calibrate(SYNC_RUN, run.settings, threads=run.threads, timings=FixedTimings())
    plan = predict(run.settings, rates, Link(), vector=run.vector)
    used = measured_records(read_metrics(SYNC_RUN), skip_last=True)
    phases = sum(used[0][k] for k in ("time/env", "time/encoder", "time/heads", "time/link_wait"))
    assert plan.seconds == pytest.approx(phases, rel=0.01)
    assert plan.seconds == pytest.approx(used[0]["time/iteration"], rel=0.02)
    # The bytes are the run's meters: float32 features up, gradients down.
    assert plan.bytes_per_step * 4096 == pytest.approx(1_410_189_688, rel=1e-3)
    # One thread is 1.5x slower per call in FixedTimings: so is the plan's training at --threads 1.
    one = calibrate(SYNC_RUN, run.settings, threads=1, timings=FixedTimings())
    assert one.train0 == pytest.approx(1.5 * rates.train0)


def test_calibration_refuses_what_it_cannot_measure(tmp_path):
    run = load_run(SYNC_RUN)
    bf16 = dataclasses.replace(run.settings, codecs=dataclasses.replace(run.settings.codecs, codec_rollout="bf16"))
    with pytest.raises(SettingsError, match="--bytes-from"):
        calibrate(SYNC_RUN, bf16, threads=0, timings=FixedTimings())
    for other in (dict(bottleneck=256), dict(model="impala"), dict(model_kwargs="width=8"), dict(hidden=64)):
        with pytest.raises(SettingsError, match="network"):
            calibrate(SYNC_RUN, dataclasses.replace(run.settings, **other), threads=0, timings=FixedTimings())
    assert run.settings.model in ("auto", "nature")  # `auto` is the built-in for images: the same network
    same = dataclasses.replace(run.settings, model="nature" if run.settings.model == "auto" else "auto")
    calibrate(SYNC_RUN, same, threads=0, timings=FixedTimings())
    pipelined = tmp_path / "pipelined"
    shutil.copytree(SYNC_RUN, pipelined, ignore=shutil.ignore_patterns("checkpoints"))
    config = json.loads((pipelined / "config-stage0.json").read_text())
    config["settings"]["schedule"]["rollout_groups"] = "4"
    config["settings"]["env"]["num_envs"] = 4
    (pipelined / "config-stage0.json").write_text(json.dumps(config))
    with pytest.raises(SettingsError, match="synchronous"):
        calibrate(pipelined, run.settings, threads=0, timings=FixedTimings())
    with pytest.raises(SettingsError, match="no config"):
        load_run(tmp_path)


def test_layouts_cover_the_schedules():
    names = [name for name, _, _ in layouts(_settings())]
    assert names[0] == "sync" and "pipelined groups=4 micro-batches=2" in names
    assert not any(name.startswith("async") for name in names)
    stale = layouts(_settings(), allow_stale=True)
    assert all(s.schedule.asynchronous for name, s, _ in stale if name.startswith("async"))
    assert all(threads == 1 for name, _, threads in stale if name != "sync")


def test_timings_measure_the_networks():
    run = load_run(SYNC_RUN)
    timings = Timings(run.settings, run.spec, seconds=0.02)
    act0, act1 = timings.act(1, 2)
    train0, train1 = timings.train(1, 8)
    assert all(0 < t < 10 and math.isfinite(t) for t in (act0, act1, train0, train1))
    assert timings.act(1, 2) == (act0, act1)  # kept, not timed again


def test_plan_command_recommends(monkeypatch):
    monkeypatch.setattr("splitrl.plan.Timings", lambda settings, spec: FixedTimings())
    result = CliRunner().invoke(main, ["plan", "--from", str(SYNC_RUN), "--rate", "20mbit", "--rtt", "20",
                                       "--num-envs", "4", "--num-steps", "1024", "--recommend", "--allow-stale"])
    assert result.exit_code == 0, result.output
    assert "recommended: pipelined" in result.output
    assert "| sync |" in result.output and "samples 1 of an iteration old on average" in result.output
    paced = CliRunner().invoke(main, ["plan", "--from", str(SYNC_RUN), "--rate", "20mbit", "--rtt", "20",
                                      "--num-envs", "4", "--num-steps", "1024", "--recommend", "--allow-stale",
                                      "--async", "--publish", "epoch"])
    assert paced.exit_code == 0, paced.output
    assert "publish=epoch" in paced.output and "samples 0.55 of an iteration old on average" in paced.output
    bad = CliRunner().invoke(main, ["plan", "--from", str(SYNC_RUN), "--codec-rollout", "bf16"])
    assert bad.exit_code != 0 and "--bytes-from" in bad.output


def test_the_check_predicts_every_row_of_a_bench_from_its_reference(monkeypatch):
    from splitrl.bench.plan_bench import CHECKS, check_plan, plan_table

    monkeypatch.setattr("splitrl.bench.plan_bench.Timings", lambda settings, spec: FixedTimings())
    rows = check_plan(CHECKS[:1], root=ROOT)
    measured = json.loads((ROOT / CHECKS[0].path).read_text())
    assert [(r["mode"], r["rtt_ms"]) for r in rows] == [(m["mode"], m["rtt_ms"]) for m in measured]
    reference = rows[0]
    assert reference["mode"] == "sync" and abs(reference["error"]) < 0.02  # it predicts itself
    shaped = [r for r in rows if r["rtt_ms"]]
    assert all(r["rate"] == "1gbit" and r["link_rtt_ms"] > 20 for r in shaped)
    assert next(r for r in shaped if r["mode"] == "sync")["predicted"] > reference["predicted"] + 90
    table = plan_table(rows)
    assert table.count("| pipeline-latency |") == len(rows) and "within 20 %" in table


def test_a_minibatch_in_micro_batches_overlaps_the_stages():
    # One micro-batch: everything in turn, one round trip.
    assert minibatch_seconds(3.0, 1.8, 0.2, 0.1, 0.02, 1) == pytest.approx(3.0 + 1.8 + 0.2 + 0.1 + 0.02)
    # Two: stage0 forwards both (0.5 s each), stage1 takes each as it comes (0.9 s), stage0 back-propagates each
    # gradient (1 s) once its forwards are done: 2.4 s for the first, 3.4 s for the second.
    assert minibatch_seconds(3.0, 1.8, 0.0, 0.0, 0.0, 2) == pytest.approx(3.4)
    # Never below stage0's own work, nor below the longer link direction.
    assert minibatch_seconds(3.0, 1.8, 0.0, 0.0, 0.0, 64) >= 3.0
    assert minibatch_seconds(0.1, 0.1, 5.0, 1.0, 0.0, 64) >= 5.0


def test_a_shapers_bucket_lets_a_message_that_fits_it_through_after_an_idle_spell():
    link = Link.shaped(10e6)  # tbf's bucket at 10 Mbit/s: 32 KiB
    rate = 10e6 * TCP_GOODPUT / 8
    assert link.burst == 32 * 1024
    assert link.transfer(20_000, idle=0.1) == 0.0  # 0.1 s idle filled the bucket; the message fits it
    assert link.transfer(20_000, idle=0.004) == pytest.approx((20_000 - 0.004 * rate) / rate)  # partly filled
    assert link.transfer(100_000, idle=1.0) == pytest.approx((100_000 - 32 * 1024 * TCP_GOODPUT) / rate)
    assert link.transfer(100_000) == pytest.approx(100_000 / rate) == Link(rate=10e6).transfer(100_000, idle=1.0)
    assert Link.shaped(0.0) == Link()


def test_the_waits_beyond_the_link_split_into_a_cost_a_round_trip_and_a_cost_a_byte():
    from splitrl.plan import overheads

    # 4096 small round trips (68 kB in all) against 320 large ones (1.3 GB): two equations, two unknowns.
    trips_r, bytes_r, trips_t, bytes_t = 4096, 68e3, 320, 1.3e9

    def split(pm: float, pb: float) -> tuple[float, float]:
        return overheads(trips_r * pm + bytes_r * pb, trips_r, bytes_r, trips_t * pm + bytes_t * pb, trips_t, bytes_t)

    assert split(7e-4, 4e-9) == pytest.approx((7e-4, 4e-9))
    # Waits only a cost a round trip explains: no cost a byte; and the other way round.
    assert split(5e-4, 0.0) == pytest.approx((5e-4, 0.0))
    assert split(0.0, 3e-9)[0] == pytest.approx(0.0, abs=1e-12)
    # Where the exact answer is negative (training waited less than its round trips alone cost), one term explains
    # both, neither is negative, and no wait at all costs nothing.
    pm, pb = overheads(3.0, trips_r, bytes_r, 0.01, trips_t, bytes_t)
    assert pm == pytest.approx(3.01 / (trips_r + trips_t)) and pb == 0.0
    assert overheads(-1.0, trips_r, bytes_r, -1.0, trips_t, bytes_t) == (0.0, 0.0)


def test_calibration_takes_both_costs_from_a_run_that_timed_its_rollouts_wait_apart(tmp_path):
    """A synchronous run records the rollout's part of its wait on the link (`time/link_wait_rollout`): the
    calibration gives back the cost a round trip and a byte that made the two waits."""
    run_dir = tmp_path / "run"
    shutil.copytree(SYNC_RUN, run_dir)
    records = read_metrics(run_dir)
    pm, pb = 6e-4, 2e-9
    for r in records:
        rollout = r["net/step/sent_bytes"] + r["net/action/recv_bytes"]
        training = iteration_bytes(r) - rollout
        r["time/link_wait_rollout"] = 4096 * pm + rollout * pb
        r["time/link_wait"] = r["time/link_wait_rollout"] + 320 * pm + training * pb
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    run = load_run(run_dir)
    rates = calibrate(run_dir, run.settings, threads=run.threads, timings=FixedTimings())
    assert rates.per_message == pytest.approx(pm, rel=0.02) and rates.per_byte == pytest.approx(pb, rel=0.02)
    # Without the rollout's part (runs recorded before it), the whole wait is a cost a byte.
    for r in records:
        del r["time/link_wait_rollout"]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    old = calibrate(run_dir, run.settings, threads=run.threads, timings=FixedTimings())
    assert old.per_message == 0.0 and old.per_byte > pb


def test_a_synchronous_run_records_its_rollouts_wait_on_the_link(tmp_path):
    from .conftest import TINY, train_in_process

    assert train_in_process("--run-dir", str(tmp_path), *TINY).exit_code == 0
    for r in read_metrics(tmp_path):
        assert 0.0 <= r["time/link_wait_rollout"] <= r["time/iteration"]


def test_micro_batches_taken_at_once_overlap_within_each_stage():
    """Two micro-batches, stage0's forward 1 s and backward 2 s a minibatch, stage1's 2 s, no link: in turn the
    parts chain (3.5 s); on two workers a side, both forwards, both losses and both backwards run at once (2.5 s)."""
    assert minibatch_seconds(3.0, 2.0, 0.0, 0.0, 0.0, 2) == pytest.approx(3.5)
    assert minibatch_seconds(3.0, 2.0, 0.0, 0.0, 0.0, 2, workers=2) == pytest.approx(2.5)
    assert minibatch_seconds(3.0, 2.0, 0.0, 0.0, 0.0, 1, workers=2) == pytest.approx(5.0)  # one part: nothing to overlap
