#!/usr/bin/env bash
# The MNIST-MLP grid of docs/results/raga.md, most important runs first (the grid resumes).
#   nohup timeout 6000 bash experiments/raga/run_mnist_mlp.sh > experiments/raga/results/mlp_r20.log 2>&1 &
set -e
cd "$(dirname "$0")/../.."
ROUNDS=${ROUNDS:-20}
OUT=experiments/raga/results/mlp_r${ROUNDS}.jsonl
run() { PYTHONPATH=. python experiments/raga/grid.py --model mlp --rounds "$ROUNDS" --eval-every 5 --out "$OUT" "$@"; }
run --attacks gaussian --fractions 0 0.1 0.2 0.3 0.4
run --attacks signflip alie --fractions 0.4 0.2
run --attacks signflip alie --fractions 0.1 0.3
