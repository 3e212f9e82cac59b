"""Fuzzing the wire: frames captured from a real session, mutated, fed to the decoder and to a live stage1.

Every case must end in one of two ways: a valid `Message` or a `ProtocolError` (the
decoder), or a clean stop of stage1's loop with a splitrl error (the live stage1).
Anything else (another exception type, a hang, memory that keeps growing) is a finding.

Mutations (``byte``, ``frames`` and ``structure``) are drawn from one seeded
`random.Random`, so a case is reproducible from ``(seed, index)``:

- byte-level on one frame: bit flips, interesting bytes (msgpack type markers, 0x00,
  0xff), truncation, random bytes appended, a chunk deleted or duplicated;
- frame-level: a frame dropped, duplicated, swapped, an empty frame added, many frames;
- structure-aware: the header unpacked, one value somewhere in it (the fixed keys, the
  application header, a tensor spec) replaced by an interesting value (wrong types,
  huge and negative ints, NaN, long strings, deep nesting, msgpack ext types) or a key
  deleted or added, then packed again; tensor bytes made NaN or infinite.
"""

from __future__ import annotations

import collections
import math
import queue
import random
import resource
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import msgpack

from .. import runner as session
from ..schedule.common import torch_thread
from ..settings import EnvSettings, PPOSettings, RunOptions, TrainSettings
from ..stages import LIMITS, STAGE0, STAGE1
from ..transport import ProtocolError, decode
from ..transport.local import LocalTransport

__all__ = ["capture_session", "Mutator", "FuzzCounts", "fuzz_decoder", "fuzz_stage1", "CAPTURE_SETTINGS"]

Frames = list[bytes]

CAPTURE_SETTINGS = TrainSettings(total_steps=16, env=EnvSettings(max_episode_steps=20),
                                 ppo=PPOSettings(num_steps=8, epochs=1, minibatches=2))
"""A two-iteration session with every message kind the synchronous schedule sends (replica aside)."""


def capture_session(settings: TrainSettings = CAPTURE_SETTINGS, run_dir: str | None = None) -> dict[str, list[Frames]]:
    """Run the twin once and return every message both stages sent, as bytes, by sender (STAGE0/STAGE1)."""
    import tempfile

    captured: dict[str, list[Frames]] = {STAGE0: [], STAGE1: []}
    original = LocalTransport._send_frames

    def record(self: LocalTransport, frames: list[Any], timeout: float) -> None:
        # The end that talks to stage1 is stage0's, and vice versa.
        captured[STAGE0 if self.peer == STAGE1 else STAGE1].append([bytes(f) for f in frames])
        original(self, frames, timeout)

    with tempfile.TemporaryDirectory() as tmp:
        LocalTransport._send_frames = record  # type: ignore[method-assign]
        try:
            session.train_twin(settings, RunOptions(run_dir=run_dir or tmp, threads=1, checkpoint_every=0))
        finally:
            LocalTransport._send_frames = original  # type: ignore[method-assign]
    return captured


_INTERESTING_BYTES = [0x00, 0xFF, 0x7F, 0x80, 0xC0, 0xC1, 0xC2, 0xC3, 0xC4, 0xC7, 0xCC, 0xCF, 0xD0, 0xD3, 0xD4,
                      0xD9, 0xDB, 0xDC, 0xDD, 0xDE, 0xDF, 0x90, 0x9F, 0x80, 0x8F, 0xA0, 0xBF]


def _deep(levels: int) -> Any:
    value: Any = 0
    for _ in range(levels):
        value = [value]
    return value


_INTERESTING_VALUES: list[Callable[[], Any]] = [
    lambda: None, lambda: True, lambda: 0, lambda: -1, lambda: 1, lambda: 2**31, lambda: 2**63 - 1, lambda: -(2**63),
    lambda: 2**64 - 1, lambda: 1.5, lambda: math.nan, lambda: math.inf, lambda: "", lambda: "x" * 300,
    lambda: "step\n12:00:00 [stage0] forged", lambda: "\x1b[2J", lambda: b"\x00" * 8, lambda: [], lambda: {},
    lambda: [0] * 1000, lambda: {"a": 1}, lambda: {str(i): i for i in range(300)}, lambda: _deep(20),
    lambda: _deep(300), lambda: [-1], lambda: [2**40, 2**40], lambda: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
    lambda: msgpack.ExtType(1, b"x"), lambda: "float32", lambda: "complex64", lambda: "step", lambda: "hello",
    lambda: "abort", lambda: "features", lambda: "9bad", lambda: 1.0,
]


