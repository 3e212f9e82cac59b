"""The two pipeline stages and the loops that run them."""

from .protocol import KINDS, STAGE0, STAGE1
from .run import prepare, run_stage0, run_stage1, train_twin
from .stage0 import Stage0
from .stage1 import Stage1, Stage1Server

__all__ = ["KINDS", "STAGE0", "STAGE1", "Stage0", "Stage1", "Stage1Server", "prepare", "run_stage0", "run_stage1", "train_twin"]
