"""DeepSeek-V4 against transformers' own implementation on a tiny random config in float32: a sliding-only,
two CSA (ratio 2, indexer top-4) and an HCA (ratio 8) layer, an 8-token window, hash-routed first layers,
clamped experts, yarn on the compressed layers. Prompts run past the window and over many compressed
entries; greedy tokens, logits, decode logprobs, chunked prefill (compressor state carried across steps),
requests joining mid-flight, two ranks (TP=2, TP=2 + EP=2); and the layer pieces on their own: the
compressor's RoPE positions, the scope merge with sinks, the decode step's reads, hash routing, the clamped
experts (torch and Triton), checkpoint names, the cache specs."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import tiny_models
from gloo_ranks import spawn_two
from tiny_models import make_tiny_v4_model, randomize_v4_extras, tiny_v4_config  # noqa: F401
from engine import LLM, EngineConfig, LLMEngine, SamplingParams
from engine.layers import deepseek_v4 as v4_attention
from engine.layers.deepseek_v4 import DeepseekV4Attention, merge_scopes_with_sinks
from engine.layers.deepseek_v4_compressor import StepLayout, WindowPooling
from engine.layers.deepseek_v4_rope import TrailingRope, rotate_trailing
from engine.loader import build_model, load_weights, resolve_model
from engine.models.deepseek_v4 import checkpoint_to_module_name
from engine.parallel import state as parallel_state

GREEDY_32 = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
LONG_PROMPT = list(range(3, 60))  # 57 tokens: 7 windows of 8, 28 CSA entries (top-4 chosen), 7 HCA entries
PROMPTS = [LONG_PROMPT, [5, 6, 7], list(range(100, 131))]


@pytest.fixture(autouse=True)
def cpu_kernels():
    from engine import kernels
    kernels.activate("torch", torch.device("cpu"))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_tiny_v4_model(tmp_path_factory.mktemp("deepseek_v4") / "tiny")


@pytest.fixture(scope="module")
def hf_tokens(model_dir) -> dict:
    return {tuple(prompt): tiny_models.hf_greedy(model_dir, prompt, 32) for prompt in PROMPTS}


@pytest.fixture(scope="module")
def llm(model_dir) -> LLM:
    return LLM(str(model_dir), dtype="float32", block_size=4, show_progress=False)


def test_prompt_logits_within_1e_4_of_transformers(model_dir):
    """A single cache-less prefill (the profiling pass's path: scopes over the step's own entries)."""
    model = build_model(resolve_model(str(model_dir)), torch.float32, torch.device("cpu"), show_progress=False)
    ours = tiny_models.engine_logits(model, LONG_PROMPT)
    reference = tiny_models.hf_logits(model_dir, LONG_PROMPT)
    assert (ours - reference).abs().max().item() < 1e-4  # measured 1.5e-5 (logits up to 6.8)


def test_batched_greedy_tokens_equal_transformers_generate(llm, hf_tokens):
    for prompt, output in zip(PROMPTS, llm.generate(PROMPTS, GREEDY_32)):
        assert output.token_ids == hf_tokens[tuple(prompt)]


def test_decode_logprobs_after_long_prefill_within_1e_4_of_transformers(llm, model_dir):
    """Every token after the first comes from a decode step reading the window, the indexer's choice and the
    HCA entries from the caches, with compressor state carried from the prefill."""
    output = llm.generate([LONG_PROMPT], SamplingParams(temperature=0, max_tokens=12, logprobs=0,
                                                        ignore_eos=True))[0]
    reference = tiny_models.hf_logits(model_dir, LONG_PROMPT + output.token_ids).log_softmax(-1)
    for step, (token, entry) in enumerate(zip(output.token_ids, output.logprobs)):
        assert abs(entry[token].logprob - reference[len(LONG_PROMPT) - 1 + step, token].item()) < 1e-4


def test_chunked_prefill_and_requests_joining_mid_flight_keep_transformers_tokens(model_dir, hf_tokens):
    """Prompts split into 11-token chunks (windows of 2 and 8 tokens straddle the steps: the compressors'
    state carries them), later requests prefilled in the steps where earlier ones decode."""
    prompts = [PROMPTS[0], PROMPTS[2]]
    engine = LLMEngine(EngineConfig(str(model_dir), dtype="float32", block_size=4, max_num_batched_tokens=11,
                                    max_num_seqs=2), show_progress=False)
    outputs = tiny_models.generate_staggered(engine, prompts, GREEDY_32, every=4)
    assert outputs == [hf_tokens[tuple(prompt)] for prompt in prompts]


def test_decode_step_reads_the_window_and_the_chosen_entries_not_the_context(llm, monkeypatch):
    """The decode step's attention reads at most `sliding_window` window entries, `index_topk` CSA entries
    and the (context / 8) HCA entries, however long the context."""
    reads = []
    original = v4_attention.mla_sparse_attention

    def spy(q, cache, slots, scale, v_dim):
        reads.append((q.shape[0], slots.shape[1]))
        return original(q, cache, slots, scale, v_dim)
    monkeypatch.setattr(v4_attention, "mla_sparse_attention", spy)
    prompt = list(range(3, 83))  # 80 tokens, then one decode step at position 80
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    decode = [width for tokens, width in reads if tokens == 1]
    # per layer: sliding (window), CSA (window, top-k), HCA (window, 81 // 8 entries), CSA (window, top-k)
    assert decode == [8, 8, 4, 8, 10, 8, 4]


def test_compressed_entry_is_rotated_at_its_windows_first_position():
    """Entry w of a ratio-r compressor rotates at position w * r (the ROCm decode bug used the window's last
    position, (w + 1) * r - 1): pooled by hand, rotated at the first positions, equal; at the last, not."""
    config = _layer_config()
    torch.manual_seed(0)
    rope = TrailingRope(config, "compress", 8)
    pooling = WindowPooling(config, ratio=4, head_dim=16, overlap=False, rope=rope)
    for param in pooling.parameters():
        param.data.normal_()
    x = torch.randn(12, config.hidden_size)
    positions = torch.arange(12)
    layout = StepLayout(positions, torch.zeros(12, dtype=torch.long), torch.tensor([0]), torch.tensor([12]), None)
    entries, done = pooling.pool(x, layout, None)
    assert done.tolist() == [3, 7, 11]
    kv = pooling.kv_proj(x).view(3, 4, 16)
    gate = pooling.gate_proj(x).view(3, 4, 16) + pooling.position_bias
    pooled = pooling.kv_norm((kv * gate.softmax(dim=1)).sum(dim=1))
    for positions_used, should_match in (([0, 4, 8], True), ([3, 7, 11], False)):
        cos, sin = rope.cos_sin(torch.tensor(positions_used), pooled.dtype)
        assert torch.allclose(entries, rotate_trailing(pooled, cos, sin), atol=1e-5) == should_match


def test_merged_scopes_with_sinks_equal_one_softmax_with_a_sink_column():
    torch.manual_seed(0)
    tokens, heads, dim = 5, 3, 8
    scores = [torch.randn(tokens, heads, n) for n in (6, 4)]
    scores[1][0] = float("-inf")  # token 0 has no compressed entry
    values = [torch.randn(tokens, n, dim) for n in (6, 4)]
    sinks = torch.randn(heads)
    outs = [torch.einsum("thk,tkd->thd", s.softmax(-1).nan_to_num(), v) for s, v in zip(scores, values)]
    merged = merge_scopes_with_sinks(outs, [s.logsumexp(-1) for s in scores], sinks)
    logits = torch.cat([*scores, sinks[None, :, None].expand(tokens, -1, 1)], dim=-1)
    expected = torch.einsum("thk,tkd->thd", logits.softmax(-1)[..., :-1], torch.cat(values, dim=1))
    assert torch.allclose(merged, expected, atol=1e-6)
    empty = merge_scopes_with_sinks([torch.zeros(1, heads, dim)], [torch.full((1, heads), float("-inf"))], sinks)
    assert torch.equal(empty, torch.zeros(1, heads, dim))


def test_hash_layers_route_each_token_to_its_table_experts(model_dir, monkeypatch):
    from engine.kernels import ops
    model = build_model(resolve_model(str(model_dir)), torch.float32, torch.device("cpu"), show_progress=False)
    seen = []
    original = ops.fused_experts

    def spy(x, w13, w2, weights, ids, **kwargs):
        seen.append(ids.clone())
        return original(x, w13, w2, weights, ids, **kwargs)
    monkeypatch.setattr(ops, "fused_experts", spy)
    prompt = [7, 300, 7, 12]
    tiny_models.engine_logits(model, prompt)
    for layer, ids in zip(model.model.layers, seen):
        if layer.mlp.hashed:
            assert torch.equal(ids.long(), layer.mlp.gate.tid2eid[torch.tensor(prompt)])
    assert [layer.mlp.hashed for layer in model.model.layers] == [True, True, False, False]


def test_routed_experts_clamp_gate_above_and_up_both_sides():
    from engine.kernels.torch.moe import fused_experts
    torch.manual_seed(0)
    x, w13, w2 = torch.randn(6, 16), torch.randn(4, 2 * 8, 16), torch.randn(4, 16, 8)
    weights, ids = torch.rand(6, 2), torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0], [0, 2], [1, 3]])
    out = fused_experts(x, w13, w2, weights, ids, swiglu_limit=1.5)
    expected = torch.zeros(6, 16)
    for t in range(6):
        for k in range(2):
            gate, up = (w13[ids[t, k]] @ x[t]).split(8)
            expected[t] += weights[t, k] * (w2[ids[t, k]] @ (F.silu(gate.clamp(max=1.5)) * up.clamp(-1.5, 1.5)))
    assert torch.allclose(out, expected, atol=1e-4)
    assert not torch.allclose(fused_experts(x, w13, w2, weights, ids), expected, atol=1e-2)


_TRITON_CLAMP_CHECK = """
import torch
from engine.kernels.torch.moe import fused_experts as reference
from engine.kernels.triton.moe import fused_experts
torch.manual_seed(0)
device = "cuda" if torch.cuda.is_available() else "cpu"
x, w13, w2 = torch.randn(5, 32), torch.randn(4, 32, 32) * 0.3, torch.randn(4, 32, 16) * 0.3
weights, ids = torch.rand(5, 2), torch.tensor([[0, 1], [1, 2], [2, 3], [3, -1], [0, 2]], dtype=torch.int32)
out = fused_experts(*[t.to(device) for t in (x, w13, w2, weights, ids)], swiglu_limit=0.5).cpu()
expected = reference(x, w13, w2, weights, ids, swiglu_limit=0.5)
assert (out - expected).abs().max().item() < 1e-5, (out - expected).abs().max().item()
assert (expected - reference(x, w13, w2, weights, ids)).abs().max().item() > 1.0
"""


def test_triton_experts_clamp_like_the_torch_reference():
    """On a GPU, or under Triton's interpreter in a fresh process (the interpreter is chosen when the kernels
    are defined, so it cannot be switched on inside this one)."""
    pytest.importorskip("triton")
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    result = subprocess.run([sys.executable, "-c", _TRITON_CLAMP_CHECK], env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]


def test_transformers_module_names_load_like_the_saved_release_names(model_dir):
    """save_pretrained writes DeepSeek's release names (`attn.wq_a`, `ffn.experts.3.w1`, `hc_attn_fn`...);
    transformers' own module names (`self_attn.q_a_proj`, fused `experts.gate_up_proj`) load the same."""
    source = resolve_model(str(model_dir))
    saved = build_model(source, torch.float32, torch.device("cpu"), show_progress=False)
    in_memory = tiny_models.hf_model(model_dir).state_dict()
    assert checkpoint_to_module_name("model.layers.1.self_attn.compressor.indexer.q_b_proj.weight") == \
        "model.layers.1.self_attn.compressor.indexer.q_b_proj.weight"
    with torch.no_grad():
        for param in saved.parameters():
            param.zero_()
    load_weights(saved, list(in_memory.items()), show_progress=False)
    reference = build_model(source, torch.float32, torch.device("cpu"), show_progress=False)
    assert torch.equal(tiny_models.engine_logits(saved, PROMPTS[2]), tiny_models.engine_logits(reference, PROMPTS[2]))


