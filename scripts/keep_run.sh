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
set -euo pipefail
checkpoints=1
if [[ "${1:-}" == --no-checkpoints ]]; then checkpoints=0; shift; fi
[[ $# == 2 ]] || { echo "usage: $0 [--no-checkpoints] SRC DEST" >&2; exit 2; }
src=$1 dest=$2
[[ -f "$src/metrics.jsonl" ]] || { echo "$src: no metrics.jsonl (not a run directory?)" >&2; exit 1; }
rm -rf "$dest"
mkdir -p "$dest"
for f in "$src"/*; do
    [[ -f "$f" ]] && cp -p "$f" "$dest/"
done
if ((checkpoints)); then
    newest=""
    for ck in "$src"/checkpoints/stage0-iter*.pt; do
        [[ -e "$ck" ]] || continue
        it=${ck##*-iter}; it=${it%.pt}
        [[ -e "$src/checkpoints/stage1-iter$it.pt" ]] && newest=$it
    done
    [[ -n "$newest" ]] || { echo "$src: no iteration with both stages' checkpoints" >&2; exit 1; }
    mkdir -p "$dest/checkpoints"
    cp -p "$src"/checkpoints/stage[01]-iter"$newest".pt* "$dest/checkpoints/"
    echo "kept $src with the checkpoints of iteration $((10#$newest)) ($(du -sh "$dest/checkpoints" | cut -f1))"
fi
git add -f "$dest"
