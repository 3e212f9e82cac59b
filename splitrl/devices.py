"""Where a stage computes (``--device``), and the crossings between the wire's host memory and that device.

Each stage has a device of its own (``--stage0-device``, ``--stage1-device``; ``--device`` on ``splitrl stage0``
and ``splitrl stage1``): ``cpu``, ``cuda``, ``cuda:N`` or ``auto`` (the first CUDA device where this machine has
one, else the CPU). It is a local choice: two stages on different devices talk as two on the same, and the
handshake's hash does not cover it.

The boundary: the wire is host memory, and so are the codecs (`splitrl.codecs.CodecSet` encodes a tensor's host
copy and decodes on the host); models, optimizers, rollout storage and PPO's maths live on the stage's device,
and the envs step on the CPU (numpy). A tensor crosses to the device once, where it is used (`to_device`: on a
CUDA device through pinned, page-locked memory with a non-blocking copy, `transfer`), and what goes back to the
wire is copied to the host first (`to_host`). On the CPU both return the tensor itself: a CPU run goes through
the same code and computes the same numbers as one that never heard of devices.

The names are checked without importing torch (``--help`` stays light); whether this machine has the device is
checked before any socket opens (`device_errors`), with one line naming the option.

``--channels-last`` is the other half of how a stage computes (`place`): its 2-d convolutions take their inputs
in channels-last memory (NHWC), where torch's CPU kernels (oneDNN) run them faster than on NCHW inputs. Only the
activations inside the convolutions change layout: the weights, their gradients, the optimizer's moments, the
checkpoints and everything on the wire stay as they are. The maths is the same, its float32 sums taken in another
order, so the numbers are not the default's to the last bit; both stages and the twin apply it alike.

A forward of a few rows on the CPU (the rollout's acting, `acting_threads`) runs on one intra-op thread, whatever
``--threads`` says: torch's threads split a batch of one env's step too finely to gain, and waking them costs
more than the work (`benchmarks/acting_threads.py`: one env's step, both networks' forwards and the draw,
1.4-1.5 ms on one thread, 2.1-2.8 ms on two). The training's minibatches keep every thread.
"""

from __future__ import annotations

import os
import re
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING, Any, ContextManager, Iterator

from .errors import SettingsError

if TYPE_CHECKING:
    import torch

__all__ = ["DEVICE_NAMES", "check_device_name", "device_error", "resolve_device", "use_device", "transfer", "to_device",
           "to_host", "describe_device", "place", "ACTING_ROWS", "one_thread", "acting_threads",
           "update_threads", "channels_last_input"]

DEVICE_NAMES = ("cpu", "cuda", "cuda:N", "auto")
"""What ``--device`` takes."""
_NAME = re.compile(r"cpu|auto|cuda(:\d+)?")


def check_device_name(text: str, option: str = "--device") -> str:
    """``text`` if it names a device (`DEVICE_NAMES`), else SettingsError naming ``option``; whether this machine
    has it is `device_error`'s question."""
    if not isinstance(text, str) or not _NAME.fullmatch(text):
        raise SettingsError(f"{option} {text!r}: expected one of cpu, cuda, cuda:N (N a device's number) or auto")
    return text


def _cuda_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def device_error(text: str, option: str = "--device") -> str | None:
    """Why this machine cannot compute on ``text`` (one line naming ``option``), or None if it can."""
    try:
        check_device_name(text, option)
    except SettingsError as exc:
        return str(exc)
    if not text.startswith("cuda"):
        return None
    count = _cuda_count()
    if count == 0:
        import torch

        why = "this torch is built without CUDA" if torch.version.cuda is None else "no CUDA device is visible"
        return f"{option} {text}: this machine has no CUDA device ({why}; torch {torch.__version__}); use cpu or auto"
    index = int(text.partition(":")[2] or 0)
    if index >= count:
        return f"{option} {text}: this machine has {count} CUDA device(s), cuda:0 .. cuda:{count - 1}"
    return None


def resolve_device(text: str) -> "torch.device":
    """The torch device ``text`` names, with its index (``cuda`` is the current CUDA device, ``auto`` the CUDA device
    where there is one, else the CPU). SettingsError if this machine has no such device."""
    import torch

    message = device_error(text)
    if message:
        raise SettingsError(message)
    if text == "cpu" or (text == "auto" and _cuda_count() == 0):
        return torch.device("cpu")
    if text in ("cuda", "auto"):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(text)


def use_device(device: "torch.device") -> None:
    """Set this process up to compute on ``device``, before its first kernel there: on a CUDA device, kernels that
    give the same numbers every time (cuDNN's deterministic convolutions, not its benchmarked choice; torch's
    deterministic algorithms, warning where an op has none; cuBLAS with a fixed workspace), so that a run repeats
    and a split run equals its twin bit for bit, as on the CPU. Nothing on the CPU, whose kernels repeat as they
    are."""
    if device.type != "cuda":
        return
    import torch
    import torch.utils.deterministic

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = False  # (no memset of every new tensor: nothing reads it)


