#!/usr/bin/env bash
# A paper's sweep on a lent GPU machine in one call: its runs under a time limit (each run stops at its
# first evaluation after it and is recorded as stopped, see experiments/sweep.py), the result file,
# the slots' logs and the GPU's utilization under OUT_DIR:
#
#   FL_LIGHTNING_COMMIT=<commit> bash experiments/gpu_sweep.sh OUT_DIR PAPER SECONDS JOBS PATTERN...
#
#   env.txt          the card, the packages, the commit
#   <paper>.json     the runs (experiments/results.py): docs/results/<paper>.json's, whose runs are not run
#                    again, and this call's; merged into that file with experiments.sweep.merge_parts
#   sweep.log        the sweep's output and the last 40 lines of each slot's log (its runs' output)
#   gpu_util.csv     nvidia-smi's utilization and memory every 5 s
#
# The copy of the tree on that machine has no git history: FL_LIGHTNING_COMMIT names the clean commit it
# is. MNIST's idx files are read from data/MNIST/raw (a copy carried with the tree) through ../shared/data,
# the configs' root; wheels of packages the machine lacks (jsonargparse and its needs) from .whl.
# BACKEND=batched (or sequential) runs every client on that backend (experiments/sweep.py --backend).
set -u
out=${1:?OUT_DIR}
paper=${2:?PAPER}
limit=${3:?SECONDS}
jobs=${4:?JOBS}
shift 4
[ $# -gt 0 ] || { echo "give the runs' name patterns" >&2; exit 2; }
: "${FL_LIGHTNING_COMMIT:?the commit this copy of the tree is}"
mkdir -p "$out"
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
  export PYTHONPATH=/tmp/site
fi
[ -e ../shared/data ] || { mkdir -p ../shared && ln -s "$PWD/data" ../shared/data; }
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, pytorch_lightning, jsonargparse; print('torch', torch.__version__, 'lightning', pytorch_lightning.__version__, 'jsonargparse', jsonargparse.__version__)"
  echo "commit $FL_LIGHTNING_COMMIT, $(nproc) cores"
} > "$out/env.txt" 2>&1
cat "$out/env.txt"
nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv -l 5 > "$out/gpu_util.csv" 2>&1 &
sampler=$!
# a folder of this call's own: a warm machine keeps an earlier call's part logs (a stopped run resumes from
# its checkpoint under runs/, which stays)
work=$(mktemp -d /tmp/gpu_sweep.XXXXXX)
[ -e "docs/results/$paper.json" ] && cp "docs/results/$paper.json" "$work/$paper.json"
python3 -m experiments.sweep "$paper" --only "$@" --jobs "$jobs" --time-limit "$limit" ${BACKEND:+--backend "$BACKEND"} \
  --out "$work/$paper.json" \
  > "$out/sweep.log" 2>&1
echo "sweep: rc $?" >> "$out/sweep.log"
kill "$sampler" 2>/dev/null
for log in "$work"/*.log; do
  [ -e "$log" ] && { echo "== $log"; tail -n 40 "$log"; } >> "$out/sweep.log"
done
cp "$work/$paper.json" "$out/" 2>/dev/null
tail -n 5 "$out/sweep.log"
