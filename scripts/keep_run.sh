#!/usr/bin/env bash
# Keep a long run across sessions: copy run directory SRC to DEST with its records (metrics, episodes, eval,
# both stages' configs) and, unless --no-checkpoints, only its newest checkpoint that both stages hold (and the
# sha256 files), then `git add -f` DEST (checkpoints under docs/results/ are otherwise ignored).
#
#   scripts/keep_run.sh runs/paper-length/bf16-seed1 docs/results/paper-length/bf16-seed1
#   scripts/keep_run.sh --no-checkpoints runs/x docs/results/x      # a finished run: records only
#
# One stage1 checkpoint of the paper's network is about 50 MB (heads and Adam moments, float32): keep only
# runs that will be continued. `scripts/paper_length.sh` copies such a run back and goes on with --resume.
#
# A fleet's run directory (`splitrl run --edges N`: stage1's, each edge's in SRC/edge-K) is kept as a whole: the
# newest iteration stage1 and every edge hold a checkpoint of.
set -euo pipefail
checkpoints=1
if [[ "${1:-}" == --no-checkpoints ]]; then checkpoints=0; shift; fi
[[ $# == 2 ]] || { echo "usage: $0 [--no-checkpoints] SRC DEST" >&2; exit 2; }
src=$1 dest=$2
edges=()
if [[ ! -f "$src/metrics.jsonl" && -f "$src/edge-0/metrics.jsonl" ]]; then
    while [[ -f "$src/edge-${#edges[@]}/metrics.jsonl" ]]; do edges+=("edge-${#edges[@]}"); done
fi
[[ -f "$src/metrics.jsonl" || ${#edges[@]} -gt 0 ]] || { echo "$src: no metrics.jsonl (not a run directory?)" >&2; exit 1; }
rm -rf "$dest"
mkdir -p "$dest"
for dir in "" "${edges[@]}"; do
    mkdir -p "$dest/$dir"
    for f in "$src/$dir"/*; do
        [[ -f "$f" ]] && cp -p "$f" "$dest/$dir/"
    done
done
if ((checkpoints)); then
    # stage0's checkpoints: the run's own, or every edge's
    stage0=("$src") && ((${#edges[@]})) && stage0=("${edges[@]/#/$src/}")
    newest=""
    for ck in "$src"/checkpoints/stage1-iter*.pt; do
        [[ -e "$ck" ]] || continue
        it=${ck##*-iter}; it=${it%.pt}
        all=1
        for d in "${stage0[@]}"; do [[ -e "$d/checkpoints/stage0-iter$it.pt" ]] || all=0; done
        ((all)) && newest=$it
    done
    [[ -n "$newest" ]] || { echo "$src: no iteration with both stages' checkpoints" >&2; exit 1; }
    mkdir -p "$dest/checkpoints"
    cp -p "$src"/checkpoints/stage1-iter"$newest".pt* "$dest/checkpoints/"
    for d in "${stage0[@]}"; do
        to="$dest${d#"$src"}/checkpoints"
        mkdir -p "$to"
        cp -p "$d"/checkpoints/stage0-iter"$newest".pt* "$to/"
    done
    echo "kept $src with the checkpoints of iteration $((10#$newest)) ($(du -sh "$dest" | cut -f1))"
fi
git add -f "$dest"
