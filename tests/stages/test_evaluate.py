"""After training: `splitrl eval` on held-out seeds, videos, evaluation during training, live TensorBoard."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from splitrl.runs import iteration_bytes, link_bytes
from splitrl.stages.evaluate import EVAL_SEED_OFFSET

from ..conftest import TINY, splitrl_here

VOLATILE = ("time/", "cpu/", "charts/SPS", "eval/")


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("eval") / "run"
    splitrl_here("train", "--run-dir", str(run), *TINY)
    return run


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_eval_scores_the_same_seeds_the_same_and_writes_eval_jsonl_only_when_asked(trained):
    both = splitrl_here("eval", str(trained), "--episodes", "2", "--threads", "1")
    lines = both.stdout.splitlines()
    assert "deterministic (expected)" in lines[0] and "sampled" in lines[1]  # side by side, the same seeds
    assert all("seeds 1000001..1000002" in line for line in lines[:2]) and not (trained / "eval.jsonl").exists()
    first = splitrl_here("eval", str(trained), "--episodes", "2", "--threads", "1", "--deterministic", "--record")
    again = splitrl_here("eval", str(trained), "--episodes", "2", "--threads", "1", "--deterministic", "--record")
    assert "over 2 episodes" in first.stdout and first.stdout == again.stdout and first.stdout in both.stdout
    rows = [json.loads(line) for line in (trained / "eval.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and rows[0]["returns"] == rows[1]["returns"] and rows[0]["iteration"] == 2
    assert rows[0]["seed"] == 1 + EVAL_SEED_OFFSET and rows[0]["lengths"] == [20, 20]  # --max-episode-steps 20
    assert rows[0]["greedy"] == "expected" and rows[0]["deterministic"] is True
    other = splitrl_here("eval", str(trained), "--episodes", "2", "--seed", "7", "--sample", "--iteration", "1",
                         "--record")
    assert json.loads((trained / "eval.jsonl").read_text().splitlines()[-1])["returns"] != rows[0]["returns"]
    assert "sampled" in other.stdout and "iteration 1:" in other.stdout and "deterministic" not in other.stdout


def test_eval_refuses_what_it_cannot_load(trained, tmp_path):
    missing = splitrl_here("eval", str(trained), "--iteration", "9", code=None)
    assert missing.exit_code == 2 and "no checkpoint pair of it; there are [1, 2]" in missing.stderr
    empty = splitrl_here("eval", str(tmp_path), code=None)
    assert empty.exit_code == 2 and "not a run directory" in empty.stderr


def test_video_is_a_playable_mp4_of_every_episode(trained, tmp_path):
    from moviepy import VideoFileClip  # the library RecordVideo writes with

    splitrl_here("eval", str(trained), "--episodes", "1", "--deterministic", "--video", str(tmp_path / "video"))
    (video,) = sorted((tmp_path / "video").glob("**/*.mp4"))
    clip = VideoFileClip(str(video))
    try:
        frames = sum(1 for _ in clip.iter_frames())
        assert clip.size == [600, 400]  # CarRacing's window, as a person sees it, not the 96 x 96 observation
        assert frames == 21  # the reset's frame and one per step of a 20-step episode
    finally:
        clip.close()


def test_evaluation_during_training_changes_neither_training_nor_its_bytes(trained, tmp_path):
    run = tmp_path / "run"
    splitrl_here("train", "--run-dir", str(run), *TINY, "--eval-every", "1", "--eval-episodes", "2")
    plain, scored = _metrics(trained), _metrics(run)
    assert all("eval/return_mean" in r and "eval/return_std" in r and r["eval/episodes"] == 2 for r in scored)
    assert [{k: v for k, v in r.items() if not k.startswith(VOLATILE) and "eval_heads" not in k} for r in scored] \
        == [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in plain]  # same losses, same bytes
    assert [iteration_bytes(r) for r in scored] == [iteration_bytes(r) for r in plain]
    assert link_bytes(scored[-1]) == link_bytes(plain[-1]) < link_bytes(scored[-1], everything=True)
    assert scored[-1]["net/eval_heads/recv_bytes"] > 0 and scored[-1]["time/eval"] > 0
    # the final checkpoint's score is what `splitrl eval` finds on the same held-out seeds
    splitrl_here("eval", str(run), "--episodes", "2", "--threads", "1", "--deterministic", "--record")
    assert json.loads((run / "eval.jsonl").read_text().splitlines()[-1])["return_mean"] == \
        pytest.approx(scored[-1]["eval/return_mean"])


def test_tensorboard_holds_the_keys_while_the_run_is_going(spawn, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    long = [a if a != "64" else "320" for a in TINY]  # ten iterations
    proc = spawn("train", "--run-dir", str(run), *long, "--tensorboard")
    deadline = time.monotonic() + 240
    while not (run / "metrics.jsonl").exists() or not (run / "metrics.jsonl").read_text().strip():
        assert time.monotonic() < deadline and proc.popen.poll() is None, proc.output()
        time.sleep(0.2)
    assert proc.popen.poll() is None  # still training
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    keys = set(events.Tags()["scalars"])
    assert {"charts/episodic_return_ema", "losses/policy_loss", "losses/approx_kl", "cpu/stage1",
            "time/heads"} <= keys, keys
    proc.popen.kill()
