"""CPU benchmark: SmolLM2-135M in bf16 through atom-ray's engine and through transformers, same run.

Measures batch-1 decode tokens/s (and its ratio to the memory-bandwidth roofline) and total output
throughput for 16 requests of mixed prompt and output lengths. transformers runs the same bf16 weights
(de-quantized from the same GGUF file), once request by request with `generate` and once with its
continuous-batching manager; the better of the two is the baseline. Each figure is the median of three rounds, the engine's and
transformers' rounds alternating so that both see the same machine.

    python benchmarks/cpu_smollm2.py [--out bench_out/cpu_smollm2.json]
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch

from benchmarks.common import environment_record, print_table, timed

NUM_REQUESTS = 16
DECODE_PROMPT_LEN, DECODE_NEW_TOKENS = 32, 128


def measure_bandwidth(num_bytes: int = 512 << 20, repeats: int = 5) -> float:
    """Host memory bandwidth in bytes/s: a large copy, counting bytes read plus bytes written."""
    src = torch.ones(num_bytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return 2 * num_bytes / statistics.median(times)


def hf_model_from_engine_weights(source):
    """transformers' Llama with the bf16 weights our loader de-quantized from the same GGUF file."""
    from transformers import LlamaForCausalLM
    model = LlamaForCausalLM(source.hf_config).to(torch.bfloat16).eval()
    state = dict(source.gguf.iter_weights())
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all("lm_head" in name for name in missing), (missing, unexpected)
    model.tie_weights()
    model.generation_config.eos_token_id = None
    return model


def workload(vocab_size: int, seed: int = 0):
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, vocab_size) for _ in range(rng.randint(16, 256))] for _ in range(NUM_REQUESTS)]
    output_lens = [rng.randint(16, 128) for _ in range(NUM_REQUESTS)]
    return prompts, output_lens


ROUNDS = 3  # engine and transformers alternate, so both see the same machine; medians are reported


def engine_generate(llm, prompt):
    from engine import SamplingParams
    return lambda n: llm.generate([prompt], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))


def hf_generate(model, prompt):
    ids = torch.tensor([prompt])

    def run(n):
        with torch.inference_mode():
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    return run


def decode_rate(run) -> tuple[float, float]:
    """Decode tokens/s (the time of DECODE_NEW_TOKENS extra tokens) and the prefill seconds."""
    prefill = timed(lambda: run(1))
    total = timed(lambda: run(DECODE_NEW_TOKENS + 1))
    return DECODE_NEW_TOKENS / (total - prefill), prefill


def engine_throughput(llm, prompts, output_lens) -> float:
    from engine import SamplingParams
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in output_lens]
    llm.generate(prompts[:2], params[:2])  # warm-up
    llm.engine.scheduler.block_manager.reset_prefix_cache()  # no reuse of an earlier round's prompts
    seconds = timed(lambda: llm.generate(prompts, params))
    return sum(output_lens) / seconds


def hf_sequential_throughput(model, prompts, output_lens) -> float:
    def run():
        with torch.inference_mode():
            for prompt, n in zip(prompts, output_lens):
                model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                               pad_token_id=0)
    return sum(output_lens) / timed(run)


