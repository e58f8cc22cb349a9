#!/usr/bin/env bash
# The mu study (paper Fig. 4) at the paper's federation size: Synthetic(0, 0), logistic
# regression, 100 clients with lognormal sizes, all clients every round, tau = 20, B = 1,
# eta = 0.3, mu in {0, 1, 4} for SVRG and SARAH and FedAvg beside them, ROUNDS rounds (the
# paper: 400; docs/results/fedproxvr.md has 100, evaluated every 5 rounds, and 400, every 10),
# 3 seeds; two 1-thread processes (FedAvg and SVRG | SARAH), which report.py merges.
#   ROUNDS=400 EVERY=10 bash experiments/fedproxvr/run_mu_full.sh [a|b|all]
set -u
cd "$(dirname "$0")/../.."
R=experiments/fedproxvr/results
L=experiments/fedproxvr/logs
mkdir -p "$R" "$L"
ROUNDS=${ROUNDS:-100}
EVERY=${EVERY:-5}
N=mu_n100_r$ROUNDS
run() { OMP_NUM_THREADS=1 timeout 7200 python experiments/fedproxvr/run.py mu --rounds "$ROUNDS" --eval-every "$EVERY" --seeds 0 1 2 "$@"; }
case "${1:-all}" in
  a) run --only FedAvg "FedProxVR (SVRG) mu=0" "FedProxVR (SVRG) mu=1" "FedProxVR (SVRG) mu=4" \
       --out $R/$N.json > $L/$N.log 2>&1 ;;
  b) run --only "FedProxVR (SARAH) mu=0" "FedProxVR (SARAH) mu=1" "FedProxVR (SARAH) mu=4" \
       --out $R/${N}_sarah.json > $L/${N}_sarah.log 2>&1 ;;
  all) bash "$0" a & bash "$0" b; wait
       python experiments/fedproxvr/report.py $R/$N.json $R/${N}_sarah.json ;;
esac
