"""The `aiter` backend's MLA ops (engine/kernels/aiter/mla.py) on the AITER test double, against the torch
reference: the absorbed decode through mla_decode_fwd over a page-size-1 view of the cache (ragged
lengths, padded head counts), chunked prefill over a cached prefix through flash_attn_varlen_func, sparse
attention over selected slots with its log-sum-exp; the start-up declines; and tiny DeepSeek-V2/V3 models
giving the torch backend's greedy tokens with kernel_backend="aiter"."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import aiter_double
from engine.kernels import registry
from engine.kernels.attention import CommonAttentionMetadata
from engine.kernels.mla import MLAWeights
from engine.kernels.torch import mla as reference
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from tiny_models import AITER_MLA_SHAPES as MLA_SHAPES
from tiny_models import make_trained_tiny_model, training_sequence

LATENT, ROPE, NOPE, V = (MLA_SHAPES[k] for k in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"))
BLOCK_SIZE = 4


@pytest.fixture
def double():
    """The double imported as `aiter`, the backend allowed on the CPU (emulating an MI355X)."""
    with aiter_double.serving("gfx950") as module:
        yield module


def rand(generator, *shape, std=1.0):
    return (torch.randn(*shape, generator=generator) * std).to(torch.bfloat16)


def mla_weights(generator, heads: int) -> MLAWeights:
    kv_b = rand(generator, heads * (NOPE + V), LATENT, std=LATENT ** -0.5)
    per_head = kv_b.view(heads, NOPE + V, LATENT)
    return MLAWeights(lambda x: x @ kv_b.T, per_head[:, :NOPE], per_head[:, NOPE:])


def metadata(num_decodes: int, query_lens: list[int], seq_lens: list[int], block_table: torch.Tensor):
    """A step's metadata; each sequence's new tokens are its last query_len positions."""
    starts = [0]
    for length in query_lens:
        starts.append(starts[-1] + length)
    slots = torch.cat([torch.tensor([int(block_table[i, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE
                                     for p in range(s - q, s)]) for i, (q, s) in enumerate(zip(query_lens, seq_lens))])
    return CommonAttentionMetadata(
        num_seqs=len(seq_lens), num_decodes=num_decodes, num_tokens=starts[-1],
        query_start_loc=torch.tensor(starts, dtype=torch.int32), seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=block_table, slot_mapping=slots.long(), max_query_len=max(query_lens), max_seq_len=max(seq_lens),
        query_start_loc_cpu=starts, seq_lens_cpu=seq_lens, num_computed_tokens_cpu=[s - q for s, q in
                                                                                    zip(seq_lens, query_lens)])


def run_both(heads: int, num_decodes: int, query_lens: list[int], seq_lens: list[int], seed: int = 0):
    """The aiter op and the torch reference on the same inputs and the same prefilled cache: their outputs
    and the caches they leave."""
    from engine.kernels.aiter import mla as aiter_mla
    generator = torch.Generator().manual_seed(seed)
    blocks_per_seq = -(-max(seq_lens) // BLOCK_SIZE)
    num_blocks = len(seq_lens) * blocks_per_seq + 1
    # Scattered blocks (block 0 unused) so that slots are not positions.
    block_table = (torch.randperm(num_blocks - 1, generator=generator)[:len(seq_lens) * blocks_per_seq] + 1)
    block_table = block_table.view(len(seq_lens), blocks_per_seq).int()
    cache = rand(generator, num_blocks, BLOCK_SIZE, LATENT + ROPE)  # earlier tokens' entries (and junk past them)
    weights = mla_weights(generator, heads)
    tokens = sum(query_lens)
    q_nope, q_pe = rand(generator, tokens, heads, NOPE), rand(generator, tokens, heads, ROPE)
    latent, k_pe = rand(generator, tokens, LATENT), rand(generator, tokens, ROPE)
    step = metadata(num_decodes, query_lens, seq_lens, block_table)
    results = []
    for op in (aiter_mla.mla_attention, reference.mla_attention):
        kv_cache = cache.clone()
        results.append((op(q_nope, q_pe, latent, k_pe, kv_cache, step, weights, 0.1, BLOCK_SIZE), kv_cache))
    return results


def assert_close(got: torch.Tensor, expected: torch.Tensor, tolerance: float = 2e-2) -> None:
    scale = expected.float().abs().max().item()
    assert (got.float() - expected.float()).abs().max().item() <= tolerance * scale


@pytest.mark.parametrize("heads", [4, 16, 128])
def test_decode_with_ragged_lengths_matches_the_reference(double, heads):
    """Three decodes of contexts 9, 1 and 14 (4 and 128 heads run as the 16- and 128-head kernels)."""
    (got, got_cache), (expected, expected_cache) = run_both(heads, 3, [1, 1, 1], [9, 1, 14])
    assert aiter_double.CALLS["mla_decode_fwd"] == 1 and aiter_double.CALLS["concat_and_cache_mla"] == 1
    assert torch.equal(got_cache, expected_cache)
    assert_close(got, expected)


def test_chunked_prefill_over_a_cached_prefix_matches_the_reference(double):
    """One decode, a second chunk of 5 tokens over 7 cached ones, and a fresh 6-token prompt in one step."""
    (got, got_cache), (expected, expected_cache) = run_both(16, 1, [1, 5, 6], [10, 12, 6])
    assert aiter_double.CALLS["flash_attn_varlen_func"] == 1 and aiter_double.CALLS["mla_decode_fwd"] == 1
    assert torch.equal(got_cache, expected_cache)
    assert_close(got, expected)


def test_profiling_pass_without_a_cache_attends_over_its_own_tokens(double):
    from engine.kernels.aiter import mla as aiter_mla
    generator = torch.Generator().manual_seed(1)
    weights = mla_weights(generator, 16)
    q_nope, q_pe = rand(generator, 7, 16, NOPE), rand(generator, 7, 16, ROPE)
    latent, k_pe = rand(generator, 7, LATENT), rand(generator, 7, ROPE)
    step = metadata(0, [3, 4], [3, 4], torch.tensor([[1, 2], [3, 4]], dtype=torch.int32))
    got = aiter_mla.mla_attention(q_nope, q_pe, latent, k_pe, None, step, weights, 0.1, BLOCK_SIZE)
    expected = reference.mla_attention(q_nope, q_pe, latent, k_pe, None, step, weights, 0.1, BLOCK_SIZE)
    assert "concat_and_cache_mla" not in aiter_double.CALLS
    assert_close(got, expected)


def test_more_heads_than_the_kernels_take_run_the_reference(double):
    (got, _), (expected, _) = run_both(130, 2, [1, 1], [5, 3])
    assert "mla_decode_fwd" not in aiter_double.CALLS
    assert torch.equal(got, expected)


def test_sparse_attention_over_selected_slots_matches_the_reference(double):
    """Rows with -1 padding, one row with no entry (zeros, LSE -inf), repeated slots; out and LSE."""
    from engine.kernels.aiter import mla as aiter_mla
    generator = torch.Generator().manual_seed(2)
    cache = rand(generator, 6, BLOCK_SIZE, LATENT + ROPE)
    q = rand(generator, 4, 16, LATENT + ROPE)
    slots = torch.tensor([[3, 7, 0, -1, -1], [-1, -1, -1, -1, -1], [23, 22, 5, 5, 9], [12, -1, 4, -1, 1]])
    out, lse = aiter_mla.mla_sparse_attention(q, cache, slots, 0.05, LATENT)
    expected_out, expected_lse = reference.mla_sparse_attention(q, cache, slots, 0.05, LATENT)
    assert aiter_double.CALLS["mla_decode_fwd"] == 1
    assert out.shape == (4, 16, LATENT) and out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert torch.equal(out[1], torch.zeros_like(out[1])) and torch.isinf(lse[1]).all() and (lse[1] < 0).all()
    assert_close(out, expected_out)
    torch.testing.assert_close(lse[[0, 2, 3]], expected_lse[[0, 2, 3]], atol=1e-3, rtol=1e-4)


def test_sparse_attention_with_no_entry_at_all_skips_the_kernel(double):
    from engine.kernels.aiter import mla as aiter_mla
    cache = torch.zeros(2, BLOCK_SIZE, LATENT + ROPE, dtype=torch.bfloat16)
    out, lse = aiter_mla.mla_sparse_attention(torch.ones(3, 16, LATENT + ROPE, dtype=torch.bfloat16), cache,
                                              torch.full((3, 2), -1), 0.1, LATENT)
    assert "mla_decode_fwd" not in aiter_double.CALLS
    assert not out.any() and torch.isneginf(lse).all()


def test_the_double_refuses_what_the_decode_kernel_cannot_run(double):
    """0.1.7's limits: 16 or 128 heads (non-persistent), bf16, the 576/512 entry; and no LSE comes back."""
    from aiter.mla import mla_decode_fwd
    kv = torch.zeros(8, 1, 1, LATENT + ROPE, dtype=torch.bfloat16)
    indptr, indices = torch.tensor([0, 2], dtype=torch.int32), torch.tensor([1, 2], dtype=torch.int32)
    one = torch.ones(1, dtype=torch.int32)

    def call(heads=16, dim=LATENT + ROPE, dtype=torch.bfloat16):
        q = torch.ones(1, heads, dim, dtype=dtype)
        o = torch.empty(1, heads, LATENT, dtype=dtype)
        return mla_decode_fwd(q, kv[..., :dim].to(dtype), o, torch.tensor([0, 1], dtype=torch.int32), indptr,
                              indices, one, 1)
    _, final_lse = call()
    assert torch.isnan(final_lse).all()
    with pytest.raises(AssertionError, match="nhead=32"):
        call(heads=32)
    with pytest.raises(RuntimeError, match="Q_type"):
        call(dtype=torch.float16)
    with pytest.raises(RuntimeError, match="576"):
        call(dim=LATENT + 32)


