"""FP8 latent caches (`kv_cache_dtype="fp8"`) for multi-head latent attention: one per-tensor scale per layer
(1.0, or the checkpoint's `self_attn.k_scale`), entries quantized as they are written and dequantized as they
are read. The torch reference over an FP8 cache computes exactly what it computes over the dequantized cache;
trained tiny DeepSeek-V2/V3 keep their teacher-forced choices (a wrong scale breaks that); the cache is FP8
(half of bf16's bytes); DeepSeek-V3.2 keeps its index keys in the model's dtype; per-token scales are refused;
the aiter backend leaves FP8 latent caches to the fallback. The Triton kernels over FP8 caches:
tests/engine/kernels/test_triton_mla.py."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import aiter_double
import tiny_models
from engine import LLM, SamplingParams
from engine.config import ConfigError
from engine.kernels import registry
from engine.kernels.attention import CommonAttentionMetadata, KVCacheQuant, quantize_to_fp8
from engine.kernels.mla import MLAWeights, read_entries
from engine.kernels.torch import mla as reference
from engine.layers.mla import MLAAttention

FP8 = torch.float8_e4m3fn
# Trained tiny DeepSeeks (seconds on a CPU): V2 without q-LoRA, V3 with it.
SHAPES = dict(hidden_size=128, intermediate_size=192, moe_intermediate_size=64, kv_lora_rank=32, qk_nope_head_dim=16,
              qk_rope_head_dim=16, v_head_dim=32, num_attention_heads=4, num_key_value_heads=4, head_dim=16)
TRAINED = {"deepseek_v2": {}, "deepseek_v3": {"q_lora_rank": 48}}
# Prompts in 16-token chunks: the first chunk attends over its own entries as computed, every later chunk
# reads the earlier ones from the (FP8) cache.
CHUNKED = dict(dtype="float32", max_num_batched_tokens=16, max_num_seqs=1, num_kv_blocks=64, show_progress=False)
CHUNK = 16


@pytest.fixture(autouse=True)
def cpu_kernels():
    from engine import kernels
    kernels.activate("torch", torch.device("cpu"))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("mla-fp8")
    # AdamW's moments of tiny gradients turn subnormal: on a CPU that can make training 100 times slower.
    torch.set_flush_denormal(True)
    try:
        return {arch: tiny_models.make_trained_tiny_model(root / arch, arch, steps=100, **SHAPES, **extra)
                for arch, extra in TRAINED.items()}
    finally:
        torch.set_flush_denormal(False)


def teacher_forced(llm: LLM, folder) -> tuple[list[int], torch.Tensor]:
    """Over a stretch of the training text: the top-1 choice at each position, and the log-probability of
    the text's own next token."""
    sequence = tiny_models.training_sequence(folder, 96)
    entries = llm.generate([sequence], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1))[0]
    entries = entries.prompt_logprobs[1:]
    top1 = [min(entry.items(), key=lambda kv: kv[1].rank)[0] for entry in entries]
    return top1, torch.tensor([entry[token].logprob for entry, token in zip(entries, sequence[1:])])


@pytest.fixture(scope="module")
def full_precision(trained):
    return {arch: teacher_forced(LLM(str(folder), **CHUNKED), folder) for arch, folder in trained.items()}


def agreement(got: list[int], expected: list[int]) -> float:
    assert len(got) == len(expected)
    return sum(a == b for a, b in zip(got, expected)) / len(expected)


def logprob_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    """The largest change of the text's log-probabilities where the cache is read (after the first chunk)."""
    return float((got - expected)[CHUNK:].abs().max())


def with_kv_scales(folder, destination, scales: dict[int, float]):
    """A copy of a checkpoint with per-tensor KV-cache scales as compressed-tensors writes them
    (`self_attn.k_scale` and `self_attn.v_scale`, [] float32) for the given layers."""
    shutil.copytree(folder, destination)
    tensors = load_file(str(destination / "model.safetensors"))
    for layer, scale in scales.items():
        for name in ("k_scale", "v_scale"):
            tensors[f"model.layers.{layer}.self_attn.{name}"] = torch.tensor(scale, dtype=torch.float32)
    save_file(tensors, str(destination / "model.safetensors"), metadata={"format": "pt"})
    return destination


def latent_layers(llm: LLM) -> list[MLAAttention]:
    return [m for m in llm.engine.executor.runner.cache_layers if isinstance(m, MLAAttention)]


