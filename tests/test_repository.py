"""What the repository holds: records and code, no binaries (a clone stays light)."""

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

LARGEST = 2 * 1024 * 1024
"""No tracked file outside models/ is larger (a long run's records over it are kept compressed:
`splitrl.runs.read_metrics`)."""

MODELS = 10 * 1000 * 1000
"""models/ holds exported policies (`splitrl export`), small enough to read: this many bytes at most in all."""


def _tracked() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    return [name for name in out.decode().split("\0") if name]


def test_no_checkpoint_is_tracked_outside_models_and_no_file_is_over_2_mb():
    tracked = [n for n in _tracked() if (ROOT / n).is_file()]
    assert tracked, "not a git checkout"
    checkpoints = [n for n in tracked if n.endswith(".pt") and not n.startswith("models/")]
    assert checkpoints == [], "checkpoints are training state: commit a run's records only (scripts/keep_run.sh)"
    large = [n for n in tracked if not n.startswith("models/") and (ROOT / n).stat().st_size > LARGEST]
    assert large == [], f"tracked files over {LARGEST} bytes"
    models = sum((ROOT / n).stat().st_size for n in tracked if n.startswith("models/"))
    assert models < MODELS, f"models/ holds {models} bytes"
