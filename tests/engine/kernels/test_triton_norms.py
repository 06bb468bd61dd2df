"""The Triton RMSNorm variants against the torch references: every style of NORM_STYLES (offset (1 + w), w in
float32, weightless, Llama's) alone and fused with the residual add, and Gated DeltaNet's gated norm, in float32
and bfloat16, at odd and model-sized rows and on strided per-head views; negative controls show that a kernel
computing the wrong formula fails the same checks. Then tiny Gemma 4, Qwen3-Next and gpt-oss give the torch
backend's logits and greedy tokens with these kernels in place of the torch norms.

On a CUDA GPU the kernels run compiled; elsewhere under TRITON_INTERPRET=1 (whose float32 -> bfloat16 casts
truncate instead of rounding: bfloat16 results may differ from torch's by one unit in the last place)."""
from __future__ import annotations

import functools

import pytest
import torch

from triton_device import DEVICE, ON_GPU  # noqa: E402  (skips the module without Triton)

import tiny_models  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from engine.kernels import ops as live_ops  # noqa: E402
from engine.kernels import torch as torch_backend  # noqa: E402
from engine.kernels import triton as triton_backend  # noqa: E402
from engine.kernels.torch import ops as reference  # noqa: E402
from engine.kernels.triton import ops  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16]
TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}
STYLES = ["offset", "float32", "none", "llama"]
# Odd rows, Gemma 4's hidden size, a row longer than one pass (two passes over chunks).
HIDDEN = [80, 5376, 40000] if ON_GPU else [80, 5376]
EPS = 1e-6


def randn(*shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape) * scale).to(device=DEVICE, dtype=dtype)


def norm_weight(style: str, hidden: int, dtype: torch.dtype) -> torch.Tensor | None:
    """Weights as the checkpoints hold them: offsets from one near zero for "offset", near one otherwise."""
    if style == "none":
        return None
    return randn(hidden, dtype=dtype, scale=0.3) + (0.0 if style == "offset" else 1.0)


def assert_matches(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    torch.testing.assert_close(actual.float(), expected.float(), **TOLERANCE[expected.dtype])


# ---- rms_norm_variant ----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("style", STYLES)
def test_each_style_matches_its_reference(style, hidden, dtype):
    x, weight = randn(5, hidden, dtype=dtype, scale=3.0), norm_weight(style, hidden, dtype)
    assert_matches(ops.rms_norm_variant(x, weight, EPS, style), reference.rms_norm_variant(x, weight, EPS, style))


@pytest.mark.parametrize("style", ["offset", "float32"])
def test_a_float32_weight_on_bfloat16_activations_gives_bfloat16(style):
    """gpt-oss keeps its norm weights in float32: the product is taken there, the output is x's dtype."""
    x, weight = randn(6, 80, dtype=torch.bfloat16), norm_weight(style, 80, torch.float32)
    out = ops.rms_norm_variant(x, weight, EPS, style)
    assert out.dtype == torch.bfloat16
    assert_matches(out, reference.rms_norm_variant(x, weight, EPS, style))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [256, 512])
@pytest.mark.parametrize("style", ["offset", "float32", "none"])
def test_per_head_norms_of_strided_views_into_a_fused_qkv_output(style, head_dim, dtype):
    """q/k/v norms (Gemma 4's head dims 256 and 512, Qwen3-Next's offset q/k norms) on [T, H, D] views whose
    rows are a fused projection's, without a copy: each head normalised on its own."""
    tokens, heads, kv_heads = 3, 4, 2
    qkv = randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, scale=2.0)
    q = qkv[:, :heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    assert not q.is_contiguous() and not k.is_contiguous()
    weight = norm_weight(style, head_dim, dtype)
    for view in (q, k):
        expected = reference.rms_norm_variant(view, weight, EPS, style)
        assert_matches(ops.rms_norm_variant(view, weight, EPS, style), expected)


def test_a_transposed_input_is_normalised_along_its_last_dimension():
    x = randn(80, 6).t()  # last stride not one: copied first
    weight = norm_weight("offset", 80, torch.float32)
    assert_matches(ops.rms_norm_variant(x, weight, EPS, "offset"), reference.rms_norm_variant(x, weight, EPS, "offset"))


def test_no_rows_give_an_empty_result():
    out = ops.rms_norm_variant(randn(0, 80), None, EPS, "none")
    assert out.shape == (0, 80)


def test_an_unknown_style_is_refused_naming_the_styles():
    with pytest.raises(ValueError, match="style 'gemma' is unknown; one of"):
        ops.rms_norm_variant(randn(2, 80), randn(80), EPS, "gemma")


# ---- fused_add_rms_norm_variant ------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("style", STYLES)
def test_fused_residual_variant_returns_the_norm_of_the_sum_and_the_sum(style, hidden, dtype):
    x, residual = randn(5, hidden, dtype=dtype), randn(5, hidden, dtype=dtype, scale=4.0)
    weight = norm_weight(style, hidden, dtype)
    normed, summed = ops.fused_add_rms_norm_variant(x, residual, weight, EPS, style)
    expected_normed, expected_sum = reference.fused_add_rms_norm_variant(x, residual, weight, EPS, style)
    assert_matches(summed, expected_sum)
    assert_matches(normed, expected_normed)
    if ON_GPU or dtype == torch.float32:  # the add is exact arithmetic (the interpreter truncates to bf16)
        torch.testing.assert_close(summed, expected_sum, rtol=0, atol=0)


@pytest.mark.parametrize("x_dtype, residual_dtype", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)],
                         ids=["float32-sum-into-bf16-stream", "bf16-into-float32-stream"])
