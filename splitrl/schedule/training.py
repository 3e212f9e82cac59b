"""Each stage's training: every minibatch of an iteration through the encoder and back, as every schedule runs it.

For each minibatch stage0 forwards its parts (`Parts`) and sends their features (``train_fwd``), all of them
before the first reply, so stage1's heads work on part j while stage0 forwards j + 1; then it back-propagates
each gradient as it comes back (``train_bwd``) and ends the minibatch (`Step`). The parts are the whole
minibatch (`whole`: the synchronous schedule), its micro-batches (`microbatches`: the pipelined and
asynchronous schedules, GPipe), or a fleet's edge's share of it (`splitrl.schedule.fleet`). The step is one
optimizer step and the replica's update where one is due (`local_step`), or a fleet's gradient sum or
average.

Stage1's side (`stage1_train`) is the mirror image for one stage0: a loss per part as its features arrive, the
gradient sent back at once, one optimizer step a minibatch. A fleet's stage1 (`splitrl.schedule.fleet`) serves
several edges' shares of each minibatch and sums their encoders, a loop of its own.

Where a network may take its micro-batches at once (`splitrl.schedule.workers`), each side hands them to worker
threads: stage0 forwards every part at once and back-propagates each as its gradient comes; stage1 takes each
part's loss as its features come. The gradients add up in the parts' order, so the numbers are those of the
parts taken in turn.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Callable

import torch

from ..stages import Edge, EdgeExchange, Learner, LearnerExchange
from ..transport import Transport
from .common import PhaseClock, expect, stops
from .workers import PartWorkers, Task, add_in_order, part_workers

__all__ = ["Part", "Parts", "Step", "whole", "microbatches", "local_step", "stage0_train", "stage1_train"]

Part = tuple[torch.Tensor, torch.Tensor, dict[str, int]]
"""(the rows this edge forwards, the indices their features are sent with, what the part's messages' headers add)."""

Parts = Callable[[torch.Tensor], list[Part]]
"""A minibatch's indices -> its parts, in the order they are sent (none: this edge holds no sample of it)."""

Step = Callable[[int, int, int, bool, bool], bool]
"""``step(epoch, mb, minibatches, forwarded, stop)``, once minibatch ``mb`` (of the epoch's ``minibatches``) has
its gradients in the encoder: ``forwarded``, whether this edge forwarded any part of it; ``stop``, whether
stage1's last ``train_bwd`` ended the epochs. Returns whether the epochs end."""


def whole(idx: torch.Tensor) -> list[Part]:
    """The minibatch in one message each way."""
    return [(idx, idx, {})]


def microbatches(micro: int) -> Parts:
    """The minibatch in ``micro`` micro-batches, each message tagged with its ``j`` (also with one)."""

    def parts(idx: torch.Tensor) -> list[Part]:
        return [(part, part, {"j": j}) for j, part in enumerate(idx.chunk(micro))]

    return parts


def local_step(edge: Edge, exchange: EdgeExchange, link: Transport, clock: PhaseClock) -> Step:
    """One optimizer step with the minibatch's gradient, then the replica's weights if the exchange updates
    them after this minibatch (``heads``)."""

    def step(epoch: int, mb: int, minibatches: int, forwarded: bool, stop: bool) -> bool:
        with clock("encoder"):
            edge.optimizer_step()
        names = exchange.due(epoch, mb)
        if names:  # the replica's weights, updated mid-iteration
            with clock("link"):
                update = expect(link, "heads")
            with clock("codec"):
                exchange.apply_update(update, {"iteration": edge.train_iteration, "epoch": epoch, "mb": mb}, names)
        return stop

    return step