def _two_rank_worker(rank: int, folder: str, rendezvous: str, out: str, expert_parallel: bool) -> None:
    from engine import kernels
    kernels.activate("torch", torch.device("cpu"))
    parallel_state.init_parallel(rank, 2, rendezvous, torch.device("cpu"), expert_parallel=expert_parallel,
                                 max_num_batched_tokens=len(LONG_PROMPT))
    model = build_model(resolve_model(folder), torch.float32, torch.device("cpu"), show_progress=False)
    torch.save(tiny_models.engine_logits(model, LONG_PROMPT), f"{out}/rank{rank}.pt")
    dist.barrier()  # neither rank tears gloo down while the other may still be using it (seen: SIGABRT)
    dist.destroy_process_group()


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp2", "tp2_ep2"])
def test_two_ranks_give_the_single_process_logits(model_dir, tmp_path, expert_parallel):
    """Attention and hyper-connections replicated; experts split by intermediate size (TP) or whole experts
    per rank (EP, the hash layers' fixed choices sliced with their tokens); the shared expert split by TP."""
    spawn_two(_two_rank_worker, str(model_dir), f"file://{tmp_path}/rendezvous", str(tmp_path), expert_parallel)
    reference = tiny_models.hf_logits(model_dir, LONG_PROMPT)
    for rank in range(2):
        assert (torch.load(tmp_path / f"rank{rank}.pt") - reference).abs().max().item() < 1e-4


