"""Gemma 4's E2B/E4B extras against transformers' Gemma4ForCausalLM on a tiny random checkpoint (float32, CPU):
per-layer input embeddings (a second table and a projection of the embedding, gated into each layer), KV
sharing between layers (the last layers attend over an earlier layer's cache and keep none of their own) and
double-wide MLPs on the sharing layers. Each feature has a negative control that breaks the comparison."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import tiny_models
from gloo_ranks import spawn_two
from engine import LLM, SamplingParams
from engine.loader import build_model, resolve_model
from engine.models.gemma4 import kv_sharing_sources
from engine.parallel import state as parallel_state

S, F = "sliding_attention", "full_attention"
# Seven layers, the last three sharing: the sliding ones read layer 2, the full one layer 3; layer 0 (sliding)
# and layer 1 (full) are the wrong layers of the negative control. Untied embeddings: with tied ones this tiny
# model's greedy tokens repeat one or two ids whatever its layers do.
SMALL = dict(num_hidden_layers=7, layer_types=[S, F, S, F, S, S, F], num_kv_shared_layers=3,
             use_double_wide_mlp=True, hidden_size_per_layer_input=8,
             vocab_size_per_layer_input=tiny_models.VOCAB_SIZE, attention_k_eq_v=False, tie_word_embeddings=False)
SOURCES = [None, None, None, None, 2, 2, 3]
PROMPTS = [list(range(3, 40)), [5, 6, 7], list(range(50, 75)), [100] * 9 + [200]]
PROMPT = list(range(3, 60))
GREEDY_32 = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)

engine_logits = tiny_models.folder_logits
close_to_transformers = tiny_models.logits_close


@pytest.fixture(scope="module")
def small_dir(tmp_path_factory):
    return tiny_models.make_tiny_gemma4(tmp_path_factory.mktemp("gemma4_e"), **SMALL)


@pytest.fixture(scope="module")
def reference(small_dir):
    return tiny_models.hf_logits(small_dir, PROMPT)


def test_sharing_layers_read_the_last_earlier_layer_of_their_type_as_transformers_says(small_dir):
    config = resolve_model(str(small_dir)).hf_config
    assert kv_sharing_sources(config) == SOURCES
    assert [i for i, mode in enumerate(config.kv_sharing_modes) if mode == "store"] == [2, 3]
    assert [i for i, mode in enumerate(config.kv_sharing_modes) if mode == "reuse"] == [4, 5, 6]


def test_prompt_logits_match_transformers(small_dir, reference):
    assert close_to_transformers(engine_logits(small_dir, PROMPT), reference)


def test_kv_sharing_from_a_k_as_v_full_layer_matches_transformers(tmp_path):
    folder = tiny_models.make_tiny_gemma4(tmp_path / "k_eq_v", **{**SMALL, "attention_k_eq_v": True})
    assert close_to_transformers(engine_logits(folder, PROMPT), tiny_models.hf_logits(folder, PROMPT))


@pytest.mark.parametrize("chunk", [None, 16])
def test_greedy_tokens_match_transformers_past_the_window(small_dir, chunk):
    """Prompts and decodes longer than the window (8); with chunk=16 the 37-token prompt is prefilled in
    three steps, so the sharing layers read the source layers' cache of the earlier chunks."""
    extra = {} if chunk is None else dict(max_num_batched_tokens=chunk, max_num_seqs=4)
    llm = LLM(str(small_dir), dtype="float32", block_size=4, show_progress=False, **extra)
    outputs = llm.generate(PROMPTS, GREEDY_32)
    expected = [tiny_models.hf_greedy(small_dir, prompt, 32) for prompt in PROMPTS]
    assert min(len(set(tokens)) for tokens in expected) > 16  # they vary: the comparison can see a broken layer
    assert [o.token_ids for o in outputs] == expected


def _per_layer_inputs_zeroed(model):
    inner = model.model
    inner.per_layer_inputs = lambda ids, embeddings, original=inner.per_layer_inputs: torch.zeros_like(
        original(ids, embeddings))


def _per_layer_table_unscaled(model):
    model.model.per_layer_embed_scale = 1.0


def _per_layer_projection_unscaled(model):
    model.model.per_layer_projection_scale = 1.0


def _per_layer_sum_unscaled(model):
    model.model.per_layer_input_scale = 1.0


def _share_from_wrong_layers(model):
    """The sliding sharing layers read layer 0 and the full one layer 1 (same shapes, other layers)."""
    layers = model.model.layers
    for i, wrong in ((4, 0), (5, 0), (6, 1)):
        attention, source = layers[i].self_attn, layers[wrong].self_attn
        attention.kv_source_index, attention.attn._source = wrong, (source.attn,)
        source.stores_kv = True


