"""The parts of the asynchronous schedule's alignment probe, `benchmarks/async_probe.py` (its doc says what it
checks and how to run it).

- `record`: what happened, kept where it happened: env steps at the vector env's boundary, every version's
  layers as training left them, each step's versions, what each stage trained on;
- `checks`: the invariants (a) to (f), each a function reading the record;
- `stage0`, `stage1`: the hooks on the twin's Edge and Learner that fill the record and call the checks;
- `hold`: ``--hold``'s pacing; `plants`: ``--plant``'s deliberate bugs;
- `run`: the settings the probe covers; `summary`: the counts and the summary line; `errors`: the reports;
- `probe`: `Probe`, one run's probe built from the above.
"""

from .errors import InvariantBroken, ProbeError
from .plants import PLANTS
from .probe import Probe

__all__ = ["PLANTS", "InvariantBroken", "Probe", "ProbeError"]
