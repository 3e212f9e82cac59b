from splitrl.bench.e2e_bench import format_e2e_table, run_e2e_bench


def test_e2e_bench_runs_both_modes_on_a_tiny_configuration(tmp_path):
    tiny = ["--total-steps", "32", "--num-steps", "32", "--epochs", "1", "--minibatches", "2", "--threads", "1"]
    rows = run_e2e_bench(iterations=1, repeats=1, extra_args=tiny, out_dir=str(tmp_path), timeout=300)
    assert [r["mode"] for r in rows] == ["split", "twin"]
    for row in rows:
        assert row["steps"] == 32 and row["SPS"] > 0 and row["seconds_per_iteration"] > 0
    # Identical work on both sides of the comparison: the same bytes cross either link.
    assert rows[0]["bytes_per_iteration"] == rows[1]["bytes_per_iteration"] > 0
    table = format_e2e_table(rows)
    assert "| split | 0 |" in table and "| twin | 0 |" in table


def test_e2e_bench_runs_a_git_revision_beside_this_tree(tmp_path):
    tiny = ["--total-steps", "32", "--num-steps", "32", "--epochs", "1", "--minibatches", "2", "--threads", "1"]
    rows = run_e2e_bench(iterations=1, repeats=1, extra_args=tiny, out_dir=str(tmp_path), timeout=300, against="HEAD")
    assert [(r["version"], r["mode"]) for r in rows] == [("this", "split"), ("HEAD", "split"), ("this", "twin"),
                                                         ("HEAD", "twin")]
    assert all(r["steps"] == 32 for r in rows)
    table = format_e2e_table(rows).splitlines()
    assert table[0].startswith("| version | mode |") and "| HEAD | twin | 0 |" in table[-1]
