#!/usr/bin/env bash
# Every MNIST-ST run of docs/results/feddro.md, in the order they were run (one process at a time):
#   nohup bash experiments/feddro/run_all.sh > experiments/feddro/run_all.log 2>&1 &
#   python experiments/feddro/summarize.py --sweep-lam 5
# LeNet, 8 clients (equal random split of MNIST-ST), batch 16, I = 8, 50 rounds = 400 local steps.
set -u
cd "$(dirname "$0")/../.."
run() {
  timeout 1500 python experiments/feddro/mnist_st.py --out experiments/feddro/results.jsonl "$@" 2>&1 \
    | grep -E "^(fedavg|compfedavg|feddro) |Error|error"
}
main() { run --local-steps 8 --rounds 50 --eval-every 5 "$@"; }
# 1. the three algorithms at a common setting (lr 0.05, lambda 2, beta 0.5), seeds 0 and 1
for seed in 0 1; do
  for alg in fedavg compfedavg feddro; do main --algorithm $alg --seed $seed --lam 2 --beta 0.5 --lr 0.05; done
done
# 2. FedDRO was unstable there: a small tuning on seed 0 (lr, beta, lambda)
main --algorithm feddro --seed 0 --lam 2 --beta 0.5 --lr 0.02
main --algorithm feddro --seed 0 --lam 2 --beta 1.0 --lr 0.05
main --algorithm feddro --seed 0 --lam 5 --beta 0.5 --lr 0.05
# 3. seed 2 of the common setting
for alg in fedavg compfedavg feddro; do main --algorithm $alg --seed 2 --lam 2 --beta 0.5 --lr 0.05; done
# 4. the stable FedDRO setting (lambda 5) on seeds 1, 2
for seed in 1 2; do main --algorithm feddro --seed $seed --lam 5 --beta 0.5 --lr 0.05; done
# 5. FedDRO I sweep at 25 model-averaging rounds (I = 8 is read from step 4's runs at round 25)
for I in 1 2 4 16; do
  run --algorithm feddro --seed 0 --local-steps $I --rounds 25 --eval-every 5 --lam 5 --beta 0.5 --lr 0.05
done
# 6. the vanilla compositional baseline at lambda 5 (same objective as the stable FedDRO)
for seed in 0 1 2; do main --algorithm compfedavg --seed $seed --lam 5 --lr 0.05; done
echo done
