#!/usr/bin/env bash
# Issue 29's GPU measurement on one H100 or H200 (one device call, under 10 minutes; each step under its own
# limit so that a slow one leaves the others' results in $OUT): first the speculative-decoding GPU tests,
# then, at real shapes with dummy bf16 weights, speculation against none at batch 1 and 64:
# - DeepSeek-V2-Lite with an MTP layer (hf_overrides num_nextn_predict_layers=1): the cost at zero acceptance
#   (its own drafts) and the gain at recorded acceptance p = 0.6 / 0.8 with the MTP layer still drafting;
# - Llama-3.1-8B with a random EAGLE3-shaped head: the same.
# In float32: with dummy bf16 weights (2026-11-27 16:27, H200) a verify step's rounding flipped a near-tied argmax
# early in every run, after which the recorded continuation matched nothing (acceptance ~0, "same tokens: no").
# DeepSeek-V2-Lite in float32 is ~63 GB of weights: run this on an H200 (needs_h200), or on an H100 only the EAGLE3
# step.
set -u
OUT=${OUT:-/tmp/spec_decode_out}
. "$(dirname "$0")/steps.sh"
B="python3 -m benchmarks.spec_decode_bench --load-format dummy --dtype ${DTYPE:-float32} --workloads random"
nvidia-smi --query-gpu=name,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
run tests 120 python3 -m pytest -q tests/engine/test_spec_decode.py -k "emitted or distribution or negative"
run mtp 230 $B --model benchmarks/configs/deepseek-v2-lite --method mtp \
    --hf-overrides '{"num_nextn_predict_layers": 1}' --batch-sizes 1,64 --max-tokens 256 --out "$OUT/mtp.json"
run eagle3 230 $B --model benchmarks/configs/llama-3.1-8b --method eagle3 --eagle3-draft random \
    --batch-sizes 1,64 --max-tokens 256 --out "$OUT/eagle3.json"
grep -hE "passed|failed|error|^(random|workload|-)" "$OUT"/*.log | cut -c1-300