def test_float32_models_run_mla_elsewhere_and_the_table_says_why(double):
    table = dict(registry.resolve("aiter", torch.device("cpu"), registry.ModelFacts(dtype=torch.float32)).table())
    assert "fallback: mla_decode_fwd's assembly kernels take bf16" in table["mla_attention"]
    assert "fallback" in table["mla_sparse_attention"]
    table = dict(registry.resolve("aiter", torch.device("cpu"), registry.ModelFacts(dtype=torch.bfloat16)).table())
    assert table["mla_attention"].startswith("aiter.concat_and_cache_mla + aiter.mla.mla_decode_fwd")
    assert table["mla_sparse_attention"].startswith("aiter.mla.mla_decode_fwd")


@pytest.fixture(scope="module")
def trained_deepseek(tmp_path_factory):
    root = tmp_path_factory.mktemp("aiter-mla")
    return {arch: make_trained_tiny_model(root / arch, arch, steps=30, **MLA_SHAPES)
            for arch in ("deepseek_v2", "deepseek_v3")}


def greedy(folder, backend: str) -> list[list[int]]:
    text = training_sequence(folder, 80)
    prompts = [text[:30], text[40:43], text[50:80]]  # the first and last longer than a 16-token chunk
    llm = LLM(str(folder), kernel_backend=backend, dtype="bfloat16", num_kv_blocks=64, device="cpu",
              max_num_batched_tokens=16, max_num_seqs=4, show_progress=False)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("arch", ["deepseek_v2", "deepseek_v3"])
