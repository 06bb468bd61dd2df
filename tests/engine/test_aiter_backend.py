"""The `aiter` kernel backend's adapter code (layouts, weight preparation, dispatch and fallback rules), run
end to end on CPU against the AITER test double (tests/aiter_double: each used function's documented
semantics in torch). Whether the double matches the real AITER is test_aiter_api_drift.py's job; whether
the real kernels match the double only a ROCm host can say (benchmarks/validate_rocm.py)."""
from __future__ import annotations

import pytest
import torch

import aiter_double
from engine.kernels import registry
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from tiny_models import make_trained_tiny_model, training_sequence

# pa_fwd_asm serves head size 128 only: these shapes keep attention on AITER (GQA 2).
AITER_SHAPES = dict(hidden_size=256, num_attention_heads=2, num_key_value_heads=1, head_dim=128,
                    intermediate_size=384)


@pytest.fixture
def double(request):
    """The double imported as `aiter`, the backend allowed on the CPU, for one emulated GPU arch."""
    with aiter_double.serving(getattr(request, "param", "gfx950")) as module:
        yield module


# Trained briefly (tests/tiny_models.make_trained_tiny_model): bf16 kernels that round differently from the
# reference flip a random model's near-tied choices; a trained model's margins are a real model's.
@pytest.fixture(scope="module")
def trained_llama(tmp_path_factory):
    return make_trained_tiny_model(tmp_path_factory.mktemp("aiter") / "llama", "llama", **AITER_SHAPES)


@pytest.fixture(scope="module")
def trained_moe(tmp_path_factory):
    return make_trained_tiny_model(tmp_path_factory.mktemp("aiter") / "moe", "qwen3_moe",
                                   **AITER_SHAPES)


def greedy(folder, backend: str, **kwargs) -> list[list[int]]:
    text = training_sequence(folder, 120)
    prompts = [text[:40], text[50:53], text[60:120]]  # one longer than a 16-token chunk, one of 3 tokens
    llm = LLM(str(folder), kernel_backend=backend, dtype="bfloat16", num_kv_blocks=64, device="cpu", **kwargs)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0))
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("model", ["trained_llama", "trained_moe"])
def test_greedy_tokens_match_the_torch_backend(double, model, request):
    folder = request.getfixturevalue(model)
    expected = greedy(folder, "torch")
    aiter_double.CALLS.clear()
    assert greedy(folder, "aiter") == expected
    ran = set(aiter_double.CALLS)
    assert {"pa_fwd_asm", "flash_attn_varlen_func", "reshape_and_cache", "rmsnorm2d_fwd_with_add",
            "rope_cached_positions_2c_fwd_inplace", "silu_and_mul"} <= ran, ran
    if model == "tiny_moe":
        assert {"topk_softmax", "fused_moe"} <= ran, ran


def test_chunked_prefill_reads_the_shuffled_cache(double, trained_llama):
    """Prompts longer than the step budget are prefilled in chunks: later chunks gather their context from
    AITER's 5-D cache."""
    kwargs = dict(max_num_batched_tokens=16, max_num_seqs=4)
    expected = greedy(trained_llama, "torch", **kwargs)
    assert greedy(trained_llama, "aiter", **kwargs) == expected


@pytest.mark.parametrize("scheme", ["fp8_tensor", "fp8_channel", "fp8_block", "mxfp4"])
def test_quantized_layers_agree_with_the_torch_reference(double, trained_llama, scheme):
    """Online-quantized weights through AITER's quantized GEMMs (shuffled, fnuz where the arch needs it)
    give the torch reference's teacher-forced choices."""
    sequence = training_sequence(trained_llama, 96)

    def top1(backend):
        llm = LLM(str(trained_llama), kernel_backend=backend, dtype="bfloat16", num_kv_blocks=64, device="cpu",
                  quantization=scheme)
        out = llm.generate([sequence], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1))[0]
        return [min(p.items(), key=lambda kv: kv[1].rank)[0] for p in out.prompt_logprobs[1:]]

    expected = top1("torch")
    aiter_double.CALLS.clear()
    got = top1("aiter")
    agreement = sum(a == b for a, b in zip(got, expected)) / len(expected)
    assert agreement >= 0.95, agreement
    kernels = {"fp8_tensor": "tgemm.mm", "fp8_channel": "gemm_a8w8_bpreshuffle",
               "fp8_block": "gemm_a8w8_blockscale_bpreshuffle", "mxfp4": None}[scheme]
    if kernels:
        assert any(kernels.split(".")[-1] in name for name in aiter_double.CALLS), aiter_double.CALLS


