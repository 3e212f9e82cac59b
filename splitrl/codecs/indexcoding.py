"""Compact codings of a sorted set of positions, and the choice between them.

A position set is a strictly increasing int64 array of k indices into a flat
array of n candidate slots (0 <= position < n). Two codings:

* BITMASK: one bit per slot, ``ceil(n / 8)`` bytes whatever k is
  (``np.packbits`` with little-endian bit order: slot i is bit ``i % 8`` of
  byte ``i // 8``; the padding bits of the last byte are zero).
* VARINT: the gaps between positions as LEB128 unsigned varints. The first gap
  is ``pos[0]``, then ``pos[i] - pos[i-1] - 1``, so neighbouring positions cost
  a gap of 0. A gap below 2**7 takes 1 byte, below 2**14 2 bytes, below 2**21
  3 bytes, and so on (7 payload bits per byte, low group first, the high bit
  set on every byte of a value except its last).

Where the bitmask and the varint cross over (density d = k / n):

* Every varint gap costs at least 1 byte, so the varint costs at least k bytes
  and the bitmask (n / 8 bytes) is never larger once d >= 1/8 = 12.5 %.
* The gaps sum to at most n - k, and a gap taking b bytes is at least
  128**(b - 1), so every byte beyond the first uses up at least 128 of that
  sum: the varint costs at most k + (n - k) / 128 bytes. That is below n / 8
  while d < 15/127 ~= 11.8 %, so the varint always wins below 11.8 %.
* Between 11.8 % and 12.5 % the winner depends on how the positions cluster
  (k - 1 neighbours plus gaps of exactly 128 is the worst case for the varint).
  For positions spread evenly or at random, a gap of 128 or more is rare at
  these densities (about (1 - d)**128 ~= 4e-8 of gaps at d = 1/8), so the
  crossover is d ~= 1/8 in practice. Two-byte gaps only become common below
  d ~= 1/128, where the varint (about 2 bytes per position) is already far
  smaller than the bitmask (16 bytes per position at d = 1/128): the longer
  gaps of sparse sets never move the crossover.

Against the paper's int16 ``(row, col)`` pairs (4k bytes, the `Paper` codec in
codecs/sparse.py): the bitmask is no larger once 4k >= n / 8, i.e. at
d >= 1/32 ~= 3.1 %. A varint gap below 2**21 costs at most 3 bytes, so for
n <= 2**21 the varint, and so the cheaper of BITMASK and VARINT, is strictly
smaller than the pairs for any non-empty set. (int16 pairs reach n = 2**30; only
there can a handful of positions with gaps of 2**21 or more cost 4-5 bytes each.)

Decoders take bytes from the network: they check everything, raise
`ValueError` with a message on any malformed input, and allocate at most
O(len(buf) + n).
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "BITMASK",
    "VARINT",
    "MAX_VARINT_BYTES",
    "bitmask_encode",
    "bitmask_decode",
    "bitmask_size",
    "varint_encode",
    "varint_decode",
    "varint_size",
    "encode_positions",
    "decode_positions",
]

BITMASK, VARINT = 0, 1

MAX_VARINT_BYTES = 9
"""9 bytes hold 63 payload bits: every non-negative int64."""

_INT64_MAX = (1 << 63) - 1
# Smallest gap needing j + 2 bytes, for j = 0 .. 7.
_VARINT_THRESHOLDS = tuple(1 << (7 * j) for j in range(1, MAX_VARINT_BYTES))


# --------------------------------------------------------------------------- input checks


def _as_positions(pos: np.ndarray) -> np.ndarray:
    """``pos`` as a 1-D int64 array (integer dtypes only; an empty array may be any dtype)."""
    arr = np.asarray(pos)
    if arr.ndim != 1:
        raise ValueError(f"positions must be 1-D, got shape {arr.shape}")
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"positions must be integers, got dtype {arr.dtype}")
    if arr.dtype == np.uint64 and arr.max() > _INT64_MAX:
        raise ValueError("positions must be non-negative int64 values")
    return arr.astype(np.int64, copy=False)


def _gaps(pos: np.ndarray) -> np.ndarray:
    """Gaps of a 1-D int64 position array as uint64; raises unless non-negative and increasing."""
    if pos.size == 0:
        return np.zeros(0, dtype=np.uint64)
    if pos[0] < 0:
        raise ValueError(f"positions must be non-negative, got {int(pos[0])}")
    gaps = np.empty(pos.size, dtype=np.int64)
    gaps[0] = pos[0]
    np.subtract(pos[1:], pos[:-1], out=gaps[1:])
    gaps[1:] -= 1
    if pos.size > 1 and gaps[1:].min() < 0:
        raise ValueError("positions must be strictly increasing")
    return gaps.view(np.uint64)


def _check_n(n: int) -> int:
    if isinstance(n, (bool, np.bool_)) or not isinstance(n, (int, np.integer)):
        raise ValueError(f"n must be an integer, got {n!r}")
    if n < 0:
        raise ValueError(f"n must be non-negative, got {n}")
    return int(n)


def _check_range(pos: np.ndarray, n: int) -> None:
    """Positions of a strictly increasing array lie in [0, n) (only the ends need checking)."""
    if pos.size and (pos[0] < 0 or pos[-1] >= n):
        raise ValueError(f"positions must lie in [0, {n}), got {int(pos[0])} .. {int(pos[-1])}")


def _as_bytes(buf: np.ndarray) -> np.ndarray:
    """``buf`` as a 1-D uint8 array (a bytes-like object is viewed, not copied)."""
    if isinstance(buf, (bytes, bytearray, memoryview)):
        return np.frombuffer(buf, dtype=np.uint8)
    arr = np.asarray(buf)
    if arr.dtype != np.uint8 or arr.ndim != 1:
        raise ValueError(f"buffer must be a 1-D uint8 array, got {arr.dtype} with shape {arr.shape}")
    return arr


# --------------------------------------------------------------------------- bitmask


def bitmask_size(n: int) -> int:
    """Bytes of a bitmask over ``n`` slots: ``ceil(n / 8)``."""
    return (_check_n(n) + 7) // 8


def bitmask_encode(pos: np.ndarray, n: int) -> np.ndarray:
    """One bit per slot (little-endian bit order), ``ceil(n / 8)`` bytes as uint8."""
    n = _check_n(n)
    pos = _as_positions(pos)
    _check_range(pos, n)
    _gaps(pos)  # raises unless strictly increasing
    return _bitmask_build(pos, n)


def _bitmask_build(pos: np.ndarray, n: int) -> np.ndarray:
    mask = np.zeros(n, dtype=bool)
    mask[pos] = True
    return np.packbits(mask, bitorder="little")


def bitmask_decode(buf: np.ndarray, n: int) -> np.ndarray:
    """Positions (int64) of the set bits; the buffer must be exactly ``ceil(n / 8)`` bytes."""
    n = _check_n(n)
    buf = _as_bytes(buf)
    if buf.size != (n + 7) // 8:
        raise ValueError(f"bitmask over {n} slots must be {(n + 7) // 8} bytes, got {buf.size}")
    if n % 8 and buf[-1] >> (n % 8):
        raise ValueError(f"bitmask has bits set in its padding: positions >= n = {n}")
    bits = np.unpackbits(buf, count=n, bitorder="little")
    return np.flatnonzero(bits.view(bool))


# --------------------------------------------------------------------------- varint


def _varint_lengths(gaps: np.ndarray) -> np.ndarray | None:
    """Bytes per gap (uint8), or None when every gap fits in one byte."""
    if gaps.size == 0:
        return None
    top = int(gaps.max())
    if top < _VARINT_THRESHOLDS[0]:
        return None
    lengths = np.ones(gaps.size, dtype=np.uint8)
    for threshold in _VARINT_THRESHOLDS:
        if top < threshold:
            break
        lengths += gaps >= np.uint64(threshold)
    return lengths


def _varint_total(gaps: np.ndarray, lengths: np.ndarray | None) -> int:
    return gaps.size if lengths is None else int(lengths.sum(dtype=np.int64))


def varint_size(pos: np.ndarray) -> int:
    """Bytes `varint_encode` would produce, without building them."""
    gaps = _gaps(_as_positions(pos))
    return _varint_total(gaps, _varint_lengths(gaps))


def _varint_build(gaps: np.ndarray, lengths: np.ndarray | None) -> np.ndarray:
    if lengths is None:  # every gap < 128: one byte each, no continuation bits
        return gaps.astype(np.uint8)
    ends = np.cumsum(lengths, dtype=np.int64)
    starts = ends - lengths
    out = np.empty(int(ends[-1]), dtype=np.uint8)
    longest = int(lengths.max())
    for j in range(longest):
        if j == 0:
            sel, g, ln, at = slice(None), gaps, lengths, starts
        else:
            sel = np.flatnonzero(lengths > j)
            g, ln, at = gaps[sel], lengths[sel], starts[sel] + j
        byte = ((g >> np.uint64(7 * j)) & np.uint64(0x7F)).astype(np.uint8)
        byte |= (ln > j + 1).astype(np.uint8) << np.uint8(7)
        out[at] = byte
    return out


def varint_encode(pos: np.ndarray) -> np.ndarray:
    """The gaps of ``pos`` as LEB128 unsigned varints (uint8)."""
    gaps = _gaps(_as_positions(pos))
    return _varint_build(gaps, _varint_lengths(gaps))


def _check_count(count: int | None, found: int) -> None:
    if count is not None and count != found:
        raise ValueError(f"expected {count} positions, the varint buffer holds {found}")


def _varint_gaps(buf: np.ndarray, count: int | None) -> np.ndarray:
    """Decode the varints of ``buf`` to uint64 values (each < 2**63)."""
    if buf.size == 0:
        _check_count(count, 0)
        return np.zeros(0, dtype=np.uint64)
    if buf[-1] & 0x80:
        raise ValueError("varint buffer ends inside a value (truncated)")
    cont = buf >= 0x80
    if not cont.any():  # every value is one byte
        _check_count(count, buf.size)
        return buf.astype(np.uint64)
    ends = np.flatnonzero(~cont)
    _check_count(count, ends.size)
    starts = np.empty_like(ends)
    starts[0] = 0
    np.add(ends[:-1], 1, out=starts[1:])
    lengths = ends - starts + 1
    longest = int(lengths.max())
    if longest > MAX_VARINT_BYTES:
        raise ValueError(f"varint of {longest} bytes: at most {MAX_VARINT_BYTES} allowed")
    payload = buf & np.uint8(0x7F)
    values = payload[starts].astype(np.uint64)
    for j in range(1, longest):
        sel = np.flatnonzero(lengths > j)
        values[sel] |= payload[starts[sel] + j].astype(np.uint64) << np.uint64(7 * j)
    return values


def _positions_from_gaps(gaps: np.ndarray) -> np.ndarray:
    """pos[i] = sum(gaps[:i+1]) + i, as int64; raises if that does not fit."""
    k = gaps.size
    if k == 0:
        return np.zeros(0, dtype=np.int64)
    steps = gaps + np.uint64(1)  # each gap < 2**63, so no wrap here
    top = int(steps.max())
    safe = top * k <= _INT64_MAX + 1
    cum = np.cumsum(steps, out=steps)
    if not safe:
        # uint64 cumsum wraps silently; with every step in [1, 2**63] the first wrap
        # makes a value no larger than its predecessor.
        wrapped = k > 1 and bool(np.any(cum[1:] <= cum[:-1]))
        if wrapped or int(cum[-1]) > _INT64_MAX + 1:
            raise ValueError("varint positions overflow int64")
    cum -= np.uint64(1)
    return cum.view(np.int64)


def varint_decode(buf: np.ndarray, count: int | None = None) -> np.ndarray:
    """Positions (int64, strictly increasing) from LEB128 gaps.

    Raises ValueError on a truncated last value, a value longer than
    `MAX_VARINT_BYTES`, positions beyond int64, or (given ``count``) a different count.
    """
    return _positions_from_gaps(_varint_gaps(_as_bytes(buf), count))


# --------------------------------------------------------------------------- choice


def encode_positions(pos: np.ndarray, n: int) -> tuple[int, np.ndarray]:
    """``(method, uint8 buffer)``: the smaller of BITMASK and VARINT (a tie goes to BITMASK).

    The varint is only built when it wins; its size comes from per-gap byte counts.
    """
    n = _check_n(n)
    pos = _as_positions(pos)
    _check_range(pos, n)
    gaps = _gaps(pos)  # raises unless strictly increasing
    mask_bytes = (n + 7) // 8
    # Every varint gap costs at least a byte, so with k >= n / 8 the bitmask cannot lose.
    if pos.size >= mask_bytes:
        return BITMASK, _bitmask_build(pos, n)
    lengths = _varint_lengths(gaps)
    if mask_bytes <= _varint_total(gaps, lengths):
        return BITMASK, _bitmask_build(pos, n)
    return VARINT, _varint_build(gaps, lengths)


def decode_positions(method: int, buf: np.ndarray, n: int, count: int | None = None) -> np.ndarray:
    """Positions (int64, strictly increasing, in [0, n)) from an `encode_positions` result.

    ``count``, when given, must equal the number of positions. Anything malformed
    raises ValueError.
    """
    n = _check_n(n)
    if count is not None:
        if isinstance(count, (bool, np.bool_)) or not isinstance(count, (int, np.integer)):
            raise ValueError(f"count must be an integer, got {count!r}")
        count = int(count)
        if not 0 <= count <= n:
            raise ValueError(f"count {count} is outside [0, n = {n}]")
    if isinstance(method, (bool, np.bool_)) or not isinstance(method, (int, np.integer)):
        raise ValueError(f"method must be an integer id, got {method!r}")
    buf = _as_bytes(buf)
    if method == BITMASK:
        pos = bitmask_decode(buf, n)
        if count is not None and pos.size != count:
            raise ValueError(f"expected {count} positions, the bitmask holds {pos.size}")
        return pos
    if method == VARINT:
        gaps = _varint_gaps(buf, count)
        if gaps.size > n:
            raise ValueError(f"{gaps.size} positions cannot be distinct in {n} slots")
        pos = _positions_from_gaps(gaps)
        if pos.size and pos[-1] >= n:
            raise ValueError(f"decoded position {int(pos[-1])} is not below n = {n}")
        return pos
    raise ValueError(f"unknown position coding method {method!r}")
