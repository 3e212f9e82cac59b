"""Pure PPO maths for a tanh-squashed Gaussian policy (no I/O, no envs)."""

from .buffer import RolloutBuffer, minibatch_schedule, shuffled_minibatches
from .distributions import LOG_STD_MAX, LOG_STD_MIN, TanhGaussian, clamp_log_std
from .gae import compute_gae
from .losses import explained_variance, ppo_loss

__all__ = [
    "compute_gae",
    "TanhGaussian",
    "LOG_STD_MIN",
    "LOG_STD_MAX",
    "clamp_log_std",
    "ppo_loss",
    "explained_variance",
    "RolloutBuffer",
    "minibatch_schedule",
    "shuffled_minibatches",
]
