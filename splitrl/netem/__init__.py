"""Link shaping with tc (`splitrl netem`) and network namespaces joined by a shaped veth pair.

`tc` runs tc commands for one interface (`shaping` builds them, `qdiscs` reads
tc's JSON back in words; `tc` re-exports both); `netns` makes the
namespaces (two joined by a shaped veth pair, or one with only its loopback)
and starts processes inside. Neither knows what runs there (the lab's training
runs are `splitrl.lab`) and neither imports torch: the commands stay
quick to start.
"""

from .netns import Counters, Lab, LabNames, LoopbackNamespace, netns_available
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
    "Counters",
    "Lab",
    "LabNames",
    "LoopbackNamespace",
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
    "netns_available",
    "plan_shaping",
    "show_shaping",
]
