#!/usr/bin/env bash
# Issue 30's whole-node measurements (benchmarks/node_scaling.py) on the GPUs of this host (8, else 4),
# each step under its own time limit so that a slow step leaves the others' JSON in $OUT. PART names one
# step, or several separated by commas for one device call when their limits add up to less than its ten
# minutes:
#   moe-qwen3         Qwen3-235B-A22B, DP=n + EP=n against TP=n            (limit 540 s)
#   moe-deepseek      DeepSeek-V3 (MLA, bf16), DP=n + EP=n against TP=n     (limit 540 s)
#   moe-deepseek-fp8  DeepSeek-V3 with FP8 128x128 block weights, the same  (limit 540 s)
#   dense-70b         Llama-3.1-70B at TP=n (and TP=4), decode vs roofline  (limit 330 s)
#   dense-8b          Llama-3.1-8B at TP=1, 2, 4, 8                         (limit 360 s)
#   serving           the whole-node TP serve config under `serve run`, against the same engine offline
#                     at concurrency 64 and 256                             (limit 540 s)
# Times are estimates from issue 26's two-GPU runs, not yet measured at these sizes (node_scaling.py's
# docstring). LIMIT overrides the step's limit, REQUESTS its request count. `python3 -m benchmarks.node_scaling
# --part moe --dry-run` prints what a part runs (layer counts, layouts) without a GPU.
# Needs Ray on PYTHONPATH (the README's offline bundle).
set -u
OUT=${OUT:-/tmp/node_scaling_out}
PART=${PART:-moe-qwen3}
. "$(dirname "$0")/steps.sh"
S="python3 -m benchmarks.node_scaling"
nvidia-smi --query-gpu=name,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
for step in ${PART//,/ }; do
  case "$step" in
    moe-qwen3)        args="--part moe --models qwen3-235b-a22b"; limit=540 ;;
    moe-deepseek)     args="--part moe --models deepseek-v3"; limit=540 ;;
    moe-deepseek-fp8) args="--part moe --models deepseek-v3-fp8"; limit=540 ;;
    dense-70b)        args="--part dense --models llama-3.1-70b"; limit=330 ;;
    dense-8b)         args="--part dense --models llama-3.1-8b"; limit=360 ;;
    serving)          args="--part serving"; limit=540 ;;
    *) echo "unknown PART step $step (moe-qwen3, moe-deepseek, moe-deepseek-fp8, dense-70b, dense-8b, serving)"
       exit 2 ;;
  esac
  run "$step" "${LIMIT:-$limit}" $S $args ${REQUESTS:+--num-requests $REQUESTS} --out "$OUT/$step.json"
done
grep -hE "^(20[0-9][0-9]-|[0-9]+ GPU|qwen|deepseek|llama|model|shape|target|DP=|TP=|serving|offline c|HTTP c|-)" \
  "$OUT"/*.log | cut -c1-300