@pytest.mark.parametrize("double", ["gfx942"], indirect=True)
def test_mi300x_converts_fp8_to_fnuz_and_sends_mxfp4_elsewhere(double):
    from engine.kernels.aiter import quant as aiter_quant
    from engine.kernels.quant import QuantScheme, quantize_weight
    weight = torch.randn(256, 256) * 0.05
    qw = quantize_weight(weight, QuantScheme("fp8_channel"))
    aiter_quant.gemm_fp8_channel.prepare(qw)
    prepared = qw.prepared["aiter"]
    assert prepared["weight"].dtype == torch.float8_e4m3fnuz
    torch.testing.assert_close(prepared["scale"], qw.scale * 2)
    x = torch.randn(5, 256, dtype=torch.bfloat16)
    from engine.kernels.torch.quant import gemm_quantized
    got, reference = aiter_quant.gemm_fp8_channel(x, qw).float(), gemm_quantized(x, qw).float()
    exact = x.float() @ weight.t()
    # fnuz rounds differently from e4m3fn, so compare errors: both within FP8's few per cent of the exact product
    assert (got - exact).norm() / exact.norm() < 0.06
    assert (got - reference).norm() / reference.norm() < 0.06
    facts = registry.ModelFacts(head_sizes=(128,), gqa_ratios=(2,))
    backend = registry.resolve("aiter", torch.device("cpu"), facts)
    assert "gfx950" in backend.sources["gemm_mxfp4"] and "torch" in backend.sources["gemm_mxfp4"]


def test_the_kernel_table_names_each_aiter_kernel_and_each_fallback(double):
    facts = registry.ModelFacts(head_sizes=(64,), gqa_ratios=(3,), block_size=16)
    backend = registry.resolve("aiter", torch.device("cpu"), facts)
    sources = dict(backend.table())
    assert sources["gemm_fp8_block"] == "aiter.get_hip_quant(per_1x128) + aiter.gemm_a8w8_blockscale_bpreshuffle"
    assert sources["fused_experts"] == "aiter.fused_moe.fused_moe"
    assert "torch fallback: pa_fwd_asm needs head size 128" in sources["attention"]
    assert sources["gemm_float32"].startswith("torch.ops.gemm_float32")
    served = registry.resolve("aiter", torch.device("cpu"), registry.ModelFacts(head_sizes=(128,), gqa_ratios=(8,)))
    assert dict(served.table())["attention"].startswith("aiter.reshape_and_cache")
    window = registry.resolve("aiter", torch.device("cpu"),
                              registry.ModelFacts(head_sizes=(128,), gqa_ratios=(8,), sliding_window=True))
    assert "sliding window" in dict(window.table())["attention"]
    sinks = registry.resolve("aiter", torch.device("cpu"), registry.ModelFacts(
        head_sizes=(128,), gqa_ratios=(8,), attention_extras=("attention sinks", "logit soft-capping")))
    assert "pa_fwd_asm has no attention sinks or logit soft-capping" in dict(sinks.table())["attention"]


def test_gelu_tanh_gate_runs_on_aiter_as_the_torch_reference(double):
    """Gemma's gated MLP activation: AITER's gelu_tanh_and_mul (one kernel) against the torch op, and the
    float32 model's fallback."""
    from engine.kernels.torch import ops as torch_ops
    backend = registry.resolve("aiter", torch.device("cpu"), registry.ModelFacts(head_sizes=(128,), gqa_ratios=(2,)))
    assert backend.sources["gelu_tanh_and_mul"] == "aiter.gelu_tanh_and_mul"
    x = torch.randn(3, 5, 64, dtype=torch.bfloat16)
    aiter_double.CALLS.clear()
    out = backend.ops["gelu_tanh_and_mul"](x)
    assert aiter_double.CALLS == {"gelu_tanh_and_mul": 1} and out.shape == (3, 5, 32)
    torch.testing.assert_close(out, torch_ops.gelu_tanh_and_mul(x), rtol=1e-2, atol=1e-2)
    assert not torch.allclose(out.float(), torch_ops.silu_and_mul(x).float(), atol=1e-2), "not SiLU's gate"
    float32 = registry.resolve("aiter", torch.device("cpu"),
                               registry.ModelFacts(head_sizes=(128,), gqa_ratios=(2,), dtype=torch.float32))
    assert "aiter" not in float32.sources["gelu_tanh_and_mul"]


