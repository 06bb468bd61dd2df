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

Every row also says whether the tokens equal the off run's (they must, in float32).

    python -m benchmarks.spec_decode_bench [--model smollm2-135m] [--device cpu] [--batch-sizes 1,16] [--out f.json]
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from benchmarks.common import environment_record, print_table  # noqa: E402

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


def workload(name: str, batch: int, tokenizer) -> list:
    if name == "copy":
        base = [f"Original: {t}\nCopy: {t}\nOriginal: {t}\nCopy:" for t in TEXTS]
        base.append(f"{CODE}\n# The same module again, unchanged:\n")
    else:
        base = [tokenizer.apply_chat_template([{"role": "user", "content": c}], tokenize=False,
                                              add_generation_prompt=True) for c in CHAT]
    return [base[i % len(base)] for i in range(batch)]


class RecordedSpeculator:
    """Drafts the target's recorded greedy continuation, each token right with probability p."""

    def __init__(self, recorded: dict[tuple, list[int]], k: int, p: float, vocab_size: int, seed: int = 0) -> None:
        self.recorded, self.k, self.p, self.vocab_size = recorded, k, p, vocab_size
        self.rng = random.Random(seed)

    def propose(self, running) -> None:
        for request in running:
            request.spec_token_ids = []
            if request.num_tokens_to_compute != 1 or request.num_pending_tokens:
                continue
            future = self.recorded.get(tuple(request.prompt_token_ids), [])[request.num_output_tokens:]
            room = min(request.max_tokens - request.num_output_tokens, len(future)) - 1
            drafts = future[:max(0, min(self.k, room))]
            request.spec_token_ids = [t if self.rng.random() < self.p else (t + 1) % self.vocab_size for t in drafts]


def run(engine, prompts, params) -> tuple[list, float]:
    ids = [engine.new_request_id() for _ in prompts]
    start = time.perf_counter()
    for request_id, prompt, p in zip(ids, prompts, params):
        engine.add_request(request_id, prompt, p)
    finals = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
    return [finals[i].outputs[0] for i in ids], time.perf_counter() - start


def spec_counters(engine) -> tuple[int, int, int]:
    s = engine.stats()
    return s.get("spec_verifies", 0), s.get("spec_draft_tokens", 0), s.get("spec_accepted_tokens", 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch-sizes", default="1,16")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--num-speculative-tokens", type=int, default=3)
    parser.add_argument("--workloads", default="copy,chat")
    parser.add_argument("--out")
    args = parser.parse_args()
    from engine import LLM, SamplingParams

    common = dict(show_progress=False, dtype=args.dtype, device=args.device, max_model_len=2048)
    k = args.num_speculative_tokens
    plain = LLM(args.model, **common)
    spec = LLM(args.model, speculative_config={"method": "ngram", "num_speculative_tokens": k}, **common)
    ngram_speculator = spec.engine.speculator
    vocab = plain.engine.source.hf_config.vocab_size
    rows, records = [], []
    for name in args.workloads.split(","):
        for batch in [int(b) for b in args.batch_sizes.split(",")]:
            prompts = workload(name, batch, plain.get_tokenizer().hf)
            greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens)
            run(plain.engine, prompts[:2], [greedy] * 2)  # warm-up
            base, base_s = run(plain.engine, prompts, [greedy] * batch)
            lengths = [len(o.token_ids) for o in base]
            # Each request generates exactly its baseline count, whatever the drafter.
            params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
            _, base_s = run(plain.engine, prompts, params)
            base_rate = sum(lengths) / base_s
            recorded = {}
            for prompt, output in zip(prompts, base):
                recorded[tuple(plain.engine.tokenize(prompt)[1])] = list(output.token_ids)
            drafters = [("ngram", ngram_speculator)] + [
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
            spec.engine.speculator = ngram_speculator
    print_table(["workload", "batch", "drafter", "output tok/s", "vs off", "acceptance", "mean accepted len",
                 "same tokens"], rows)
    if args.out:
        Path(args.out).write_text(json.dumps({"environment": environment_record(), "k": k,
                                              "max_tokens": args.max_tokens, "results": records}, indent=1))
    plain.shutdown()
    spec.shutdown()


if __name__ == "__main__":
    main()