class Mutator:
    """Draws one mutated message from a corpus of captured ones."""

    KINDS = ("byte", "frames", "structure")

    def __init__(self, corpus: list[Frames], seed: int) -> None:
        if not corpus:
            raise ValueError("an empty corpus")
        self.corpus = corpus
        self.rng = random.Random(seed)

    def __call__(self) -> tuple[str, Frames]:
        base = [bytes(f) for f in self.rng.choice(self.corpus)]
        how = self.rng.choice(self.KINDS)
        for _ in range(self.rng.choice((1, 1, 1, 2, 3))):
            base = getattr(self, f"_{how}")(base)
        return how, base

    # -- byte level ---------------------------------------------------------------------
    def _byte(self, frames: Frames) -> Frames:
        rng = self.rng
        i = 0 if rng.random() < 0.7 or len(frames) == 1 else rng.randrange(len(frames))
        data = bytearray(frames[i])
        op = rng.randrange(6)
        if op == 0 and data:
            for _ in range(rng.randint(1, 8)):
                j = rng.randrange(len(data))
                data[j] ^= 1 << rng.randrange(8)
        elif op == 1 and data:
            data[rng.randrange(len(data))] = rng.choice(_INTERESTING_BYTES)
        elif op == 2:
            del data[rng.randrange(len(data) + 1):]
        elif op == 3:
            data += bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 64)))
        elif op == 4 and data:
            j = rng.randrange(len(data))
            del data[j:j + rng.randint(1, 16)]
        elif data:
            j = rng.randrange(len(data))
            data[j:j] = data[j:j + rng.randint(1, 16)]
        return frames[:i] + [bytes(data)] + frames[i + 1:]

    def _frames(self, frames: Frames) -> Frames:
        rng = self.rng
        op = rng.randrange(5)
        out = list(frames)
        if op == 0 and len(out) > 1:
            del out[rng.randrange(1, len(out))]
        elif op == 1:
            out.insert(rng.randrange(len(out) + 1), rng.choice(out))
        elif op == 2 and len(out) > 1:
            a, b = rng.randrange(len(out)), rng.randrange(len(out))
            out[a], out[b] = out[b], out[a]
        elif op == 3:
            out.insert(rng.randrange(len(out) + 1), b"")
        else:
            out += [b"\x00" * rng.randint(0, 8)] * rng.randint(1, 100)
        return out

    # -- structure aware ----------------------------------------------------------------
    def _structure(self, frames: Frames) -> Frames:
        rng = self.rng
        try:
            head = msgpack.unpackb(frames[0], raw=False, strict_map_key=False)
        except Exception:
            return self._byte(frames)
        if not isinstance(head, dict):
            return self._byte(frames)
        if rng.random() < 0.15 and len(frames) > 1:  # the values, not the layout: NaN or infinity in a tensor
            i = rng.randrange(1, len(frames))
            data = bytearray(frames[i])
            if len(data) >= 4:
                j = rng.randrange(len(data) // 4) * 4
                data[j:j + 4] = rng.choice((b"\x00\x00\xc0\x7f", b"\x00\x00\x80\x7f", b"\x00\x00\x80\xff"))
            return frames[:i] + [bytes(data)] + frames[i + 1:]
        containers = _containers(head)
        parent = rng.choice(containers)
        op = rng.randrange(4)
        if isinstance(parent, dict):
            if op == 0 and parent:
                del parent[rng.choice(list(parent))]
            elif op == 1:
                parent[rng.choice(("v", "k", "s", "h", "t", "x", "", "reason", "t" * 40))] = rng.choice(_INTERESTING_VALUES)()
            elif parent:
                parent[rng.choice(list(parent))] = rng.choice(_INTERESTING_VALUES)()
        elif isinstance(parent, list):
            if op == 0 and parent:
                del parent[rng.randrange(len(parent))]
            elif op == 1:
                parent.insert(rng.randrange(len(parent) + 1), rng.choice(_INTERESTING_VALUES)())
            elif parent:
                parent[rng.randrange(len(parent))] = rng.choice(_INTERESTING_VALUES)()
        try:
            packed = msgpack.packb(head, use_bin_type=True)
        except Exception:  # msgpack refuses some values (too deep, too large): send the bytes unchanged
            return frames
        return [packed] + frames[1:]


def _containers(root: Any) -> list[Any]:
    found, stack = [], [root]
    while stack:
        value = stack.pop()
        if isinstance(value, dict):
            found.append(value)
            stack.extend(value.values())
        elif isinstance(value, list):
            found.append(value)
            stack.extend(value)
    return found


@dataclass
class FuzzCounts:
    """What the cases did. ``findings`` is anything but the allowed outcomes: it must stay empty."""

    cases: int = 0
    outcomes: collections.Counter = field(default_factory=collections.Counter)
    by_mutation: collections.Counter = field(default_factory=collections.Counter)
    findings: list[str] = field(default_factory=list)
    seconds: float = 0.0
    max_rss_mib_before: float = 0.0
    max_rss_mib_after: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"cases": self.cases, "outcomes": dict(self.outcomes), "by_mutation": dict(self.by_mutation),
                "findings": self.findings, "seconds": round(self.seconds, 1),
                "max_rss_mib_before": round(self.max_rss_mib_before, 1),
                "max_rss_mib_after": round(self.max_rss_mib_after, 1)}


