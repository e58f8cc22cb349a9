#!/usr/bin/env bash
# Run Table I cells of FedDeper one after the other, one thread, each under a wall-clock bound.
#   bash experiments/feddeper/run_table1.sh mnist_mlp_n10_m5 mnist_mlp_n10_m10
# Logs: experiments/feddeper/logs/<setting>_<method>.log; metrics: experiments/feddeper/runs/<setting>/<method>/metrics.csv;
# wall times: experiments/feddeper/logs/wall_times.tsv.
set -u
cd "$(dirname "$0")/../.."
mkdir -p experiments/feddeper/logs
METHODS=${METHODS:-"feddeper fedavg scaffold fedprox feddeper_star"}
for setting in "$@"; do
  for method in $METHODS; do
    start=$(date +%s)
    timeout "${TIMEOUT:-1500}" env OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 fl-lightning fit \
      --config "configs/feddeper/$setting/$method.yaml" ${EXTRA_ARGS:-} > "experiments/feddeper/logs/${setting}_${method}.log" 2>&1
    rc=$?
    printf '%s\t%s\t%s\t%s\n' "$setting" "$method" "$(( $(date +%s) - start ))" "$rc" >> experiments/feddeper/logs/wall_times.tsv
  done
done
