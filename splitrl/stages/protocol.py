"""The session between the stages: message kinds, their contents, and the roles.

stage0 drives; stage1 only answers. Per iteration:

  rollout   stage0 -> step {features[, reward, terminated, truncated, final_features, final_index]}
            stage1 -> action {action}                      (num_steps times)
            stage0 -> rollout_end {features, reward, terminated, truncated[, final_*]}
            stage1 -> heads {<weight updates>}             (only with the replica codec)
  training  stage0 -> train_fwd {features | outputs} header {epoch, mb}
            stage1 -> train_bwd {grad}                     (epochs x minibatches times,
                                                            only when stage0 holds parameters)
            stage1 -> heads {<weight updates>} header {iteration, epoch, mb}
                                                           (after the train_bwd of the minibatches
                                                            that the replica's last_every/all_every name)
  wrap-up   stage0 -> iter_end header {iteration, checkpoint}
            stage1 -> progress header {epoch}               (per epoch, only when stage1 trains alone)
            stage1 -> iter_stats header {losses/..., time/heads}
  the end   stage0 -> close

A ``step`` at t > 0 carries the outcome of the action taken at t - 1; the last
outcome of an iteration rides on ``rollout_end`` with the features of the
observation to bootstrap from. ``final_features`` holds the encoded real last
observation of each env whose episode was truncated (``final_index`` says which),
so stage1 can bootstrap it. The minibatch order is `minibatch_schedule(seed,
iteration)` on both sides; ``epoch``/``mb`` in the header catch any disagreement.
"""

from __future__ import annotations

from ..transport import WireLimits

__all__ = ["STAGE0", "STAGE1", "KINDS", "LIMITS"]

STAGE0 = "stage0"
STAGE1 = "stage1"

KINDS = frozenset(
    {"step", "action", "rollout_end", "heads", "train_fwd", "train_bwd", "iter_end", "progress", "iter_stats", "close"}
)

LIMITS = WireLimits(kinds=KINDS)
