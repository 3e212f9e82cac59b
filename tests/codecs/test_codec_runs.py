"""Short runs with codecs: they complete, and the link meters show the bytes they save.

Every ratio is against the same tiny run with fp32 on the link, measured by the
transport (stage0's meters: it sends step/train_fwd and receives train_bwd). The runs
train as the twin in this process: its in-process link frames and meters every message
as a socket does. One configuration, `SPLIT`, also runs split over loopback
(`splitrl run`), and its meters must equal its twin's.
"""

import json

import pytest

from ..conftest import TINY

RUNS = {
    "fp32": [],
    "mixed": ["--codec-rollout", "bf16", "--codec-fwd", "int8", "--codec-bwd", "paper:warm=64"],
    "sparse": ["--codec-rollout", "relu", "--codec-fwd", "delta", "--codec-bwd", "ef:density=0.05"],
    "lean": ["--codec-rollout", "fp16", "--codec-fwd", "delta:q=none",
             "--codec-bwd", "ef:density=0.02,values=int8+zstd"],
    "replica": ["--codec-rollout", "int8+zstd", "--exchange", "replica"],
    "replica-sync": ["--codec-rollout", "int8+zstd", "--exchange", "replica:last_every=1,all_every=3"],
    "cloud": ["--cut", "input"],
    "cloud-frames": ["--cut", "input", "--codec-rollout", "frames"],
}


SPLIT = "lean"
"""The configuration also run split: stateful codecs on every stream (delta's cache, error feedback's residual),
each kept on both stages, and zstd."""


def _read(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, _warm):
    """Run every configuration once as the twin in this process, and `SPLIT` split over loopback beside them."""
    from splitrl.launch import free_port_pair

    from ..conftest import WarmProc, splitrl_here

    base = tmp_path_factory.mktemp("codec-runs")
    endpoint = f"tcp://127.0.0.1:{free_port_pair()}"
    split = [WarmProc((stage, option, endpoint, "--run-dir", str(base / "split"), *TINY, *RUNS[SPLIT]),
                      base / f"split-{stage}.log", _warm) for stage, option in (("stage1", "--bind"),
                                                                               ("stage0", "--connect"))]
    try:
        out: dict[str, list[dict]] = {}
        for name in RUNS:
            splitrl_here("train", "--run-dir", str(base / name), *TINY, *RUNS[name])
            out[name] = _read(base / name)
        done = [proc.finish(timeout=240) for proc in split[::-1]]
    finally:
        for proc in split:
            proc.stop()
    assert all(code == 0 for code, _ in done), f"split {SPLIT}:\n" + "\n".join(text for _, text in done)
    out["_split"] = _read(base / "split")
    out["_base"] = base
    return out


def _bytes(rows, key, iteration=None):
    return sum(r.get(key, 0) for r in rows if iteration is None or r["iteration"] == iteration)


def _ratio(runs, name, key, baseline="fp32", iteration=None):
    return _bytes(runs[name], key, iteration) / _bytes(runs[baseline], key, iteration)


STEP, FWD, BWD = "net/step/sent_bytes", "net/train_fwd/sent_bytes", "net/train_bwd/recv_bytes"


def test_every_codec_run_completes_both_iterations(runs):
    for name in RUNS:
        assert [r["iteration"] for r in runs[name]] == [1, 2], name


def test_the_split_run_meters_what_its_twin_does(runs):
    """What makes the twins' byte counts a split run's: the same frames on the same meters, over a socket."""
    volatile = ("time/", "cpu/", "charts/SPS")
    split, twin = ([{k: v for k, v in r.items() if not k.startswith(volatile)} for r in runs[name]]
                   for name in ("_split", SPLIT))
    assert [r["iteration"] for r in split] == [1, 2]
    assert split == twin
    assert split[-1]["net/train_bwd/recv_bytes"] > 0