def _max_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def fuzz_decoder(corpus: list[Frames], cases: int, seed: int = 0) -> FuzzCounts:
    """Mutate ``cases`` messages and decode each with the stages' limits."""
    mutate = Mutator(corpus, seed)
    counts = FuzzCounts(max_rss_mib_before=_max_rss_mib())
    start = time.perf_counter()
    for index in range(cases):
        how, frames = mutate()
        counts.by_mutation[how] += 1
        try:
            decode(frames, LIMITS)
            counts.outcomes["decoded"] += 1
        except ProtocolError:
            counts.outcomes["protocol_error"] += 1
        except Exception as exc:  # a finding: the decoder raised something it must not
            counts.outcomes["other_error"] += 1
            counts.findings.append(f"case {seed}:{index} ({how}): {type(exc).__name__}: {str(exc)[:200]}")
    counts.cases = cases
    counts.seconds = time.perf_counter() - start
    counts.max_rss_mib_after = _max_rss_mib()
    return counts


_CLEAN_STOPS = (ProtocolError,)


def _answered_session(link: LocalTransport, timeout: float) -> int | None:
    """The session id in stage1's first message (its hello), read raw from stage0's inbox; None if it
    did not answer (a mutated hello is a stranger's, and stage1 goes on waiting)."""
    try:
        frames = link.inbox.get(timeout=timeout)
    except queue.Empty:
        return None
    sid = msgpack.unpackb(bytes(frames[0])).get("i")
    return sid if isinstance(sid, int) else None


def _in_session(frames: Frames, sid: int | None) -> Frames:
    """A captured message with its session id replaced by the live session's (unchanged without one)."""
    if sid is None:
        return frames
    outer = msgpack.unpackb(frames[0])
    outer["i"] = sid
    return [msgpack.packb(outer), *frames[1:]]


def fuzz_stage1(captured: dict[str, list[Frames]], cases: int, seed: int = 0, settings: TrainSettings = CAPTURE_SETTINGS,
                timeout: float = 2.0) -> FuzzCounts:
    """Replay stage0's captured session to a live stage1 loop (its own thread, the stages' framing and
    limits), with one message somewhere in it mutated. Stage1 must go on or stop with a ProtocolError
    (its abort says why); never another error, never a hang (each case is bounded by ``timeout``)."""
    from ..envs import inspect_env

    spec = inspect_env(settings.env)
    settings = settings.for_observation(spec.observation)  # as a stage resolves them: the captured hello's
    sent = captured[STAGE0]
    mutate = random.Random(seed)
    counts = FuzzCounts(max_rss_mib_before=_max_rss_mib())
    start = time.perf_counter()
    for index in range(cases):
        position = mutate.randrange(len(sent))
        learner = session.make_learner(settings, spec)
        ours, theirs = LocalTransport.pair(STAGE0, STAGE1, limits=LIMITS, timeout=timeout)
        outcome: list[BaseException | None] = []

        def serve() -> None:
            try:
                session.serve_stage1(learner, theirs, None, start_timeout=timeout)
                outcome.append(None)
            except BaseException as exc:  # examined below
                outcome.append(exc)

        thread = torch_thread(serve, "fuzzed stage1")
        thread.start()
        how, live = "", None
        for i, frames in enumerate(sent):
            if outcome:
                break
            if i == 1:  # the session stage1 opened in its answer to the hello: the rest must carry its id
                live = _answered_session(ours, timeout)
            if i:
                frames = _in_session(frames, live)
            if i == position:
                how, frames = Mutator([frames], seed * 1_000_003 + index)()
                counts.by_mutation[how] += 1
            # The raw frames go straight into stage1's inbox: they need not decode (that is the point).
            theirs.inbox.put([bytearray(f) for f in frames])
        thread.join(timeout * 4 + 10)
        if thread.is_alive():
            counts.outcomes["hang"] += 1
            counts.findings.append(f"live case {seed}:{index} ({how}, message {position}): stage1 still running")
            ours.close()
            theirs.close()
            continue
        exc = outcome[0]
        if exc is None:
            counts.outcomes["session_completed"] += 1
        elif isinstance(exc, _CLEAN_STOPS):
            counts.outcomes[type(exc).__name__] += 1
        elif type(exc).__name__ == "TransportTimeout":
            counts.outcomes["timeout"] += 1  # a dropped message: stage1 waited its timeout for the next
        else:
            counts.outcomes["other_error"] += 1
            counts.findings.append(f"live case {seed}:{index} ({how}, message {position}): "
                                   f"{type(exc).__name__}: {str(exc)[:200]}")
        ours.close()
        theirs.close()
    counts.cases = cases
    counts.seconds = time.perf_counter() - start
    counts.max_rss_mib_after = _max_rss_mib()
    return counts
