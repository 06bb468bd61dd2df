#!/usr/bin/env bash
# Issue 26's measurements on a two-GPU host, in the order they matter, each step under its own time limit so
# that a slow step leaves the others' JSON in $OUT. Times seen on 2x H200 (2026-11-27): an engine start
# 25-45 s, a Qwen3-30B-A3B layout 90-110 s with the 512 requests (416 s for all four, 10:26), a DeepSeek-V2-Lite
# or Llama-3.1-8B one-GPU layout ~60 s and a two-GPU one 76-99 s with 256 requests, the tiny-model check ~80 s
# a layout, the serving step (an offline engine, then the Serve app: ready after ~170 s) over 230 s. Run it
# as three device calls of under 10 minutes each: PART=1, PART=2, PART=3; prompt-step graphs against
# eager prompt steps: PART=prompt-check, PART=prompt-qwen3, PART=prompt-llama; the Qwen3 layouts with
# each rank's host stacks sampled: PART=diag-qwen3; issue 26's figures with the baselines run last and the
# compiles in timed steps reported: PART=clean-qwen3, PART=clean-rest.
# Needs Ray on PYTHONPATH (the README's offline bundle).
set -u
OUT=${OUT:-/tmp/multi_gpu_out}
PART=${PART:-1}
. "$(dirname "$0")/steps.sh"
M="python3 -m benchmarks.multi_gpu"
if [ "$PART" = 1 ]; then
  nvidia-smi --query-gpu=name,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
  run qwen3 470 $M --models qwen3-30b-a3b --out "$OUT/qwen3.json"
  run exchange 110 python3 -m benchmarks.ep_exchange_bench --out "$OUT/exchange.json"
elif [ "$PART" = 2 ]; then
  run deepseek 220 $M --models deepseek-v2-lite --num-requests 256 --out "$OUT/deepseek.json"
  run llama 200 $M --models llama-3.1-8b --num-requests 256 --out "$OUT/llama.json"
  run check 160 $M --check --out "$OUT/check.json"
elif [ "$PART" = prompt-check ]; then  # prompt-step graphs: the GPU tests, the tiny-model check, one step's profile
  nvidia-smi --query-gpu=name,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
  run gpu_tests 200 python3 -m pytest -q -x -p no:cacheprovider tests/engine/test_gpu.py -k "graph"
  run check 200 $M --check --layouts "1 GPU,TP=2,TP=2 + EP" --out "$OUT/check.json"
  run prefill_graphs 100 python3 -m benchmarks.profile_prefill --out "$OUT/prefill_graphs.json"
  run prefill_eager 100 python3 -m benchmarks.profile_prefill --prompt-graphs off --out "$OUT/prefill_eager.json"
elif [ "$PART" = prompt-qwen3 ]; then  # each layout with prompt-step graphs and without
  run qwen3 560 $M --models qwen3-30b-a3b --out "$OUT/qwen3.json" \
      --layouts "1 GPU,TP=2,TP=2 + EP,1 GPU (eager prompt steps),TP=2 (eager prompt steps)"
elif [ "$PART" = diag-qwen3 ]; then  # the unrun GPU tests, then the Qwen3 layouts with host stacks sampled
  nvidia-smi --query-gpu=name,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
  run gpu_tests 150 python3 -m pytest -q -p no:cacheprovider tests/engine/test_gpu.py \
      -k "verify_steps_replayed or graph_replay_gives_the_eager_tokens"
  run qwen3 420 $M --models qwen3-30b-a3b --out "$OUT/qwen3.json" --host-sample-hz 200 \
      --layouts "1 GPU,TP=2,TP=2 + EP"
elif [ "$PART" = ep-variants ]; then  # TP=2 + EP: as is (mixing off), with NCCL's graph mixing, one-shot exchanges to 8 MiB
  Q="$M --models qwen3-30b-a3b --host-sample-hz 50"
  run tp2ep 145 $Q --layouts "TP=2 + EP" --out "$OUT/tp2ep.json"
  NCCL_GRAPH_MIXING_SUPPORT=1 run tp2ep_mixing 145 $Q --layouts "TP=2 + EP" --out "$OUT/tp2ep_mixing.json"
  ATOM_RAY_SYMMETRIC_ALL_REDUCE_KIB=8192 run tp2ep_oneshot 145 $Q --layouts "TP=2 + EP" --out "$OUT/tp2ep_oneshot.json"
  run one_gpu 140 $Q --layouts "1 GPU" --out "$OUT/one_gpu.json"  # last: the first run pays the cold compile cache
elif [ "$PART" = no-mixing ]; then  # NCCL's graph mixing off (the default since): tokens, then the layouts
  run check 190 $M --check --layouts "1 GPU,TP=2 + EP,DP=2 + EP=2" --out "$OUT/check.json"
  run qwen3 385 $M --models qwen3-30b-a3b --layouts "1 GPU,TP=2,DP=2 + EP=2" --out "$OUT/qwen3.json"
elif [ "$PART" = clean-qwen3 ]; then  # issue 26's Qwen3 layouts, the baseline last, compiles reported
  run qwen3 480 $M --models qwen3-30b-a3b --out "$OUT/qwen3.json" --layouts "1 GPU,TP=2,TP=2 + EP,DP=2 + EP=2"
  run check 100 $M --check --layouts "1 GPU,DP=2 + EP=2" --out "$OUT/check.json"
elif [ "$PART" = clean-rest ]; then  # DeepSeek-V2-Lite and Llama-3.1-8B on the same 256 requests per layout
  run deepseek 250 $M --models deepseek-v2-lite --num-requests 256 --out "$OUT/deepseek.json"
  run llama 300 $M --models llama-3.1-8b --num-requests 256 --out "$OUT/llama.json" \
      --layouts "1 GPU,TP=2,1 GPU (prompt-step graphs),TP=2 (prompt-step graphs)"
elif [ "$PART" = prompt-llama ]; then
  run llama 400 $M --models llama-3.1-8b --num-requests 256 --out "$OUT/llama.json"
else
  run serving 560 python3 -m benchmarks.serving --model benchmarks/configs/qwen3-30b-a3b --levels 64 \
      --engine-args '{"data_parallel_size": 2, "enable_expert_parallel": true}' --out "$OUT/serving_dp2.json"
fi
grep -hE "^(qwen|llama|deep|model|-|c=64|check)" "$OUT"/*.log | cut -c1-300