def transfer(device: "torch.device") -> tuple[bool, bool]:
    """How a host tensor goes to ``device``: (through pinned memory, with a non-blocking copy). Both on a CUDA
    device (the copy then runs beside the host's work, and the caching host allocator keeps the pinned block until
    the copy is done); neither on the CPU, where there is nothing to copy."""
    cuda = device.type == "cuda"
    return cuda, cuda


def to_device(tensor: "torch.Tensor", device: "torch.device") -> "torch.Tensor":
    """``tensor`` on ``device``: the tensor itself where it is there already (always, on the CPU), else copied, from
    the host through pinned memory with a non-blocking copy on a CUDA device (`transfer`)."""
    if tensor.device == device:
        return tensor
    pin, non_blocking = transfer(device)
    if pin and tensor.device.type == "cpu" and not tensor.is_pinned():
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=non_blocking)


def to_host(tensor: "torch.Tensor") -> "torch.Tensor":
    """``tensor`` in host memory, as the wire and the codecs take it: the tensor itself on the CPU, else a copy
    (which waits for the device's work on it)."""
    return tensor if tensor.device.type == "cpu" else tensor.cpu()


def describe_device(device: "torch.device") -> dict[str, Any]:
    """What a run's config records of a stage's device: its name, and for a CUDA device the card and the CUDA
    version torch was built with."""
    import torch

    out: dict[str, Any] = {"device": str(device)}
    if device.type == "cuda":
        out.update(name=torch.cuda.get_device_name(device), cuda=torch.version.cuda)
    return out


def place(module: "torch.nn.Module", device: "torch.device", channels_last: bool = False) -> "torch.nn.Module":
    """``module`` on ``device``; with ``channels_last``, each of its 2-d convolutions takes its input in
    channels-last memory (a forward pre-hook: a no-op on an input already so, as every convolution's after the
    first is, since a convolution keeps its input's layout)."""
    module = module.to(device)
    if channels_last:
        import torch

        for layer in module.modules():
            if isinstance(layer, torch.nn.Conv2d):
                layer.register_forward_pre_hook(channels_last_input)
    return module


def channels_last_input(layer: "torch.nn.Module", args: tuple) -> tuple:
    """``--channels-last``'s forward pre-hook: the input in channels-last memory; it reads and keeps nothing."""
    import torch

    x = args[0]
    if x.dim() != 4:  # an unbatched (C, H, W) input: torch pads it to a batch of one itself
        return args
    return (x.contiguous(memory_format=torch.channels_last),) + tuple(args[1:])


ACTING_ROWS = 4
"""The most rows of a CPU forward that `acting_threads` runs on one intra-op thread. Measured with
`benchmarks/acting_threads.py` (a step's forwards and draw, the paper's networks; wall ms on one thread / two):
1 row 1.39-1.48 / 2.07-2.78, 4 rows 3.01-3.06 / 3.69-4.31, 8 rows 4.65 / 4.61-4.64, 16 rows 7.31-7.34 / 5.54-5.81.
From 8 rows on, the second thread pays in wall time (not in CPU time)."""


@contextmanager
def intra_op_threads(threads: int) -> Iterator[None]:
    """torch's intra-op threads (this thread's) set to ``threads`` for the block, then back."""
    import torch

    before = torch.get_num_threads()
    if threads == before:
        yield
        return
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def one_thread() -> ContextManager[None]:
    """torch's intra-op threads (this thread's) set to one for the block, then back."""
    return intra_op_threads(1)


def acting_threads(device: "torch.device", rows: int) -> ContextManager[None]:
    """For a forward of ``rows`` rows on ``device``: `one_thread` on the CPU up to `ACTING_ROWS` rows, else
    nothing. torch's CPU kernels give these forwards the numbers they give on more threads (checked for the
    built-in networks: `tests/test_devices.py`), so a run's numbers do not depend on it."""
    return one_thread() if device.type == "cpu" and rows <= ACTING_ROWS else nullcontext()


def update_threads(device: "torch.device") -> ContextManager[None]:
    """For an optimizer's step on ``device`` (the gradient's clipping and Adam's update): `one_thread` on the CPU,
    else nothing. The step streams the parameters, their gradients and Adam's moments through memory once or
    twice each: a second thread hardly shortens it and costs up to half its CPU again
    (`benchmarks/training_threads.py`). On one thread the clip's norms are summed in one order whatever
    ``--threads`` is."""
    return one_thread() if device.type == "cpu" else nullcontext()