def _mlp_single_width(model):
    """The sharing layers' MLPs cut to intermediate_size: the doubled half's output columns zeroed."""
    for layer in model.model.layers[4:]:
        width = layer.mlp.down_proj.weight.shape[1]
        layer.mlp.down_proj.weight.data[:, width // 2:] = 0


@pytest.mark.parametrize("edit", [_per_layer_inputs_zeroed, _per_layer_table_unscaled, _per_layer_projection_unscaled,
                                  _per_layer_sum_unscaled, _share_from_wrong_layers, _mlp_single_width])
def test_negative_controls_break_parity(small_dir, reference, edit):
    assert not close_to_transformers(engine_logits(small_dir, PROMPT, edit), reference)


def test_sharing_from_wrong_layers_through_the_cache_breaks_the_tokens(small_dir):
    """The cache path's control: decodes (and the later prefill chunks) read the wrong layers' caches."""
    llm = LLM(str(small_dir), dtype="float32", block_size=4, show_progress=False, max_num_batched_tokens=16,
              max_num_seqs=4)
    _share_from_wrong_layers(llm.engine.executor.runner.model)
    outputs = llm.generate(PROMPTS, GREEDY_32)
    assert [o.token_ids for o in outputs] != [tiny_models.hf_greedy(small_dir, p, 32) for p in PROMPTS]


def test_sharing_layers_have_twice_the_mlp_width(small_dir):
    model = build_model(resolve_model(str(small_dir)), torch.float32, torch.device("cpu"), show_progress=False)
    widths = [layer.mlp.down_proj.weight.shape[1] for layer in model.model.layers]
    size = tiny_models.GEMMA4_CONFIG["intermediate_size"]
    assert widths == [size] * 4 + [2 * size] * 3


def test_kv_sharing_layers_allocate_no_cache_of_their_own(small_dir, tmp_path):
    """The sharing layers declare no cache: the pools hold the four source layers' entries, fewer bytes per
    block than the same model without sharing, and the sharing layers read their sources' tensors."""
    unshared_dir = tiny_models.make_tiny_gemma4(tmp_path / "unshared", **{**SMALL, "num_kv_shared_layers": 0})
    shared = LLM(str(small_dir), dtype="float32", block_size=4, show_progress=False, num_kv_blocks=256)
    unshared = LLM(str(unshared_dir), dtype="float32", block_size=4, show_progress=False, num_kv_blocks=256)
    runners = [llm.engine.executor.runner for llm in (shared, unshared)]
    with_caches = [[i for i, layer in enumerate(r.model.model.layers) if layer.self_attn.attn.cache_specs()]
                   for r in runners]
    assert with_caches == [[0, 1, 2, 3], list(range(7))]
    per_layer = [sum(spec.bytes_per_block(4, torch.float32) for spec in layer.self_attn.attn.cache_specs().values())
                 for layer in runners[1].model.model.layers]
    assert runners[0].kv_cache_bytes_per_block() == sum(per_layer[:4]) < runners[1].kv_cache_bytes_per_block()
    assert runners[0].layout.total_bytes < runners[1].layout.total_bytes
    shared.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    layers = runners[0].model.model.layers
    for i, source in enumerate(SOURCES):
        if source is not None:
            assert layers[i].self_attn.attn.kv_cache is layers[source].self_attn.attn.kv_cache is not None


def test_hub_layout_with_the_sharing_layers_kv_weights_serves_the_text_models_tokens(small_dir, tmp_path):
    """Gemma4ForConditionalGeneration as the hub stores E2B/E4B: the text stack under model.language_model.,
    the per-layer tables beside it, and K/V projections and norms for the sharing layers that transformers
    never reads (nor do we: random ones change nothing)."""
    def sharing_layers_kv(tensors, text):
        for i in (4, 5, 6):
            prefix = f"model.language_model.layers.{i}.self_attn."
            for name, source_name in (("k_proj", "k_proj"), ("v_proj", "k_proj"), ("k_norm", "k_norm")):
                source = text.get(f"model.layers.{SOURCES[i]}.self_attn.{source_name}.weight")
                if source is not None:
                    tensors[f"{prefix}{name}.weight"] = torch.randn_like(source)
    folder = tiny_models.as_gemma4_multimodal(small_dir, tmp_path / "gemma4_e_it", sharing_layers_kv)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    wrapped = LLM(str(folder), dtype="float32", show_progress=False).generate(PROMPTS, params)
    plain = LLM(str(small_dir), dtype="float32", show_progress=False).generate(PROMPTS, params)
    assert [o.token_ids for o in wrapped] == [o.token_ids for o in plain]


def _two_rank_worker(rank: int, folder: str, rendezvous: str, out: str) -> None:
    parallel_state.init_parallel(rank, 2, rendezvous, torch.device("cpu"))
    model = build_model(resolve_model(folder), torch.float32, torch.device("cpu"), show_progress=False)
    torch.save(tiny_models.engine_logits(model, PROMPT), f"{out}/rank{rank}.pt")
    dist.barrier()  # neither rank tears gloo down while the other may still be using it
    dist.destroy_process_group()


def test_tensor_parallel_2_matches_transformers(small_dir, reference, tmp_path):
    """Two ranks (gloo): the per-layer table split by vocabulary, the sharing layers' query heads those their
    source keeps on the rank."""
    spawn_two(_two_rank_worker, str(small_dir), f"file://{tmp_path}/rendezvous", str(tmp_path))
    for rank in range(2):
        assert close_to_transformers(torch.load(tmp_path / f"rank{rank}.pt"), reference)


@pytest.mark.parametrize("overrides,named", [
    (dict(num_kv_shared_layers=4, num_hidden_layers=4), "KV sharing in every layer"),
    (dict(hidden_size_per_layer_input=8, vocab_size_per_layer_input=100), "per-layer input vocabulary"),
])
def test_unservable_e_configs_are_refused_by_name(tmp_path, overrides, named):
    folder = tiny_models.make_tiny_gemma4(tmp_path / "variant", **overrides)
    with pytest.raises(ValueError, match=named):
        LLM(str(folder), dtype="float32", show_progress=False)
