#!/usr/bin/env bash
# Runs the MNIST analogue of PeFLL's Table 1 sequentially (one process at a time, 1 thread):
#   ROUNDS=40 nohup bash experiments/pefll/run_all.sh > experiments/pefll/logs/run_all.log 2>&1 &
# Each run writes experiments/pefll/results/<method>_s<seed>.json and logs/<method>_s<seed>.log;
# runs whose result exists are skipped. RUNS lists method:seed pairs in the order to run them.
set -u
cd "$(dirname "$0")/../.."
mkdir -p experiments/pefll/results experiments/pefll/logs
ROUNDS=${ROUNDS:-40}
RUNS=${RUNS:-"pefll:0 fedavg:0 local:0 pfedhn:0 pefll:1 fedavg:1 local:1 pefll:2 fedavg:2 local:2 pfedhn:1 pfedhn:2"}
COMMON="--rounds $ROUNDS --clients_per_round 5 --local_steps 10 --eval_every 20 --client_lr 0.01"
for run in $RUNS; do
  method=${run%%:*}; seed=${run##*:}
  out=experiments/pefll/results/${method}_s${seed}.json
  [ -f "$out" ] && continue
  extra=""
  [ "$method" = local ] && extra="--local_steps 50"
  echo "$(date -u +%T) start $method seed $seed"
  timeout 1500 python experiments/pefll/mnist_table1.py --method "$method" --seed "$seed" $COMMON $extra \
    --out "$out" > "experiments/pefll/logs/${method}_s${seed}.log" 2>&1
  echo "$(date -u +%T) end $method seed $seed rc=$?"
done
