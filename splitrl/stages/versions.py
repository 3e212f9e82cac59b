"""Policy versions: the trained layers published as numbered copies, and the copy the rollout acts with.

Either stage holds its layers twice when the rollout acts while training runs (the asynchronous
schedule): the layers that train, and an acting copy. After training, the trained layers are
`PolicyVersions.publish`-ed as a frozen copy under one version number or several (an early stop,
--target-kl, publishes one copy under every version it skipped), and the rollout `adopt`s a version
between two steps: stage0 when it switches its encoder, stage1 when stage0's step message says which
version acted. A version counts training iterations, or epochs with --publish epoch
(`TrainSettings.versions_per_iteration`). Without an acting copy the layers act as they train.
"""

from __future__ import annotations

import copy
from typing import Callable, Generic, Iterable, TypeVar

from torch import nn

__all__ = ["PolicyVersions"]

M = TypeVar("M", bound=nn.Module)


class PolicyVersions(Generic[M]):
    """The acting copy of ``trained`` (``trained`` itself without ``acting_copy``) and the published versions."""

    def __init__(self, trained: M, acting_copy: bool) -> None:
        self.trained = trained
        self.acting: M = self.frozen() if acting_copy else trained
        self.version = 0
        """The version the acting copy was adopted as."""
        self.newest = 0
        """The newest number the acting copy was published under: `version` but where an early stop published it
        under several."""
        self.published: dict[int, M] = {}
        """Copies not adopted yet, by version (several numbers may name one copy)."""

    @property
    def copied(self) -> bool:
        """Whether the rollout acts with a copy (else with the layers that train)."""
        return self.acting is not self.trained

    def frozen(self) -> M:
        """A copy of the trained layers that no optimizer touches."""
        return copy.deepcopy(self.trained).requires_grad_(False)

    def publish(self, versions: Iterable[int]) -> M:
        """The trained layers as one frozen copy, under each of ``versions``."""
        module = self.frozen()
        for version in versions:
            self.published[version] = module
        return module

    def adopt(self, version: int | None, unknown: Callable[[int], Exception]) -> int:
        """Act with the copy of ``version`` (default: the newest published); returns the version acting. Older
        copies and ``version``'s own number are dropped; a version never published raises ``unknown(version)``."""
        if version is None:
            version = max([self.version, *list(self.published)])
        if version != self.version:
            module = self.published.get(version)
            if module is None:
                raise unknown(version)
            self.acting, self.version = module, version
            # An early stop's aliases are all >= version, none dropped yet: the newest names the copy.
            self.newest = max(v for v, m in list(self.published.items()) if m is module)
        for old in [v for v in list(self.published) if v <= version]:  # list(): publish() may add meanwhile
            del self.published[old]
        return self.version

    def restart(self, version: int) -> None:
        """After a checkpoint's weights were loaded: a fresh acting copy of them as ``version``, nothing published."""
        self.acting = self.frozen()
        self.version = self.newest = version
        self.published = {}
