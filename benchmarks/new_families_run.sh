#!/usr/bin/env bash
# Issue 27's GPU checks and measurements on one H100 or H200, each step under its own time limit so that a
# slow step leaves the others' results in $OUT. Two device calls of under 10 minutes: PART=1, PART=2.
# PART=1 wants flash-linear-attention's wheel carried (`carry: [".whl-fla"]`, see benchmarks/gdn_check.py).
set -u
OUT=${OUT:-/tmp/new_families_out}
PART=${PART:-1}
. "$(dirname "$0")/steps.sh"
N="python3 -m benchmarks.new_families"
if [ "$PART" = 1 ]; then
  nvidia-smi --query-gpu=name,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
  # Correctness first: the new attention options, gpt-oss experts, decode graphs of two cache groups.
  run kernels 150 python3 -m pytest -q tests/engine/kernels/test_triton_attention_options.py \
      tests/engine/kernels/test_triton_gpt_oss_experts.py tests/engine/kernels/test_triton_norms.py \
      tests/engine/test_gpu.py -k "options or gpt_oss or norm or two_cache_groups"
  if ls .whl-fla/*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/fla .whl-fla/*.whl
    PYTHONPATH=$PWD:/tmp/fla run gdn 150 python3 -m pytest -q -rs tests/engine/kernels/test_triton_gdn.py
    PYTHONPATH=$PWD:/tmp/fla run gdn_check 90 python3 -m benchmarks.gdn_check --out "$OUT/gdn.json"
  fi
  run window 60 $N window --out "$OUT/window.json"
  run latency 150 $N latency --models gpt-oss-20b,gemma-4-26b-a4b --skip-hf --out "$OUT/latency.json"
else
  run throughput 560 $N throughput --models gpt-oss-20b,qwen3.5-35b-a3b --num-requests 64 --out "$OUT/throughput.json"
fi
grep -hE "passed|failed|error|^(gpt|gemma|qwen|decode|offline|-)" "$OUT"/*.log | cut -c1-300
