"""`splitrl bench codecs` on a tiny capture: real streams, real wire bytes."""

import pytest

from splitrl.bench.codec_bench import capture, format_codec_table, pipeline_table, run_codec_bench


@pytest.fixture(scope="module")
def cap():
    return capture(num_steps=32, epochs=2, minibatches=2)


def test_capture_keeps_every_stream(cap):
    assert len(cap.rollout) == 32 and cap.rollout[0].shape == (1, 4096)
    assert len(cap.fwd) == len(cap.bwd) == len(cap.idx) == 4  # 2 epochs x 2 minibatches
    assert cap.fwd[0].shape == cap.bwd[0].shape == (16, 4096)
    assert cap.obs.shape == (32, 1, 4, 96, 96)
    assert sorted(cap.idx[0].tolist() + cap.idx[1].tolist()) == list(range(32))  # one epoch covers the batch


def test_bytes_and_errors_per_codec(cap):
    specs = {"rollout": ["fp32", "bf16"], "fwd": ["fp32", "delta:q=none"],
             "bwd": ["fp32", "bf16", "ef:density=0.05", "paper:warm=0"]}
    rows = {(r["stream"], r["codec"]): r for r in run_codec_bench(cap, specs)}
    assert rows[("bwd", "fp32")]["bytes_per_element"] == pytest.approx(4.0, rel=0.01)
    assert rows[("bwd", "bf16")]["bytes_per_element"] == pytest.approx(2.0, rel=0.01)
    assert rows[("bwd", "fp32")]["rel_error"] == 0.0
    assert 0 < rows[("bwd", "bf16")]["rel_error"] < 0.01
    assert rows[("fwd", "delta:q=none")]["bytes_per_element"] < 0.01
    ef, paper = rows[("bwd", "ef:density=0.05")], rows[("bwd", "paper:warm=0")]
    assert ef["bytes_per_element"] < 0.2 and paper["bytes_per_element"] == pytest.approx(0.6, rel=0.05)
    # Error feedback keeps each sample's residual: its per-sample sums are closer than any single message.
    assert ef["rel_error_sum"] < ef["rel_error"]
    table = format_codec_table(list(rows.values()))
    assert table.count("\n") == len(rows) + 1


def test_pipeline_table_carries_the_cloud_rows(cap):
    rows = run_codec_bench(cap, {"rollout": ["fp32", "bf16"], "fwd": ["fp32", "bf16"], "bwd": ["fp32", "bf16"]})
    table = pipeline_table(cap, rows)
    fp32 = next(line for line in table.splitlines() if line.startswith("| split, fp32"))
    assert "| 344," in fp32  # 4096 x (4 + 10 x (4 + 4)) bytes plus headers: the paper's ~348 KB per step
    cloud = [line for line in table.splitlines() if line.startswith("| cloud")]
    assert len(cloud) == 2
    raw, frames = (float(line.split("|")[5].replace(",", "")) for line in cloud)
    assert raw > 36_864 and frames < raw / 5
