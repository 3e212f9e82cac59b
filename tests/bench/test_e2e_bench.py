import json
from pathlib import Path

import pytest

from splitrl.bench.e2e_bench import format_e2e_table, history_table, run_e2e_bench


def test_e2e_bench_runs_a_git_revision_beside_this_tree(tmp_path, monkeypatch):
    tiny = ["--total-steps", "32", "--num-steps", "32", "--epochs", "1", "--minibatches", "2", "--threads", "1"]
    monkeypatch.chdir(tmp_path)  # --out relative to where the bench is started, for the revision's runs too
    rows = run_e2e_bench(iterations=1, repeats=1, extra_args=tiny, out_dir="runs", timeout=300, against="HEAD")
    assert [(r["version"], r["mode"]) for r in rows] == [("this", "split"), ("HEAD", "split"), ("this", "twin"),
                                                         ("HEAD", "twin")]
    for row in rows:
        assert row["steps"] == 32 and row["SPS"] > 0 and row["seconds_per_iteration"] > 0
        assert (tmp_path / "runs" / Path(row["run_dir"]).name / "metrics.jsonl").is_file()
    # Identical work in both modes of a version: the same bytes cross either link.
    for version in ("this", "HEAD"):
        split, twin = (r["bytes_per_iteration"] for r in rows if r["version"] == version)
        assert split == twin > 0, version
    table = format_e2e_table(rows).splitlines()
    assert table[0].startswith("| version | mode |") and "| HEAD | twin | 0 |" in table[-1]
    assert any("| this | split | 0 |" in line for line in table)


def test_the_history_table_puts_each_saved_runs_split_against_its_twin(tmp_path):
    def row(version, mode, seconds):
        return {"version": version, "mode": mode, "seconds_per_iteration": seconds, "SPS": 4096 / seconds}

    saved = tmp_path / "e2e-a.json"
    saved.write_text(json.dumps([row("this", "split", 120.0), row("abcdef123", "split", 100.0),
                                 row("this", "twin", 100.0), row("this", "twin", 80.0), row("abcdef123", "twin", 90.0)]))
    lines = history_table([saved]).splitlines()
    # split steps/s over the mean of the twin's: (4096 / 120) / ((4096 / 100 + 4096 / 80) / 2)
    assert lines[2] == "| e2e-a.json | abcdef1 | 120.0 | 100.0 / 80.0 | 0.74x |"
    alone = tmp_path / "split-only.json"
    alone.write_text(json.dumps([row("this", "split", 1.0)]))
    with pytest.raises(ValueError, match="split-only.json: no split and twin rows"):
        history_table([alone])
    with pytest.raises(ValueError, match="not the rows of `splitrl bench e2e --json`"):
        history_table([tmp_path / "e2e-a.json", _text(tmp_path / "notes.md", "# not json")])


def _text(path, text):
    path.write_text(text)
    return path
