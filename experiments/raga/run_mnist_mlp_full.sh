#!/usr/bin/env bash
# The paper's full MNIST-MLP run on the CPU (docs/results/raga.md): 1000 rounds of the T = 1000
# schedule, the Gaussian attack at 0 and 0.4, the four methods, in two 1-thread processes
# (RAGA, RFA | FedAvg, Byrd-SAGA; the grid resumes). About 13-20 min per run on an idle core.
#   bash experiments/raga/run_mnist_mlp_full.sh [a|b|all]
set -u
cd "$(dirname "$0")/../.."
R=experiments/raga/results
run() { PYTHONPATH=. python experiments/raga/grid.py --model mlp --rounds 1000 --eval-every 50 \
          --attacks gaussian --fractions 0.4 0 "$@"; }
case "${1:-all}" in
  a) run --methods raga rfa --out $R/mlp_r1000_a.jsonl >> $R/mlp_r1000_a.log 2>&1 ;;
  b) run --methods fedavg byrdsaga --out $R/mlp_r1000_b.jsonl >> $R/mlp_r1000_b.log 2>&1 ;;
  all) bash "$0" a & bash "$0" b; wait; cat $R/mlp_r1000_a.jsonl $R/mlp_r1000_b.jsonl > $R/mlp_r1000.jsonl ;;
esac
