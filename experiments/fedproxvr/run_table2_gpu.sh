#!/usr/bin/env bash
# Table 2 at the paper's data size on one GPU (docs/results/fedproxvr.md, section 2c): MNIST, the
# paper's CNN, 10 clients, 30 % of the images (clients of 125 to 2,868 training images), the
# paper's rows as configured (tau = 20; FedAvg beta 10 B 16; SVRG beta 10 mu 0.01 B 16; SARAH
# beta 9 mu 0.01 B 32), 300 rounds, 3 seeds: 9 processes at once on the one GPU (about 1.2 s per
# SVRG round alone on an H100), then the tables of report.py.
#   MNIST_ROOT=<dir holding MNIST/raw> bash experiments/fedproxvr/run_table2_gpu.sh
set -u
cd "$(dirname "$0")/../.."
ROOT=${MNIST_ROOT:-../shared/data}
ROUNDS=${ROUNDS:-300}
R=experiments/fedproxvr/results
L=experiments/fedproxvr/logs
mkdir -p "$R" "$L"
outs=()
for label in FedAvg "FedProxVR (SVRG)" "FedProxVR (SARAH)"; do
  tag=$(echo "$label" | tr -cd '[:alnum:]' | tr '[:upper:]' '[:lower:]')
  for seed in 0 1 2; do
    out=$R/table2_gpu_r${ROUNDS}_${tag}_s$seed.json
    outs+=("$out")
    python experiments/fedproxvr/run.py table2 --rounds "$ROUNDS" --eval-every 10 --seeds "$seed" --only "$label" \
      --set "data.init_args.root=$ROOT" --set data.init_args.used_fraction=0.3 --out "$out" \
      > "$L/table2_gpu_r${ROUNDS}_${tag}_s$seed.log" 2>&1 &
  done
done
wait
python experiments/fedproxvr/report.py "${outs[@]}"
