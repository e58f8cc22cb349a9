#!/usr/bin/env bash
# The longer MNIST-MLP runs of docs/results/raga.md (200 rounds of the T = 1000 schedule),
# the Gaussian attack at every fraction 0 / 0.1 / 0.2 / 0.3 / 0.4 for the four methods (the grid
# resumes: runs already in the result file are skipped).
#   nohup bash experiments/raga/run_mnist_mlp_long.sh > experiments/raga/results/mlp_r200.log 2>&1 &
set -e
cd "$(dirname "$0")/../.."
OUT=experiments/raga/results/mlp_r200.jsonl
run() { PYTHONPATH=. python experiments/raga/grid.py --model mlp --rounds 200 --eval-every 10 --out "$OUT" "$@"; }
run --attacks gaussian --fractions 0 0.4
run --attacks gaussian --fractions 0.2
run --attacks gaussian --fractions 0.1 0.3