# ---- the reference over an FP8 cache ----------------------------------------------------------------------

def step(query_lens: list[int], seq_lens: list[int], num_decodes: int, block_size: int, generator):
    """A mixed step's metadata over scattered blocks (each sequence's new tokens: its last query_len
    positions)."""
    blocks_per_seq = -(-max(seq_lens) // block_size)
    num_blocks = len(seq_lens) * blocks_per_seq + 2
    table = torch.randperm(num_blocks, generator=generator)[:len(seq_lens) * blocks_per_seq]
    table = table.view(len(seq_lens), blocks_per_seq).int()
    starts = [0]
    for length in query_lens:
        starts.append(starts[-1] + length)
    slots = [int(table[i, p // block_size]) * block_size + p % block_size
             for i, (q, s) in enumerate(zip(query_lens, seq_lens)) for p in range(s - q, s)]
    metadata = CommonAttentionMetadata(
        num_seqs=len(seq_lens), num_decodes=num_decodes, num_tokens=starts[-1],
        query_start_loc=torch.tensor(starts, dtype=torch.int32), seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=table, slot_mapping=torch.tensor(slots), max_query_len=max(query_lens),
        max_seq_len=max(seq_lens), query_start_loc_cpu=starts, seq_lens_cpu=list(seq_lens),
        num_computed_tokens_cpu=[s - q for s, q in zip(seq_lens, query_lens)])
    return metadata, num_blocks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_reference_over_an_fp8_cache_equals_it_over_the_dequantized_cache(dtype):
    """Decodes, a prefill over a cached prefix and a fresh one, then sparse attention over the cache: with the
    FP8 cache and its scale, and with a cache holding the dequantized entries, the outputs and the cache
    contents are equal bit for bit. The step's own entries lie on the FP8 grid times the scale (a power of
    two), so that both caches store the same values."""
    generator = torch.Generator().manual_seed(0)
    heads, rank, rope, nope, v_dim, block_size = 4, 32, 8, 16, 24, 4
    quant = KVCacheQuant("tensor", torch.tensor([0.25]), torch.tensor([0.25]))
    metadata, num_blocks = step([1, 1, 5, 3], [13, 6, 5, 11], 2, block_size, generator)

    def on_grid(*shape):
        return read_entries(quantize_to_fp8(torch.randn(*shape, generator=generator), quant.k_scale, FP8), quant,
                            dtype)
    cache = quantize_to_fp8(torch.randn(num_blocks, block_size, rank + rope, generator=generator), quant.k_scale,
                            FP8)
    dequantized = read_entries(cache, quant, dtype)
    tokens = metadata.num_tokens
    q_nope = torch.randn(tokens, heads, nope, generator=generator).to(dtype)
    q_pe = torch.randn(tokens, heads, rope, generator=generator).to(dtype)
    latent, k_pe = on_grid(tokens, rank), on_grid(tokens, rope)
    kv_b = (torch.randn(heads * (nope + v_dim), rank, generator=generator) * rank ** -0.5).to(dtype)
    per_head = kv_b.view(heads, nope + v_dim, rank)
    weights = MLAWeights(lambda x: x @ kv_b.T, per_head[:, :nope], per_head[:, nope:])
    out = reference.mla_attention(q_nope, q_pe, latent, k_pe, cache, metadata, weights, 0.3, block_size, quant)
    expected = reference.mla_attention(q_nope, q_pe, latent, k_pe, dequantized, metadata, weights, 0.3, block_size)
    assert cache.dtype == FP8 and torch.equal(read_entries(cache, quant, dtype), dequantized)
    assert torch.equal(out, expected)

    q = torch.randn(3, heads, rank + rope, generator=generator).to(dtype)
    slots = torch.randint(-1, num_blocks * block_size, (3, 7), generator=generator)
    sparse = reference.mla_sparse_attention(q, cache, slots, 0.2, rank, quant)
    sparse_expected = reference.mla_sparse_attention(q, dequantized, slots, 0.2, rank)
    assert all(torch.equal(a, b) for a, b in zip(sparse, sparse_expected))


# ---- DeepSeek-V2 / V3 through engine.LLM ---------------------------------------------------------------------

@pytest.mark.parametrize("arch", list(TRAINED))
def test_fp8_latent_cache_keeps_the_teacher_forced_choices(arch, trained, full_precision):
    llm = LLM(str(trained[arch]), kv_cache_dtype="fp8", **CHUNKED)  # kv_cache_scales="auto": per tensor, 1.0
    runner = llm.engine.executor.runner
    assert runner.kv_scale_granularity == "tensor"
    assert all(layer.kv_quant.k_scale.item() == 1.0
               and layer.kv_quant.v_scale.data_ptr() == layer.kv_quant.k_scale.data_ptr()
               for layer in latent_layers(llm))
    top1, logprobs = teacher_forced(llm, trained[arch])
    expected_top1, expected_logprobs = full_precision[arch]
    assert agreement(top1, expected_top1) >= 0.95  # measured 1.0
    assert logprob_error(logprobs, expected_logprobs) < 0.1  # measured 0.0014 (V2), 0.011 (V3)


@pytest.mark.parametrize("arch", list(TRAINED))
def test_a_wrong_scale_breaks_the_choices(arch, trained, full_precision):
    """The negative control of the test above: a scale 10^4 times too large flushes every entry to zero."""
    llm = LLM(str(trained[arch]), kv_cache_dtype="fp8", **CHUNKED)
    for layer in latent_layers(llm):
        layer.attn.k_scale.data.fill_(1e4)
    top1, logprobs = teacher_forced(llm, trained[arch])
    expected_top1, expected_logprobs = full_precision[arch]
    assert agreement(top1, expected_top1) < 0.95  # measured 0.88 (V2), 0.86 (V3)
    assert logprob_error(logprobs, expected_logprobs) > 1.0  # measured 8.0 (V2), 7.0 (V3)


def test_the_cache_is_fp8_at_half_the_bytes_of_bf16(trained):
    folder = str(trained["deepseek_v2"])
    fp8 = LLM(folder, kv_cache_dtype="fp8", **{**CHUNKED, "dtype": "bfloat16"})
    bf16 = LLM(folder, **{**CHUNKED, "dtype": "bfloat16"})
    assert {layer.kv_cache.dtype for layer in latent_layers(fp8)} == {FP8}
    entry = SHAPES["kv_lora_rank"] + SHAPES["qk_rope_head_dim"]
    layers = len(latent_layers(fp8))
    fp8_runner, bf16_runner = fp8.engine.executor.runner, bf16.engine.executor.runner
    assert fp8_runner.kv_cache_bytes_per_block() == layers * fp8_runner.block_size * entry
    assert 2 * fp8_runner.kv_cache_bytes_per_block() == bf16_runner.kv_cache_bytes_per_block()


def test_checkpoint_k_scales_are_what_quantizes_the_cache(trained, full_precision, tmp_path):
    """A compressed-tensors checkpoint's `self_attn.k_scale` becomes its layer's scale (`v_scale` is skipped:
    one scale per latent entry); a checkpoint whose scales are 10^4 times too large breaks the choices."""
    folder = trained["deepseek_v3"]
    num_layers = json.loads((folder / "config.json").read_text())["num_hidden_layers"]
    scales = {layer: 0.02 * (layer + 1) for layer in range(num_layers)}
    llm = LLM(str(with_kv_scales(folder, tmp_path / "scaled", scales)), kv_cache_dtype="fp8", **CHUNKED)
    assert [layer.kv_quant.k_scale.item() for layer in latent_layers(llm)] == pytest.approx(list(scales.values()))
    assert all(layer.checkpoint_kv_scales for layer in latent_layers(llm))
    top1, logprobs = teacher_forced(llm, folder)
    assert agreement(top1, full_precision["deepseek_v3"][0]) >= 0.95  # measured 1.0
    assert logprob_error(logprobs, full_precision["deepseek_v3"][1]) < 0.1  # measured 0.019

    broken = with_kv_scales(folder, tmp_path / "broken", {layer: 1e4 for layer in range(num_layers)})
    top1, logprobs = teacher_forced(LLM(str(broken), kv_cache_dtype="fp8", **CHUNKED), folder)
    assert agreement(top1, full_precision["deepseek_v3"][0]) < 0.95  # measured 0.86
    assert logprob_error(logprobs, full_precision["deepseek_v3"][1]) > 1.0  # measured 7.0


def test_per_token_scales_are_refused_naming_the_option(trained):
    with pytest.raises(ConfigError, match=r"kv_cache_scales='token' is not supported for this model: its "
                                          r"MLAAttention layers .* per-tensor scale"):
        LLM(str(trained["deepseek_v2"]), kv_cache_dtype="fp8", kv_cache_scales="token", **CHUNKED)


# ---- DeepSeek-V3.2 -------------------------------------------------------------------------------------------

def test_deepseek_v32_keeps_index_keys_in_the_model_dtype_and_its_logprobs(tmp_path):
    """DSA's latent cache in FP8 beside index keys in float32 (the top-k selection reads unquantized index
    keys). A random model is sensitive to the latent's rounding: its log-probabilities move by 0.32 on
    average after the first chunk (measured), against 2.4 with every entry flushed to zero."""
    # tests/engine/test_deepseek_v32.py's tiny DeepSeek-V3.2: an index top-k (8) smaller than the prompt.
    folder = tiny_models.make_dsa_model(tmp_path / "v32", tiny_models.deepseek_v32_config(), random_index_norm=False)
    prompt = torch.randint(3, tiny_models.VOCAB_SIZE, (64,), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)

    def logprobs(llm):
        entries = llm.generate([prompt], params)[0].prompt_logprobs[1:]
        return torch.tensor([entry[token].logprob for entry, token in zip(entries, prompt[1:])])

    def mean_error(got, expected):
        return float((got - expected)[CHUNK:].abs().mean())
    llm = LLM(str(folder), kv_cache_dtype="fp8", **CHUNKED)
    caches = [layer.caches for layer in llm.engine.executor.runner.cache_layers]
    assert {c["kv"].dtype for c in caches} == {FP8} and {c["index_k"].dtype for c in caches} == {torch.float32}
    expected = logprobs(LLM(str(folder), **CHUNKED))
    error = mean_error(logprobs(llm), expected)
    for layer in llm.engine.executor.runner.cache_layers:  # the negative control: entries flushed to zero
        layer.attn.k_scale.data.fill_(1e4)
    assert error < 0.5 and mean_error(logprobs(llm), expected) > 1.5


# ---- the aiter backend ---------------------------------------------------------------------------------------

@pytest.fixture
def double():
    """The AITER double imported as `aiter`, the backend allowed on the CPU (emulating an MI355X)."""
    with aiter_double.serving("gfx950") as module:
        yield module


def test_aiter_leaves_fp8_latent_caches_to_the_fallback_and_says_why(double):
    facts = dict(dtype=torch.bfloat16, mla_heads=16, mla_entry=(512, 64))
    table = dict(registry.resolve("aiter", torch.device("cpu"), registry.ModelFacts(**facts)).table())
    assert table["mla_attention"].startswith("aiter.")
    table = dict(registry.resolve("aiter", torch.device("cpu"),
                                  registry.ModelFacts(**facts, fp8_kv_cache=True)).table())
    for op in ("mla_attention", "mla_sparse_attention"):
        assert "fallback: amd-aiter 0.1.7's mla_decode_fwd reads FP8 latent caches only" in table[op]


def test_aiter_op_given_an_fp8_cache_runs_the_fallback(double):
    """Past the start-up decline too: the aiter op called with an FP8 cache gives the fallback's result."""
    from engine.kernels.aiter import mla as aiter_mla
    generator = torch.Generator().manual_seed(1)
    heads, rank, rope, nope, v_dim, block_size = 16, 512, 64, 16, 16, 4
    quant = KVCacheQuant("tensor", torch.tensor([0.5]), torch.tensor([0.5]))
    metadata, num_blocks = step([1, 4], [9, 7], 1, block_size, generator)
    cache = quantize_to_fp8(torch.randn(num_blocks, block_size, rank + rope, generator=generator), quant.k_scale, FP8)
    tokens = metadata.num_tokens
    inputs = [torch.randn(*shape, generator=generator).to(torch.bfloat16)
              for shape in ((tokens, heads, nope), (tokens, heads, rope), (tokens, rank), (tokens, rope))]
    kv_b = (torch.randn(heads * (nope + v_dim), rank, generator=generator) * rank ** -0.5).to(torch.bfloat16)
    per_head = kv_b.view(heads, nope + v_dim, rank)
    weights = MLAWeights(lambda x: x @ kv_b.T, per_head[:, :nope], per_head[:, nope:])
    expected_cache = cache.clone()
    out = aiter_mla.mla_attention(*inputs, cache, metadata, weights, 0.3, block_size, kv_quant=quant)
    expected = reference.mla_attention(*inputs, expected_cache, metadata, weights, 0.3, block_size, quant)
    assert torch.equal(out, expected) and torch.equal(cache.view(torch.uint8), expected_cache.view(torch.uint8))
