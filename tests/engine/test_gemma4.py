"""Gemma 4 (dense text stack) against transformers' Gemma4ForCausalLM on a tiny random checkpoint (float32, CPU):
sliding and full layers with different head sizes and KV heads (two cache groups), K as V on the full layers,
proportional RoPE, weightless v norm, sandwich norms, layer scalars, scaled embeddings, soft-capped logits.
Each feature has a negative control that breaks the comparison. The E2B/E4B extras: test_gemma4_small.py."""
from __future__ import annotations

import pytest
import torch

import tiny_models
from engine import LLM, SamplingParams
from engine.kernels.attention import AttentionOptions

PROMPTS = [list(range(3, 40)), [5, 6, 7], list(range(50, 75)), [100] * 9 + [200]]


@pytest.fixture(scope="module")
def gemma4_dir(tmp_path_factory):
    return tiny_models.make_tiny_gemma4(tmp_path_factory.mktemp("gemma4"))


engine_logits = tiny_models.folder_logits
close_to_transformers = tiny_models.logits_close


def test_prompt_logits_match_transformers(gemma4_dir):
    prompt = list(range(3, 60))
    assert close_to_transformers(engine_logits(gemma4_dir, prompt), tiny_models.hf_logits(gemma4_dir, prompt))


def _no_window(model):
    for layer in model.model.layers:
        layer.self_attn.attn.options = AttentionOptions()


def _separate_v(model):  # V from its own (random) rows instead of the key's
    for layer in model.model.layers:
        attn = layer.self_attn
        if attn.k_eq_v:
            q, kv = attn.q_size, attn.kv_size
            attn.qkv_proj.weight.data[q + kv:] = torch.randn_like(attn.qkv_proj.weight.data[q + kv:]) * 0.2


def _no_layer_scalar(model):
    for layer in model.model.layers:
        layer.layer_scalar.data.fill_(1.0)


def _no_softcap(model):
    model.softcap = None


def _no_embed_scale(model):
    model.model.embed_scale = 1.0


def _v_norm_off(model):
    for layer in model.model.layers:
        layer.self_attn.v_norm = torch.nn.Identity()


@pytest.mark.parametrize("edit", [_no_window, _separate_v, _no_layer_scalar, _no_softcap, _no_embed_scale, _v_norm_off])
def test_negative_controls_break_parity(gemma4_dir, edit):
    prompt = list(range(3, 60))
    assert not close_to_transformers(engine_logits(gemma4_dir, prompt, edit), tiny_models.hf_logits(gemma4_dir, prompt))


@pytest.mark.parametrize("chunk", [None, 16])
def test_greedy_tokens_through_two_cache_groups_of_different_head_sizes(gemma4_dir, chunk):
    extra = {} if chunk is None else dict(max_num_batched_tokens=chunk, max_num_seqs=4)
    llm = LLM(str(gemma4_dir), dtype="float32", block_size=4, show_progress=False, **extra)
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    for prompt, output in zip(PROMPTS, outputs):
        assert output.token_ids == tiny_models.hf_greedy(gemma4_dir, prompt, 32)
    groups = {(g["ratio"], g["window"]): g for g in llm.engine.stats()["kv_cache_groups"]}
    assert set(groups) == {(1, None), (1, tiny_models.GEMMA4_CONFIG["sliding_window"])}
    assert all(g["num_free_blocks"] == g["num_blocks"] for g in groups.values())


def test_the_text_stack_of_a_gemma4_multimodal_checkpoint_serves_the_text_models_tokens(gemma4_dir, tmp_path):
    """Gemma4ForConditionalGeneration in the hub's layout (text weights under model.language_model., a vision
    tower and its embedder beside them): the text stack's tokens."""
    folder = tiny_models.as_gemma4_multimodal(gemma4_dir, tmp_path / "gemma4_it")
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    wrapped = LLM(str(folder), dtype="float32", show_progress=False).generate(PROMPTS, params)
    plain = LLM(str(gemma4_dir), dtype="float32", show_progress=False).generate(PROMPTS, params)
    assert [o.token_ids for o in wrapped] == [o.token_ids for o in plain]


MOE = dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32)


@pytest.fixture(scope="module")
def gemma4_moe_dir(tmp_path_factory):
    return tiny_models.make_tiny_gemma4(tmp_path_factory.mktemp("gemma4_moe"), **MOE)


def _route_normalised(model):  # the router fed the experts' normalised input instead of the residual stream
    for layer in model.model.layers:
        norm = layer.pre_feedforward_layernorm_2
        layer.moe.gate.route = (lambda route, norm: lambda x, *a, **k: route(norm(x), *a, **k))(layer.moe.gate.route,
                                                                                              norm)


def _no_per_expert_scale(model):
    for layer in model.model.layers:
        layer.moe.gate.per_expert_scale.data.fill_(1.0)


def _silu_experts(model):
    for layer in model.model.layers:
        layer.moe.gelu = False


def test_26b_a4b_experts_beside_the_mlp_match_transformers(gemma4_moe_dir):
    prompt = list(range(3, 60))
    reference = tiny_models.hf_logits(gemma4_moe_dir, prompt)
    assert close_to_transformers(engine_logits(gemma4_moe_dir, prompt), reference)
    for edit in (_route_normalised, _no_per_expert_scale, _silu_experts):
        assert not close_to_transformers(engine_logits(gemma4_moe_dir, prompt, edit), reference), edit.__name__
    llm = LLM(str(gemma4_moe_dir), dtype="float32", show_progress=False, max_num_batched_tokens=16, max_num_seqs=4)
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    assert [o.token_ids for o in outputs] == [tiny_models.hf_greedy(gemma4_moe_dir, p, 24) for p in PROMPTS]
