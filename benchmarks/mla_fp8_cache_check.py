"""DeepSeek-V2-Lite (dummy bf16 weights) greedy tokens with a bf16 and with an FP8 latent cache, one cache kind per
process: `PYTHONPATH=. python -m benchmarks.mla_fp8_cache_check auto|fp8 OUT.json` on a GPU. With random weights
the logits are near ties, so this checks that the FP8 path runs (graphs captured), not its accuracy."""
import json, sys
from engine import LLM, SamplingParams
kind, out = sys.argv[1], sys.argv[2]
llm = LLM("benchmarks/configs/deepseek-v2-lite", load_format="dummy", dtype="bfloat16", max_model_len=2048,
          max_num_seqs=8, kv_cache_dtype=kind, show_progress=False)
prompts = [list(range(100, 400)), list(range(1000, 1100)), [5, 6, 7] * 50]
outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
stats = llm.engine.stats()
json.dump({"tokens": [o.token_ids for o in outs], "num_kv_blocks": stats["num_kv_blocks"],
           "graphs": llm.engine.executor.runner.graphs is not None}, open(out, "w"))
print(kind, stats["num_kv_blocks"], "graphs", llm.engine.executor.runner.graphs is not None)
