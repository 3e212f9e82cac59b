from splitrl.bench.e2e_bench import format_e2e_table, run_e2e_bench


def test_e2e_bench_runs_a_git_revision_beside_this_tree(tmp_path):
    tiny = ["--total-steps", "32", "--num-steps", "32", "--epochs", "1", "--minibatches", "2", "--threads", "1"]
    rows = run_e2e_bench(iterations=1, repeats=1, extra_args=tiny, out_dir=str(tmp_path), timeout=300, against="HEAD")
    assert [(r["version"], r["mode"]) for r in rows] == [("this", "split"), ("HEAD", "split"), ("this", "twin"),
                                                         ("HEAD", "twin")]
    for row in rows:
        assert row["steps"] == 32 and row["SPS"] > 0 and row["seconds_per_iteration"] > 0
    # Identical work in both modes of a version: the same bytes cross either link.
    for version in ("this", "HEAD"):
        split, twin = (r["bytes_per_iteration"] for r in rows if r["version"] == version)
        assert split == twin > 0, version
    table = format_e2e_table(rows).splitlines()
    assert table[0].startswith("| version | mode |") and "| HEAD | twin | 0 |" in table[-1]
    assert any("| this | split | 0 |" in line for line in table)
