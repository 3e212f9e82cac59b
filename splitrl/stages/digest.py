"""Digests of a fleet's encoder: what each edge says it holds, and what a relayed ``encoder_state`` holds.

Every edge of a fleet keeps the same encoder bit for bit (``--encoder-sync grad``: the same summed gradients
and optimizer steps, so the same weights and Adam moments; ``avg``: the same agreed weights after each
epoch's last average). So each edge reports at each iteration's end (``iter_end``'s ``encoder``) a digest
of every tensor a joining edge would take from it that the edges hold alike (`EdgeEncoder.state`: the
parameters, not buffers computed from each edge's own data; with ``grad`` the moments too), stage1 takes the one most edges report as the fleet's (`splitrl.schedule.agreement`), and
checks an ``encoder_state`` it relays against it, tensor by tensor, before a new edge starts from it.

A digest is BLAKE2b-128 of the tensor's dtype, shape and bytes, as 32 hex digits: one pass over the bytes
(the paper's encoder: 78k parameters, a few hundred kilobytes with its moments) per iteration.
"""

from __future__ import annotations

import hashlib
from typing import Iterable

import torch

from ..devices import to_host

__all__ = ["tensor_digest", "digests", "DIGEST_CHARS"]

DIGEST_CHARS = 32
"""Hex digits of one digest (BLAKE2b with a 16-byte digest)."""


def tensor_digest(t: torch.Tensor) -> str:
    """The digest of ``t``'s dtype, shape and bytes (in host memory, C order)."""
    t = to_host(t.detach()).contiguous()
    h = hashlib.blake2b(digest_size=DIGEST_CHARS // 2)
    h.update(f"{str(t.dtype).removeprefix('torch.')} {list(t.shape)}".encode())
    h.update(t.reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def digests(tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, str]:
    """Each named tensor's digest."""
    return {name: tensor_digest(t) for name, t in tensors}
