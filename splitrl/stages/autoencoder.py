"""``--bottleneck-train autoencoder``: the paper's literal learned compression at the cut.

The paper's future work: "lightweight autoencoders could learn compressed representations
of activations". Here stage1 fits a linear autoencoder to the encoder's 4,096 features and
ships its encoder half to stage0, which sends the K-value code in their place:

- stage0's network ends with the projection E (K x 4096), as with ``--bottleneck K``, but
  PPO's loss never changes it (its gradient still flows through E into the CNN);
- every ``--autoencoder-every``-th rollout step, stage0 also sends that step's 4,096
  features (``ae_sample``, int8+zstd: counted with the rollout's bytes);
- after each rollout stage1 fits E and the decoder D (K to 4096, the heads' trunk) to
  reconstruct the samples of the last `REPLAY` rollouts (mean squared error, Adam), and E's
  change travels with the replica's update after the rollout (`splitrl.stages.replica`,
  quantised like the heads' weights: counted with the replica's bytes);
- the heads take D's reconstruction, so a new fit that turns the code's basis changes
  nothing they see: only how well the 4,096 features come through.

What is not exact: the fit comes after the rollout and before its training, so that
iteration trains on the rollout's codes (the old E's) through the new D, and PPO's ratio
starts off 1 by the fit's change (the replica's offsets carry E's change to first order).
Keeping the old D (and E on stage0) until the next rollout would make training exact; the
measured run (docs/benchmarks/learning.md) is of this version.

Compared with ``--bottleneck-train ppo``, the cut's K values are what reconstructs the
features best rather than what the loss needs, and the link carries the samples and E.
With the replica exchange, stage0's replica is the heads with D folded into their first
layers (`splitrl.stages.replica.replica_weights`): both are linear, so the replica stays
K wide and its updates as small as the end-to-end bottleneck's.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch
from torch import nn

from ..codecs import CodecSet, Context
from ..devices import to_device
from ..transport import Message

__all__ = ["SAMPLE", "SAMPLE_CODEC", "PROJECTION", "REPLAY", "sampled", "pack_sample", "unpack_sample", "Autoencoder"]

SAMPLE = "ae_sample"
"""The step message's tensor that carries the step's features before the projection."""
SAMPLE_CODEC = "int8+zstd"
PROJECTION = "encoder.projection"
"""E's name in the replica's update after the rollout."""
REPLAY = 4
"""Rollouts whose samples each fit trains on (1,024 features at the defaults: 4,096 steps, every 16th)."""
FIT_STEPS, FIT_BATCH, FIT_LR = 50, 256, 1e-3
"""Each fit: Adam steps on batches of samples from the replay, and its step size."""


def sampled(settings: Any, t: int) -> bool:
    """Whether rollout step ``t``'s message carries its features before the projection."""
    return settings.bottleneck_train == "autoencoder" and t % settings.autoencoder_every == 0


_SAMPLES = CodecSet(rollout=SAMPLE_CODEC)
"""The samples' codec (stateless: one for every message), packed and checked as any rollout tensor."""


def pack_sample(x: torch.Tensor, tensors: dict[str, torch.Tensor], header: dict[str, Any]) -> None:
    _SAMPLES.pack("rollout", SAMPLE, x, Context(), tensors, header)


def unpack_sample(msg: Message, rows: int, width: int) -> torch.Tensor:
    """The samples ``msg`` carries, (rows, width); `CodecError` if they do not fit."""
    return _SAMPLES.unpack("rollout", SAMPLE, msg.tensors, msg.header, Context(), (rows, width), torch.float32)


class Autoencoder:
    """Stage1's fit of E (stage0's projection, a copy kept here) and D (the heads' trunk)."""

    def __init__(self, projection: nn.Linear, decoder: nn.Linear, seed: int) -> None:
        self.projection, self.decoder = projection, decoder
        self.params = [projection.weight, decoder.weight, decoder.bias]
        self.optimizer = torch.optim.Adam(self.params, lr=FIT_LR)
        self.generator = torch.Generator().manual_seed(seed)
        self.replay: deque[torch.Tensor] = deque(maxlen=REPLAY)
        self.current: list[torch.Tensor] = []

    def add(self, x: torch.Tensor) -> None:
        """Samples from the rollout being collected (they join the fit's device: the projection's)."""
        self.current.append(to_device(x, self.projection.weight.device))

    def fit(self) -> dict[str, float]:
        """Fit on the replay with this rollout's samples in it; statistics of the fit."""
        if self.current:
            self.replay.append(torch.cat(self.current))
            self.current = []
        if not self.replay:
            return {}
        data = torch.cat(list(self.replay))
        variance = float(data.var(dim=0, unbiased=False).sum())
        for p in self.params:
            p.requires_grad_(True)
        try:
            for _ in range(FIT_STEPS):
                rows = data[torch.randint(len(data), (min(FIT_BATCH, len(data)),), generator=self.generator)]
                loss = (self.decoder(self.projection(rows)) - rows).pow(2).sum(1).mean()
                self.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                self.optimizer.step()
        finally:
            for p in self.params:
                p.requires_grad_(False)
                p.grad = None
        with torch.no_grad():
            error = float((self.decoder(self.projection(data)) - data).pow(2).sum(1).mean())
        return {"autoencoder/loss": error, "autoencoder/explained": 1.0 - error / variance if variance else 1.0,
                "autoencoder/samples": float(len(data))}

    def state_dict(self) -> dict[str, Any]:
        return {"projection": self.projection.weight.detach().clone(), "optimizer": self.optimizer.state_dict(),
                "replay": [x.clone() for x in self.replay], "generator": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with torch.no_grad():
            self.projection.weight.copy_(state["projection"])
        self.optimizer.load_state_dict(state["optimizer"])
        device = self.projection.weight.device
        self.replay = deque((to_device(x, device).clone() for x in state["replay"]), maxlen=REPLAY)
        self.generator.set_state(state["generator"])
        self.current = []
