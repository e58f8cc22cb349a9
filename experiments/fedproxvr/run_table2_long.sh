#!/usr/bin/env bash
# The 50-round Table 2 runs of docs/results/fedproxvr.md: MNIST, the paper's CNN, 10 clients,
# 3 % of the images, tau = 10, B = 16 (as the 5-round runs), 3 seeds, evaluation every 2 rounds,
# two processes of 1 thread (FedAvg and SVRG | SARAH); report.py merges the two result files.
#   bash experiments/fedproxvr/run_table2_long.sh [fedavg_svrg|sarah|all]
set -u
cd "$(dirname "$0")/../.."
R=experiments/fedproxvr/results
L=experiments/fedproxvr/logs
mkdir -p "$R" "$L"
run() {
  timeout 5400 python experiments/fedproxvr/run.py table2 --rounds 50 --eval-every 2 --seeds 0 1 2 \
    --set data.init_args.used_fraction=0.03 --set model.init_args.local_steps=10 --set data.init_args.batch_size=16 "$@"
}
case "${1:-all}" in
  fedavg_svrg) run --only FedAvg "FedProxVR (SVRG)" --out $R/table2_r50.json > $L/table2_r50.log 2>&1 ;;
  sarah) run --only "FedProxVR (SARAH)" --out $R/table2_r50_sarah.json > $L/table2_r50_sarah.log 2>&1 ;;
  all) bash "$0" fedavg_svrg & bash "$0" sarah; wait
       python experiments/fedproxvr/report.py $R/table2_r50.json $R/table2_r50_sarah.json ;;
esac