def test_cache_specs_declare_window_compressed_indexer_and_state():
    config = _layer_config()
    specs = {t: DeepseekV4Attention(config, i).cache_specs() for i, t in enumerate(config.layer_types)}
    assert set(specs["sliding_attention"]) == {"window"}
    assert specs["sliding_attention"]["window"].group == (1, 8)
    csa = specs["compressed_sparse_attention"]
    assert csa["compressed"].group == csa["indexer"].group == (2, None)
    assert csa["compressor_state"].shape == (4, 2, 64) and csa["indexer_state"].shape == (4, 2, 32)
    hca = specs["heavily_compressed_attention"]
    assert set(hca) == {"window", "compressed", "compressor_state"}
    assert hca["compressed"].group == (8, None) and hca["compressor_state"].shape == (8, 2, 32)


def _layer_config():
    from transformers import AutoConfig
    return AutoConfig.for_model("deepseek_v4", vocab_size=64, **tiny_v4_config())


def test_dummy_weights_draw_a_valid_hash_routing_table(model_dir):
    """load_format="dummy" (the benchmarks' random weights): each token's hash experts are distinct ids of
    the layer's experts, so the model runs."""
    model = build_model(resolve_model(str(model_dir), load_format="dummy"), torch.float32, torch.device("cpu"),
                        show_progress=False)
    tables = [p for name, p in model.named_parameters() if name.endswith("tid2eid")]
    assert tables
    for table in tables:
        num_experts = model.config.n_routed_experts
        assert int(table.min()) >= 0 and int(table.max()) < num_experts
        assert all(len(set(row)) == len(row) for row in table[:64].tolist())
    assert tiny_models.engine_logits(model, LONG_PROMPT).isfinite().all()
