"""MTP drafting (speculative_config method "mtp") on a tiny DeepSeek-V3.2 and a tiny GLM-5, whose MTP layer
(model.layers.{num_hidden_layers}.*) is a DSA layer: MLA over the keys its own lightning indexer selects
(index_topk 8, shorter than the sequences drafted over), and a MoE MLP.

As for DeepSeek-V3 (tests/engine/test_spec_decode_mtp.py), the layer is trained on the CPU on the tiny target's
greedy continuations (tests/mtp_training.py, with transformers' DeepseekV32DecoderLayer / GlmMoeDsaDecoderLayer
as its block), then drafts in the engine: it keeps most single drafts on the prompts it was trained on, the
tokens are those of a run without speculation for k = 1..3, through chunked prefill and preemption, and
nothing leaks. Negative controls: the neighbouring row's hidden state keeps almost nothing, and the same
layer attending densely (no selection) keeps clearly fewer, so the drafter's own sparse selection is what it
was trained with. The loaded layer's logits equal transformers' for the same checkpoint tensors."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

import tiny_models
from engine import LLM, SamplingParams
from engine.forward_context import forward_context
from engine.kernels.attention import CommonAttentionMetadata
from engine.kv_cache_spec import FULL_GROUP
from engine.layers.dsa import SparseMLAAttention
from engine.layers.fused_moe import FusedMoE
from engine.loader import build_model, resolve_model
from engine.models.deepseek_v32 import DeepseekV32ForCausalLM
from mtp_training import reference_logits, train_mtp, training_prompts

FAMILIES = {"deepseek_v32": tiny_models.deepseek_v32_config, "glm_moe_dsa": tiny_models.glm_moe_dsa_config}
TRAIN_STEPS = 120  # (measured: then 0.97 (V3.2) and 0.99 (GLM-5) of single drafts kept; 100 steps: 0.96)
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
LOGIT_TOLERANCE = 1e-4  # as tests/engine/test_deepseek_v32.py: absorbed sparse MLA against expanded keys


def mtp(k: int) -> dict:
    return {"method": "mtp", "num_speculative_tokens": k}


@pytest.fixture(scope="module", params=list(FAMILIES))
def trained(request, tmp_path_factory):
    """A tiny DeepSeek-V3.2 or GLM-5 with a trained MTP layer in its checkpoint, and the layer's tensors."""
    folder = tiny_models.make_dsa_model(tmp_path_factory.mktemp(request.param),
                                        {**FAMILIES[request.param](), "num_nextn_predict_layers": 1})
    tensors = train_mtp(folder, steps=TRAIN_STEPS)
    save_file(tensors, str(folder / "model-mtp.safetensors"))
    return folder, tensors


def run(folder, prompts, speculative_config=None, edit=None, **engine_args) -> tuple[list, dict]:
    """Greedy tokens and stats of an engine over `prompts`, after `edit(model)` where given."""
    llm = LLM(str(folder), dtype="float32", show_progress=False, speculative_config=speculative_config,
              **engine_args)
    try:
        if edit is not None:
            edit(llm.engine.executor.runner.model)
        outputs = llm.generate(prompts, GREEDY)
        stats = llm.engine.stats()
    finally:
        llm.shutdown()
    return [o.token_ids for o in outputs], stats


def test_trained_mtp_layer_keeps_most_drafts_and_gives_the_tokens_without_speculation(trained):
    folder, _ = trained
    prompts = training_prompts()
    expected, _ = run(folder, prompts)
    rates = {}
    for k in (1, 2, 3):
        tokens, stats = run(folder, prompts, mtp(k))
        assert tokens == expected, k
        assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
        rates[k] = stats["spec_acceptance_rate"]
    # the first draft is what it was trained on; later ones come from its own hidden state, which it was not
    assert rates[1] > 0.8 and rates[3] > 0.3, rates  # measured 0.97-0.99 and 0.54-0.55
    # chunked prefill (4-token chunks: the drafter's index keys and latents cached a chunk at a time), small
    # blocks, a cache too small for four requests at once (preemption)
    tokens, stats = run(folder, prompts, mtp(3), max_num_batched_tokens=4, max_num_seqs=4, num_kv_blocks=14,
                        block_size=4, max_model_len=48)
    assert tokens == expected and stats["spec_acceptance_rate"] > 0.3, stats  # measured 0.60-0.62
    assert stats["num_preemptions"] > 0 and stats["num_free_kv_blocks"] == stats["num_kv_blocks"]


def test_mtp_layer_is_a_dsa_layer_with_its_own_caches(trained):
    """Its indexer is its own (a GLM-5 MTP layer too, whatever indexer_types says of the decoder layers), and
    its latent and index-key caches are its own, in the full group beside the target's layers'."""
    folder, _ = trained
    llm = LLM(str(folder), dtype="float32", show_progress=False, speculative_config=mtp(1))
    try:
        model = llm.engine.executor.runner.model
        attention = model.mtp.block.self_attn
        assert isinstance(attention, SparseMLAAttention) and attention.indexer is not None
        assert isinstance(model.mtp.block.mlp, FusedMoE)
        specs = attention.cache_specs()
        assert set(attention.caches) == {"kv", "index_k"}
        assert specs["kv"].group == specs["index_k"].group == FULL_GROUP
        target_caches = {cache.data_ptr() for layer in model.model.layers for cache in layer.self_attn.caches.values()}
        assert not {cache.data_ptr() for cache in attention.caches.values()} & target_caches
    finally:
        llm.shutdown()


