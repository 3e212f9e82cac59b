"""`python benchmarks/floor_rtt.py`: each variant makes its round trips and gives one figure a round."""

import pytest

from benchmarks.floor_rtt import measure


def test_each_variant_gives_a_median_round_trip_a_round():
    results = measure(["one", "two-check"], count=20, rounds=1)
    assert list(results) == ["one", "two-check"]
    assert all(len(figures) == 1 and all(0 < f < 1e6 for f in figures) for figures in results.values())


def test_unknown_variants_are_refused():
    with pytest.raises(ValueError, match="unknown variant"):
        measure(["three"])
