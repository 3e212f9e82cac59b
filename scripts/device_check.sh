#!/usr/bin/env bash
# The device check: a stage on a GPU computes what its twin computes, resumes anywhere, and what it buys.
#
#   scripts/device_check.sh [OUT_DIR]                  # on a machine with CUDA (one H200: about 5 minutes)
#   DEVICE=cpu PIPELINE_ARGS="--num-steps 64 --total-steps 64 --epochs 1 --minibatches 2" \
#       scripts/device_check.sh /tmp/dry               # the same steps on the CPU, small: a dry run of this script
#
# OUT_DIR (default $OUT, else runs/device-check) gets device-check.txt, everything printed here (commit it as
# docs/results/device-check.txt), and the runs under OUT_DIR/runs. In order:
#   1. torch's, CUDA's and cuDNN's versions and the device's name;
#   2. split == twin, bit for bit (scripts/same_runs.py: every tensor of both stages' checkpoints and every
#      metric), on tiny runs: both stages on DEVICE, then stage0 on the CPU and stage1 on DEVICE; and with both on
#      DEVICE, the pipelined schedule, the asynchronous one (rescored; paced by epochs), the replica exchange and
#      the cut before the first layer (stage1 trains alone);
#   3. a run trained on DEVICE resumes on the CPU, and one trained on the CPU resumes on DEVICE;
#   4. one paper iteration of `splitrl bench pipeline --modes sync` (4096 steps, 10 epochs of 32 minibatches,
#      over loopback) with stage1 on DEVICE, beside the same with both stages on the CPU.
# Exits 1 if any check fails (each step is bounded by a timeout). PYTHON (default: python) runs splitrl from this
# checkout; PIPELINE_ARGS go to both pipeline runs.
set -uo pipefail

cd "$(dirname "$0")/.."
ROOT=$PWD
DEVICE=${DEVICE:-cuda}
PY=${PYTHON:-python}
OUT_DIR=${1:-${OUT:-runs/device-check}}
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
REPORT=$OUT_DIR/device-check.txt
RUNS=$OUT_DIR/runs
rm -rf "$RUNS"
mkdir -p "$RUNS"
: >"$REPORT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
read -r -a EXTRA <<<"${PIPELINE_ARGS:-}"
TINY=(--total-steps 64 --num-steps 32 --epochs 2 --minibatches 2 --max-episode-steps 20 --threads 1
      --checkpoint-every 1)
FAILED=()

say() { printf '%s\n' "$*" | tee -a "$REPORT"; }

# step NAME SECONDS COMMAND...: runs COMMAND (its output in RUNS/NAME.log), says how it went; 1 if it failed.
step() {
    local name=$1 limit=$2
    shift 2
    local start=$SECONDS code
    timeout --signal=INT --kill-after=30 "$limit" "$@" >"$RUNS/$name.log" 2>&1
    code=$?
    if [ "$code" -eq 0 ]; then
        say "  ok    $name ($((SECONDS - start)) s)"
        return 0
    fi
    local why="exit $code"
    [ "$code" -eq 124 ] && why="timed out after $limit s"
    say "  FAIL  $name ($((SECONDS - start)) s, $why): $(tail -n 3 "$RUNS/$name.log" | tr '\n' ' ')"
    FAILED+=("$name")
    return 1
}

SPLITRL=("$PY" -m splitrl)

say "# splitrl device check: DEVICE=$DEVICE"
say "$(date -u '+%Y-%m-%d %H:%M UTC'), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
say ""
say "## 1. versions"
if ! "$PY" - "$DEVICE" >>"$REPORT" 2>&1 <<'EOF'
import platform
import sys

import torch

from splitrl.devices import describe_device, resolve_device

print(f"python {platform.python_version()}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
      f"cuDNN {torch.backends.cudnn.version()}, CUDA available: {torch.cuda.is_available()}, "
      f"devices: {torch.cuda.device_count()}")
print(f"{sys.argv[1]}: {describe_device(resolve_device(sys.argv[1]))}")
print(f"host: {platform.processor() or platform.machine()}, {__import__('os').cpu_count()} CPUs")
EOF
then
    tail -n 5 "$REPORT"
    say "FAIL: no device $DEVICE here; nothing else checked"
    exit 1
fi
tail -n 3 "$REPORT"

# split_vs_twin NAME ARGS...: the same tiny run split (`splitrl run`: two processes over loopback) and as the
# twin (`splitrl train`, one process), compared bit for bit (NET=totals|none: the link's counts as totals only, or
# not: scripts/same_runs.py).
split_vs_twin() {
    local name=$1
    shift
    step "$name-split" 300 "${SPLITRL[@]}" run --run-dir "$RUNS/$name-split" "${TINY[@]}" "$@" || return
    step "$name-twin" 300 "${SPLITRL[@]}" train --run-dir "$RUNS/$name-twin" "${TINY[@]}" "$@" || return
    local verdict
    verdict=$("$PY" scripts/same_runs.py --net "${NET:-all}" "$RUNS/$name-split" "$RUNS/$name-twin")
    local code=$?
    say "        split == twin: $verdict"
    [ "$code" -eq 0 ] || FAILED+=("$name: split != twin")
}

