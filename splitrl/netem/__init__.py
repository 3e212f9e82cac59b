"""Link shaping with tc (`splitrl netem`) and the two-namespace lab (`splitrl lab`).

`tc` builds, runs and reads tc commands for one interface; `lab` joins two
network namespaces with a shaped veth pair and runs the stages inside. Neither
imports torch at module level: the commands stay quick to start.
"""

from .lab import Lab, LabNames, LabResult, format_report, measure_throughput, run_lab
from .tc import (
    Applied,
    NetemMissing,
    NoSuchDevice,
    NotPermitted,
    PartialShaping,
    Plan,
    Shaping,
    ShapingError,
    ToolMissing,
    apply_shaping,
    clear_shaping,
    plan_shaping,
    show_shaping,
)

__all__ = [
    "Applied",
    "Lab",
    "LabNames",
    "LabResult",
    "NetemMissing",
    "NoSuchDevice",
    "NotPermitted",
    "PartialShaping",
    "Plan",
    "Shaping",
    "ShapingError",
    "ToolMissing",
    "apply_shaping",
    "clear_shaping",
    "format_report",
    "measure_throughput",
    "plan_shaping",
    "run_lab",
    "show_shaping",
]
