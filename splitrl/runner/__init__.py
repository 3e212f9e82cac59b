"""The workers around a schedule: each stage as a process, and both in one process (the twin).

A worker owns what the compute objects (`splitrl.stages`) and the schedules (`splitrl.schedule`) must
not: the run directory, the link, the handshake, resuming, joining, and stopping cleanly. One concern
a file:

- `rundir`: the run directory checked and prepared before any socket opens; where a resumed run goes on;
- `precheck`: the part of that check which needs neither torch nor an env built, made first by `splitrl run`;
- `links`: the link as ``--transport`` chooses it, and the check before it reaches beyond this machine;
- `joining`: a fleet's edge finding its place at stage1, a stage1 its place among the learners;
- `build`: the `Edge`, the `Learner` and the schedule the settings ask for;
- `stage0`, `stage1`: each stage as a process (`serve_stage0` / `serve_stage1`: the handshake, resume and
  the schedule's loop over a link already open; `run_stage0` / `run_stage1`: the whole process);
- `twin`: both stages in one process over an in-process link.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..lazy import lazy_getattr

if TYPE_CHECKING:
    from .build import make_edge, make_learner
    from .links import open_link
    from .rundir import prepare
    from .stage0 import run_stage0, serve_stage0
    from .stage1 import run_stage1, serve_stage1
    from .twin import train_twin

_LAZY = {"prepare": "rundir", "open_link": "links", "make_edge": "build", "make_learner": "build",
         "serve_stage0": "stage0", "serve_stage1": "stage1", "run_stage0": "stage0", "run_stage1": "stage1",
         "train_twin": "twin"}

__all__ = sorted(_LAZY)

__getattr__ = lazy_getattr(__name__, _LAZY, globals())
