"""DeepSeek-V3.2 and GLM-5 (DeepSeek Sparse Attention: MLA over the keys a lightning indexer selects)
against transformers' own implementation on tiny random configs in float32, with an index top-k (8) smaller
than the prompts (20-60 tokens) so that selection decides the output: logits, greedy tokens, the absorbed
decode, chunked prefill and prefix caching over the latent and indexer caches, GLM-5's layers that reuse an
earlier layer's selection, and TP=2."""
from __future__ import annotations

import json
import shutil
import types
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import tiny_models
from gloo_ranks import spawn_two
from tiny_models import (deepseek_v32_config, deepseek_v32_yarn_config, glm_moe_dsa_config,  # noqa: F401
                         make_dsa_model)
from engine import LLM, SamplingParams
from engine.forward_context import forward_context
from engine.kernels.attention import CommonAttentionMetadata
from engine.kv_cache_spec import FULL_GROUP, CacheGroupMetadata, PagedSpec
from engine.layers.dsa import LightningIndexer, SparseMLAAttention
from engine.layers.mla import MLAAttention
from engine.loader import build_model, resolve_model
from engine.models.deepseek_v32 import DeepseekV32ForCausalLM
from engine.parallel import state as parallel_state

INDEX_TOPK = tiny_models.DSA_INDEX_TOPK
PROMPTS = [list(range(3, 60)), list(range(10, 40)), [100] * 9 + [200] * 12, [5, 6, 7]]
GREEDY_32 = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
# float32 logits: the absorbed sparse path (q_nope @ W_UK over the latent) against transformers' expanded
# keys and values under a sparse mask; equal maths, different rounding (measured below 3e-5).
LOGIT_TOLERANCE = 1e-4


CONFIGS = {"deepseek_v32": deepseek_v32_config, "glm_moe_dsa": glm_moe_dsa_config,
           "deepseek_v32_yarn": deepseek_v32_yarn_config}


def with_config(folder: Path, destination: Path, **changes) -> Path:
    """A copy of a model folder whose config.json has `changes` (same weights)."""
    destination.mkdir(parents=True, exist_ok=True)
    for path in folder.iterdir():
        shutil.copy(path, destination / path.name)
    config = json.loads((folder / "config.json").read_text())
    (destination / "config.json").write_text(json.dumps({**config, **changes}))
    return destination


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("dsa")
    return {arch: make_dsa_model(root / arch, make()) for arch, make in CONFIGS.items()}


@pytest.fixture(autouse=True)
def cpu_kernels():
    from engine import kernels
    kernels.activate("torch", torch.device("cpu"))


def _build(folder):
    return build_model(resolve_model(str(folder)), torch.float32, torch.device("cpu"), show_progress=False)