def test_tiny_deepseek_gives_the_torch_backends_greedy_tokens(double, trained_deepseek, arch):
    """Chunked prefills over cached latents and absorbed decodes, end to end through engine.LLM."""
    folder = trained_deepseek[arch]
    expected = greedy(folder, "torch")
    aiter_double.CALLS.clear()
    assert greedy(folder, "aiter") == expected
    assert {"concat_and_cache_mla", "mla_decode_fwd", "flash_attn_varlen_func"} <= set(aiter_double.CALLS)


def test_the_doubles_latent_cache_write_skips_padding_and_scales_fp8(double):
    """concat_and_cache_mla: [latent | rope] at slot // bs, slot % bs; slot -1 untouched; fp8 stores x / scale."""
    latent, k_pe = torch.randn(3, 8), torch.randn(3, 4)
    cache = torch.zeros(2, 4, 12)
    double.concat_and_cache_mla(latent, k_pe, cache, torch.tensor([6, -1, 0]), "auto", torch.ones(1))
    assert torch.equal(cache[1, 2], torch.cat((latent[0], k_pe[0])))
    assert torch.equal(cache[0, 0], torch.cat((latent[2], k_pe[2])))
    assert int((cache != 0).any(-1).sum()) == 2
    fp8 = torch.zeros(2, 4, 12, dtype=double.dtypes.fp8)
    double.concat_and_cache_mla(latent, k_pe, fp8, torch.tensor([6, -1, 0]), "fp8", torch.full((1,), 0.5))
    torch.testing.assert_close(fp8[1, 2].float(), (torch.cat((latent[0], k_pe[0])) * 2).to(fp8.dtype).float())


def test_shapes_the_mla_kernels_cannot_take_and_clamped_experts_fall_back_at_start_up(double):
    def table(**facts):
        return dict(registry.resolve("aiter", torch.device("cpu"),
                                     registry.ModelFacts(dtype=torch.bfloat16, **facts)).table())
    assert table(mla_heads=16, mla_entry=(512, 64))["mla_attention"].startswith("aiter.")
    assert "fallback: mla_decode_fwd's assembly kernels are built for 512+64" in \
        table(mla_heads=16, mla_entry=(32, 16))["mla_attention"]
    assert "fallback: mla_decode_fwd runs at most 128" in table(mla_heads=256, mla_entry=(512, 64))["mla_attention"]
    assert table()["fused_experts"].startswith("aiter.")
    clamped = table(clamped_experts=True)
    for op in ("fused_experts", "fused_experts_fp8", "fused_experts_mxfp4"):
        assert "fallback: aiter's fused_moe has no clamped SwiGLU" in clamped[op], op


def test_model_facts_carry_the_mla_shape_and_the_clamp(tmp_path):
    from engine.config import EngineConfig
    from engine.loader.source import load_hf_config
    from engine.runner.model_facts import model_facts
    root = Path(__file__).parents[2] / "benchmarks" / "configs"
    v3 = model_facts(load_hf_config(root / "deepseek-v3"), EngineConfig(model="x"), torch.bfloat16)
    assert (v3.mla_heads, v3.mla_entry, v3.clamped_experts) == (128, (512, 64), False)
    v4 = model_facts(load_hf_config(root / "deepseek-v4-flash"), EngineConfig(model="x"), torch.bfloat16)
    assert v4.clamped_experts and v4.mla_entry is None