def test_learning_table_has_a_row_per_run_with_its_codecs_and_ratio(runs, tmp_path):
    from splitrl.bench.learning_bench import learning_table, summarise_run

    base = runs["_base"]
    table = learning_table([base / "fp32", base / "lean"], reference="fp32").splitlines()
    assert len(table) == 4
    assert "`fp16 / delta:q=none / ef:density=0.02,values=int8+zstd`" in table[3]
    lean, plain = summarise_run(base / "lean"), summarise_run(base / "fp32")
    assert lean["steps"] == plain["steps"] == 64
    ratio = float(table[3].split("|")[7])
    assert ratio == pytest.approx(plain["total_bytes"] / lean["total_bytes"], rel=0.01) and ratio > 2
    first = summarise_run(base / "lean", upto=1)
    assert first["iterations"] == 1 and first["steps"] == 32 and first["total_bytes"] < lean["total_bytes"]
    # A run stopped early compares per env step, not by its smaller total.
    import shutil

    short = tmp_path / "lean-short"
    shutil.copytree(base / "lean", short)
    (short / "metrics.jsonl").write_text((base / "lean" / "metrics.jsonl").read_text().splitlines()[0] + "\n")
    row = learning_table([base / "fp32", short], reference="fp32").splitlines()[3]
    assert float(row.split("|")[7]) == pytest.approx(plain["bytes_per_step"] / first["bytes_per_step"], rel=0.01)
    assert "held-out" not in learning_table([base / "fp32", short], reference="fp32")
    # `splitrl eval` records of the last iteration counted: a column, the newest of each mode
    record = {"iteration": 1, "deterministic": True, "episodes": 3, "return_mean": 9.0, "return_std": 1.0}
    records = [record, {**record, "return_mean": 12.25}, {**record, "iteration": 2, "return_mean": 99.0},
               {**record, "deterministic": False, "episodes": 5, "return_mean": -4.0, "return_std": 2.5}]
    (short / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    table = learning_table([base / "fp32", short], reference="fp32").splitlines()
    assert table[0].endswith("| held-out eval: deterministic / sampled |") and table[1].endswith("---:|---|")
    assert table[2].endswith("| - / - |") and table[3].endswith("| 12.2 ± 1.0 (3) / -4.0 ± 2.5 (5) |")


def test_the_kind_table_splits_each_runs_bytes_per_env_step_by_message_kind(runs):
    from splitrl.bench.learning_bench import KINDS, kind_table, summarise_run

    base = runs["_base"]
    rows = kind_table([base / "fp32", base / "replica"]).splitlines()
    assert len(rows) == 4 and rows[2].startswith("| fp32 |")
    for row, name in zip(rows[2:], ("fp32", "replica")):
        cells = [float(c.replace(",", "")) for c in row.strip("|").split("|")[1:]]
        assert 0 < cells[-2] < 0.01 * cells[-1]  # 'other' (hello, iter_end, ...): the kinds named hold the rest
        assert cells[-1] == pytest.approx(summarise_run(base / name)["bytes_per_step"], abs=0.1)
    fp32, replica = ([float(c.replace(",", "")) for c in row.strip("|").split("|")[1:]] for row in rows[2:])
    heads = KINDS.index("heads")
    assert fp32[heads] == 0 and replica[heads] > 0  # only the replica sends its heads
    assert replica[KINDS.index("train_fwd")] < fp32[KINDS.index("train_fwd")] / 100  # outputs, not features


def test_casts_and_int8_cut_bytes_by_their_width(runs):
    assert 0.45 < _ratio(runs, "mixed", STEP) < 0.55  # bf16 rollout features
    assert 0.45 < _ratio(runs, "lean", STEP) < 0.55  # fp16 rollout features
    assert 0.24 < _ratio(runs, "mixed", FWD) < 0.27  # int8 + one float32 scale per row


def test_paper_codec_sends_full_gradients_until_its_warm_start_then_about_a_tenth(runs):
    # warm=64 env steps: iteration 1 trains at step 32 (full float32), iteration 2 at step 64 (sparse).
    assert 0.99 < _ratio(runs, "mixed", BWD, iteration=1) < 1.01
    # 10 % of entries at 2 x int16 + bfloat16 = 6 bytes each, against 4 bytes for every entry.
    assert 0.13 < _ratio(runs, "mixed", BWD, iteration=2) < 0.17


def test_sparse_codecs_send_a_fraction(runs):
    # ReLU features: about half are zero; the non-zeros go as float32 plus their positions.
    assert 0.3 < _ratio(runs, "sparse", STEP) < 0.8
    assert 0.24 < _ratio(runs, "sparse", FWD) < 0.27  # delta with int8 changes
    assert _ratio(runs, "sparse", BWD) < 0.06  # 5 % of entries, bf16 values, varint or bitmask positions
    assert _ratio(runs, "lean", BWD) < 0.02  # 2 % of entries, int8 values, zstd
    assert _ratio(runs, "lean", FWD) < 0.01  # zero budget: headers only


def test_cloud_setup_sends_pixels_only_and_frames_cut_them(runs):
    assert _bytes(runs["cloud"], FWD) == 0 and _bytes(runs["cloud"], BWD) == 0
    assert _ratio(runs, "cloud-frames", STEP, baseline="cloud") < 0.35


def test_replica_sends_the_heads_outputs_and_one_weight_update_per_iteration(runs):
    import torch

    from splitrl.models import build_agent
    from splitrl.stages.replica_plan import replicated

    # 16 samples a minibatch x (3 action means + 1 value) float32, against 16 x 4096 float32.
    assert _ratio(runs, "replica", FWD) < 0.002 and _ratio(runs, "replica", BWD) < 0.002
    assert _bytes(runs["fp32"], "net/heads/recv_bytes") == 0
    _, heads = build_agent((4, 96, 96), 3, "cnn", seed=1, hidden=int(TINY[TINY.index("--hidden") + 1]))
    # int8: a byte per weight plus a float32 scale per row (a bias is one row).
    size = {name: p.numel() + 4 * (p.shape[0] if p.dim() >= 2 else 1) for name, p in replicated(heads)}
    expected = sum(size.values())
    # replica-sync, 4 minibatches an iteration: the rollout's update, the small one after
    # minibatches 1 and 2 (all but the first layers), all weights after 3, none after the last.
    small = expected - size["critic.0.weight"] - size["actor_mean.0.weight"]
    header = 1024  # a message's framing: the header names each tensor, its dtype and shape
    for iteration in (1, 2):
        got = _bytes(runs["replica"], "net/heads/recv_bytes", iteration)
        assert expected < got < expected + header, (iteration, got, expected)
        got = _bytes(runs["replica-sync"], "net/heads/recv_bytes", iteration)
        assert 2 * expected + 2 * small < got < 2 * expected + 2 * small + 4 * header, (iteration, got)
    assert not any(isinstance(v, float) and v != v for r in runs["replica"] for v in r.values())  # no NaN
    assert torch.isfinite(torch.tensor([r["losses/approx_kl"] for r in runs["replica"]])).all()