def stage0_train(edge: Edge, exchange: EdgeExchange, link: Transport, clock: PhaseClock,
                 order: list[list[torch.Tensor]], *, parts: Parts = whole, step: Step | None = None,
                 on_epoch: Callable[[int, bool], None] | None = None) -> None:
    """Every minibatch of one iteration (``order``: `Edge.begin_training`'s minibatch order, one list an epoch):
    each of its ``parts`` forwarded and sent, then each gradient back-propagated as it arrives, then ``step``
    (default: `local_step`). ``on_epoch(epoch, last)`` after each epoch's last step (``last``: no epoch
    follows)."""
    step = step or local_step(edge, exchange, link, clock)
    workers = part_workers(edge.net) if edge.params else None
    for epoch, minibatches in enumerate(order):
        for mb, idx in enumerate(minibatches):
            split = parts(idx)
            apart = workers is not None and len(split) > 1  # every part's forward at once, each backward as it can
            forwards = [workers.submit(clock, "encoder", edge.forward, rows) for rows, _, _ in split] if apart else []
            sent = []
            for k, (rows, sent_idx, tag) in enumerate(split):
                if apart:
                    features = forwards[k].result()  # (its seconds: the worker's, in clock's "encoder")
                else:
                    with clock("encoder"):
                        features = edge.forward(rows)
                with clock("codec"):
                    out, (tensors, header) = exchange.send(features, sent_idx)
                with clock("link"):
                    link.send("train_fwd", tensors, {**header, "epoch": epoch, "mb": mb, **tag})
                sent.append((out, tag))
            stop = False
            backwards = []
            for k, (out, tag) in enumerate(sent):
                with clock("link"):
                    reply = expect(link, "train_bwd", epoch=epoch, mb=mb, **tag)
                stop = stops(reply, mb == len(minibatches) - 1 and k == len(sent) - 1)
                with clock("codec"):
                    grad = exchange.grad(out, reply)
                if apart:
                    backwards.append(workers.submit(clock, "encoder", edge.part_gradients, out.out, grad))
                else:
                    with clock("encoder"):
                        edge.backward(out.out, grad)
            if apart:
                grads = [b.result() for b in backwards]
                with clock("encoder"):
                    add_in_order(edge.params, grads)
            stop = step(epoch, mb, len(minibatches), bool(sent), stop)
            edge.progress.minibatch()
        if on_epoch is not None:
            on_epoch(epoch, stop or epoch == len(order) - 1)
        if stop:  # stage1 saw the KL pass --target-kl
            break


def stage1_train(learner: Learner, exchange: LearnerExchange, link: Transport, busy: PhaseClock,
                 order: list[list[torch.Tensor]], *, parts: Parts = whole,
                 on_epoch: Callable[[int, bool], None] | None = None) -> None:
    """Every minibatch of one iteration from stage1's side, the ``parts`` stage0 sends: a loss per part as it
    arrives, its gradient sent back at once (stage0 back-propagates while the next part's loss is taken), then
    one optimizer step a minibatch and the replica's update where one is due. ``on_epoch`` as in
    `stage0_train`."""
    stop = False
    workers = part_workers(learner.heads) if exchange.apart else None
    for epoch, minibatches in enumerate(order):
        for mb, idx in enumerate(minibatches):
            sent = parts(idx)
            last = mb == len(minibatches) - 1
            if workers is not None and len(sent) > 1:
                stop = _stage1_apart(learner, exchange, link, busy, workers, idx, sent, epoch, mb, last)
            else:
                for k, (part, _, tag) in enumerate(sent):
                    msg = expect(link, "train_fwd", epoch=epoch, mb=mb, **tag)
                    with busy("heads"):
                        tensors, header = exchange.learn(msg, part, idx if len(sent) > 1 else None)
                    stop = last and k == len(sent) - 1 and learner.stop_early()
                    link.send("train_bwd", tensors, {**header, "epoch": epoch, "mb": mb, **tag,
                                                     **({"stop": True} if stop else {})})
            with busy("heads"):
                learner.optimizer_step()
                update = exchange.update(epoch, mb)
            if update is not None:
                link.send("heads", *update)
        if on_epoch is not None:
            on_epoch(epoch, stop or epoch == len(order) - 1)
        if stop:
            break


def _stage1_apart(learner: Learner, exchange: LearnerExchange, link: Transport, busy: PhaseClock,
                  workers: PartWorkers, idx: torch.Tensor, sent: list[Part], epoch: int, mb: int, last: bool) -> bool:
    """`stage1_train`'s minibatch ``idx`` in the ``sent`` parts, each part's loss taken on a worker as its features
    come. Whenever a part's features come, the gradients of the parts taken by then go back, in the parts' order;
    the rest once all have come. The heads' gradients add up in that order (`add_in_order`). Returns whether the
    epochs stop here."""
    taking: deque[tuple[Any, Task, dict[str, int]]] = deque()
    grads: list[list[torch.Tensor | None]] = []
    stop = False

    def reply(wait: bool) -> None:
        nonlocal stop
        while taking and (wait or taking[0][1].done()):
            part, task, tag = taking.popleft()
            task.wait()  # (the worker's seconds count as "heads" in `result`, not this wait)
            with busy("heads"):
                (tensors, header), heads_grads = exchange.end_part(part, task.result, idx)
            grads.append(heads_grads)
            stop = last and not taking and len(grads) == len(sent) and learner.stop_early()
            link.send("train_bwd", tensors, {**header, "epoch": epoch, "mb": mb, **tag,
                                             **({"stop": True} if stop else {})})

    for rows, _, tag in sent:
        msg = expect(link, "train_fwd", epoch=epoch, mb=mb, **tag)
        with busy("heads"):
            x, part = exchange.begin_part(msg, rows)
        taking.append((part, workers.submit(busy, "heads", learner.part_gradients, x, rows, idx), tag))
        reply(wait=False)
    reply(wait=True)
    with busy("heads"):
        add_in_order(learner.params, grads)
    return stop
