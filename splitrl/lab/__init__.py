"""The two-host lab on one machine (``splitrl lab``): both stages in a `splitrl.netem.netns.Lab`, and what crossed.

The lab (two network namespaces joined by a veth pair shaped alike in both
directions, `splitrl.netem.netns`) runs the real ``splitrl stage1`` /
``splitrl stage0`` processes inside, with any training settings. `run` brings it
up, measures the link (`link`, with `probe` at both ends), runs the stages to the
end (`stages`) and accounts for the bytes (`accounting`). The lab benchmark
(``splitrl bench lab``) and the pipeline benchmark's shaped rows use the same parts.
The stages and the probes run as processes of their own, in the namespaces.
"""

from .accounting import SideBytes, app_bytes_from_metrics
from .link import Throughput, measure_round_trip, measure_throughput
from .run import LabResult, format_report, run_lab
from .stages import DEFAULT_PORT, LARGEST_MESSAGE, heartbeat_for, spawn_stages, stage_commands, train_in_lab

__all__ = [
    "DEFAULT_PORT",
    "LARGEST_MESSAGE",
    "LabResult",
    "SideBytes",
    "Throughput",
    "app_bytes_from_metrics",
    "format_report",
    "heartbeat_for",
    "measure_round_trip",
    "measure_throughput",
    "run_lab",
    "spawn_stages",
    "stage_commands",
    "train_in_lab",
]
