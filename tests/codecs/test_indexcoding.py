"""Position-set codings: exact round trips, exact sizes, the cheaper choice, and
decoders that reject malformed buffers with ValueError (never IndexError)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from splitrl.codecs.indexcoding import (
    BITMASK,
    MAX_VARINT_BYTES,
    VARINT,
    bitmask_decode,
    bitmask_encode,
    bitmask_size,
    decode_positions,
    encode_positions,
    varint_decode,
    varint_encode,
    varint_size,
)

SEED = 1234
N_BIG = 524288
DENSITIES = [1e-4, 1e-3, 0.01, 0.05, 0.1, 0.118, 0.125, 0.13, 0.3, 0.5, 0.9]


# --------------------------------------------------------------------------- references


def leb128(value: int) -> list[int]:
    """Reference unsigned LEB128 of one value (plain Python, small inputs only)."""
    out = []
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return out


def reference_varint(pos: list[int]) -> bytes:
    out: list[int] = []
    prev = -1
    for p in pos:
        out += leb128(p - prev - 1)
        prev = p
    return bytes(out)


def reference_bitmask(pos: list[int], n: int) -> bytes:
    out = bytearray((n + 7) // 8)
    for p in pos:
        out[p // 8] |= 1 << (p % 8)
    return bytes(out)


def random_positions(n: int, density: float, seed: int = SEED) -> np.ndarray:
    rng = np.random.default_rng(seed)
    k = int(round(n * density))
    return np.sort(rng.choice(n, size=k, replace=False)).astype(np.int64)


def from_gaps(gaps: list[int]) -> np.ndarray:
    return np.cumsum(np.asarray(gaps, dtype=np.int64) + 1) - 1


def round_trips(pos: np.ndarray, n: int) -> None:
    """Every coding decodes back to exactly ``pos``."""
    pos = np.asarray(pos, dtype=np.int64)

    out = bitmask_decode(bitmask_encode(pos, n), n)
    assert out.dtype == np.int64 and np.array_equal(out, pos)

    out = varint_decode(varint_encode(pos), count=pos.size)
    assert out.dtype == np.int64 and np.array_equal(out, pos)

    method, buf = encode_positions(pos, n)
    assert buf.dtype == np.uint8 and buf.ndim == 1
    out = decode_positions(method, buf, n, count=pos.size)
    assert out.dtype == np.int64 and np.array_equal(out, pos)
    assert np.array_equal(decode_positions(method, buf, n), pos)


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("n", [1, 7, 8, 9, 1000, N_BIG])
def test_round_trip_edges(n):
    round_trips(np.zeros(0, dtype=np.int64), n)  # empty
    round_trips(np.array([0]), n)  # first slot
    round_trips(np.array([n - 1]), n)  # last slot
    round_trips(np.array([n // 2]), n)
    round_trips(np.arange(n), n)  # every slot
    if n > 1:
        round_trips(np.array([0, n - 1]), n)


def test_round_trip_empty_universe():
    round_trips(np.zeros(0, dtype=np.int64), 0)
    assert bitmask_encode([], 0).size == 0
    method, buf = encode_positions(np.zeros(0, dtype=np.int64), 0)
    assert method == BITMASK and buf.size == 0


@pytest.mark.parametrize("density", DENSITIES)
@pytest.mark.parametrize("n", [12345, N_BIG])
def test_round_trip_random(n, density):
    pos = random_positions(n, density)
    assert pos.size > 0
    round_trips(pos, n)


@pytest.mark.parametrize("dtype", [np.int32, np.uint32, np.int64, np.uint64, np.int16])
def test_integer_dtypes(dtype):
    pos = np.array([0, 3, 200, 1000], dtype=dtype)
    round_trips(pos, 1001)


def test_known_bytes():
    # LEB128 textbook values and the gap convention (neighbours cost a zero gap).
    assert varint_encode(np.array([300])).tolist() == [0xAC, 0x02]
    assert varint_encode(np.array([0, 1, 2])).tolist() == [0, 0, 0]
    assert varint_encode(np.array([5, 10])).tolist() == [5, 4]
    # Little-endian bit order: slot i is bit i % 8 of byte i // 8.
    assert bitmask_encode(np.array([0, 3, 9]), 10).tolist() == [0b00001001, 0b00000010]


@pytest.mark.parametrize(
    "gap, expected",
    [
        (0, [0x00]),
        (127, [0x7F]),
        (128, [0x80, 0x01]),
        (16383, [0xFF, 0x7F]),
        (16384, [0x80, 0x80, 0x01]),
        (2**21 - 1, [0xFF, 0xFF, 0x7F]),
        (2**21, [0x80, 0x80, 0x80, 0x01]),
    ],
)
def test_varint_byte_boundaries(gap, expected):
    # As the first gap, and as a later gap after position 10 (pos = 10 + gap + 1).
    assert varint_encode(np.array([gap])).tolist() == expected
    assert varint_encode(np.array([10, 11 + gap])).tolist() == [10] + expected
    assert varint_size(np.array([10, 11 + gap])) == 1 + len(expected)
    n = 12 + gap
    round_trips(np.array([gap]), n)
    round_trips(np.array([10, 11 + gap]), n)


def test_varint_mixed_gaps_match_reference():
    rng = np.random.default_rng(SEED)
    gaps = np.concatenate([
        rng.integers(0, 128, 300),
        rng.integers(128, 16384, 200),
        rng.integers(16384, 2**21, 50),
        rng.integers(2**21, 2**28, 10),
        [127, 128, 16383, 16384, 0, 0],
    ])
    rng.shuffle(gaps)
    pos = from_gaps(gaps.tolist())
    expected = reference_varint(pos.tolist())
    buf = varint_encode(pos)
    assert buf.tobytes() == expected
    assert varint_size(pos) == len(expected)
    assert np.array_equal(varint_decode(buf), pos)


def test_largest_varint_values():
    # 9 bytes hold 63 bits: the largest int64 decodes; nothing beyond it does.
    big = 2**63 - 1
    buf = np.array(leb128(big), dtype=np.uint8)
    assert buf.size == MAX_VARINT_BYTES
    assert varint_decode(buf).tolist() == [big]
    assert varint_encode(np.array([big])).tolist() == buf.tolist()


# --------------------------------------------------------------------------- sizes


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 15, 16, 17, 1000, 12345, N_BIG])
def test_bitmask_size(n):
    pos = np.arange(0, n, 3)
    buf = bitmask_encode(pos, n)
    assert buf.dtype == np.uint8 and buf.size == -(-n // 8) == bitmask_size(n)


@pytest.mark.parametrize("density", DENSITIES)
def test_varint_size_is_sum_of_gap_bytes(density):
    pos = random_positions(N_BIG, density)
    gaps = np.diff(pos, prepend=-1) - 1
    per_gap = sum(len(leb128(int(g))) for g in gaps)
    buf = varint_encode(pos)
    assert buf.size == per_gap == varint_size(pos)
    # Only the last byte of each value lacks the continuation bit.
    assert np.count_nonzero(buf < 0x80) == pos.size


# --------------------------------------------------------------------------- the choice


def check_choice(pos: np.ndarray, n: int) -> int:
    """encode_positions picks the strictly smaller coding, BITMASK on a tie."""
    mask_bytes, var_bytes = bitmask_size(n), varint_size(pos)
    method, buf = encode_positions(pos, n)
    if var_bytes < mask_bytes:
        assert method == VARINT and buf.tobytes() == varint_encode(pos).tobytes()
    else:
        assert method == BITMASK and buf.tobytes() == bitmask_encode(pos, n).tobytes()
    assert buf.size == min(mask_bytes, var_bytes)
    return method


@pytest.mark.parametrize("density", DENSITIES)
def test_choice_random(density):
    check_choice(random_positions(N_BIG, density), N_BIG)


def test_choice_both_regimes():
    assert check_choice(random_positions(N_BIG, 0.05), N_BIG) == VARINT
    assert check_choice(random_positions(N_BIG, 0.5), N_BIG) == BITMASK
    # Random sets cross over at 1/8: gaps of 128 or more are vanishingly rare there.
    assert check_choice(random_positions(N_BIG, 0.12), N_BIG) == VARINT
    assert check_choice(random_positions(N_BIG, 0.13), N_BIG) == BITMASK


def test_choice_tie_goes_to_bitmask():
    n = 64  # 8 bytes of bitmask
    assert check_choice(np.arange(0, 64, 8), n) == BITMASK  # 8 one-byte gaps: a tie
    assert check_choice(np.arange(0, 56, 8), n) == VARINT  # 7 bytes
    assert check_choice(np.zeros(0, dtype=np.int64), n) == VARINT  # 0 bytes beats 8
    assert check_choice(np.zeros(0, dtype=np.int64), 0) == BITMASK  # 0 == 0


def worst_case_for_varint(k: int, n: int) -> np.ndarray:
    """k positions with as many 2-byte gaps (of exactly 128) as fit in n slots."""
    extra = min(k, (n - k) // 128)
    gaps = [128] * extra + [0] * (k - extra)
    pos = from_gaps(gaps)
    assert pos[-1] < n
    return pos


def test_crossover_bitmask_vs_varint():
    # Uniform spacing: every gap is 1 byte, the crossover is exactly k = n / 8.
    n = 8 * 1024
    assert check_choice(np.linspace(0, n - 1, n // 8).astype(np.int64), n) == BITMASK
    assert check_choice(np.linspace(0, n - 1, n // 8 - 1).astype(np.int64), n) == VARINT
    # Above 1/8 nothing can make the bitmask lose (each varint costs at least a byte).
    assert check_choice(worst_case_for_varint(n // 8, n), n) == BITMASK
    # The varint costs at most k + (n - k) / 128 bytes: it always wins below
    # k / n = 15/127 (~11.8 %), and the worst case loses from there on.
    n = 127 * 128
    k = 15 * n // 127  # 1920
    for kk in range(k - 40, k):
        pos = worst_case_for_varint(kk, n)
        assert varint_size(pos) == kk + (n - kk) // 128 < n / 8
        assert check_choice(pos, n) == VARINT
    assert check_choice(worst_case_for_varint(k, n), n) == BITMASK
    assert check_choice(worst_case_for_varint(k + 1, n), n) == BITMASK
    assert 0.118 < 15 / 127 < 0.1182


@pytest.mark.parametrize("density", DENSITIES)
def test_choice_never_larger_than_pairs(density):
    # Below n = 2**21 every varint gap takes at most 3 bytes, so the choice beats 4-byte pairs.
    for n in (2**21, N_BIG):
        pos = random_positions(n, density, seed=SEED + 1)
        _, buf = encode_positions(pos, n)
        assert buf.size < 4 * pos.size
    assert varint_encode(np.array([2**21 - 1])).size == 3
    # The sparsest extreme: one position at the far end.
    assert encode_positions(np.array([2**21 - 1]), 2**21)[1].size < 4


# --------------------------------------------------------------------------- encoder checks


@pytest.mark.parametrize(
    "pos",
    [[3, 2], [2, 2], [-1, 4], [0, 10], [10], [1, 5, 5, 9]],
    ids=["decreasing", "duplicate", "negative", "n", "beyond n", "inner duplicate"],
)
def test_encoders_reject_bad_positions(pos):
    pos = np.array(pos)
    n = 10
    with pytest.raises(ValueError):
        encode_positions(pos, n)
    with pytest.raises(ValueError):
        bitmask_encode(pos, n)
    if pos.min() >= 0 and np.all(np.diff(pos) > 0):
        return  # in order: fine for a varint (it does not know n)
    with pytest.raises(ValueError):
        varint_encode(pos)


def test_encoders_reject_non_integer_positions():
    with pytest.raises(ValueError):
        encode_positions(np.array([0.0, 1.0]), 10)
    with pytest.raises(ValueError):
        varint_encode(np.array([[0, 1]]))


# --------------------------------------------------------------------------- decoder checks


def u8(values) -> np.ndarray:
    return np.array(values, dtype=np.uint8)


def test_decode_rejects_truncated_varint():
    buf = varint_encode(np.array([5, 300]))
    assert buf.tolist() == [5, 0xA6, 0x02]
    with pytest.raises(ValueError, match="truncated"):
        varint_decode(buf[:-1])
    with pytest.raises(ValueError, match="truncated"):
        decode_positions(VARINT, buf[:-1], 1000)
    with pytest.raises(ValueError, match="truncated"):
        decode_positions(VARINT, u8([0x80]), 1000)


def test_decode_rejects_overlong_varint():
    ten = u8([0x80] * 9 + [0x00])  # value 0 written in 10 bytes
    with pytest.raises(ValueError, match="bytes"):
        varint_decode(ten)
    with pytest.raises(ValueError, match="bytes"):
        decode_positions(VARINT, np.concatenate([u8([1, 2]), ten, u8([3])]), 1000)
    assert varint_decode(u8([0x80] * 8 + [0x00])).tolist() == [0]  # 9 bytes is allowed


def test_decode_rejects_int64_overflow():
    big = leb128(2**63 - 1)
    with pytest.raises(ValueError, match="overflow"):
        varint_decode(u8(big + [0]))  # second position would be 2**63
    with pytest.raises(ValueError, match="overflow"):
        varint_decode(u8(big * 3))  # the uint64 sum wraps past zero
    with pytest.raises(ValueError):
        decode_positions(VARINT, u8(big * 3), 1000)


def test_decode_rejects_positions_beyond_n():
    n = 100
    with pytest.raises(ValueError, match="below n"):
        decode_positions(VARINT, varint_encode(np.array([100])), n)
    with pytest.raises(ValueError, match="below n"):
        decode_positions(VARINT, varint_encode(np.array([5, 99, 100])), n)
    with pytest.raises(ValueError):
        decode_positions(VARINT, u8([0] * 101), n)  # 101 positions in 100 slots
    with pytest.raises(ValueError):
        decode_positions(VARINT, u8([0]), 0)
    with pytest.raises(ValueError):
        decode_positions(VARINT, u8(leb128(2**63 - 1)), n)
    # A bitmask bit in the padding of the last byte is a position >= n.
    with pytest.raises(ValueError, match="padding"):
        decode_positions(BITMASK, u8([0, 0b100]), 10)
    with pytest.raises(ValueError, match="padding"):
        bitmask_decode(u8([0, 0b10000000]), 15)
    assert decode_positions(BITMASK, u8([0, 0b10]), 10).tolist() == [9]


@pytest.mark.parametrize("n", [0, 1, 8, 10, 1000])
def test_decode_rejects_bitmask_of_wrong_length(n):
    size = -(-n // 8)
    for wrong in (size - 1, size + 1, 2 * size + 8):
        if wrong < 0:
            continue
        with pytest.raises(ValueError, match="bytes"):
            decode_positions(BITMASK, np.zeros(wrong, dtype=np.uint8), n)
        with pytest.raises(ValueError, match="bytes"):
            bitmask_decode(np.zeros(wrong, dtype=np.uint8), n)


@pytest.mark.parametrize("method", [2, 3, 7, 255, -1, "0", 0.0, None, True])
def test_decode_rejects_unknown_method(method):
    with pytest.raises(ValueError):
        decode_positions(method, np.zeros(2, dtype=np.uint8), 16)


def test_decode_rejects_count_mismatch():
    n = 1000
    pos = np.array([1, 50, 300, 999])
    for method, buf in ((VARINT, varint_encode(pos)), (BITMASK, bitmask_encode(pos, n))):
        assert decode_positions(method, buf, n, count=4).tolist() == pos.tolist()
        for count in (0, 3, 5, n, n + 1, -1):
            with pytest.raises(ValueError):
                decode_positions(method, buf, n, count=count)
    with pytest.raises(ValueError):
        varint_decode(varint_encode(pos), count=3)
    with pytest.raises(ValueError):
        varint_decode(u8([]), count=1)
    with pytest.raises(ValueError):  # the one-byte fast path checks the count too
        varint_decode(u8([1, 2, 3]), count=2)


def test_decode_rejects_wrong_buffer_type():
    with pytest.raises(ValueError):
        decode_positions(VARINT, np.zeros(4, dtype=np.int16), 100)
    with pytest.raises(ValueError):
        decode_positions(BITMASK, np.zeros((2, 2), dtype=np.uint8), 32)
    # Bytes objects (as a socket delivers them) are fine.
    assert decode_positions(VARINT, bytes([3, 0]), 100).tolist() == [3, 4]


def test_decode_random_garbage_only_raises_value_error():
    rng = np.random.default_rng(SEED)
    n = 4096
    for trial in range(300):
        size = int(rng.integers(0, 80))
        buf = rng.integers(0, 256, size, dtype=np.uint8)
        if trial % 2:  # fewer continuation bits: more buffers that end cleanly
            buf[rng.random(size) < 0.7] &= 0x7F
        for method in (BITMASK, VARINT):
            try:
                pos = decode_positions(method, buf, n)
            except ValueError:
                continue
            assert pos.dtype == np.int64
            assert pos.size == 0 or (pos[0] >= 0 and pos[-1] < n and np.all(np.diff(pos) > 0))


# --------------------------------------------------------------------------- property


PROPERTY = settings(
    max_examples=150,
    deadline=None,
    database=None,  # no .hypothesis directory in the repository
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)


@st.composite
def position_sets(draw):
    n = draw(st.integers(1, 70000))
    raw = draw(st.lists(st.integers(0, n - 1), max_size=300))
    dense_from = draw(st.integers(0, n - 1))
    dense_len = draw(st.integers(0, min(2000, n - dense_from)))
    pos = np.unique(np.concatenate([np.array(raw, dtype=np.int64),
                                    np.arange(dense_from, dense_from + dense_len)]))
    return pos.astype(np.int64), n


@PROPERTY
@given(position_sets())
def test_property_round_trip(case):
    pos, n = case
    round_trips(pos, n)
    check_choice(pos, n)
    assert varint_encode(pos).tobytes() == reference_varint(pos.tolist())
    assert bitmask_encode(pos, n).tobytes() == reference_bitmask(pos.tolist(), n)


@PROPERTY
@given(st.binary(max_size=64), st.integers(0, 600))
def test_property_decoders_trust_nothing(data, n):
    for method in (BITMASK, VARINT):
        try:
            pos = decode_positions(method, data, n)
        except ValueError:
            continue
        assert pos.size == 0 or (pos[0] >= 0 and pos[-1] < n and np.all(np.diff(pos) > 0))
        # What decodes re-encodes to the same bytes when it is canonical.
        if method == BITMASK:
            assert bitmask_encode(pos, n).tobytes() == data
