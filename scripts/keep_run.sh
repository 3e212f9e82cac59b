#!/usr/bin/env bash
# Keep a run's records: copy run directory SRC's records (metrics, episodes, evals, logs, both stages' configs)
# to DEST and `git add` them. Checkpoints are never kept: they are training state, not results (binaries stay
# out of git; docs/results/**/checkpoints/ is ignored). A run to be continued goes on from its checkpoints on
# the machine that has them (`splitrl run --resume SRC`); an exported policy (`splitrl export`) is what ships.
#
#   scripts/keep_run.sh runs/classic-control/cartpole-mlp docs/results/classic-control/cartpole-mlp
#
# A fleet's run directory (`splitrl run --edges N`: stage1's, each edge's in SRC/edge-K, with --learners L each
# learner r > 0's in SRC/learner-r) is kept as a whole.
set -euo pipefail
[[ $# == 2 ]] || { echo "usage: $0 SRC DEST" >&2; exit 2; }
src=$1 dest=$2
edges=() learners=()
if [[ ! -f "$src/metrics.jsonl" ]]; then
    for d in "$src"/edge-*/; do [[ -f "$d/metrics.jsonl" ]] && edges+=("$(basename "$d")"); done
    for d in "$src"/learner-*/; do [[ -d "$d" ]] && learners+=("$(basename "$d")"); done
fi
[[ -f "$src/metrics.jsonl" || ${#edges[@]} -gt 0 ]] || { echo "$src: no metrics.jsonl (not a run directory?)" >&2; exit 1; }
rm -rf "$dest"
for dir in "" "${edges[@]}" "${learners[@]}"; do
    mkdir -p "$dest/$dir"
    for f in "$src/$dir"/*; do
        [[ -f "$f" && "$f" != *.pt && "$f" != *.pt.sha256 ]] && cp -p "$f" "$dest/$dir/"
    done
done
echo "kept the records of $src in $dest ($(du -sh "$dest" | cut -f1))"
git add "$dest"