@pytest.mark.parametrize("style", ["offset", "float32"])
def test_fused_residual_variant_adds_in_the_residuals_dtype(style, x_dtype, residual_dtype):
    """A float32 all-reduced sum is rounded to the residual's dtype before the add; a float32 residual stream
    stays float32, and so does the normalised output (the layer's torch path gives that too)."""
    x, residual = randn(4, 80, dtype=x_dtype), randn(4, 80, dtype=residual_dtype)
    weight = norm_weight(style, 80, torch.bfloat16)
    normed, summed = ops.fused_add_rms_norm_variant(x, residual, weight, EPS, style)
    expected_normed, expected_sum = reference.fused_add_rms_norm_variant(x, residual, weight, EPS, style)
    assert summed.dtype == normed.dtype == residual_dtype
    assert_matches(summed, expected_sum)
    assert_matches(normed, expected_normed)


def test_fused_residual_variant_leaves_its_inputs_alone():
    x, residual = randn(3, 80), randn(3, 80)
    before = (x.clone(), residual.clone())
    ops.fused_add_rms_norm_variant(x, residual, norm_weight("float32", 80, torch.float32), EPS, "float32")
    assert torch.equal(x, before[0]) and torch.equal(residual, before[1])


# ---- rms_norm_gated ------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [80, 128])
def test_gated_norm_of_each_value_head_matches_the_reference(head_dim, dtype):
    """Gated DeltaNet's output [T, H, dv] with the gate z a strided view into the in-projection's output: each
    head normalised alone, one weight [dv] for all heads."""
    tokens, heads = 5, 4
    x = randn(tokens, heads, head_dim, dtype=dtype, scale=2.0)
    projection = randn(tokens, 3 * heads * head_dim, dtype=dtype)
    gate = projection[:, heads * head_dim:2 * heads * head_dim].view(tokens, heads, head_dim)
    assert not gate.is_contiguous()
    weight = norm_weight("llama", head_dim, dtype)
    assert_matches(ops.rms_norm_gated(x, gate, weight, EPS), reference.rms_norm_gated(x, gate, weight, EPS))


def test_gated_norm_with_a_float32_weight_keeps_the_product_in_float32():
    x, gate = randn(6, 2, 80, dtype=torch.bfloat16), randn(6, 2, 80, dtype=torch.bfloat16)
    weight = norm_weight("llama", 80, torch.float32)
    assert_matches(ops.rms_norm_gated(x, gate, weight, EPS), reference.rms_norm_gated(x, gate, weight, EPS))


def test_gated_norm_of_rows_longer_than_one_pass():
    x, gate, weight = randn(2, 40000), randn(2, 40000), norm_weight("llama", 40000, torch.float32)
    assert_matches(ops.rms_norm_gated(x, gate, weight, EPS), reference.rms_norm_gated(x, gate, weight, EPS))


# ---- negative controls: the checks above catch a kernel with the wrong formula ----------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_offset_without_the_one_fails_the_offset_check(dtype):
    """The "float32" style is the offset style without + 1: run on an offset weight it must not pass."""
    x, weight = randn(5, 80, dtype=dtype), norm_weight("offset", 80, dtype)
    expected = reference.rms_norm_variant(x, weight, EPS, "offset")
    assert_matches(ops.rms_norm_variant(x, weight, EPS, "offset"), expected)
    with pytest.raises(AssertionError):
        assert_matches(ops.rms_norm_variant(x, weight, EPS, "float32"), expected)


def test_a_weightless_norm_fails_the_weighted_check():
    x, weight = randn(5, 80), norm_weight("float32", 80, torch.float32)
    with pytest.raises(AssertionError):
        assert_matches(ops.rms_norm_variant(x, None, EPS, "none"),
                       reference.rms_norm_variant(x, weight, EPS, "float32"))


