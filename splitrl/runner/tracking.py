"""``--track``: the run's metrics in Weights & Biases, under the names CleanRL gives them.

Stage0 (or the twin) writes metrics.jsonl, one record an iteration with stage1's statistics in it, so it is the
process that tracks: `WandbTracker` gets every record `RunLog` writes and logs it at its ``global_step``
(`cleanrl_metrics` says under which names). A run's record keys are already CleanRL's where CleanRL has one
(``charts/episodic_return``, ``charts/SPS``, ``losses/...``); what the record lacks is added: the mean length
of the iteration's episodes (from episodes.jsonl's lines) and the learning rate. The link's meters
(``net/<kind>/<direction>_bytes`` and ``_messages``) go under ``link/``. wandb is an optional extra, imported
only here.
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path
from typing import Any

from ..runs import iteration_bytes, link_bytes, metric_scalars
from ..settings import TRACK_MISSING, RunOptions, TrainSettings

__all__ = ["cleanrl_metrics", "WandbTracker", "VIDEO_KEY"]

VIDEO_KEY = "videos/eval"
"""Where an evaluation's mp4 (``--capture-video``) goes in the W&B run."""


def cleanrl_metrics(record: dict[str, Any], settings: TrainSettings,
                    episode_lengths: list[int] | None = None) -> dict[str, float]:
    """A metrics record as W&B gets it: CleanRL's keys, ``charts/learning_rate`` (the heads' Adam, stage1's
    PPO learner; ``charts/learning_rate_encoder``: stage0's), ``charts/episodic_length`` (the mean of
    ``episode_lengths``, the iteration's episodes, if any), the link's meters as
    ``link/<kind>/<direction>_bytes`` and ``_messages`` (this iteration's), ``link/bytes`` (training's, this
    iteration), ``link/total_bytes`` (training's so far; ``link/total_sent_bytes`` and ``link/total_recv_bytes``
    as stage0 sees them), and every other number of the record under its own key."""
    out: dict[str, float] = {}
    for key, value in metric_scalars(record):
        if key.startswith("net_total/"):
            continue  # the running totals: link/total_* below
        out["link/" + key.removeprefix("net/") if key.startswith("net/") else key] = value
    ppo = settings.ppo
    fraction = ppo.lr_fraction(int(record["iteration"]), settings.num_iterations)
    out["charts/learning_rate"] = ppo.lr_heads * fraction
    out["charts/learning_rate_encoder"] = ppo.lr_encoder * fraction
    if episode_lengths:
        out["charts/episodic_length"] = sum(episode_lengths) / len(episode_lengths)
    out["link/bytes"] = iteration_bytes(record)
    out["link/total_bytes"] = link_bytes(record)
    for direction in ("sent", "recv"):
        out[f"link/total_{direction}_bytes"] = link_bytes(record, direction)
    return out


class WandbTracker:
    """One W&B run for one run directory's metrics: `metrics` for each record, `episode` for each finished
    episode (their lengths, per iteration, until that iteration's record comes), `close` at the end.

    The run is named after the run directory (a fleet's edge: ``RUN-edge-K``, grouped under ``RUN``) and its
    config is the run's config.json. W&B's own files go to $WANDB_DIR if set, else into the run directory
    (RUN_DIR/wandb/; an offline run there is uploaded later with ``wandb sync``). A resumed run is a new W&B
    run from the iteration it resumes after."""

    def __init__(self, settings: TrainSettings, options: RunOptions, run_dir: str | Path,
                 config: dict[str, Any]) -> None:
        try:
            import wandb
        except ImportError:
            raise ImportError(TRACK_MISSING) from None
        self.settings = settings
        self.dir = Path(run_dir)
        self._lengths: dict[int, list[int]] = {}
        self._lock = threading.Lock()  # the asynchronous schedule's episodes end on its rollout thread
        self._videos = set(self._video_files())  # a resumed run's are in its earlier W&B run
        name, group = self.dir.name, None
        if settings.schedule.edges > 1:  # each edge writes its own metrics: a run each, one group
            group = self.dir.resolve().parent.name
            name = f"{group}-{name}"
        try:
            self.run = wandb.init(project=options.wandb_project_name, entity=options.wandb_entity or None,
                                  name=name, group=group, config=config,
                                  dir=None if os.environ.get("WANDB_DIR") else str(self.dir))
        except wandb.errors.Error as exc:  # not logged in, no such entity, ...: one line, not a traceback
            raise RuntimeError(f"--track: W&B could not start a run: {exc} (WANDB_MODE=offline logs without an "
                               "account; `wandb sync` uploads it later)") from None
        self._video = wandb.Video

    def _video_files(self) -> list[Path]:
        return sorted((self.dir / "videos").glob("*.mp4"))

    def episode(self, record: dict[str, Any]) -> None:
        with self._lock:
            self._lengths.setdefault(int(record["iteration"]), []).append(int(record["length"]))

    def metrics(self, record: dict[str, Any]) -> None:
        iteration = int(record["iteration"])
        with self._lock:
            lengths = self._lengths.pop(iteration, None)
            for done in [i for i in self._lengths if i < iteration]:  # an iteration without a record: none come
                del self._lengths[done]
        data: dict[str, Any] = cleanrl_metrics(record, self.settings, lengths)
        for path in self._video_files():
            if path not in self._videos:  # an evaluation's episode, recorded since the last record
                self._videos.add(path)
                data[VIDEO_KEY] = self._video(str(path), format="mp4")
        self.run.log(data, step=int(record["global_step"]))

    def close(self) -> None:
        """Finish the W&B run: failed if it closes while an error or a stop propagates (the run log closes in a
        ``finally``)."""
        self.run.finish(exit_code=1 if sys.exc_info()[0] is not None else 0)
