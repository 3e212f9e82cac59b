"""What a checkpoint file holds, and how it is read without running code.

A checkpoint is data: tensors and plain values (dict, list, tuple, str, int, float, bool,
None). It is written with `torch.save` and read with ``torch.load(..., weights_only=True)``,
torch's allow-listing unpickler, with no class added to its list: a file that names any other
Python object (a crafted ``__reduce__``, a numpy array) is refused before anything in it is
built. The numpy values a stage's state holds (the env wrappers' statistics, replayed actions)
are turned into plain values on the way out (`to_plain`) and back on the way in (`from_plain`),
each as a one-key dict naming its kind:

- a numpy array: ``{"__ndarray__": tensor}`` (the array's own dtype and shape, through torch);
- a numpy scalar: ``{"__npscalar__": [dtype name, python value]}``.

The checksum beside a checkpoint (`splitrl.runs`) catches damage; this module is what stops
malice. Format 1 checkpoints (no ``format`` key; those committed under docs/results are such)
hold numpy arrays and deques as pickled objects: `upgrade` rewrites one the user vouches for, reading it with the same
unpickler and an allow-list of exactly those data classes (a deque read as a list), so even an
upgrade runs no code.
"""

from __future__ import annotations

import io
from collections import OrderedDict
import re
from typing import Any

import numpy as np
import torch

from .devices import to_host

__all__ = ["FORMAT", "UnsafeCheckpointError", "to_plain", "from_plain", "dumps", "loads", "upgrade"]

FORMAT = 2
"""The format written under the key ``"format"`` of every checkpoint; 1 (absent) is the pickled one."""

_NDARRAY, _NPSCALAR = "__ndarray__", "__npscalar__"


class UnsafeCheckpointError(ValueError):
    """A checkpoint that names Python objects beyond tensors and plain values: refused, never unpickled."""


def to_plain(value: Any, path: str = "state") -> Any:
    """``value`` with every numpy array and numpy scalar replaced by its tagged plain form, and every tensor in host
    memory (a stage on a GPU saves what a stage on a CPU reads, and back: `loads` maps to the CPU, and each stage
    moves what it loads to its device); TypeError naming the path of anything else that is neither a tensor nor a
    plain value (it could not be loaded)."""
    if isinstance(value, torch.Tensor):
        return to_host(value)
    if isinstance(value, np.ndarray):
        return {_NDARRAY: torch.from_numpy(np.array(value, copy=True, order="C"))}
    if isinstance(value, np.generic):  # before float: numpy's float64 is a float too
        return {_NPSCALAR: [value.dtype.name, value.item()]}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        out = OrderedDict() if isinstance(value, OrderedDict) else {}  # a module's state_dict stays one
        for key, item in value.items():
            if not isinstance(key, (str, int)):
                raise TypeError(f"{path}: a checkpoint's dict keys are str or int, not {type(key).__name__}")
            out[key] = to_plain(item, f"{path}.{key}")
        return out
    if isinstance(value, (list, tuple)):
        items = [to_plain(v, f"{path}[{i}]") for i, v in enumerate(value)]
        return items if isinstance(value, list) else tuple(items)
    raise TypeError(f"{path}: a checkpoint holds tensors and plain values, not {type(value).__name__}")


def from_plain(value: Any) -> Any:
    """The inverse of `to_plain`."""
    if isinstance(value, dict):
        if len(value) == 1 and _NDARRAY in value:
            return value[_NDARRAY].numpy()
        if len(value) == 1 and _NPSCALAR in value:
            dtype, item = value[_NPSCALAR]
            return np.dtype(dtype).type(item)
        return type(value)((key, from_plain(item)) for key, item in value.items())
    if isinstance(value, list):
        return [from_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(from_plain(v) for v in value)
    return value


def dumps(state: dict[str, Any]) -> bytes:
    """``state`` as a checkpoint file's bytes (format `FORMAT`)."""
    buffer = io.BytesIO()
    torch.save({**to_plain(state), "format": FORMAT}, buffer)
    return buffer.getvalue()


def _load(data: bytes, name: str, allow: list[Any] | None = None) -> dict[str, Any]:
    try:
        with torch.serialization.safe_globals(allow or []):
            state = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    except (RuntimeError, EOFError, OSError) as exc:
        raise ValueError(f"{name} is not a checkpoint torch can read: {exc}") from None
    except Exception as exc:  # torch's UnpicklingError: the file names something outside the allow-list
        found = re.search(r"GLOBAL ([\w.]+)", str(exc))
        what = f"the Python object {found.group(1)}" if found else "Python objects"
        raise UnsafeCheckpointError(
            f"{name} names {what}, which splitrl does not load (reading a checkpoint runs no code); if it is a "
            "checkpoint of an older splitrl that you trust, `splitrl upgrade-checkpoints` rewrites it") from None
    if not isinstance(state, dict):
        raise ValueError(f"{name} is not a checkpoint: it holds a {type(state).__name__}, not a dict")
    return state


def loads(data: bytes, name: str = "the checkpoint") -> dict[str, Any]:
    """A checkpoint's state from its bytes; `UnsafeCheckpointError` (one line, naming ``name``) if it names any
    Python object, ValueError if it is not a checkpoint of this format."""
    state = _load(data, name)
    if state.pop("format", 1) != FORMAT:
        raise UnsafeCheckpointError(f"{name} is in an older checkpoint format; `splitrl upgrade-checkpoints` "
                                    "rewrites it")
    return from_plain(state)


def _empty_list(*_: Any) -> list[Any]:
    return []


def _legacy_allow_list() -> list[Any]:
    """The data classes format 1 checkpoints pickle: numpy arrays, dtypes and scalars, and the env wrappers'
    deques, read as lists (torch's unpickler fills only lists; `splitrl.envs.restore_vector_env` refills the
    live queue). None of them runs code when it is built from a file: an array is rebuilt from its dtype,
    shape and bytes."""
    dtypes = [type(np.dtype(name)) for name in ("bool", "uint8", "int8", "int16", "int32", "int64", "float16",
                                                 "float32", "float64")]
    core = getattr(np, "_core", None) or np.core  # numpy 2 renamed numpy.core
    return [(_empty_list, "collections.deque"), np.ndarray, np.dtype, core.multiarray._reconstruct,
            core.multiarray.scalar, *dtypes]


def upgrade(data: bytes, name: str = "the checkpoint") -> bytes | None:
    """A format 1 checkpoint's bytes rewritten in this format (None if it already is), read with torch's
    unpickler allowing only the data classes format 1 holds (`_legacy_allow_list`)."""
    state = _load(data, name, allow=_legacy_allow_list())
    if state.get("format") == FORMAT:
        return None
    return dumps(state)