say ""
say "## 2. split == twin, bit for bit (tiny runs: ${TINY[*]})"
ON_DEVICE=(--stage0-device "$DEVICE" --stage1-device "$DEVICE")
split_vs_twin both-on-device "${ON_DEVICE[@]}"
split_vs_twin stage0-cpu-stage1-device --stage0-device cpu --stage1-device "$DEVICE"
TWO_ENVS=(--num-envs 2 --total-steps 128 --rollout-groups 2)
split_vs_twin pipelined "${ON_DEVICE[@]}" "${TWO_ENVS[@]}" --microbatches 2
# The asynchronous schedule's deterministic forms (free-running, what acts depends on the threads' timing):
# rescored with no lag, and paced by epochs (samples one version behind: decoupled PPO's corrections).
NET=totals split_vs_twin async-rescore "${ON_DEVICE[@]}" "${TWO_ENVS[@]}" --async --max-staleness 0 --rescore \
    --codec-fwd bf16
NET=none split_vs_twin async-epoch "${ON_DEVICE[@]}" "${TWO_ENVS[@]}" --async --max-staleness 1 --publish epoch
split_vs_twin replica "${ON_DEVICE[@]}" --codec-rollout int8 --exchange replica:last_every=1,all_every=3
split_vs_twin cut-input "${ON_DEVICE[@]}" --cut input --codec-rollout frames+zstd

say ""
say "## 3. checkpoints hold host tensors: resumed on another device"
HALF=(--total-steps 32 --num-steps 32 --epochs 2 --minibatches 2 --max-episode-steps 20 --threads 1)
# resumed NAME RUN_DIR: the run went on from its checkpoint of iteration 1 to iteration 2; the config records the
# devices it last ran on.
resumed() {
    local verdict code
    verdict=$("$PY" - "$2" <<'EOF'
import json
import sys
from pathlib import Path

from splitrl.runs import checkpoint_iterations, read_metrics

run = Path(sys.argv[1])
iterations = [r["iteration"] for r in read_metrics(run)]
devices = json.loads((run / "config.json").read_text())["devices"]
held = {stage: checkpoint_iterations(run, stage) for stage in ("stage0", "stage1")}
ok = iterations == [1, 2] and all(2 in its for its in held.values())
print(f"{'ok' if ok else 'WRONG'}: iterations {iterations}, checkpoints {held}, last on {devices}")
sys.exit(0 if ok else 1)
EOF
)
    code=$?
    say "        $verdict"
    [ "$code" -eq 0 ] || FAILED+=("$1")
}
step trained-on-device 300 "${SPLITRL[@]}" train --run-dir "$RUNS/resume-a" "${HALF[@]}" "${ON_DEVICE[@]}" &&
    step resumed-on-cpu 300 "${SPLITRL[@]}" train --resume "$RUNS/resume-a" "${TINY[@]}" &&
    resumed resumed-on-cpu "$RUNS/resume-a"
step trained-on-cpu 300 "${SPLITRL[@]}" train --run-dir "$RUNS/resume-b" "${HALF[@]}" &&
    step resumed-on-device 300 "${SPLITRL[@]}" train --resume "$RUNS/resume-b" "${TINY[@]}" "${ON_DEVICE[@]}" &&
    resumed resumed-on-device "$RUNS/resume-b"

say ""
say "## 4. one paper iteration, splitrl bench pipeline --modes sync --rtt 0 --iterations 1${EXTRA[*]:+ -- ${EXTRA[*]}}"
PIPELINE=(bench pipeline --modes sync --rtt 0 --iterations 1)
step pipeline-cpu 480 "${SPLITRL[@]}" "${PIPELINE[@]}" --out "$RUNS/pipeline-cpu" -- "${EXTRA[@]}"
step pipeline-stage1-device 480 "${SPLITRL[@]}" "${PIPELINE[@]}" --out "$RUNS/pipeline-stage1-device" -- \
    --stage1-device "$DEVICE" "${EXTRA[@]}"
"$PY" - "$RUNS" "$DEVICE" >>"$REPORT" 2>&1 <<'EOF'
import json
import sys
from pathlib import Path

runs, device = Path(sys.argv[1]), sys.argv[2]
print("| stages | s/iteration | steps/s | env s | encoder s (stage0) | heads s (stage1) | link wait s | MB/iteration |")
print("|---|---:|---:|---:|---:|---:|---:|---:|")
for label, name in (("both on cpu", "pipeline-cpu"), (f"stage1 on {device}", "pipeline-stage1-device")):
    metrics = runs / name / "0ms-sync" / "metrics.jsonl"
    if not metrics.is_file():
        print(f"| {label} | (no run) | | | | | | |")
        continue
    r = json.loads(metrics.read_text().splitlines()[-1])
    net = sum(v for k, v in r.items() if k.startswith("net/") and k.endswith("_bytes"))
    times = " | ".join(f"{r.get(f'time/{key}', float('nan')):.1f}" for key in ("env", "encoder", "heads", "link_wait"))
    print(f"| {label} | {r['time/iteration']:.1f} | {r['charts/SPS']:.1f} | {times} | {net / 1e6:.0f} |")
EOF
tail -n 4 "$REPORT"

say ""
if [ ${#FAILED[@]} -eq 0 ]; then
    say "device check: PASS (runs and logs in $RUNS)"
    exit 0
fi
say "device check: FAIL: ${FAILED[*]}"
exit 1
