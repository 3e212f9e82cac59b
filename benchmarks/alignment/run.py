"""The twin's settings as the probe reads them, and the settings it covers."""

from __future__ import annotations

from typing import Any

from .errors import ProbeError

__all__ = ["Run"]


class Run:
    """The run's settings (known once stage1 is built) and the numbers the checks derive from them."""

    def __init__(self) -> None:
        self.settings: Any = None

    @property
    def asynchronous(self) -> bool:
        return self.settings.schedule.mode == "async"

    @property
    def per_iteration(self) -> int:
        """P: policy versions an iteration (its epochs with --publish epoch, else 1); version i * P is iteration
        i's end."""
        return self.settings.ppo.epochs if self.settings.schedule.publish == "epoch" else 1

    @property
    def bound(self) -> int:
        """The largest lag a sample may have, in iterations."""
        return self.settings.schedule.max_staleness if self.asynchronous else 0

    def take(self, settings: Any, hold: bool, plant: str | None) -> None:
        """Keep ``settings``, or say in a `ProbeError` why the probe (with ``--hold``, ``--plant``) cannot check
        such a run."""
        s = settings
        if s.schedule.mode not in ("async", "pipelined", "sync") or s.cut != "cnn" or s.bottleneck_train != "ppo" \
                or s.codecs.parsed_exchange().name != "features" or s.ppo.target_kl > 0:
            raise ProbeError("the probe covers one edge, --cut cnn, --exchange features, --bottleneck-train ppo "
                             "and no --target-kl")
        self.settings = s
        if hold and not (self.asynchronous and s.schedule.max_staleness >= 1):
            raise ProbeError("--hold needs --async and --max-staleness >= 1")
        if hold and self.per_iteration > 1:
            raise ProbeError("--hold needs --publish iteration (--publish epoch paces the rollout itself)")
        if plant in ("adopt-late", "version-tag") and not self.asynchronous:
            raise ProbeError(f"--plant {plant} needs --async (only its rollout swaps versions)")
        if plant == "rescore-stale" and not settings.schedule.rescore:
            raise ProbeError("--plant rescore-stale needs --rescore")
