#!/usr/bin/env bash
# The GPU checks of docs/performance.md ("On a GPU"), in one command on a machine with
# a CUDA device: the tests that need one, the frameworks benchmark's GPU run, and RAGA's paper config
# through `fl-lightning fit`. Each stage runs under its own time limit (a stage that overruns is cut,
# the next one still runs), prints the end of its output and writes everything under OUT_DIR:
#   env.txt              the card, the driver and the packages
#   gpu_check.log        every stage's output
#   frameworks.json      benchmarks/frameworks.py --accelerator gpu, workloads a b100 c
#   frameworks_1000.json the same for the 1,000-client workloads a1000 b1000
#   cli_rounds.json      benchmarks/cli_rounds.py, RAGA's configs/raga/mnist_mlp.yaml, batched, eager and compiled
#   parts_<w>.json       benchmarks/round_parts.py: where a round of workload w goes, part by part (the
#                        `parts` stage: b100 and b1000 compiled, a1000 eager)
#   block_memory.json    benchmarks/block_memory.py --accelerator gpu: a block's client measured against
#                        the default block's estimate (the `memory` stage, 20 s on the CPU)
#   finetuning_<m>.json  benchmarks/finetuning.py --accelerator gpu: 1,000 clients finetuned 20 steps one
#                        after another and in batched blocks, model m (mlp, lenet; the `finetune` stage)
#
#   bash benchmarks/gpu_check.sh OUT_DIR MNIST_ROOT [STAGE=SECONDS ...]
#
# Stages (default: tests=120 frameworks=230 cli=160, 8.5 min, under a 10-minute call). On an H200,
# tests took 96 s, frameworks 202 s; cli's eager pair of runs 51 s, its compiled pair over 60 s (the
# 10-round run alone 41-48 s). Others run when named, in a second call: `many=160` (the 1,000-client
# workloads, 145 s), `parts=60` (each of its three runs under 60 s), `memory=60`, `finetune=120` (each model's run). A stage may name its subset after
# a colon: frameworks:b100 (those workloads, into frameworks_b100.json), cli:compiled (the compiled
# variant alone), parts:a1000:eager. MNIST_ROOT holds MNIST/raw (the four idx files). Needs the
# project importable (PYTHONPATH) and jsonargparse for the CLI.
set -u
out=${1:?OUT_DIR}
mnist=${2:?MNIST_ROOT}
shift 2
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(tests=120 frameworks=230 cli=160)
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
log="$out/gpu_check.log"

{
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  python3 -c "import torch, pytorch_lightning, torchmetrics; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'lightning', pytorch_lightning.__version__, 'torchmetrics', torchmetrics.__version__)"
  nproc
  git log -1 --format='commit %H' 2>/dev/null || true
} > "$out/env.txt" 2>&1
cat "$out/env.txt"

run_stage() {  # name limit command...
  local name=$1 limit=$2
  shift 2
  local start=$SECONDS
  echo "== $name (limit ${limit} s): $*" | tee -a "$log"
  timeout -k 5 "$limit" "$@" >> "$log" 2>&1
  local rc=$?
  echo "== $name: rc $rc after $((SECONDS - start)) s" | tee -a "$log"
}

for stage in "${stages[@]}"; do
  name=${stage%%=*}
  limit=${stage#*=}
  subset=
  [[ $name == *:* ]] && subset=${name#*:} && name=${name%%:*}
  case $name in
    tests)
      run_stage tests "$limit" python3 -m pytest -q -rfEs -p no:cacheprovider -n 4 \
        tests/test_gpu.py tests/test_gpu_batched.py tests/test_pool_on_device.py tests/test_precision.py \
        tests/test_compile_step.py
      grep -E "passed|failed|FAILED|ERROR" "$log" | tail -n 20 ;;
    frameworks)
      run_stage frameworks "$limit" python3 benchmarks/frameworks.py --accelerator gpu --compile-step --repeats 2 \
        --workloads ${subset:-a b100 c} --mnist "$mnist" --out "$out/frameworks${subset:+_${subset// /_}}.json"
      grep -E "ms/round|FAILED|TFLOP/s \(" "$log" | tail -n 40 ;;
    many)
      run_stage many "$limit" python3 benchmarks/frameworks.py --accelerator gpu --compile-step --repeats 1 \
        --workloads a1000 b1000 --mnist "$mnist" --out "$out/frameworks_1000.json"
      grep -E "ms/round|FAILED" "$log" | tail -n 16 ;;
    cli)
      eager=("--variant" "batched=--model.init_args.client_backend batched")
      [ "$subset" = compiled ] && eager=()
      run_stage cli "$limit" python3 benchmarks/cli_rounds.py --config configs/raga/mnist_mlp.yaml \
        --rounds 10 110 --target 1000 --extra "--data.init_args.root $mnist" "${eager[@]}" \
        --variant "batched, compiled step=--model.init_args.client_backend batched --model.init_args.compile_step true" \
        --out "$out/cli_rounds${subset:+_$subset}.json"
      grep -E "ms/round|FAILED|rounds:" "$log" | tail -n 12 ;;
    parts)
      for spec in ${subset:-b100:compiled a1000:eager b1000:compiled}; do
        workload=${spec%%:*}
        compiled=()
        [ "${spec#*:}" = compiled ] && compiled=(--compile-step)
        run_stage "parts $spec" "$limit" python3 benchmarks/round_parts.py --accelerator gpu --workload "$workload" \
          "${compiled[@]}" --mnist "$mnist" --out "$out/parts_$workload.json"
      done
      grep -A9 -E "^(a|b|c)[0-9]*, block" "$log" | tail -n 30 ;;
    memory)
      run_stage memory "$limit" python3 benchmarks/block_memory.py --accelerator gpu --out "$out/block_memory.json"
      grep -A3 -E "^workload" "$log" | tail -n 4 ;;
    finetune)
      for model in ${subset:-mlp lenet}; do
        run_stage "finetune $model" "$limit" python3 benchmarks/finetuning.py --accelerator gpu --model "$model" \
          --clients 1000 --steps 20 --repeats 1 --mnist "$mnist" --out "$out/finetuning_$model.json"
      done
      grep -A3 -E "^(MNIST|random).*clients x" "$log" | tail -n 8 ;;
    *)
      echo "unknown stage $name (tests, frameworks, cli, many, parts, memory, finetune)" | tee -a "$log" ;;
  esac
done