def test_a_norm_without_the_residual_fails_the_fused_check():
    x, residual, weight = randn(5, 80), randn(5, 80), norm_weight("offset", 80, torch.float32)
    expected_normed, _ = reference.fused_add_rms_norm_variant(x, residual, weight, EPS, "offset")
    with pytest.raises(AssertionError):
        assert_matches(ops.rms_norm_variant(x, weight, EPS, "offset"), expected_normed)


def test_a_gated_norm_without_the_gate_fails_the_gated_check():
    x, gate, weight = randn(5, 2, 80), randn(5, 2, 80), norm_weight("llama", 80, torch.float32)
    expected = reference.rms_norm_gated(x, gate, weight, EPS)
    with pytest.raises(AssertionError):
        assert_matches(ops.rms_norm_variant(x, weight, EPS, "llama"), expected)


# ---- models: the torch backend with the Triton norms in place of its own ---------------------------------

NORM_OPS = ("rms_norm_variant", "fused_add_rms_norm_variant", "rms_norm_gated")
PROMPTS = [list(range(3, 15)), [5, 6, 7]]  # short: every interpreted launch costs milliseconds
GREEDY_8 = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture
def triton_norms(monkeypatch):
    """Puts the Triton norm kernels into the torch backend's table (what LLM activates) and into the live ops
    (what a model built directly calls); returns the number of calls each took."""
    calls = dict.fromkeys(NORM_OPS, 0)

    def counted(name):
        kernel = triton_backend.BACKEND.ops[name]

        def run(*args):
            calls[name] += 1
            return kernel(*args)
        return run

    for name in NORM_OPS:
        monkeypatch.setitem(torch_backend.BACKEND.ops, name, counted(name))
        monkeypatch.setattr(live_ops, name, torch_backend.BACKEND.ops[name])
    return calls


# Gemma 4 with untied embeddings: with tied ones this tiny model's greedy tokens repeat one id.
MODELS = {"gemma4": functools.partial(tiny_models.make_tiny_gemma4, tie_word_embeddings=False),
          "qwen3_next": tiny_models.make_tiny_qwen3_next, "gpt_oss": tiny_models.make_tiny_gpt_oss}
# Which norm ops each family runs: Gemma 4 normalises each block's output before its add; the Llama-shaped
# families fuse the add into the next norm.
USES = {"gemma4": {"rms_norm_variant"}, "qwen3_next": set(NORM_OPS),
        "gpt_oss": {"rms_norm_variant", "fused_add_rms_norm_variant"}}


@pytest.fixture(scope="module", params=list(MODELS))
def model(request, tmp_path_factory):
    if ON_GPU:
        pytest.skip("the model comparison runs on the CPU (the torch backend with the interpreted kernels)")
    assert all(torch_backend.BACKEND.ops[name] is getattr(reference, name) for name in NORM_OPS)  # the baseline
    folder = MODELS[request.param](tmp_path_factory.mktemp(request.param))
    expected_logits = tiny_models.folder_logits(folder, PROMPTS[0])
    expected_tokens = [out.token_ids for out in LLM(str(folder), dtype="float32", show_progress=False)
                       .generate(PROMPTS, GREEDY_8)]
    return request.param, folder, expected_logits, expected_tokens


def test_tiny_models_give_the_torch_norms_logits_and_greedy_tokens(model, triton_norms):
    name, folder, expected_logits, expected_tokens = model
    logits = tiny_models.folder_logits(folder, PROMPTS[0])
    assert tiny_models.logits_close(logits, expected_logits, tolerance=1e-4), (logits - expected_logits).abs().max()
    tokens = [out.token_ids for out in LLM(str(folder), dtype="float32", show_progress=False)
              .generate(PROMPTS, GREEDY_8)]
    assert tokens == expected_tokens, (tokens, expected_tokens)
    assert {op for op, count in triton_norms.items() if count} == USES[name]


def test_a_norm_kernel_with_the_wrong_style_breaks_the_comparison(model, triton_norms, monkeypatch):
    """The negative control of the comparison above: the Triton kernels with offset and float32 swapped (the
    offset weight without its + 1, or a + 1 too many) move the logits far past the tolerance."""
    _, folder, expected_logits, _ = model
    swapped = {"offset": "float32", "float32": "offset", "none": "none", "llama": "llama"}
    monkeypatch.setattr(live_ops, "rms_norm_variant",
                        lambda x, weight, eps, style: ops.rms_norm_variant(x, weight, eps, swapped[style]))
    monkeypatch.setattr(live_ops, "fused_add_rms_norm_variant", lambda x, residual, weight, eps, style:
                        ops.fused_add_rms_norm_variant(x, residual, weight, eps, swapped[style]))
    assert not tiny_models.logits_close(tiny_models.folder_logits(folder, PROMPTS[0]), expected_logits, tolerance=1e-4)