def hf_continuous_batching_throughput(model, prompts, output_lens) -> float:
    from transformers import GenerationConfig
    config = GenerationConfig(max_new_tokens=max(output_lens), do_sample=False, eos_token_id=None, pad_token_id=0)
    manager = model.init_continuous_batching(generation_config=config)
    manager.start()
    try:
        def one_round():
            pending = {manager.add_request(p, max_new_tokens=n) for p, n in zip(prompts, output_lens)}
            produced = 0
            while pending:
                result = manager.get_result(timeout=600)
                if result is None:
                    raise RuntimeError("transformers' continuous batching produced no result")
                if result.request_id in pending and result.is_finished():
                    if result.error:
                        raise RuntimeError(result.error)
                    pending.discard(result.request_id)
                    produced += len(result.generated_tokens)
            return produced
        one_round()  # warm-up
        rates = []
        for _ in range(ROUNDS):
            start = time.perf_counter()
            produced = one_round()
            rates.append(produced / (time.perf_counter() - start))
            assert produced == sum(output_lens), (produced, sum(output_lens))
    finally:
        manager.stop(block=True)
    return statistics.median(rates)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench_out/cpu_smollm2.json")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="the engine's step budget (default: the engine's, 512 on CPU)")
    args = parser.parse_args()

    from engine import LLM
    llm = LLM("smollm2-135m", dtype="bfloat16", show_progress=False,
              max_num_batched_tokens=args.max_num_batched_tokens)
    source = llm.engine.source
    model = hf_model_from_engine_weights(source)
    config = source.hf_config
    rng = random.Random(1)
    decode_prompt = [rng.randrange(100, config.vocab_size) for _ in range(DECODE_PROMPT_LEN)]
    prompts, output_lens = workload(config.vocab_size)

    bandwidth = measure_bandwidth()
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # tied head counted once
    kv_bytes_per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 2
    mean_context = DECODE_PROMPT_LEN + DECODE_NEW_TOKENS / 2
    roofline = bandwidth / (weight_bytes + kv_bytes_per_token * mean_context)

    ours, theirs = engine_generate(llm, decode_prompt), hf_generate(model, decode_prompt)
    ours(8), theirs(8)  # warm-up
    rounds = [(decode_rate(ours), decode_rate(theirs)) for _ in range(ROUNDS)]
    engine_rate, engine_prefill = statistics.median(r[0][0] for r in rounds), statistics.median(r[0][1] for r in rounds)
    hf_rate, hf_prefill = statistics.median(r[1][0] for r in rounds), statistics.median(r[1][1] for r in rounds)
    engine_tput = statistics.median(engine_throughput(llm, prompts, output_lens) for _ in range(ROUNDS))
    hf_seq_tput = hf_sequential_throughput(model, prompts, output_lens)
    try:
        hf_cb_tput = hf_continuous_batching_throughput(model, prompts, output_lens)
    except Exception as exc:  # the manager's API moves between transformers releases
        print(f"transformers continuous batching failed: {exc!r}")
        hf_cb_tput = None
    hf_best = max(t for t in (hf_seq_tput, hf_cb_tput) if t is not None)

    results = {
        "environment": environment_record(),
        "model": {"name": "SmolLM2-135M-Instruct (GGUF Q4_1 de-quantized)", "dtype": "bfloat16",
                  "weight_bytes": weight_bytes, "layers": config.num_hidden_layers, "hidden": config.hidden_size},
        "measured_bandwidth_GBps": bandwidth / 1e9,
        "decode_batch1": {
            "prompt_tokens": DECODE_PROMPT_LEN, "new_tokens": DECODE_NEW_TOKENS,
            "engine_tok_s": engine_rate, "hf_tok_s": hf_rate, "ratio_vs_hf": engine_rate / hf_rate,
            "roofline_tok_s": roofline, "engine_fraction_of_roofline": engine_rate / roofline,
            "engine_prefill_s": engine_prefill, "hf_prefill_s": hf_prefill,
        },
        "throughput_16_requests": {
            "prompt_tokens": sum(map(len, prompts)), "output_tokens": sum(output_lens),
            "engine_tok_s": engine_tput, "hf_sequential_tok_s": hf_seq_tput,
            "hf_continuous_batching_tok_s": hf_cb_tput, "ratio_vs_best_hf": engine_tput / hf_best,
        },
    }
    rows = [
        ("decode b=1 tok/s", f"{engine_rate:.1f}", f"{hf_rate:.1f}", f"{engine_rate / hf_rate:.2f}x",
         f"{engine_rate / roofline:.2f} of {roofline:.0f}"),
        ("16 req output tok/s", f"{engine_tput:.1f}",
         f"{hf_seq_tput:.1f} seq / {hf_cb_tput if hf_cb_tput is None else round(hf_cb_tput, 1)} CB",
         f"{engine_tput / hf_best:.2f}x", "-"),
    ]
    print_table(["metric", "atom-ray", "transformers", "ratio", "roofline"], rows)
    print(f"bandwidth {bandwidth / 1e9:.1f} GB/s, weights {weight_bytes / 1e6:.0f} MB")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