def _cached_logits(model, prompt: list[int], num_decoded: int, block_size: int = 4) -> torch.Tensor:
    """Logits of every position of `prompt` [len, vocab]: all but the last `num_decoded` tokens prefilled
    in one step, then one decode step per remaining token, through caches bound by hand (every spec of
    cache_specs()) over a block table in reverse block order."""
    num_blocks = -(-len(prompt) // block_size)
    for layer in model.modules():
        if isinstance(layer, MLAAttention):
            layer.bind_caches({name: torch.zeros(spec.shape(num_blocks, block_size))
                               for name, spec in layer.cache_specs().items()})
    block_table = torch.arange(num_blocks - 1, -1, -1, dtype=torch.int32)[None]
    prefill_len = len(prompt) - num_decoded
    steps = [(0, prefill_len)] + [(n, n + 1) for n in range(prefill_len, len(prompt))]
    logits = []
    with torch.inference_mode():
        for begin, end in steps:
            positions = torch.arange(begin, end)
            slots = block_table[0, positions // block_size].long() * block_size + positions % block_size
            query_len = end - begin
            metadata = CommonAttentionMetadata(
                num_seqs=1, num_decodes=int(query_len == 1 and begin > 0), num_tokens=query_len,
                query_start_loc=torch.tensor([0, query_len], dtype=torch.int32),
                seq_lens=torch.tensor([end], dtype=torch.int32), block_table=block_table, slot_mapping=slots,
                max_query_len=query_len, max_seq_len=end, query_start_loc_cpu=[0, query_len], seq_lens_cpu=[end],
                num_computed_tokens_cpu=[begin],
                groups={FULL_GROUP: CacheGroupMetadata(1, None, block_size, block_table, slots, block_table.numpy())})
            with forward_context(metadata, block_size):
                logits.append(model.compute_logits(model(torch.tensor(prompt[begin:end]), positions)))
    return torch.cat(logits)


@pytest.mark.parametrize("arch", list(CONFIGS))
def test_prompt_logits_within_tolerance_of_transformers(arch, model_dirs):
    prompt = PROMPTS[0]
    ours = tiny_models.engine_logits(_build(model_dirs[arch]), prompt)
    assert (ours - tiny_models.hf_logits(model_dirs[arch], prompt)).abs().max().item() < LOGIT_TOLERANCE


@pytest.mark.parametrize("arch", list(CONFIGS))
def test_cached_prefill_and_decode_logits_within_tolerance_of_transformers(arch, model_dirs):
    """Index keys and latents read back from the caches through a permuted block table; the last 12
    positions are decodes."""
    prompt = PROMPTS[0]
    ours = _cached_logits(_build(model_dirs[arch]), prompt, num_decoded=12)
    assert (ours - tiny_models.hf_logits(model_dirs[arch], prompt)).abs().max().item() < LOGIT_TOLERANCE


@pytest.mark.parametrize("arch", ["deepseek_v32", "glm_moe_dsa"])
def test_greedy_tokens_and_logprobs_equal_transformers(arch, model_dirs):
    llm = LLM(str(model_dirs[arch]), dtype="float32", show_progress=False)
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=0))
    for prompt, output in zip(PROMPTS, outputs):
        assert output.token_ids == tiny_models.hf_greedy(model_dirs[arch], prompt, 32)
    prompt, output = PROMPTS[1], outputs[1]
    reference = tiny_models.hf_logits(model_dirs[arch], prompt + output.token_ids).log_softmax(-1)
    for step, (token, entry) in enumerate(zip(output.token_ids, output.logprobs)):
        assert abs(entry[token].logprob - reference[len(prompt) - 1 + step, token].item()) < LOGIT_TOLERANCE


def test_small_index_topk_changes_logits_and_full_context_topk_equals_dense_mla(model_dirs, tmp_path):
    """The negative control: the same weights with index_topk >= the context select every causal key, and
    then equal dense MLA (MLAAttention's own forward); with index_topk 8 the logits move well beyond rounding."""
    prompt = PROMPTS[0]
    folder = model_dirs["deepseek_v32"]
    wide = _build(with_config(folder, tmp_path / "wide", index_topk=len(prompt)))
    sparse = _cached_logits(_build(folder), prompt, num_decoded=8)
    full_context = _cached_logits(wide, prompt, num_decoded=8)
    for layer in wide.modules():
        if isinstance(layer, SparseMLAAttention):
            layer.forward = types.MethodType(MLAAttention.forward, layer)
    dense = _cached_logits(wide, prompt, num_decoded=8)
    assert (full_context - dense).abs().max().item() < LOGIT_TOLERANCE
    assert (sparse[:INDEX_TOPK] - full_context[:INDEX_TOPK]).abs().max().item() < LOGIT_TOLERANCE  # all selected
    assert (sparse - full_context).abs().max().item() > 0.5


def test_chunked_prefill_and_prefix_caching_give_transformers_tokens(model_dirs):
    """Prompts split over 16-token steps score their index keys against keys already cached; a second pass
    reuses cached prefix blocks of both caches."""
    folder = model_dirs["deepseek_v32"]
    chunked = LLM(str(folder), dtype="float32", max_num_batched_tokens=16, max_num_seqs=2, show_progress=False)
    expected = [tiny_models.hf_greedy(folder, prompt, 32) for prompt in PROMPTS]
    assert [o.token_ids for o in chunked.generate(PROMPTS, GREEDY_32)] == expected
    shared = list(range(20, 60))
    prompts = [shared + [7, 8], shared + [9]]
    cached = LLM(str(folder), dtype="float32", enable_prefix_caching=True, show_progress=False)
    first = [o.token_ids for o in cached.generate(prompts, GREEDY_32)]
    second = [o.token_ids for o in cached.generate(prompts, GREEDY_32)]
    assert cached.engine.stats()["prefix_cache_hits"] > 0
    assert first == second == [tiny_models.hf_greedy(folder, p, 32) for p in prompts]


