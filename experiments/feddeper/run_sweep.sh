#!/usr/bin/env bash
# A first probe of FedDeper's gap to the paper (docs/results/feddeper.md): the m = 5 FedDeper run
# with one hyperparameter changed at a time, 150 rounds, compared with the base run at round 150.
set -u
cd "$(dirname "$0")/../.."
run() {  # name, extra arguments
  local name=$1; shift
  start=$(date +%s)
  OMP_NUM_THREADS=1 timeout 1800 fl-lightning fit --config configs/feddeper/mnist_mlp_n10_m5/feddeper.yaml \
    --trainer.max_epochs 150 --trainer.logger.init_args.version "sweep_$name" "$@" \
    > "experiments/feddeper/logs/sweep_$name.log" 2>&1
  printf '%s\t%s\t%s\t%s\n' mnist_mlp_n10_m5 "sweep_$name" "$(( $(date +%s) - start ))" "$?" >> experiments/feddeper/logs/wall_times.tsv
}
case "${1:-all}" in
  a) run rho0.1 --model.init_args.rho 0.1 ;;
  b) run batch32 --data.init_args.batch_size 32 ;;
  all) run rho0.1 --model.init_args.rho 0.1; run batch32 --data.init_args.batch_size 32 ;;
esac
