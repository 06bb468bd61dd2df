"""Speculative decoding (issue 29): output throughput with drafts against the same engine without, in one call.

Workloads (greedy; each request generates as many tokens as without speculation, so only the step count moves):
- copy: answers that copy their prompt (a list written out again, a module repeated): n-gram lookup's case;
- chat: ordinary chat prompts, where n-gram lookup rarely finds a match (its cost when it does not pay).

Drafters:
- off: no speculation (the baseline of every ratio);
- ngram: prompt lookup (num_speculative_tokens, adaptive as configured);
- recorded p: a benchmark-only drafter that proposes the target's own greedy continuation (recorded in the off
  run), each draft token right with probability p and otherwise a wrong token, so the verify path runs at a
  controlled acceptance (issue 29's p = 0.6 and 0.8, k fixed).

With --method mtp or eagle3 (on a GPU, at a real model's shape with dummy weights: issue 29's measurement), the
drafter's own row is its cost at zero acceptance (dummy weights draft nothing useful; adaptive speculation
pauses such requests), and the recorded rows keep the model drafter running (its cost counted) while the
drafts it proposes are replaced by the recorded ones. --eagle3-draft random writes an EAGLE3 head of the
target's shape with random weights. Workload "random": random token-id prompts (dummy checkpoints have no
tokenizer).

Every row also says whether the tokens equal the off run's (they must in float32; in 16-bit dtypes a verify
step rounds differently from a decode step).

    python -m benchmarks.spec_decode_bench [--model smollm2-135m] [--device cpu] [--batch-sizes 1,16] [--out f.json]
    python -m benchmarks.spec_decode_bench --model benchmarks/configs/deepseek-v2-lite --load-format dummy \
        --dtype bfloat16 --method mtp --hf-overrides '{"num_nextn_predict_layers": 1}' --workloads random \
        --batch-sizes 1,64 --max-tokens 256
    python -m benchmarks.spec_decode_bench --model benchmarks/configs/llama-3.1-8b --load-format dummy \
        --dtype bfloat16 --method eagle3 --eagle3-draft random --workloads random --batch-sizes 1,64
"""
from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from benchmarks.common import environment_record, print_table, run_requests  # noqa: E402

TEXTS = [
    "alpha bravo charlie delta echo foxtrot golf hotel india juliett kilo lima mike november oscar papa quebec romeo",
    "one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen seventeen",
    "red orange yellow green blue indigo violet black white grey brown pink purple cyan magenta teal navy maroon",
    "Mercury Venus Earth Mars Jupiter Saturn Uranus Neptune Pluto Ceres Eris Haumea Makemake Sedna Quaoar Orcus",
]
CODE = ("def area(width, height):\n    \"\"\"The area of a rectangle.\"\"\"\n    return width * height\n\n\n"
        "def perimeter(width, height):\n    return 2 * (width + height)\n")
CHAT = ["What is the capital of France?", "Write a haiku about autumn.", "Explain what a hash map is.",
        "Give me three tips for sleeping better.", "What is 17 times 23?", "Name a famous painting and its painter."]


def workload(name: str, batch: int, tokenizer, vocab_size: int = 32000) -> list:
    if name == "random":  # token ids: dummy checkpoints have no tokenizer
        generator = random.Random(batch)
        return [[generator.randrange(100, vocab_size) for _ in range(128)] for _ in range(batch)]
    if name == "copy":
        base = [f"Original: {t}\nCopy: {t}\nOriginal: {t}\nCopy:" for t in TEXTS]
        base.append(f"{CODE}\n# The same module again, unchanged:\n")
    else:
        base = [tokenizer.apply_chat_template([{"role": "user", "content": c}], tokenize=False,
                                              add_generation_prompt=True) for c in CHAT]
    return [base[i % len(base)] for i in range(batch)]


def write_random_eagle3_draft(folder: Path, config, dtype=None, seed: int = 0) -> Path:
    """An EAGLE3 draft checkpoint (the published layout: midlayer.*, fc, norm, lm_head, t2d) with random
    weights, shaped for the Llama-family target `config` (an HF config)."""
    import torch
    from safetensors.torch import save_file
    dtype = dtype or torch.bfloat16
    hidden, heads, kv_heads = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    inter, vocab = config.intermediate_size, config.vocab_size
    raw = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
           "hidden_size": hidden, "intermediate_size": inter, "num_attention_heads": heads,
           "num_key_value_heads": kv_heads, "head_dim": head_dim, "vocab_size": vocab,
           "rms_norm_eps": config.rms_norm_eps, "max_position_embeddings": config.max_position_embeddings,
           "rope_theta": getattr(config, "rope_theta", 10000.0), "hidden_act": "silu"}
    generator = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return (torch.randn(*shape, generator=generator) * 0.02).to(dtype)
    def ones():
        return torch.ones(hidden, dtype=dtype)
    tensors = {"fc.weight": rand(hidden, 3 * hidden), "norm.weight": ones(), "lm_head.weight": rand(vocab, hidden),
               "t2d": torch.ones(vocab, dtype=torch.bool), "midlayer.input_layernorm.weight": ones(),
               "midlayer.hidden_norm.weight": ones(), "midlayer.post_attention_layernorm.weight": ones(),
               "midlayer.self_attn.q_proj.weight": rand(heads * head_dim, 2 * hidden),
               "midlayer.self_attn.k_proj.weight": rand(kv_heads * head_dim, 2 * hidden),
               "midlayer.self_attn.v_proj.weight": rand(kv_heads * head_dim, 2 * hidden),
               "midlayer.self_attn.o_proj.weight": rand(hidden, heads * head_dim),
               "midlayer.mlp.gate_proj.weight": rand(inter, hidden), "midlayer.mlp.up_proj.weight": rand(inter, hidden),
               "midlayer.mlp.down_proj.weight": rand(hidden, inter)}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(raw))
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


