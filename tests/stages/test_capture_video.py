"""``--capture-video``: the first episode of every Nth evaluation during training (and of the last) as an mp4 in
RUN_DIR/videos/, recorded by the code `splitrl eval --video` records with."""

from __future__ import annotations

import pytest

from splitrl.settings import TrainSettings
from splitrl.stages.evaluate import Evaluation, eval_seed, evaluate, load_agent

from ..conftest import splitrl_here

CARTPOLE = ["--env-id", "CartPole-v1", "--total-steps", "192", "--num-steps", "32", "--num-envs", "2", "--epochs", "1",
            "--minibatches", "2", "--max-episode-steps", "30", "--threads", "1"]
"""Three iterations of a fast env."""


def test_every_second_evaluation_and_the_last_are_filmed_as_playable_mp4s(tmp_path):
    from moviepy import VideoFileClip

    run = tmp_path / "run"
    splitrl_here("train", "--run-dir", str(run), *CARTPOLE, "--eval-every", "1", "--eval-episodes", "2",
                 "--capture-video", "--video-every", "2")
    videos = sorted((run / "videos").glob("*.mp4"))
    assert [v.name for v in videos] == ["iter00002-episode-0.mp4", "iter00003-episode-0.mp4"]
    settings, spec, encoder, heads, _ = load_agent(run, iteration=3)
    (length,) = evaluate(settings, encoder, heads, spec, episodes=1, seed=eval_seed(settings)).lengths
    clip = VideoFileClip(str(videos[-1]))
    try:
        assert clip.size == [600, 400]  # CartPole's window, as a person sees it
        assert sum(1 for _ in clip.iter_frames()) == length + 1  # the evaluation's first episode: reset and each step
    finally:
        clip.close()


@pytest.mark.parametrize("every, video_every, filmed", [(2, 2, [4, 7]), (2, 3, [6, 7]), (1, 1, [1, 2, 3, 4, 5, 6, 7]),
                                                        (3, 1, [3, 6, 7])])
def test_which_evaluations_are_filmed(every, video_every, filmed, tmp_path):
    settings = TrainSettings(total_steps=7 * 4096)  # seven iterations
    evaluation = Evaluation(settings, None, every, 1, video_dir=tmp_path, video_every=video_every)
    assert [i for i in range(1, 8) if evaluation.due(i) and evaluation.filmed(i)] == filmed
    assert not Evaluation(settings, None, every, 1).filmed(7)  # no --capture-video


def test_capture_video_needs_evaluations(tmp_path):
    result = splitrl_here("train", "--run-dir", str(tmp_path / "run"), *CARTPOLE, "--capture-video", code=2)
    assert "--capture-video records the evaluations' episodes: it needs --eval-every N" in result.output