def test_indexer_keys_ride_the_latent_block_table_and_shared_layers_keep_none(model_dirs):
    llm = LLM(str(model_dirs["glm_moe_dsa"]), dtype="float32", show_progress=False)  # kept: a dropped LLM frees
    runner = llm.engine.executor.runner
    layers = [m for m in runner.model.modules() if isinstance(m, SparseMLAAttention)]
    assert [layer.indexer is not None for layer in layers] == [True, False, False, True]
    for layer in layers:
        specs, caches = layer.cache_specs(), layer.caches
        assert specs["kv"] == PagedSpec((32 + 8,), kind="mla")
        if layer.indexer is not None:
            assert specs["index_k"] == PagedSpec((16,), kind="indexer") and specs["index_k"].group == FULL_GROUP
            assert caches["index_k"].shape == (*caches["kv"].shape[:2], 16)
        else:
            assert set(specs) == set(caches) == {"kv"}
    sparse_mlp = [type(layer.mlp).__name__ == "FusedMoE" for layer in runner.model.model.layers]
    assert sparse_mlp == [False, True, False, True]


def test_selection_breaks_ties_by_lower_position_and_takes_every_key_of_a_short_context():
    torch.manual_seed(0)
    config = types.SimpleNamespace(index_n_heads=2, index_head_dim=4, qk_rope_head_dim=2, q_lora_rank=8,
                                   hidden_size=8)
    indexer = LightningIndexer(config, rope_interleaved=False)
    keys = torch.ones(10, 4)
    keys[7] = 2.0  # the one key that scores higher than the others' tie
    queries, weights = torch.ones(2, 2, 4), torch.ones(2, 2)
    slots = torch.arange(100, 110)[None]  # position p at slot 100 + p
    chosen = indexer.select(queries, weights, torch.tensor([9, 5]), torch.cat((torch.zeros(100, 4), keys)),
                            slots, top_k=3)
    assert chosen.tolist() == [[107, 100, 101], [100, 101, 102]]  # position 7 is after the second query
    every = indexer.select(queries, weights, torch.tensor([9, 2]), keys, torch.arange(10)[None], top_k=10)
    assert every.tolist() == [list(range(10)), [0, 1, 2] + [-1] * 7]


def test_glm_shared_first_layer_and_missing_q_lora_are_refused(model_dirs, tmp_path):
    folder = model_dirs["glm_moe_dsa"]
    with pytest.raises(ValueError, match=r"indexer_types\[0\] must be 'full'"):
        _build(with_config(folder, tmp_path / "shared", indexer_types=["shared", "full", "full", "full"]))
    with pytest.raises(ValueError, match="config.indexer_types must list one of"):
        _build(with_config(folder, tmp_path / "unknown", indexer_types=["full", "sparse", "full", "full"]))
    config = resolve_model(str(model_dirs["deepseek_v32"])).hf_config
    object.__setattr__(config, "q_lora_rank", None)  # transformers' config refuses it; a hand-made one may not
    with pytest.raises(ValueError, match="needs q_lora_rank"):
        DeepseekV32ForCausalLM(config)


def _tensor_parallel_worker(rank: int, folder: str, rendezvous: str, out: str) -> None:
    parallel_state.init_parallel(rank, 2, rendezvous, torch.device("cpu"))
    model = build_model(resolve_model(folder), torch.float32, torch.device("cpu"), show_progress=False)
    heads = {m.num_heads for m in model.modules() if isinstance(m, SparseMLAAttention)}
    torch.save({"logits": _cached_logits(model, PROMPTS[0], num_decoded=6), "heads": heads}, f"{out}/rank{rank}.pt")
    dist.barrier()  # neither rank tears gloo down while the other may still be using it (seen: SIGABRT)
    dist.destroy_process_group()


def test_tensor_parallel_2_selects_the_same_keys_and_matches_one_process(model_dirs, tmp_path):
    """MLA heads split over two ranks, the indexer replicated: both ranks select the same keys (else their
    heads would attend to different contexts and the all-reduced logits would drift from one process's)."""
    folder = str(model_dirs["glm_moe_dsa"])
    spawn_two(_tensor_parallel_worker, folder, f"file://{tmp_path}/rendezvous", str(tmp_path))
    single = _cached_logits(_build(folder), PROMPTS[0], num_decoded=6)
    for rank in range(2):
        result = torch.load(tmp_path / f"rank{rank}.pt")
        assert result["heads"] == {3}
        assert (result["logits"] - single).abs().max().item() < 1e-4
