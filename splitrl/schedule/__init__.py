"""When things happen: schedules drive the stages' compute over a `Transport`.

`sync` is the synchronous schedule (the stages take turns), `pipelined` keeps
several messages in flight (env groups, micro-batches), `asynchronous` runs the
next rollout while this iteration trains, `fleet` serves several edges from one
stage1 (`roster`: which of its places hold an edge). `training` is stage0's
minibatch loop, which all of them run; `common` holds what else their loops share.
The workers that run a schedule in a process, or both sides in one (the twin),
are `splitrl.runner`'s.
"""

__all__: list[str] = []
