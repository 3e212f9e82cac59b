"""`splitrl bench floor`: an iteration's parts, each alone, with the run's own env pipeline and network."""

import json

import pytest

from splitrl.bench.floor_bench import EDGE_PARTS, PARTS, bracketed, floor_table, measure_floor
from splitrl.settings import TrainSettings

from ..conftest import splitrl_here


def test_every_part_is_timed_and_the_floors_follow_from_them():
    floor = measure_floor(_tiny(), cores=2)
    assert set(floor["parts"]) == set(PARTS) and all(s > 0 for s in floor["parts"].values())
    assert floor["total"] == pytest.approx(sum(floor["parts"].values()))
    assert floor["edge"] == pytest.approx(sum(floor["parts"][p] for p in EDGE_PARTS))
    assert floor["floor"] == pytest.approx(floor["total"] / 2)
    assert floor["two_machines"] == pytest.approx(max(floor["edge"], floor["total"] - floor["edge"]))
    assert floor["steps"] == 32
    table = floor_table(floor, [("sync", floor["floor"] * 3)]).splitlines()
    assert table[2].startswith("| envs | edge | ") and "| heads training | server |" in table[6]
    assert table[-1] == f"| sync | {floor['floor'] * 3:.1f} | 3.00x |"


def test_the_cut_before_the_first_layer_leaves_the_encoder_nothing_to_train():
    floor = measure_floor(_tiny(cut="input"), cores=1)
    assert floor["parts"]["encoder acting"] < floor["parts"]["heads acting"]
    assert floor["parts"]["encoder training"] < 0.2 * floor["parts"]["heads training"]


def test_the_command_takes_the_training_options_and_checks_them():
    out = splitrl_here("bench", "floor", "--num-steps", "32", "--epochs", "1", "--minibatches", "2",
                       "--max-episode-steps", "20", "--cores", "2").output
    assert "| floor on 2 cores (all parts / cores) |" in out
    bad = splitrl_here("bench", "floor", "--num-steps", "0", code=None)
    assert bad.exit_code != 0 and "num_steps" in bad.output.replace("-", "_")


def test_with_channels_last_the_parts_are_timed_as_such_a_run_computes_them(tmp_path, monkeypatch):
    from splitrl.bench import floor_bench

    placed = []
    monkeypatch.setattr(floor_bench, "place", lambda net, device, channels_last: placed.append(channels_last) or net)
    splitrl_here("bench", "floor", "--num-steps", "8", "--epochs", "1", "--minibatches", "2", "--max-episode-steps",
                 "20", "--channels-last", "--json", str(tmp_path / "floor.json"))
    assert placed == [True, True]  # the encoder and the heads
    assert json.loads((tmp_path / "floor.json").read_text())["channels_last"] is True


def test_each_sides_training_clips_its_gradient_as_the_update_does(monkeypatch):
    import torch

    clipped = []
    clip = torch.nn.utils.clip_grad_norm_
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_",
                        lambda params, norm: clipped.append((len(params), norm)) or clip(params, norm))
    settings = _tiny()
    measure_floor(settings, cores=1)
    minibatches = settings.ppo.epochs * settings.ppo.minibatches
    assert len(clipped) == 2 * minibatches  # the heads' and the encoder's, each minibatch
    assert {norm for _, norm in clipped} == {settings.ppo.max_grad_norm}


def test_parts_timed_before_and_after_the_runs_give_their_mean_and_say_how_far_they_moved():
    def timed(scale):
        return {"parts": {p: scale * (i + 1) for i, p in enumerate(PARTS)}, "total": scale * 15, "cores": 2,
                "steps": 4096, "channels_last": False}

    floor = bracketed(timed(1.0), timed(1.2))
    assert floor["parts"] == {p: pytest.approx(1.1 * (i + 1)) for i, p in enumerate(PARTS)}
    assert floor["total"] == pytest.approx(16.5) and floor["floor"] == pytest.approx(8.25)
    assert floor["edge"] == pytest.approx(1.1 * (1 + 2 + 4)) and floor["bracket"] == [15.0, 18.0]
    assert floor_table(floor).splitlines()[-1] == \
        "| all parts, timed before and after the runs (their mean above) | | 15.00 and 18.00 |"


def test_the_pipeline_bench_times_the_parts_before_and_after_its_runs(monkeypatch):
    from splitrl.bench import floor_bench, pipeline_bench

    order = []

    def measure(settings, cores=None, channels_last=False):
        order.append(("parts", channels_last))
        return floor_bench._implied({p: 10.0 * len(order) for p in PARTS}, 2, 4096, channels_last)

    def runs(*args, **kwargs):
        order.append("runs")
        return []

    monkeypatch.setattr(floor_bench, "measure_floor", measure)
    monkeypatch.setattr(pipeline_bench, "run_pipeline_bench", runs)
    out = splitrl_here("bench", "pipeline", "--modes", "sync", "--rtt", "0").output
    assert order == [("parts", False), "runs", ("parts", False)]
    assert "| all parts | | 100.00 |" in out and "50.00 and 150.00 |" in out  # the mean of 10 and 30 a part
    order.clear()
    out = splitrl_here("bench", "pipeline", "--modes", "sync", "--rtt", "0", "--", "--channels-last").output
    assert order == [("parts", False), ("parts", True), "runs", ("parts", False), ("parts", True)]
    assert "The parts with --channels-last" in out


def _tiny(**top):
    from splitrl.settings import EnvSettings, PPOSettings

    return TrainSettings(env=EnvSettings(max_episode_steps=20), ppo=PPOSettings(num_steps=32, epochs=1, minibatches=2),
                         **top)
