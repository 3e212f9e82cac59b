#!/usr/bin/env bash
# The paper-length runs: 100 iterations (409,600 steps) of the paper's PPO, two seeds each of bf16,
# the paper's p90, the best split (ours-bottleneck) and the cloud setup, with the fastest lossless schedule
# (4 envs x 1024 steps in 4 groups, 2 micro-batches; the paper codec takes no micro-batches: its accumulator is
# positional over a whole minibatch).
#
#   scripts/paper_length.sh [RUN ...]     # e.g. bf16-seed1; default: every run, in the order below
#
# Each run goes on from its newest checkpoint in $OUT (--resume) and a finished one is skipped, so rerunning the
# script on the same machine continues where it stopped. Records are committed (scripts/keep_run.sh), never
# checkpoints: the runs committed under docs/results/paper-length/ before that rule kept theirs in git history
# only, so a fresh clone starts a run again unless $KEPT holds its checkpoints. One run at a time: a pipelined run keeps both of this machine's cores busy.
# bf16's two runs start from the 25-iteration runs of docs/benchmarks/pipeline.md (runs/pipeline-learning-seedN/
# bf16-pipelined, the same settings but --total-steps), copied, when those are on disk.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/paper-length}
EARLIER=${EARLIER:-runs}   # where runs/pipeline-learning-seedN are
KEPT=${KEPT:-docs/results/paper-length}   # runs committed between sessions, each with its newest checkpoints
PY=${PY:-.venv/bin/python}
SCHEDULE=(--num-envs 4 --num-steps 1024 --rollout-groups 4 --vector async --threads 1 --total-steps 409600)
config() {
  case "$1" in
    bf16) echo "--codec-rollout bf16 --codec-fwd bf16 --codec-bwd bf16 --microbatches 2" ;;
    paper-p90) echo "--codec-bwd paper" ;;
    ours-bottleneck) echo "--bottleneck 256 --codec-rollout int8+zstd --exchange replica:last_every=1,all_every=80 --microbatches 2" ;;
    cloud-frames) echo "--cut input --codec-rollout frames --microbatches 2" ;;
    *) echo "unknown configuration $1" >&2; exit 2 ;;
  esac
}
RUNS=("$@")
if [ ${#RUNS[@]} -eq 0 ]; then
  RUNS=(bf16-seed1 bf16-seed2 ours-bottleneck-seed1 ours-bottleneck-seed2 paper-p90-seed1 paper-p90-seed2
        cloud-frames-seed1 cloud-frames-seed2)
fi
mkdir -p "$OUT"
for run in "${RUNS[@]}"; do
  name=${run%-seed*}; seed=${run##*-seed}; dir="$OUT/$run"
  # shellcheck disable=SC2046
  args=($(config "$name") "${SCHEDULE[@]}" --seed "$seed")
  if [ ! -d "$dir" ] && ls "$KEPT/$run"/checkpoints/stage0-iter*.pt > /dev/null 2>&1; then
    cp -r "$KEPT/$run" "$dir"  # a run an earlier session stopped and committed with its newest checkpoints
  fi
  if [ "$name" = bf16 ] && [ ! -d "$dir" ] && [ -d "$EARLIER/pipeline-learning-seed$seed/bf16-pipelined/checkpoints" ]; then
    cp -r "$EARLIER/pipeline-learning-seed$seed/bf16-pipelined" "$dir"
  fi
  if [ -f "$dir/metrics.jsonl" ] && [ "$(wc -l < "$dir/metrics.jsonl")" -ge 100 ]; then
    echo "$run: done"; continue
  fi
  if [ -d "$dir/checkpoints" ] && ls "$dir"/checkpoints/stage0-iter*.pt > /dev/null 2>&1; then
    echo "$run: continuing ($(wc -l < "$dir/metrics.jsonl") iterations so far)"
    "$PY" -m splitrl run --resume "$dir" "${args[@]}" >> "$OUT/$run.out" 2>&1
  else
    echo "$run: starting"
    "$PY" -m splitrl run --run-dir "$dir" --overwrite "${args[@]}" >> "$OUT/$run.out" 2>&1
  fi
done