class RecordedSpeculator:
    """Drafts the target's recorded greedy continuation, each token right with probability p."""

    def __init__(self, recorded: dict[tuple, list[int]], k: int, p: float, vocab_size: int, seed: int = 0) -> None:
        self.recorded, self.k, self.p, self.vocab_size = recorded, k, p, vocab_size
        self.rng = random.Random(seed)

    def propose(self, running, output=None) -> None:
        for request in running:
            request.spec_token_ids = []
            if request.num_tokens_to_compute != 1 or request.num_pending_tokens:
                continue
            future = self.recorded.get(tuple(request.prompt_token_ids), [])[request.num_output_tokens:]
            room = min(request.max_tokens - request.num_output_tokens, len(future)) - 1
            drafts = future[:max(0, min(self.k, room))]
            request.spec_token_ids = [t if self.rng.random() < self.p else (t + 1) % self.vocab_size for t in drafts]


def run(engine, prompts, params) -> tuple[list, float]:
    outputs, seconds = run_requests(engine, prompts, params)
    return [output.outputs[0] for output in outputs], seconds


def spec_counters(engine) -> tuple[int, int, int]:
    s = engine.stats()
    return s.get("spec_verifies", 0), s.get("spec_draft_tokens", 0), s.get("spec_accepted_tokens", 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--hf-overrides", type=json.loads, default=None)
    parser.add_argument("--method", default="ngram", choices=["ngram", "mtp", "eagle3"])
    parser.add_argument("--eagle3-draft", help="the draft checkpoint's folder, or 'random'")
    parser.add_argument("--batch-sizes", default="1,16")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--num-speculative-tokens", type=int, default=3)
    parser.add_argument("--workloads", default="copy,chat")
    parser.add_argument("--out")
    args = parser.parse_args()
    import tempfile
    from engine import LLM, SamplingParams

    common = dict(show_progress=False, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
                  load_format=args.load_format, max_num_seqs=max(int(b) for b in args.batch_sizes.split(",")))
    if args.hf_overrides:
        common["hf_overrides"] = args.hf_overrides
    k = args.num_speculative_tokens
    plain = LLM(args.model, **common)
    speculative_config = {"method": args.method, "num_speculative_tokens": k}
    if args.method == "eagle3":
        draft = args.eagle3_draft
        if draft in (None, "random"):
            draft = str(write_random_eagle3_draft(Path(tempfile.mkdtemp(prefix="eagle3-")),
                                                  plain.engine.source.hf_config))
        speculative_config["model"] = draft
    spec = LLM(args.model, speculative_config=speculative_config, **common)
    own_speculator = spec.engine.speculator
    vocab = plain.engine.source.hf_config.vocab_size
    tokenizer = plain.get_tokenizer()
    rows, records = [], []
    for name in args.workloads.split(","):
        for batch in [int(b) for b in args.batch_sizes.split(",")]:
            prompts = workload(name, batch, tokenizer.hf if tokenizer else None, vocab)
            greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens,
                                    ignore_eos=name == "random")
            run(plain.engine, prompts[:2], [greedy] * min(2, batch))  # warm-up
            run(spec.engine, prompts[:2], [greedy] * min(2, batch))
            base, base_s = run(plain.engine, prompts, [greedy] * batch)
            lengths = [len(o.token_ids) for o in base]
            # Each request generates exactly its baseline count, whatever the drafter.
            params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
            _, base_s = run(plain.engine, prompts, params)
            base_rate = sum(lengths) / base_s
            recorded = {}
            for prompt, output in zip(prompts, base):
                recorded[tuple(plain.engine.tokenize(prompt)[1])] = list(output.token_ids)
            drafters = [(args.method, own_speculator)] + [
                (f"recorded p={p}", RecordedSpeculator(recorded, k, p, vocab)) for p in (0.6, 0.8)]
            rows.append((name, batch, "off", f"{base_rate:.1f}", "1.00x", "-", "-", "yes"))
            records.append(dict(workload=name, batch=batch, drafter="off", tok_s=base_rate))
            for label, speculator in drafters:
                spec.engine.speculator = speculator
                before = spec_counters(spec.engine)
                outputs, seconds = run(spec.engine, prompts, params)
                after = spec_counters(spec.engine)
                verifies, drafted, kept = (a - b for a, b in zip(after, before))
                rate = sum(lengths) / seconds
                same = all(o.token_ids == b.token_ids[:len(o.token_ids)] and len(o.token_ids) == len(b.token_ids)
                           for o, b in zip(outputs, base))
                acceptance = kept / drafted if drafted else 0.0
                mean_len = 1 + kept / verifies if verifies else 0.0
                rows.append((name, batch, label, f"{rate:.1f}", f"{rate / base_rate:.2f}x", f"{acceptance:.2f}",
                             f"{mean_len:.2f}", "yes" if same else "NO"))
                records.append(dict(workload=name, batch=batch, drafter=label, tok_s=rate, ratio=rate / base_rate,
                                    acceptance=acceptance, mean_accepted_length=mean_len, drafted=drafted,
                                    same_tokens=same))
            spec.engine.speculator = own_speculator
    print_table(["workload", "batch", "drafter", "output tok/s", "vs off", "acceptance", "tokens per verify",
                 "same tokens"], rows)
    if args.out:
        Path(args.out).write_text(json.dumps({"environment": environment_record(), "model": args.model,
                                              "method": args.method, "k": k, "dtype": args.dtype,
                                              "max_tokens": args.max_tokens, "results": records}, indent=1))
    plain.shutdown()
    spec.shutdown()


if __name__ == "__main__":
    main()
