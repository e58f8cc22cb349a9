#!/usr/bin/env bash
# The MNIST-LeNet runs of docs/results/raga.md: 60 rounds of the T = 1000 schedule, Gaussian attack at
# fractions 0 and 0.4, the four methods in two 1-thread processes (RAGA, RFA | FedAvg, Byrd-SAGA).
#   bash experiments/raga/run_mnist_lenet.sh [a|b|all]
set -u
cd "$(dirname "$0")/../.."
R=experiments/raga/results
run() { PYTHONPATH=. timeout 3600 python experiments/raga/grid.py --model lenet --rounds 60 --eval-every 10 \
          --attacks gaussian --fractions 0 0.4 "$@"; }
case "${1:-all}" in
  a) run --methods raga rfa --out $R/lenet_r60_a.jsonl > $R/lenet_r60_a.log 2>&1 ;;
  b) run --methods fedavg byrdsaga --out $R/lenet_r60_b.jsonl > $R/lenet_r60_b.log 2>&1 ;;
  all) bash "$0" a & bash "$0" b; wait; cat $R/lenet_r60_a.jsonl $R/lenet_r60_b.jsonl > $R/lenet_r60.jsonl ;;
esac
