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


def test_with_more_threads_the_parts_run_on_them_as_a_run_threads_them(tmp_path, monkeypatch):
    import torch

    from splitrl.bench import floor_bench

    seen = {"forward": set(), "step": set()}
    adam_step = torch.optim.Adam.step

    def step(self, *args, **kwargs):
        seen["step"].add(torch.get_num_threads())
        return adam_step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.Adam, "step", step)
    ppo_loss = floor_bench.ppo_loss
    monkeypatch.setattr(floor_bench, "ppo_loss", lambda *a, **k: seen["forward"].add(torch.get_num_threads())
                        or ppo_loss(*a, **k))
    threads = torch.get_num_threads()
    splitrl_here("bench", "floor", "--num-steps", "8", "--epochs", "1", "--minibatches", "2", "--max-episode-steps",
                 "20", "--threads", "3", "--json", str(tmp_path / "floor.json"))
    assert seen == {"forward": {3}, "step": {1}}  # the training on three threads, its optimizers' steps on one
    assert torch.get_num_threads() == threads  # and this process's threads as they were
    floor = json.loads((tmp_path / "floor.json").read_text())
    assert floor["threads"] == 3 and "| intra-op threads (the parts as a run on as many computes them) | | 3 |" in \
        floor_table(floor)
    assert measure_floor(_tiny(), cores=1)["threads"] == 1 and "intra-op" not in floor_table(measure_floor(_tiny()))


def test_the_acting_forwards_take_each_env_group_apart(monkeypatch):
    import dataclasses

    import torch

    from splitrl.bench import floor_bench

    rows = []
    agent = floor_bench.agent

    def recording(settings, spec):
        encoder, heads = agent(settings, spec)
        encoder.register_forward_pre_hook(lambda m, args: rows.append(len(args[0])) if not torch.is_grad_enabled()
                                          else None)  # the acting forwards: no graph
        return encoder, heads

    monkeypatch.setattr(floor_bench, "agent", recording)
    settings = _tiny()
    settings = dataclasses.replace(settings, env=dataclasses.replace(settings.env, num_envs=4),
                                   schedule=dataclasses.replace(settings.schedule, rollout_groups="2"))
    measure_floor(settings, cores=1)
    assert rows == [2] * (2 * 32)  # each of the 32 steps: a forward of each group's two envs, as the run acts
    rows.clear()
    measure_floor(dataclasses.replace(settings, schedule=dataclasses.replace(settings.schedule, rollout_groups="1")))
    assert rows == [4] * 32


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


def test_the_pipeline_bench_times_the_parts_before_and_after_its_runs(monkeypatch, tmp_path):
    from splitrl.bench import floor_bench, pipeline_bench

    order = []

    def measure(settings, cores=None, channels_last=False, threads=1):
        order.append(("parts", channels_last, threads))
        return floor_bench._implied({p: 10.0 * len(order) for p in PARTS}, 2, 4096, channels_last, threads)

    def runs(*args, **kwargs):
        order.append("runs")
        return []

    monkeypatch.setattr(floor_bench, "measure_floor", measure)
    monkeypatch.setattr(pipeline_bench, "run_pipeline_bench", runs)
    out = splitrl_here("bench", "pipeline", "--modes", "sync", "--rtt", "0", "--", "--threads", "1").output
    assert order == [("parts", False, 1), "runs", ("parts", False, 1)]
    assert "| all parts | | 100.00 |" in out and "50.00 and 150.00 |" in out  # the mean of 10 and 30 a part
    order.clear()
    out = splitrl_here("bench", "pipeline", "--modes", "sync", "--rtt", "0", "--", "--channels-last",
                       "--threads", "1").output
    assert order == [("parts", False, 1), ("parts", True, 1), "runs", ("parts", False, 1), ("parts", True, 1)]
    assert "The parts with --channels-last" in out
    # Rows with arguments of their own: each set of parts they compute, once, before and after
    order.clear()
    out = splitrl_here("bench", "pipeline", "--modes", "sync --threads 2,sync --threads 1,+ async --channels-last,"
                       "+ micro-batches at once --channels-last", "--rtt", "0").output
    assert order == [("parts", False, 1), ("parts", False, 2), ("parts", True, 1), "runs",
                     ("parts", False, 1), ("parts", False, 2), ("parts", True, 1)]
    assert "The parts with 2 intra-op threads," in out  # the pipelined rows' four envs acting in four groups too:
    assert "The parts with --channels-last and 4 envs x 1024 steps acting in 4 groups," in out
    # and each row is set against its own: the two-thread row's CPU over the two-thread parts (20 and 40: 30 a
    # part, 150 in all), the one-thread row's over the floor's (10 and 30: 20 a part, 100)
    order.clear()
    row = {"rtt_ms": 0.0, "seconds_per_iteration": 100.0, "steps_per_second": 41.0, "busy_stage0": 1.0,
           "busy_stage1": 1.0, "cpu_per_iteration": 200.0, "link_wait": 0.0, "bytes_per_iteration": 1e6,
           "staleness_mean": 0.0, "staleness_max": 0.0, "measured_rtt_ms": None}
    monkeypatch.setattr(pipeline_bench, "run_pipeline_bench",
                        lambda *a, **k: [dict(row, mode="sync --threads 2"), dict(row, mode="sync --threads 1")])
    out = splitrl_here("bench", "pipeline", "--modes", "sync --threads 2,sync --threads 1", "--rtt", "0",
                       "--json", str(tmp_path / "rows.json")).output
    lines = [line for line in out.splitlines() if line.startswith("| 0 ms | sync")]
    assert lines[0].endswith("| +50.0 | 1.33x |") and lines[1].endswith("| +100.0 | 2.00x |")
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert rows[0]["parts"]["threads"] == 2 and "parts" not in rows[1] and rows[1]["floor"]["threads"] == 1


def test_a_row_with_another_env_layout_is_set_against_parts_of_that_layout(monkeypatch):
    from splitrl.bench import floor_bench, pipeline_bench

    layouts = []

    def measure(settings, cores=None, channels_last=False, threads=1):
        layouts.append((settings.env.num_envs, settings.ppo.num_steps, settings.schedule.rollout_groups, threads))
        return floor_bench._implied({p: 10.0 for p in PARTS}, 2, 4096, channels_last, threads)

    monkeypatch.setattr(floor_bench, "measure_floor", measure)
    monkeypatch.setattr(pipeline_bench, "run_pipeline_bench", lambda *a, **k: [])
    row = "+ async --num-envs 8 --num-steps 512 --rollout-groups 2"
    out = splitrl_here("bench", "pipeline", "--modes", f"sync --threads 1,{row}", "--rtt", "0").output
    # the floor (the paper's iteration on one thread), then the row's own: its envs, steps and groups, its threads
    assert layouts[:2] == [(1, 4096, "1", 1), (8, 512, "2", 1)] and len(layouts) == 4
    assert "The parts with 8 envs x 512 steps acting in 2 groups, as the rows with them compute them" in out


def _tiny(**top):
    from splitrl.settings import EnvSettings, PPOSettings

    return TrainSettings(env=EnvSettings(max_episode_steps=20), ppo=PPOSettings(num_steps=32, epochs=1, minibatches=2),
                         **top)
