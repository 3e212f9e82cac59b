"""The session between the stages: message kinds, their contents, and the roles.

Per iteration (the synchronous schedule, `splitrl.schedule.sync`, sends them in this order):

  rollout   stage0 -> step {features[, reward, terminated, truncated, final_features, final_index]} header {t}
            stage1 -> action {action} header {t}                 (num_steps times)
            stage0 -> rollout_end {features, reward, terminated, truncated[, final_*]}
            stage1 -> heads {<weight updates>} header {iteration}
                                                                 (only with --exchange replica)
  training  stage0 -> train_fwd {features | outputs} header {epoch, mb}
            stage1 -> train_bwd {grad} header {epoch, mb}        (epochs x minibatches times,
                                                                  only when stage0 holds parameters)
            stage1 -> heads {<weight updates>} header {iteration, epoch, mb}
                                                                 (after the train_bwd of the minibatches
                                                                  the replica's last_every/all_every name)
  wrap-up   stage0 -> iter_end header {iteration, checkpoint, eval}
            stage1 -> progress header {epoch}                    (per epoch, only when stage1 trains alone)
            stage1 -> iter_stats header {losses/..., time/heads, cpu/stage1}
            stage1 -> eval_heads {<the heads' weights>} header {iteration}
                                                                 (only when iter_end says eval: stage0 then
                                                                  scores the policy locally, --eval-every)
  the end   stage0 -> close

A fleet (``--edges N``, `splitrl.schedule.fleet`) runs the synchronous session with every edge, and after
each minibatch's ``train_bwd`` (an edge that holds none of the minibatch's samples sends no ``train_fwd``):

            stage0 -> encoder_grad {<the encoder's gradients>} header {epoch, mb}
            stage1 -> encoder_grad {<their sum over the edges>} header {epoch, mb[, stop]}

The pipelined and asynchronous schedules (`splitrl.schedule.pipelined`,
`splitrl.schedule.asynchronous`) send the same kinds with ``g`` (the env group) in
the rollout's headers, ``j`` (the micro-batch) in training's and ``v`` (the acting
policy's version) in the asynchronous rollout's, after a short start: stage0
-> ``ping`` {i} / stage1 -> ``pong`` {i} (five round trips, timed), then stage0
-> ``plan`` {rollout_groups}.

``action`` is float32 [N, A] in [-1, 1] for a Box action space (stage0 maps it
onto the Box), int64 [N] action indices for a Discrete one.
A ``step`` at t > 0 carries the outcome of the action taken at t - 1; the last
outcome of an iteration rides on ``rollout_end`` with the features of the
observation to bootstrap from. ``final_features`` holds the encoded real last
observation of each env whose episode was truncated (``final_index`` says which),
so stage1 can bootstrap it. The minibatch order is `minibatch_schedule(seed,
iteration)` on both sides; ``epoch``/``mb`` in the header catch any disagreement.
What ``train_fwd``/``train_bwd`` carry is the training exchange's
(`splitrl.stages.exchange`): the encoder's features and their gradient, or the
change of the heads' outputs and its gradient (`splitrl.stages.replica`).
"""

from __future__ import annotations

from typing import Any

import torch

from ..transport import Message, ProtocolError, WireLimits

__all__ = ["STAGE0", "STAGE1", "KINDS", "LIMITS", "ENCODER_PREFIX", "Payload", "tensor"]

STAGE0 = "stage0"
STAGE1 = "stage1"

KINDS = frozenset(
    {"step", "action", "rollout_end", "heads", "train_fwd", "train_bwd", "iter_end", "progress", "iter_stats", "close",
     "ping", "pong", "plan", "eval_heads", "encoder_grad", "encoder_avg", "encoder_state", "resume",
     "rescore"}
)

LIMITS = WireLimits(kinds=KINDS)

ENCODER_PREFIX = "encoder."
"""``encoder_grad``'s tensors: the encoder's parameter names after this (a tensor name starts with a letter)."""

Payload = tuple[dict[str, torch.Tensor], dict[str, Any]]
"""A message's tensors and header, as a stage computes them and a schedule sends them."""


def tensor(msg: Message, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``msg``'s tensor ``name``, checked for shape and dtype; `ProtocolError` otherwise."""
    t = msg.tensors.get(name)
    if t is None:
        raise ProtocolError(f"{msg.kind}: expected tensor {name!r}, got only {sorted(msg.tensors)}")
    if tuple(t.shape) != shape or t.dtype != dtype:
        raise ProtocolError(f"{msg.kind}: tensor {name!r}: expected {dtype} {list(shape)}, got {t.dtype} {list(t.shape)}")
    return t
