"""When things happen: schedules drive the stages' compute over a `Transport`.

`sync` is the synchronous schedule (the stages take turns), `pipelined` keeps
several messages in flight (env groups, micro-batches), `asynchronous` runs the
next rollout while this iteration trains, `fleet` serves several edges from one
stage1 (`roster`: which of its places hold an edge). `training` is both stages'
minibatch loops, which all of them run (`workers`: a minibatch's micro-batches on
worker threads at once); `common` holds what else their loops share.
The workers that run a schedule in a process, or both sides in one (the twin),
are `splitrl.runner`'s.
"""

__all__: list[str] = []
