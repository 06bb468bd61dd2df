#!/usr/bin/env bash
# Several issues' GPU measurements side by side on one host of four GPUs, in one device call: each job is
# pinned to its own GPUs (CUDA_VISIBLE_DEVICES) and writes into its own folder under $OUT; at the end every
# folder goes into $OUT/results.tar.gz (the device tool brings back at most 8 files). The jobs share the host's
# CPUs (64 cores on the four-GPU kinds), nothing else; each figure's baseline runs in the same job.
#   GPUs 0,1: issue 26, the Qwen3-30B-A3B one-GPU / TP=2 / TP=2 + EP layouts with each rank's kernels traced
#             over 30 full-batch steps of the offline run, then Llama-3.1-8B one GPU / TP=2 (256 requests);
#   GPU 2:    issue 29, benchmarks/spec_decode_run.sh;
#   GPU 3:    issue 28, the structured-output benchmark (SmolLM2's config and tokenizer, dummy weights), then
#             issue 27's PART=1 checks without the FLA step (attention options, window, latency).
# Needs Ray on PYTHONPATH (the offline bundle) for the GPUs 0,1 job.
set -u
ROOT=${OUT:-/tmp/side_by_side_out}
mkdir -p "$ROOT"
HERE=$(cd "$(dirname "$0")" && pwd)
nvidia-smi --query-gpu=name,memory.total --format=csv > "$ROOT/gpu.txt" 2>&1
(
  export CUDA_VISIBLE_DEVICES=0,1 OUT=$ROOT/multi_gpu
  . "$HERE/steps.sh"
  M="python3 -m benchmarks.multi_gpu --kernel-profile-steps 30"
  run qwen3 390 $M --models qwen3-30b-a3b --layouts "1 GPU,TP=2,TP=2 + EP" --out "$OUT/qwen3.json"
  run llama 170 $M --models llama-3.1-8b --num-requests 256 --out "$OUT/llama.json"
) &
(
  export CUDA_VISIBLE_DEVICES=2 OUT=$ROOT/spec_decode
  bash "$HERE/spec_decode_run.sh" > /dev/null 2>&1
) &
(
  export CUDA_VISIBLE_DEVICES=3 OUT=$ROOT/agentic
  . "$HERE/steps.sh"
  run structured 200 python3 -m benchmarks.structured_output_bench --model benchmarks/configs/smollm2-135m \
      --load-format dummy --dtype bfloat16 --out "$OUT/structured.json"
  OUT=$ROOT/new_families PART=1 bash "$HERE/new_families_run.sh" > /dev/null 2>&1
) &
wait
tar -czf "$ROOT/results.tar.gz" -C "$ROOT" multi_gpu spec_decode agentic new_families 2>/dev/null
for f in "$ROOT"/*/steps.txt; do echo "== $f"; cat "$f"; done
tail -n 45 "$ROOT"/multi_gpu/qwen3.log | cut -c1-200
