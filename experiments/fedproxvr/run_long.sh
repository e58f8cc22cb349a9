#!/usr/bin/env bash
# The 100-round Table 1 runs of docs/results/fedproxvr.md (MNIST for Fashion-MNIST, logistic
# regression, 100 clients, the paper's rows), 3 seeds, evaluation every 5 rounds, two processes
# of 1 thread (FedAvg and SVRG | SARAH); report.py merges the two result files.
#   bash experiments/fedproxvr/run_long.sh
set -u
cd "$(dirname "$0")/../.."
R=experiments/fedproxvr/results
L=experiments/fedproxvr/logs
mkdir -p "$R" "$L"
run() { timeout 7200 python experiments/fedproxvr/run.py table1 --rounds 100 --eval-every 5 --seeds 0 1 2 "$@"; }
run --only FedAvg "FedProxVR (SVRG)" --out $R/table1_r100.json > $L/table1_r100.log 2>&1 &
run --only "FedProxVR (SARAH)" --out $R/table1_r100_sarah.json > $L/table1_r100_sarah.log 2>&1
wait
python experiments/fedproxvr/report.py $R/table1_r100.json $R/table1_r100_sarah.json
