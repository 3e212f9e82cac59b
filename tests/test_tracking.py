"""``--track``: a run's metrics in Weights & Biases (offline mode), under CleanRL's names, from the process that
writes metrics.jsonl; without wandb, one line naming the extra."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from splitrl.runner.tracking import cleanrl_metrics
from splitrl.runs import iteration_bytes, link_bytes
from splitrl.settings import TRACK_MISSING, EnvSettings, PPOSettings, RunOptions, TrainSettings

from .conftest import child_env, splitrl_cmd, splitrl_here

CARTPOLE = ["--env-id", "CartPole-v1", "--total-steps", "128", "--num-steps", "32", "--num-envs", "2", "--epochs", "2",
            "--minibatches", "2", "--max-episode-steps", "20", "--threads", "1"]
"""Two iterations of a fast env: a reward of 1 a step, so an episode's return is its length."""

CLEANRL_KEYS = ("charts/episodic_return", "charts/episodic_length", "charts/learning_rate", "losses/value_loss",
                "losses/policy_loss", "losses/entropy", "losses/old_approx_kl", "losses/approx_kl", "losses/clipfrac",
                "losses/explained_variance", "charts/SPS")


def wandb_env(tmp_path: Path) -> dict[str, str]:
    """W&B offline, every file of its own under ``tmp_path``."""
    env = child_env()
    env.update({"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path / "wandb-dir"), "WANDB_SILENT": "true",
                "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config"), "WANDB_CACHE_DIR": str(tmp_path / "wandb-cache"),
                "WANDB_DATA_DIR": str(tmp_path / "wandb-data")})
    (tmp_path / "wandb-dir").mkdir()
    return env


def offline_history(wandb_dir: Path) -> tuple[dict, list[dict]]:
    """(the run record, the history rows) of the one offline run under ``wandb_dir``, read back by wandb's own
    reader of its transaction log (``wandb leet inspect --json``)."""
    (log,) = wandb_dir.glob("wandb/offline-run-*/run-*.wandb")
    out = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(log)], capture_output=True,
                         text=True, timeout=120, check=True).stdout
    records = [json.loads(line) for line in out.splitlines() if line.strip()]
    (run,) = [r["run"] for r in records if r["type"] == "run"]
    return run, [r["history"] for r in records if r["type"] == "history"]


def test_a_tracked_run_writes_an_offline_run_with_cleanrl_keys_and_the_link_bytes(tmp_path):
    pytest.importorskip("wandb")
    run_dir = tmp_path / "run"
    env = wandb_env(tmp_path)
    done = subprocess.run(splitrl_cmd("train", "--run-dir", str(run_dir), *CARTPOLE, "--anneal-lr", "--track",
                                      "--wandb-project-name", "splitrl-test"),
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    run, rows = offline_history(tmp_path / "wandb-dir")
    assert run["project"] == "splitrl-test" and run["display_name"] == "run"
    assert run["config"]["update"]["settings"]["env"]["env_id"] == "CartPole-v1"
    assert [row["step"]["num"] for row in rows] == [r["global_step"] for r in records] == [64, 128]
    for row, record in zip(rows, records):
        item = row["item"]
        assert set(CLEANRL_KEYS) <= set(item), sorted(item)
        for key in ("charts/episodic_return", "charts/SPS", "losses/value_loss", "losses/approx_kl"):
            assert item[key] == pytest.approx(record[key])
        # CartPole pays 1 a step: the iteration's mean length (from its episodes) is its mean return
        assert item["charts/episodic_length"] == pytest.approx(record["charts/episodic_return"])
        assert item["link/bytes"] == iteration_bytes(record) > 0
        assert item["link/total_bytes"] == link_bytes(record)
        assert item["link/train_fwd/sent_bytes"] == record["net/train_fwd/sent_bytes"] > 0
        assert not any(key.startswith(("net/", "net_total/")) for key in item)
    lr = PPOSettings().lr_heads
    assert [row["item"]["charts/learning_rate"] for row in rows] == pytest.approx([lr, lr / 2])  # --anneal-lr


def test_the_mapping_renames_the_meters_and_adds_what_cleanrl_logs():
    settings = TrainSettings(total_steps=8192, ppo=PPOSettings(anneal_lr=True))  # two iterations of 4096
    record = {"iteration": 2, "global_step": 8192, "charts/episodic_return": 3.0, "charts/SPS": 10.0,
              "losses/clipfrac": 0.1, "link/rtt_ms": 0.3, "note": "text", "time/total": float("nan"),
              "net/step/sent_bytes": 100, "net/action/recv_bytes": 40, "net/eval_heads/recv_bytes": 7,
              "net_total/step/sent_bytes": 300, "net_total/action/recv_bytes": 90,
              "net_total/eval_heads/recv_bytes": 7}
    out = cleanrl_metrics(record, settings, [4, 6])
    assert out["charts/episodic_return"] == 3.0 and out["charts/episodic_length"] == 5.0
    assert out["charts/learning_rate"] == pytest.approx(settings.ppo.lr_heads / 2)
    assert out["charts/learning_rate_encoder"] == pytest.approx(settings.ppo.lr_encoder / 2)
    assert out["link/step/sent_bytes"] == 100 and out["link/eval_heads/recv_bytes"] == 7
    assert out["link/bytes"] == 140 and out["link/total_bytes"] == 390  # training's: evaluation's heads apart
    assert out["link/total_sent_bytes"] == 300 and out["link/total_recv_bytes"] == 90
    assert out["link/rtt_ms"] == 0.3 and "note" not in out and "time/total" not in out
    assert "charts/episodic_length" not in cleanrl_metrics(record, settings, [])  # no episode ended


@pytest.mark.parametrize("command", ["train", "run"])
def test_without_wandb_track_is_one_line_naming_the_extra_before_anything_starts(command, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "wandb", None)  # what `import wandb` does where it is not installed
    result = splitrl_here(command, "--run-dir", str(tmp_path / "run"), *CARTPOLE, "--track", code=2)
    (line,) = [line for line in result.output.splitlines() if "--track" in line]
    assert TRACK_MISSING in line and "'.[wandb]'" in line
    assert not (tmp_path / "run").exists()
    assert RunOptions(track=True).package_errors() == [TRACK_MISSING]


def test_only_the_process_that_writes_the_metrics_tracks(tmp_path):
    from splitrl.runner.rundir import prepare
    from splitrl.stages import STAGE1

    settings = TrainSettings(total_steps=64, env=EnvSettings(env_id="CartPole-v1"),
                             ppo=PPOSettings(num_steps=32, minibatches=2))
    _, _, run_log = prepare(settings, RunOptions(run_dir=str(tmp_path / "run"), track=True), STAGE1)
    try:
        assert run_log.tracker is None  # stage1's statistics reach W&B with stage0's records
    finally:
        run_log.close()
