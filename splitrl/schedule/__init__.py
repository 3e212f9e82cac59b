"""When things happen: schedules drive the stages' compute over a `Transport`.

`sync` is the synchronous schedule (the stages take turns), `pipelined` keeps
several messages in flight (env groups, micro-batches), `asynchronous` runs the
next rollout while this iteration trains; `common` holds what their loops share
and `session` the thin workers that run a schedule in a process, or both sides
in one (the twin).
"""

from .session import open_link, prepare, run_stage0, run_stage1, serve_stage0, serve_stage1, train_twin

__all__ = ["open_link", "prepare", "run_stage0", "run_stage1", "serve_stage0", "serve_stage1", "train_twin"]
