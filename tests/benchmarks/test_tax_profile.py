"""benchmarks/tax_profile.py puts each py-spy sample in one part of one process."""

from benchmarks.tax_profile import account, part_of, table

LAUNCHER = 'process 7:"python -m splitrl run --run-dir r"'
STAGE0 = [LAUNCHER, "serve_stage0 (/x/splitrl/runner/stage0.py:86)", "stage0_loop (/x/splitrl/schedule/sync.py:40)"]
STAGE1 = ['process 9:"python -m splitrl stage1 --bind x"', "serve_stage1 (/x/splitrl/runner/stage1.py:56)"]


def test_a_sample_goes_to_the_innermost_part_and_its_process():
    rollout = [*STAGE0, "stage0_rollout (/x/splitrl/schedule/sync.py:60)", "Edge.observe (/x/splitrl/stages/edge.py:1)"]
    raw = "\n".join([
        ";".join([*rollout, "Module._call_impl (/v/site-packages/torch/nn/modules/module.py:1789)"]) + " 30",
        ";".join([*STAGE0, "stage0_train (/x/splitrl/schedule/training.py:85)",
                  "Module._call_impl (/v/site-packages/torch/nn/modules/module.py:1789)"]) + " 50",
        # a codec's forward is the codec's: a codec, the framing or the transport holds what runs below it
        ";".join([*STAGE0, "CodecSet.pack (/x/splitrl/codecs/base.py:10)",
                  "Module._call_impl (/v/site-packages/torch/nn/modules/module.py:1789)"]) + " 20",
        ";".join([*STAGE1, "Transport.recv (/x/splitrl/transport/base.py:3)",
                  "ZmqTransport._poll (/x/splitrl/transport/zmq_transport.py:4)"]) + " 10",
        ";".join([*STAGE1, "learn (/x/splitrl/stages/learner.py:5)"]) + " 40",
    ])
    accounted = account(raw, rate=10.0)
    assert accounted == {"stage0": {"forward, training": 5.0, "forward, acting": 3.0, "codec": 2.0},
                         "stage1": {"schedule and stages": 4.0, "transport": 1.0}}
    assert part_of(["PyEval (libpython)"]) == "other"
    lines = table(accounted).splitlines()
    assert lines[0] == "| part | stage0 | stage1 | all |" and lines[-1] == "| all | 10.0 | 5.0 | 15.0 |"


def test_nested_processes_are_the_innermost_ones_and_a_stages_env_workers_their_own():
    stage0 = 'process 9:"python -m splitrl stage0 --connect x"'
    worker = ["_async_worker (/v/site-packages/gymnasium/vector/async_vector_env.py:700)",
              "CarRacing.step (/v/site-packages/gymnasium/envs/box2d/car_racing.py:561)"]
    raw = "\n".join([
        ";".join([LAUNCHER, stage0, *worker]) + " 10",  # a worker forked by a stage started on its own
        ";".join([LAUNCHER, stage0, "serve_stage0 (/x/splitrl/runner/stage0.py:86)",
                  "process (/x/mine.py:1)"]) + " 20",  # a function named process is not a process
    ])
    assert account(raw, rate=10.0) == {"env workers": {"env step": 1.0}, "stage0": {"schedule and stages": 2.0}}


def test_the_twins_samples_go_to_the_stage_of_their_threads_loop():
    twin = 'process 7:"python -m splitrl train --run-dir r"'
    raw = "\n".join([
        ";".join([twin, "serve_stage0 (/x/splitrl/runner/stage0.py:86)", "Edge.observe (/x/splitrl/stages/edge.py:1)"])
        + " 30",
        ";".join([twin, "_bootstrap (/v/threading.py:1)", "serve_stage1 (/x/splitrl/runner/stage1.py:56)",
                  "Learner.act (/x/splitrl/stages/learner.py:5)"]) + " 20",
        ";".join([twin, "serve_stage0 (/x/splitrl/runner/stage0.py:86)", "CarRacing.step (/v/site-packages/"
                  "gymnasium/envs/box2d/car_racing.py:561)"]) + " 10",
    ])
    assert account(raw, rate=10.0) == {"stage0": {"schedule and stages": 3.0, "env step": 1.0},
                                       "stage1": {"schedule and stages": 2.0}}