def engine_mtp_logits(model, token_ids: list[int]) -> torch.Tensor:
    """Our MTP layer's logits [len - 1, vocab] over one sequence (cache-less prefills): row p from token
    p + 1 and the target's hidden state at p."""
    def metadata(n: int) -> CommonAttentionMetadata:
        return CommonAttentionMetadata(
            num_seqs=1, num_decodes=0, num_tokens=n, query_start_loc=torch.tensor([0, n], dtype=torch.int32),
            seq_lens=torch.tensor([n], dtype=torch.int32), block_table=torch.zeros(1, 1, dtype=torch.int32),
            slot_mapping=torch.arange(n), max_query_len=n, max_seq_len=n, query_start_loc_cpu=[0, n],
            seq_lens_cpu=[n], num_computed_tokens_cpu=[0])
    ids, n = torch.tensor(token_ids), len(token_ids)
    with torch.inference_mode():
        with forward_context(metadata(n), 16):
            hidden = model(ids, torch.arange(n))
        with forward_context(metadata(n - 1), 16):
            normed, _ = model.mtp_forward(ids[1:], hidden[:-1], torch.arange(n - 1))
        return model.compute_logits(normed)


def test_mtp_layer_loaded_from_the_checkpoint_gives_transformers_logits(trained):
    """The checkpoint's MTP tensors (indexer included) land where they belong: our MTP layer's logits over a
    40-token sequence equal transformers' modules holding the same tensors. The same weights attending densely
    differ well beyond rounding (selection decides the comparison)."""
    from engine import kernels
    kernels.activate("torch", torch.device("cpu"))
    folder, tensors = trained
    model = build_model(resolve_model(str(folder)), torch.float32, torch.device("cpu"), show_progress=False,
                        mtp=True)
    sequence = list(range(3, 43))
    ours = engine_mtp_logits(model, sequence)
    assert (ours - reference_logits(folder, tensors, sequence)).abs().max().item() < LOGIT_TOLERANCE
    model.mtp.block.self_attn.index_topk = len(sequence)
    assert (engine_mtp_logits(model, sequence) - ours).abs().max().item() > 0.1


def test_a_miswired_or_dense_mtp_layer_keeps_fewer_drafts(trained, monkeypatch):
    folder, _ = trained
    prompts = training_prompts()
    _, stats = run(folder, prompts, mtp(1))
    good = stats["spec_acceptance_rate"]

    def dense(model):
        model.mtp.block.self_attn.index_topk = 1 << 20
    _, stats = run(folder, prompts, mtp(1), edit=dense)
    assert stats["spec_acceptance_rate"] < good - 0.15, (stats["spec_acceptance_rate"], good)  # measured 0.63

    original = DeepseekV32ForCausalLM.mtp_forward

    def neighbouring_hidden(self, input_ids, previous_hidden, positions):
        return original(self, input_ids, previous_hidden.roll(1, dims=0), positions)
    monkeypatch.setattr(DeepseekV32ForCausalLM, "mtp_forward", neighbouring_hidden)
    _, stats = run(folder, prompts, mtp(1))
    assert stats["spec_acceptance_rate"] < 0.15 and stats["spec_acceptance_rate"] < good / 4, stats  # ~0.04


def test_an_fp8_checkpoint_loads_its_dsa_mtp_layer_quantized(tmp_path):
    """DeepSeek-V3.2's FP8 release stores the MTP layer like the others: 128x128 FP8 blocks (the indexer's wq_b
    and wk too; its weights_proj stays full precision), experts one by one. Written so by the quantizer, it
    loads into an FP8 MTP layer that drafts, and nothing leaks."""
    shapes = dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=128)  # whole 128-blocks of experts
    src = tiny_models.make_dsa_model(tmp_path / "src", {**tiny_models.deepseek_v32_config(), **shapes,
                                                        "num_nextn_predict_layers": 1})
    tiny_models.add_random_mtp_layer(src)
    dst = tmp_path / "fp8"
    subprocess.run([sys.executable, "-m", "engine.quantization.quantizer", str(src), str(dst), "--format",
                    "fp8-block", "--exclude", "lm_head", "--exclude", "re:.*embed_tokens$", "--exclude",
                    "re:.*weights_proj$"], check=True, capture_output=True)
    llm = LLM(str(dst), dtype="float32", show_progress=False, speculative_config=mtp(3))
    try:
        layer = llm.engine.executor.runner.model.mtp
        attention = layer.block.self_attn
        for module in (layer.eh_proj, layer.block.mlp, attention.kv_b_proj, attention.indexer.wq_b,
                       attention.indexer.wk):
            assert module.quant_scheme.method == "fp8_block", module
        assert attention.indexer.weights_proj.weight.dtype == torch.float32
        llm.generate(training_prompts(4), GREEDY)
        stats = llm.engine.stats()
        assert stats["spec_draft_tokens"] > 0 and stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
    finally:
        llm.shutdown()
