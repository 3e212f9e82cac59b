"""Pure PPO maths for a tanh-squashed Gaussian or a categorical policy (no I/O, no envs)."""

from .buffer import RolloutBuffer, minibatch_schedule, shuffled_minibatches
from .distributions import LOG_STD_MAX, LOG_STD_MIN, Categorical, TanhGaussian, clamp_log_std
from .gae import compute_gae, importance_weights
from .losses import LOSS_STATS, anneal, explained_variance, ppo_loss
from .optimizer import adam, load_adam_state

__all__ = [
    "compute_gae",
    "importance_weights",
    "TanhGaussian",
    "Categorical",
    "LOG_STD_MIN",
    "LOG_STD_MAX",
    "clamp_log_std",
    "LOSS_STATS",
    "ppo_loss",
    "explained_variance",
    "anneal",
    "adam",
    "load_adam_state",
    "RolloutBuffer",
    "minibatch_schedule",
    "shuffled_minibatches",
]
