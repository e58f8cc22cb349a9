#!/usr/bin/env bash
# FedDeper's gap to the paper (docs/results/feddeper.md): the FedDeper config of a Table I cell
# (or METHOD's, e.g. METHOD=fedavg) with one or two hyperparameters changed, compared with the
# base run at the same rounds.
#   bash experiments/feddeper/run_sweep.sh probe           # the first probe (m = 5, 150 rounds)
#   CELL=mnist_mlp_n10_m5 ROUNDS=500 bash experiments/feddeper/run_sweep.sh one NAME --model.init_args.rho 0.01 ...
set -u
cd "$(dirname "$0")/../.."
CELL=${CELL:-mnist_mlp_n10_m5}
ROUNDS=${ROUNDS:-150}
run() {  # name, extra arguments
  local name=$1; shift
  start=$(date +%s)
  OMP_NUM_THREADS=1 timeout 3600 fl-lightning fit --config "configs/feddeper/$CELL/${METHOD:-feddeper}.yaml" \
    --trainer.max_epochs "$ROUNDS" --trainer.logger.init_args.version "sweep_$name" "$@" \
    > "experiments/feddeper/logs/${CELL}_sweep_$name.log" 2>&1
  printf '%s\t%s\t%s\t%s\n' "$CELL" "sweep_$name" "$(( $(date +%s) - start ))" "$?" >> experiments/feddeper/logs/wall_times.tsv
}
case "${1:-probe}" in
  probe) run rho0.1 --model.init_args.rho 0.1; run batch32 --data.init_args.batch_size 32 ;;
  one) shift; run "$@" ;;
esac
