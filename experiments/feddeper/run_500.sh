#!/usr/bin/env bash
# The 500-round MNIST-MLP (n=10) runs of docs/results/feddeper.md, one after the other, one thread each.
# CELL picks the Table I cell (default mnist_mlp_n10_m5; the m = 10 runs used CELL=mnist_mlp_n10_m10).
# FedDeper and FedAvg also log the local-test accuracy with 1 and 3 extra classes (Fig. 5b);
# SCAFFOLD, FedProx and FedDeper* were run the same way without those two callbacks
# (EXTRA_CALLBACKS=0 METHODS="scaffold fedprox feddeper_star" bash experiments/feddeper/run_500.sh).
# Metrics: experiments/feddeper/runs/$CELL/<method>_500/metrics.csv.
set -u
cd "$(dirname "$0")/../.."
mkdir -p experiments/feddeper/logs
CELL=${CELL:-mnist_mlp_n10_m5}
PA=fl_lightning.callbacks.personalized.PersonalizedAccuracy
EXTRA=""
if [ "${EXTRA_CALLBACKS:-1}" = 1 ]; then
  EXTRA="--trainer.callbacks+=$PA --trainer.callbacks.extra_classes=1 --trainer.callbacks+=$PA --trainer.callbacks.extra_classes=3"
fi
for method in ${METHODS:-feddeper fedavg}; do
  start=$(date +%s)
  timeout "${TIMEOUT:-2700}" env OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 fl-lightning fit \
    --config configs/feddeper/$CELL/$method.yaml --trainer.logger.init_args.version ${method}_500 $EXTRA \
    > experiments/feddeper/logs/${CELL}_${method}_500.log 2>&1
  rc=$?
  printf '%s\t%s\t%s\t%s\n' $CELL ${method}_500 "$(( $(date +%s) - start ))" "$rc" >> experiments/feddeper/logs/wall_times.tsv
done
