"""MTP drafting (speculative_config method "mtp") on a tiny DeepSeek-V3 whose checkpoint carries a
multi-token-prediction layer (model.layers.{num_hidden_layers}.*).

The drafter really drafts: an MTP layer trained here for 300 CPU steps on the tiny target's own greedy
continuations of 48 prompts (tests/mtp_training.py: transformers' DeepseekV3DecoderLayer as its block and the
published forward: the embedding of token p + 1 and the target's last hidden state at p, each normed,
concatenated (embedding first), projected, one decoder layer, shared_head.norm, the target's head) keeps most
of its drafts when the engine runs it on those prompts. A random tiny target's continuations are too arbitrary
for 48 examples to generalise from (measured: 0.005 on fresh prompts even with 512), so what this checks is the
engine's wiring: which token, which hidden state and which position feed each draft, the drafter's own cache
filled through prefill chunks and verify steps, and its chained steps. The same weights fed the neighbouring
row's hidden state, or the token before the right one, keep almost nothing. With any weights the tokens are
those of a run without speculation, and nothing leaks."""
from __future__ import annotations

import pytest
from safetensors.torch import save_file

import tiny_models
from engine import LLM, SamplingParams
from engine.config import ConfigError
from engine.models.deepseek_v2 import DeepseekV3ForCausalLM
from mtp_training import train_mtp, training_prompts

MTP = {"method": "mtp", "num_speculative_tokens": 3}
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny DeepSeek-V3 with a trained MTP layer in its checkpoint, and its MTP tensors."""
    folder = tiny_models.make_tiny_model(tmp_path_factory.mktemp("dsv3-mtp"), "deepseek_v3",
                                         num_nextn_predict_layers=1)
    tensors = train_mtp(folder)
    save_file(tensors, str(folder / "model-mtp.safetensors"))
    return folder, tensors


def acceptance(folder, prompts, speculative_config=MTP, **engine_args) -> tuple[float, list, dict]:
    llm = LLM(str(folder), dtype="float32", show_progress=False, speculative_config=speculative_config,
              **engine_args)
    try:
        outputs = llm.generate(prompts, GREEDY)
        stats = llm.engine.stats()
    finally:
        llm.shutdown()
    return stats["spec_acceptance_rate"], [o.token_ids for o in outputs], stats


def test_trained_mtp_layer_keeps_most_drafts_and_gives_the_tokens_without_speculation(trained):
    folder, _ = trained
    prompts = training_prompts()
    plain = LLM(str(folder), dtype="float32", show_progress=False)
    expected = [o.token_ids for o in plain.generate(prompts, GREEDY)]
    plain.shutdown()
    rate, tokens, stats = acceptance(folder, prompts, {"method": "mtp", "num_speculative_tokens": 1})
    assert tokens == expected
    assert rate > 0.8, stats  # measured 1.0: its first draft is what it was trained on
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
    # three drafts a step (the later ones from its own hidden state, which it was not trained on)
    rate3, tokens, stats = acceptance(folder, prompts, MTP)
    assert tokens == expected and rate3 > 0.3, stats  # measured 0.55
    # chunked prefill (4-token chunks: the drafter's cache filled a chunk at a time), small blocks, a tight cache
    rate, tokens, stats = acceptance(folder, prompts, {"method": "mtp", "num_speculative_tokens": 1},
                                     max_num_batched_tokens=4, max_num_seqs=4, num_kv_blocks=48, block_size=4,
                                     max_model_len=64)
    assert tokens == expected and rate > 0.8, stats
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]


def miswired(kind):
    """mtp_forward fed the neighbouring row's hidden state, or the token one position early."""
    original = DeepseekV3ForCausalLM.mtp_forward

    def forward(self, input_ids, previous_hidden, positions):
        if kind == "hidden":
            previous_hidden = previous_hidden.roll(1, dims=0)
        else:
            input_ids = input_ids.roll(1, dims=0)
        return original(self, input_ids, previous_hidden, positions)
    return forward


@pytest.mark.parametrize("kind", ["hidden", "token"])
def test_a_miswired_mtp_layer_keeps_almost_nothing(trained, monkeypatch, kind):
    folder, _ = trained
    k1 = {"method": "mtp", "num_speculative_tokens": 1}
    good, _, _ = acceptance(folder, training_prompts(), k1)
    monkeypatch.setattr(DeepseekV3ForCausalLM, "mtp_forward", miswired(kind))
    rate, _, _ = acceptance(folder, training_prompts(), k1)
    assert rate < 0.15 and rate < good / 4, (rate, good)


