"""What the ZmqTransport tests share besides their fixtures (conftest.py): the longest wait, an endpoint of
each kind, and bitwise equality of tensor dicts."""

from __future__ import annotations

import itertools
import os

import torch

__all__ = ["T", "unique_ids", "endpoint_for", "assert_same"]


T = 5.0
"""Longest any receive in these tests may wait."""

unique_ids = itertools.count()


def endpoint_for(scheme: str, tmp_path) -> str:
    """A fresh endpoint of one kind: "tcp" (port 0), "ipc" (under tmp_path) or "inproc"."""
    if scheme == "tcp":
        return "tcp://127.0.0.1:0"
    if scheme == "ipc":
        return f"ipc://{tmp_path}/s"
    return f"inproc://splitrl-test-{os.getpid()}-{next(unique_ids)}"


def assert_same(a: dict, b: dict) -> None:
    assert list(a) == list(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=0, equal_nan=True)
