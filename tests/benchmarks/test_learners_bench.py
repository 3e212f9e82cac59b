"""`python benchmarks/learners_bench.py`: the learners' all-reduce, timed in real gloo processes."""

from benchmarks.learners_bench import allreduce_times


def test_the_heads_all_reduce_sums_over_the_learners_and_is_timed():
    r = allreduce_times(learners=2, repeats=2)
    assert r["summed"] == [3.0]  # learner 0's gradient 1 and learner 1's 2, in every element of the heads
    assert r["params"] > 4_000_000 and r["minibatches"] == 320  # the paper's heads and 10 epochs x 32
    assert 0 < r["median_s"] and r["per_iteration_s"] == r["median_s"] * 320
    assert r["mb_per_iteration"] == r["params"] * 4 * 320 / 1e6  # two learners: each sends the tensor once
