"""Where to cut: each cut of the model planned from one measured run, its compute from its own halves and its
bytes from the values crossing it; the refusals; the command's ranking."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
from click.testing import CliRunner

from splitrl.cli import main
from splitrl.cutplan import plan_cuts
from splitrl.models import crossing
from splitrl.errors import SettingsError
from splitrl.plan import Link, Rates, Timings, calibrate, load_run, predict

from .test_plan import SYNC_RUN

RUN = load_run(SYNC_RUN)  # the paper's network on 96 x 96 frames, cut after the CNN (4,096 values), float32


class LayeredTimings(Timings):
    """Timings without the clock: each half costs in proportion to the values its layers hand on (a stand-in for
    per-layer compute, so moving the cut moves compute between the stages); less than the measured run spent,
    which also paid for its loop, codecs and framing."""

    known: dict[str, tuple[int, bool]] = {}

    def __init__(self, settings) -> None:
        if settings.cut not in self.known:
            self.known[settings.cut] = crossing(settings, settings.cut, RUN.spec)
        self.sent, self.observation = self.known[settings.cut]

    def _share(self) -> float:
        return 0.0 if self.observation else 1.0 - self.sent / 36_864 / 2  # more values handed on: less done

    def act(self, threads: int, batch: int) -> tuple[float, float]:
        return 1e-4 * batch * self._share(), 1e-4 * batch * (1.2 - self._share())

    def train(self, threads: int, minibatch: int) -> tuple[float, float]:
        return 3e-4 * minibatch * self._share(), 3e-4 * minibatch * (1.2 - self._share())


def _plans(link: Link, **kwargs):
    return {p.cut: p for p in plan_cuts(RUN.settings, SYNC_RUN, link, vector=RUN.vector, threads=RUN.threads,
                                        only=["input", "relu2", "cnn"], timings=LayeredTimings, **kwargs)}


def test_at_the_measured_cut_the_plan_is_the_schedule_planners():
    link = Link(rate=50e6, rtt=0.01)
    own = predict(RUN.settings, calibrate(SYNC_RUN, RUN.settings, threads=RUN.threads,
                                          timings=LayeredTimings(RUN.settings)), link, vector=RUN.vector)
    assert _plans(link)["cnn"].plan == own


def test_bytes_scale_with_the_values_crossing_and_the_input_sends_the_observation_once():
    plans = _plans(Link())
    assert [plans[c].values for c in ("input", "relu2", "cnn")] == [4 * 96 * 96, 64 * 10 * 10, 4096]
    cnn, relu2, raw = plans["cnn"].plan, plans["relu2"].plan, plans["input"].plan
    calibrated = calibrate(SYNC_RUN, RUN.settings, threads=RUN.threads, timings=LayeredTimings(RUN.settings))
    moved = cnn.bytes_per_step - calibrated.down_step - calibrated.other / 4096
    assert relu2.bytes_per_step - calibrated.down_step - calibrated.other / 4096 == pytest.approx(moved * 6400 / 4096)
    assert raw.bytes_per_step == pytest.approx(4 * 96 * 96 + calibrated.down_step + calibrated.other / 4096)


def test_a_thin_link_ranks_the_observation_first_and_a_slow_edge_moves_the_cut_to_the_server():
    thin = plan_cuts(RUN.settings, SYNC_RUN, Link(rate=2e6), vector=RUN.vector, threads=RUN.threads,
                     only=["input", "relu2", "cnn"], timings=LayeredTimings)
    assert [p.cut for p in thin][0] == "input"  # 37 kB once a step against 16 kB a step plus 32 kB a sample-epoch
    fast, slow = _plans(Link()), _plans(Link(), edge_speed=0.1)
    for cut in ("relu2", "cnn"):  # the env and the encoder's half ten times slower: the edge's share grows
        assert slow[cut].plan.rollout > fast[cut].plan.rollout and slow[cut].plan.training > fast[cut].plan.training
    # At the input the edge computes nothing but the env: only the env steps slow down.
    assert slow["input"].plan.training == pytest.approx(fast["input"].plan.training)
    faster = _plans(Link(), server_speed=4.0)
    # A server four times faster runs the whole network (timed here) in a quarter of the time; what the measured
    # run's stage1 spent beyond its networks carries over as it was.
    network = 10 * 32 * LayeredTimings(dataclasses.replace(RUN.settings, cut="input")).train(0, 128)[1]
    assert faster["input"].plan.training == pytest.approx(fast["input"].plan.training - network * 3 / 4)


def test_what_cannot_be_planned_is_refused(tmp_path):
    with pytest.raises(SettingsError, match=r"^cut 'nope' is not a layer of model 'auto'|^cut 'nope' is not a layer"):
        plan_cuts(RUN.settings, SYNC_RUN, Link(), vector="sync", threads=2, only=["nope"], timings=LayeredTimings)
    with pytest.raises(SettingsError, match="--edge-speed"):
        plan_cuts(RUN.settings, SYNC_RUN, Link(), vector="sync", threads=2, edge_speed=0, timings=LayeredTimings)
    raw = tmp_path / "raw"
    shutil.copytree(SYNC_RUN, raw, ignore=shutil.ignore_patterns("checkpoints"))
    config = json.loads((raw / "config-stage0.json").read_text())
    config["settings"]["cut"] = "input"
    (raw / "config-stage0.json").write_text(json.dumps(config))
    with pytest.raises(SettingsError, match="cut at the input"):
        plan_cuts(RUN.settings, raw, Link(), vector="sync", threads=2, timings=LayeredTimings)


def test_the_command_ranks_the_cuts_and_recommends_one(monkeypatch):
    monkeypatch.setattr("splitrl.plan.Timings", lambda settings, spec: LayeredTimings(settings))
    result = CliRunner().invoke(main, ["plan", "--from", str(SYNC_RUN), "--rate", "2mbit", "--recommend",
                                       "--cuts", "input,relu2,cnn", "--edge-speed", "0.5"])
    assert result.exit_code == 0, result.output
    assert "cuts (sync schedule; edge x0.5, server x1)" in result.output
    assert "| relu2 | 6,400 |" in result.output and "recommended cut: --cut input" in result.output
    every = CliRunner().invoke(main, ["plan", "--from", str(SYNC_RUN), "--recommend"])
    assert every.exit_code == 0, every.output
    assert all(f"| {cut} |" in every.output for cut in ("input", "conv1", "relu1", "conv2", "relu3", "flatten"))
    none = CliRunner().invoke(main, ["plan", "--from", str(SYNC_RUN), "--recommend", "--cuts", "none"])
    assert none.exit_code == 0 and "recommended cut" not in none.output


def test_the_input_cut_pays_no_round_trip_a_minibatch_and_groups_leave_the_bucket_no_idle_spell():
    near, far = _plans(Link()), _plans(Link(rtt=0.05))
    # At the input stage1 trains alone: one message an epoch, not a round trip each of the 320 minibatches.
    assert far["input"].plan.training == pytest.approx(near["input"].plan.training + 10 * 0.05 / 2)
    assert far["cnn"].plan.training == pytest.approx(near["cnn"].plan.training + 320 * 0.05, rel=0.01)
    rates = Rates(env_step=0.001, act0=0.0, act1=0.0, train0=0.0, train1=0.0, up_step=16_000.0, down_step=0.0,
                  up_sample=0.0, down_sample=0.0, other=0.0)
    grouped = dataclasses.replace(RUN.settings, env=dataclasses.replace(RUN.settings.env, num_envs=8),
                                  schedule=dataclasses.replace(RUN.settings.schedule, rollout_groups="8"))
    link = Link.shaped(10e6, shared=False)
    step = predict(grouped, rates, link, vector="async").rollout / RUN.settings.ppo.num_steps
    assert step == pytest.approx(8 * link.transfer(16_000))  # eight groups' messages at the rate, back to back


def test_the_commands_refuse_what_they_cannot_do(monkeypatch):
    monkeypatch.setattr("splitrl.plan.Timings", lambda settings, spec: LayeredTimings(settings))
    alone = CliRunner().invoke(main, ["plan", "--from", str(SYNC_RUN), "--cuts", "input"])
    assert alone.exit_code != 0 and "they go with --recommend" in alone.output
    empty = CliRunner().invoke(main, ["plan", "--from", str(SYNC_RUN), "--recommend", "--cuts", ","])
    assert empty.exit_code != 0 and "--cuts names no cut" in empty.output and "Traceback" not in empty.output
    unknown = CliRunner().invoke(main, ["bench", "cuts", "--models", "nature,foo", "--table-only", "--out", "x"])
    assert unknown.exit_code != 0 and "unknown model(s) foo" in unknown.output
