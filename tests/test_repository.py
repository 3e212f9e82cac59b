"""What the repository holds: records and code, no binaries (a clone stays light)."""

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

LARGEST = 2 * 1024 * 1024
"""No tracked file is larger (a long run's records over it are kept compressed: `splitrl.runs.read_metrics`)."""

LEGACY = {f"docs/results/paper-length/{run}-seed{seed}/checkpoints/{stage}-iter00100.pt"
          for run, stages in (("ours-bottleneck", ("stage0", "stage1")),)
          for seed in (1, 2) for stage in stages}
"""Checkpoints committed before the rule, removed a few each submission (what one may remove is capped by its diff);
history is not rewritten. None may be added to this list."""


def _tracked() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    return [name for name in out.decode().split("\0") if name]


def test_no_checkpoint_is_tracked_outside_models_and_no_file_is_over_2_mb():
    tracked = _tracked()
    assert tracked, "not a git checkout"
    checkpoints = [n for n in tracked if n.endswith(".pt") and not n.startswith("models/") and n not in LEGACY]
    assert checkpoints == [], "checkpoints are training state: commit a run's records only (scripts/keep_run.sh)"
    large = [n for n in tracked if n not in LEGACY and (ROOT / n).is_file() and (ROOT / n).stat().st_size > LARGEST]
    assert large == [], f"tracked files over {LARGEST} bytes"
