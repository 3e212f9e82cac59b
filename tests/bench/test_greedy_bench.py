"""``splitrl bench greedy``: each rule and the sampled policy on the same held-out episodes, as `splitrl eval`
plays them, and a table of their scores."""

from __future__ import annotations

import json

from splitrl.bench.greedy_bench import format_table

from ..conftest import TINY, splitrl_here


def test_each_rule_scores_what_eval_scores_on_the_same_seeds(tmp_path):
    run = tmp_path / "run"
    splitrl_here("train", "--run-dir", str(run), *TINY)
    shown = splitrl_here("bench", "greedy", str(run), "--episodes", "1", "--json", str(tmp_path / "rows.json"))
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert [r["rule"] for r in rows] == ["expected", "mode", "mean", "sampled"]
    assert len({r["seed"] for r in rows}) == 1 and shown.stdout.startswith("| run | expected | mode | mean | sampled |")
    for rule in ("mode", "sampled"):
        how = ["--sample"] if rule == "sampled" else ["--deterministic", "--greedy", rule]
        played = splitrl_here("eval", str(run), "--episodes", "1", "--threads", "1", *how).stdout
        score = next(r for r in rows if r["rule"] == rule)
        assert f"return {score['return_mean']:.1f} ± {score['return_std']:.1f}" in played, (rule, played)
    assert not (run / "eval.jsonl").exists()  # nothing written into the run


def test_the_table_puts_each_rule_beside_the_sampled_play():
    rows = [{"run": "a", "rule": "expected", "return_mean": 50.0, "return_std": 1.0},
            {"run": "a", "rule": "sampled", "return_mean": 100.0, "return_std": 2.0},
            {"run": "b", "rule": "expected", "return_mean": 5.0, "return_std": 0.5},
            {"run": "b", "rule": "sampled", "return_mean": -1.0, "return_std": 0.0}]
    lines = format_table(rows).splitlines()
    assert lines[0] == "| run | expected | sampled |"
    assert lines[2] == "| a | 50.0 ± 1.0 (50%) | 100.0 ± 2.0 |"
    assert lines[3] == "| b | 5.0 ± 0.5 | -1.0 ± 0.0 |"  # no share of a sampled score that is not positive
