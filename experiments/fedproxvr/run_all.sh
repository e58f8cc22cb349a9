#!/usr/bin/env bash
# The scaled-down runs reported in docs/results/fedproxvr.md (one process at a time, 1 thread each).
# Run from the repository root:  bash experiments/fedproxvr/run_all.sh
set -u
R=experiments/fedproxvr/results
L=experiments/fedproxvr/logs
mkdir -p "$R" "$L"
# mu study (Fig. 4): Synthetic(0,0), 20 clients (paper: 100), 25 rounds (paper: 400), tau=20, B=1, eta=0.3.
timeout 2400 python experiments/fedproxvr/run.py mu --rounds 25 --seeds 0 1 2 \
  --set data.init_args.num_clients=20 --set model.init_args.clients_per_round=20 --out $R/mu.json > $L/mu.log 2>&1
# Table 2: MNIST CNN, 10 clients, 3% of the images (paper: ~30%), tau=10 (paper: 20), B=16 for all, 5 rounds (paper: ~1000).
timeout 2400 python experiments/fedproxvr/run.py table2 --rounds 5 --seeds 0 1 2 \
  --set data.init_args.used_fraction=0.03 --set model.init_args.local_steps=10 --set data.init_args.batch_size=16 \
  --out $R/table2.json > $L/table2.log 2>&1
# Table 1 with MNIST for Fashion-MNIST: logistic regression, 100 clients, paper's tau/beta/mu/B, 6 rounds (paper: ~1000).
timeout 1500 python experiments/fedproxvr/run.py table1 --rounds 6 --seeds 0 1 2 --out $R/table1.json > $L/table1.log 2>&1
# Diagnostic: FedProxVR-SARAH on Table 2's CNN with a smaller step (beta=20, eta=0.025), 2 seeds.
timeout 900 python experiments/fedproxvr/run.py table2 --rounds 5 --seeds 0 1 --only "FedProxVR (SARAH)" \
  --set data.init_args.used_fraction=0.03 --set model.init_args.local_steps=10 --set data.init_args.batch_size=16 \
  --set model.init_args.beta=20 --out $R/table2_sarah_beta20.json > $L/table2_sarah_beta20.log 2>&1
# The SARAH mu = 1 arm of the mu study (a later session; report.py merges it with mu.json).
timeout 1200 python experiments/fedproxvr/run.py mu --rounds 25 --seeds 0 1 2 --only "FedProxVR (SARAH) mu=1" \
  --set data.init_args.num_clients=20 --set model.init_args.clients_per_round=20 --out $R/mu_sarah1.json > $L/mu_sarah1.log 2>&1
