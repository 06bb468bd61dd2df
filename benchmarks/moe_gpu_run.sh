#!/usr/bin/env bash
# The MoE measurements of docs/BENCHMARKS.md in one device call (one H200): the expert op (Triton against
# the torch loop), offline throughput and batch-1 decode of the Qwen3-30B-A3B shape with dummy bf16
# weights against their rooflines, then transformers' continuous batching on the same first requests.
# Each step has its own time limit so that one slow step leaves the others' numbers in $OUT.
set -u
OUT=${OUT:-/tmp/moe_out}
MODEL=benchmarks/configs/qwen3-30b-a3b
SUBSET=${SUBSET:-64}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
run() {  # name, seconds, command...
  local name=$1 limit=$2; shift 2
  local start=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "$name rc=$? $(( $(date +%s) - start ))s" >> "$OUT/steps.txt"
}
run moe_op 100 python3 -m benchmarks.moe_bench --out "$OUT/moe_op.json"
run throughput 230 python3 -m benchmarks.gpu_perf throughput --model $MODEL --num-requests "$SUBSET" --out "$OUT/throughput.json"
run latency 110 python3 -m benchmarks.gpu_perf latency --model $MODEL --skip-hf --out "$OUT/latency.json"
run hf 130 python3 -m benchmarks.gpu_perf hf-throughput --model $MODEL --num-requests "$SUBSET" --out "$OUT/hf.json"
tail -n 40 "$OUT"/*.log | cut -c1-220