def test_gpt_oss_facts_name_its_sinks(tmp_path):
    from transformers import AutoConfig

    from engine.config import EngineConfig
    from engine.runner.model_facts import model_facts
    from tiny_models import make_tiny_gpt_oss
    folder = make_tiny_gpt_oss(tmp_path / "gpt_oss")
    facts = model_facts(AutoConfig.from_pretrained(folder), EngineConfig.from_kwargs(str(folder)), torch.bfloat16)
    assert facts.attention_extras == ("attention sinks",) and facts.sliding_window


def test_fp8_kv_cache_on_aiter_matches_the_torch_fp8_cache(double, trained_llama):
    """Per-token FP8 KV (AITER's reshape_and_cache_with_pertoken_quant + pa_fwd_asm with scales)."""
    expected = greedy(trained_llama, "torch", kv_cache_dtype="fp8")
    aiter_double.CALLS.clear()
    got = greedy(trained_llama, "aiter", kv_cache_dtype="fp8")
    assert "reshape_and_cache_with_pertoken_quant" in aiter_double.CALLS
    matching = sum(a == b for x, y in zip(got, expected) for a, b in zip(x, y))
    assert matching >= 0.95 * sum(len(x) for x in expected), (got, expected)


def test_atom_ray_kernels_prints_the_table_a_rocm_user_gets(double, trained_llama, capsys):
    from atom_ray.cli import main
    assert main(["kernels", "--model", str(trained_llama), "--kernel-backend", "aiter", "--device", "cpu",
                 "--dtype", "bfloat16", "--kv-cache-dtype", "fp8"]) == 0
    printed = capsys.readouterr().out
    assert "kernel backend aiter" in printed
    assert "pa_fwd_asm" in printed and "aiter.fused_moe.fused_moe" in printed
    assert "gemm_float32" in printed and "torch fallback" not in printed.split("attention")[-1]


@pytest.mark.parametrize("scheme", [None, "fp8_block"])
def test_experts_of_other_ranks_add_nothing(double, scheme):
    """Expert parallelism hands the expert op -1 for experts held elsewhere: fused_moe gets them as an id
    its expert_mask marks absent, and the result is the reference's."""
    from engine.kernels.aiter import ops as aiter_ops
    from engine.kernels.aiter import quant as aiter_quant
    from engine.kernels.quant import QuantScheme, quantize_weight
    from engine.kernels.torch.moe import fused_experts as reference
    from engine.kernels.torch.quant import fused_experts_quantized
    torch.manual_seed(0)
    num_experts, hidden, inter = 4, 256, 128
    w13 = (torch.randn(num_experts, 2 * inter, hidden) * 0.05).bfloat16()
    w2 = (torch.randn(num_experts, hidden, inter) * 0.05).bfloat16()
    x = torch.randn(6, hidden).bfloat16()
    ids = torch.tensor([[0, -1], [3, 1], [-1, -1], [2, 0], [1, -1], [3, 2]], dtype=torch.int32)
    weights = torch.rand(6, 2)
    if scheme is None:
        expected = reference(x, w13, w2, weights, ids)
        shuffled13, shuffled2 = w13.clone(), w2.clone()
        aiter_ops.fused_experts.prepare_weights(shuffled13, shuffled2)
        got = aiter_ops.fused_experts(x, shuffled13, shuffled2, weights, ids)
    else:
        q13, q2 = (quantize_weight(w.float(), QuantScheme(scheme)) for w in (w13, w2))
        expected = fused_experts_quantized(x, q13, q2, weights, ids)
        aiter_quant.fused_experts_fp8.prepare(q13)
        aiter_quant.fused_experts_fp8.prepare(q2)
        got = aiter_quant.fused_experts_fp8(x, q13, q2, weights, ids)
    assert got[2].abs().max() == 0  # a token with no local expert
    bound = 0.02 if scheme is None else 0.04  # FP8: AITER quantizes the intermediate in its own groups
    assert (got.float() - expected.float()).norm() / expected.float().norm() < bound


def test_rope_tables_are_converted_once_per_model_table(double):
    """AITER's cos/sin come from our float32 table once (keyed by that table), not once per step."""
    from engine.kernels.aiter import ops as aiter_ops
    table = torch.randn(64, 32)
    positions = torch.arange(5)
    for _ in range(3):
        aiter_ops.rotary_embedding(positions, torch.randn(5, 2, 32).bfloat16(), torch.randn(5, 1, 32).bfloat16(),
                                   table, True)
    assert sum(key[0] == table.data_ptr() for key in aiter_ops._ROPE_TABLES) == 1
