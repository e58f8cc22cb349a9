#!/usr/bin/env bash
# The paper's full MNIST-MLP run on one GPU (docs/results/raga.md): 1000 rounds of the T = 1000
# schedule, the Gaussian attack at every fraction, the four methods: 20 processes at once on the
# one GPU (about 0.55 s per round alone on an H100). Each process prints its curve as it goes
# ("curve <round> <accuracy> <loss>"), so a run cut short still leaves its curve in the log.
#   MNIST_ROOT=<dir holding MNIST/raw> bash experiments/raga/run_mnist_mlp_gpu.sh
set -u
cd "$(dirname "$0")/../.."
ROOT=${MNIST_ROOT:-../shared/data}
ROUNDS=${ROUNDS:-1000}
R=experiments/raga/results/mlp_gpu_r$ROUNDS
mkdir -p "$R"
for method in raga fedavg rfa byrdsaga; do
  for fraction in 0 0.1 0.2 0.3 0.4; do
    PYTHONPATH=. python experiments/raga/grid.py --model mlp --rounds "$ROUNDS" --eval-every 20 --accelerator gpu \
      --root "$ROOT" --methods "$method" --attacks gaussian --fractions "$fraction" \
      --out "$R/${method}_$fraction.jsonl" > "$R/${method}_$fraction.log" 2>&1 &
  done
done
wait
cat "$R"/*.jsonl > "$R.jsonl"
python experiments/raga/report.py "$R.jsonl"