def test_mtp_is_refused_where_it_cannot_draft(tiny_model_dirs):
    with pytest.raises(ConfigError, match="no weights for its multi-token-prediction layer"):
        LLM(str(tiny_model_dirs["deepseek_v3"]), show_progress=False, speculative_config=MTP)
    with pytest.raises(ConfigError, match="no multi-token-prediction layer"):
        LLM(str(tiny_model_dirs["deepseek_v2"]), show_progress=False, speculative_config=MTP,
            hf_overrides={"num_nextn_predict_layers": 0})
    with pytest.raises(ConfigError, match="MTP drafting is built for DeepSeek"):
        LLM(str(tiny_model_dirs["llama"]), show_progress=False, speculative_config=MTP)


def tiny_with_mtp(folder, arch):
    if arch.startswith("qwen3"):  # Qwen3-Next / Qwen3.5: the mtp.* layout, Gated DeltaNet target layers
        return tiny_models.make_tiny_qwen3_next(folder, model_type=arch, num_nextn_predict_layers=1)
    return tiny_models.make_tiny_model(folder, arch, num_nextn_predict_layers=1)


@pytest.mark.parametrize("arch", ["deepseek_v3", "glm4_moe", "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text"])
def test_untrained_mtp_layers_give_the_tokens_without_speculation(tmp_path, arch):
    """Random MTP weights (GLM-4.5's layout is DeepSeek's; Qwen3-Next's and Qwen3.5's are `mtp.*`, beside
    Gated DeltaNet layers whose states move back): drafts run and are mostly rejected, the tokens are those of a
    run without speculation, with chunked prefill and preemption, and nothing leaks. The plain engine loads the
    same files (the MTP tensors skipped)."""
    folder = str(tiny_models.add_random_mtp_layer(tiny_with_mtp(tmp_path / arch, arch)))
    prompts = training_prompts()[:6] + [list(range(10, 40))]
    plain = LLM(folder, dtype="float32", show_progress=False)
    expected = [o.token_ids for o in plain.generate(prompts, GREEDY)]
    plain.shutdown()
    for engine_args in ({}, dict(max_num_batched_tokens=8, max_num_seqs=4, num_kv_blocks=20, block_size=4,
                                 max_model_len=80)):
        _, tokens, stats = acceptance(folder, prompts, **engine_args)
        assert tokens == expected
        assert stats["spec_draft_tokens"] > 0 and stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
    assert stats["num_preemptions"] > 0


def test_an_fp8_checkpoint_loads_its_mtp_layer_quantized(tmp_path):
    """DeepSeek's FP8 release stores the MTP layer like the others (128x128 FP8 blocks with weight_scale_inv,
    experts one by one): written so by the quantizer, it loads into an FP8 MTP layer that drafts. (The tokens
    are not compared with a run without speculation: under FP8 a verify step's MLA runs the expanded prefill
    path, whose kv_b_proj quantizes its activations, where a decode step runs the absorbed one; they round
    differently, more than bf16's near-ties.)"""
    import subprocess
    import sys
    src = tiny_models.add_random_mtp_layer(tiny_models.make_tiny_model(
        tmp_path / "src", "deepseek_v3", num_nextn_predict_layers=1, moe_intermediate_size=128, hidden_size=128,
        intermediate_size=256))
    dst = tmp_path / "fp8"
    subprocess.run([sys.executable, "-m", "engine.quantization.quantizer", str(src), str(dst), "--format",
                    "fp8-block"], check=True, capture_output=True)
    llm = LLM(str(dst), dtype="float32", show_progress=False, speculative_config=MTP)
    try:
        mtp = llm.engine.executor.runner.model.mtp
        assert mtp.eh_proj.quant_scheme.method == "fp8_block"
        assert mtp.block.mlp.quant_scheme.method == "fp8_block"
        assert mtp.block.self_attn.kv_b_proj.quant_scheme.method == "fp8_block"
        llm.generate(training_prompts()[:4], GREEDY)
        stats = llm.engine.stats()
        assert stats["spec_draft_tokens"] > 0 and stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
    finally:
        llm.shutdown()


def test_a_request_that_keeps_nothing_stops_speculating_for_a_while(tmp_path):
    """Adaptive speculation: random MTP weights keep (almost) no drafts, so after 4 such verify steps a
    request pauses for 32 output tokens (no drafts, no drafting for it), then probes with one draft. Over 96
    tokens it verifies a few dozen times at most, not once per token; adaptive off, it verifies every step."""
    folder = str(tiny_models.add_random_mtp_layer(tiny_with_mtp(tmp_path / "dsv3", "deepseek_v3")))
    params = SamplingParams(temperature=0, max_tokens=96, ignore_eos=True)
    counts = {}
    for adaptive in (True, False):
        llm = LLM(folder, dtype="float32", show_progress=False, max_model_len=256,
                  speculative_config={**MTP, "adaptive": adaptive})
        try:
            llm.generate([[5, 6, 7, 8]], params)
            counts[adaptive] = llm.engine.stats()
        finally:
            llm.shutdown()
    assert counts[True]["spec_acceptance_rate"] < 0.1
    assert counts[True]["spec_verifies"] <= 24, counts[True]
    assert counts[False]["spec_verifies"] > 60, counts[False]
