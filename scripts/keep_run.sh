#!/usr/bin/env bash
# Keep a long run across sessions: copy run directory SRC to DEST with its records (metrics, episodes, eval,
# both stages' configs) and, unless --no-checkpoints, only its newest checkpoint that both stages hold (and the
# sha256 files), then `git add -f` DEST (checkpoints under docs/results/ are otherwise ignored).
#
#   scripts/keep_run.sh runs/paper-length/bf16-seed1 docs/results/paper-length/bf16-seed1
#   scripts/keep_run.sh --no-checkpoints runs/x docs/results/x      # a finished run: records only
#   scripts/keep_run.sh --keep-older runs/x docs/results/x          # leave DEST's older checkpoints in place
#
# One stage1 checkpoint of the paper's network is about 50 MB (heads and Adam moments, float32): keep only
# runs that will be continued. `scripts/paper_length.sh` copies such a run back and goes on with --resume.
# What a session submits is capped by its diffs as text, and a binary file costs about 1.3x its size there both
# when it is added and when it is removed: replacing one kept checkpoint with a newer one costs twice what adding
# it does. --keep-older adds the newest checkpoints and removes none, for a session that keeps several runs.
#
# A fleet's run directory (`splitrl run --edges N`: stage1's, each edge's in SRC/edge-K, with --learners L each
# learner r > 0's in SRC/learner-r) is kept as a whole: the newest iteration every stage holds a checkpoint of.
set -euo pipefail
checkpoints=1 older=0
while [[ "${1:-}" == --* ]]; do
    case "$1" in
        --no-checkpoints) checkpoints=0 ;;
        --keep-older) older=1 ;;
        *) echo "$0: unknown option $1" >&2; exit 2 ;;
    esac
    shift
done
[[ $# == 2 ]] || { echo "usage: $0 [--no-checkpoints | --keep-older] SRC DEST" >&2; exit 2; }
src=$1 dest=$2
edges=() learners=()
if [[ ! -f "$src/metrics.jsonl" ]]; then
    for d in "$src"/edge-*/; do [[ -f "$d/metrics.jsonl" ]] && edges+=("$(basename "$d")"); done
    for d in "$src"/learner-*/; do [[ -d "$d" ]] && learners+=("$(basename "$d")"); done
fi
[[ -f "$src/metrics.jsonl" || ${#edges[@]} -gt 0 ]] || { echo "$src: no metrics.jsonl (not a run directory?)" >&2; exit 1; }
if ((older)); then
    # the records are copied anew; the checkpoints stay
    find "$dest" -path '*/checkpoints' -prune -o -type f -exec rm -f {} + 2> /dev/null || true
else
    rm -rf "$dest"
fi
mkdir -p "$dest"
for dir in "" "${edges[@]}" "${learners[@]}"; do
    mkdir -p "$dest/$dir"
    for f in "$src/$dir"/*; do
        [[ -f "$f" ]] && cp -p "$f" "$dest/$dir/"
    done
done
if ((checkpoints)); then
    # where each stage's checkpoints are: stage1's in SRC (and each further learner's), stage0's in SRC or each edge's
    holders=("stage1:") stage0=("stage0:")
    if ((${#edges[@]})); then
        stage0=()
        for e in "${edges[@]}"; do stage0+=("stage0:$e"); done
    fi
    for l in "${learners[@]}"; do holders+=("stage1:$l"); done
    holders+=("${stage0[@]}")
    newest=""
    for ck in "$src"/checkpoints/stage1-iter*.pt; do
        [[ -e "$ck" ]] || continue
        it=${ck##*-iter}; it=${it%.pt}
        all=1
        for h in "${holders[@]}"; do [[ -e "$src/${h#*:}/checkpoints/${h%%:*}-iter$it.pt" ]] || all=0; done
        ((all)) && newest=$it
    done
    [[ -n "$newest" ]] || { echo "$src: no iteration with every stage's checkpoints" >&2; exit 1; }
    for h in "${holders[@]}"; do
        mkdir -p "$dest/${h#*:}/checkpoints"
        cp -p "$src/${h#*:}/checkpoints/${h%%:*}-iter$newest".pt* "$dest/${h#*:}/checkpoints/"
    done
    echo "kept $src with the checkpoints of iteration $((10#$newest)) ($(du -sh "$dest" | cut -f1))"
fi
git add -f "$dest"
