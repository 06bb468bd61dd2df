"""DeepSeek-V2/V3 (multi-head latent attention, DeepSeek's MoE routing) against transformers' own
implementation on tiny random configs in float32: greedy tokens, logits, the absorbed decode, chunked
prefill and prefix caching over the latent cache; and an FP8 128x128-block checkpoint in DeepSeek's own
format (`weight_scale_inv`, experts one by one) through the quantization path."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import tiny_models
from gloo_ranks import spawn_two
from engine import LLM, SamplingParams
from engine.config import ConfigError
from engine.forward_context import forward_context
from engine.kernels.attention import CommonAttentionMetadata
from engine.kernels.mla import MLAWeights
from engine.kernels.torch.mla import mla_attention
from engine.layers.mla import MLAAttention
from engine.loader import build_model, resolve_model
from engine.parallel import state as parallel_state
from engine.quantization.quantizer import quantize_checkpoint

ARCHS = ["deepseek_v2", "deepseek_v2_yarn", "deepseek_v3"]
PROMPTS = [[5, 6, 7], list(range(10, 40)), [100] * 9 + [200], list(range(3, 80))]
GREEDY_32 = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
# MLA dimensions that split into 128x128 FP8 blocks (kv_a_proj_with_mqa's 192 rows: one and a half).
BLOCK_SHAPES = dict(kv_lora_rank=128, q_lora_rank=256, qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=128,
                    num_attention_heads=4, num_key_value_heads=4)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("deepseek")
    return {arch: tiny_models.make_tiny_model(root / arch, arch) for arch in ARCHS}


@pytest.fixture(autouse=True)
def cpu_kernels():
    """Models built here live on the CPU: the torch kernels, whatever an earlier GPU engine chose."""
    from engine import kernels
    kernels.activate("torch", torch.device("cpu"))


@pytest.fixture(scope="module")
def llms(model_dirs):
    return {arch: LLM(str(model_dirs[arch]), dtype="float32", show_progress=False) for arch in ARCHS}


# Batched greedy tokens against transformers: test_hf_parity.py (its ARCHS include these configs).


@pytest.mark.parametrize("arch", ARCHS)
def test_prompt_logits_within_1e_4_of_transformers(arch, model_dirs):
    model = build_model(resolve_model(str(model_dirs[arch])), torch.float32, torch.device("cpu"), show_progress=False)
    prompt = list(range(3, 120))
    ours = tiny_models.engine_logits(model, prompt)
    reference = tiny_models.hf_logits(model_dirs[arch], prompt)
    assert (ours - reference).abs().max().item() < 1e-4


@pytest.mark.parametrize("arch", ["deepseek_v2", "deepseek_v3"])
def test_absorbed_decode_logprobs_within_1e_4_of_transformers_expanded_path(arch, llms, model_dirs):
    """Every generated token after the first comes from a decode step in latent space; transformers expands
    the latents to per-head keys and values. Equal maths, different rounding: a tolerance, not bit-parity."""
    prompt = PROMPTS[1]
    output = llms[arch].generate([prompt], SamplingParams(temperature=0, max_tokens=12, logprobs=1,
                                                          ignore_eos=True))[0]
    reference = tiny_models.hf_logits(model_dirs[arch], prompt + output.token_ids).log_softmax(-1)
    for step, (token, entry) in enumerate(zip(output.token_ids, output.logprobs)):
        assert abs(entry[token].logprob - reference[len(prompt) - 1 + step, token].item()) < 1e-4


def _metadata(num_decodes: int, query_lens: list[int], seq_lens: list[int], block_table: torch.Tensor,
              slots: torch.Tensor) -> CommonAttentionMetadata:
    starts = [0]
    for length in query_lens:
        starts.append(starts[-1] + length)
    return CommonAttentionMetadata(
        num_seqs=len(seq_lens), num_decodes=num_decodes, num_tokens=starts[-1],
        query_start_loc=torch.tensor(starts, dtype=torch.int32), seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=block_table, slot_mapping=slots, max_query_len=max(query_lens), max_seq_len=max(seq_lens),
        query_start_loc_cpu=starts, seq_lens_cpu=seq_lens,
        num_computed_tokens_cpu=[s - q for s, q in zip(seq_lens, query_lens)])


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_absorbed_decode_matches_expanded_attention(dtype, tolerance):
    """The same one-token queries as decodes (latent space, batched) and as one-token prefill chunks
    (expanded keys and values): outputs within `tolerance` of each other, relative to the output scale."""
    generator = torch.Generator().manual_seed(0)
    heads, nope, rope, v, rank, block_size = 4, 16, 8, 24, 32, 4

    def rand(*shape, std=1.0):
        return (torch.randn(*shape, generator=generator) * std).to(dtype)
    kv_b = rand(heads * (nope + v), rank, std=rank ** -0.5)
    per_head = kv_b.view(heads, nope + v, rank)
    weights = MLAWeights(lambda x: x @ kv_b.T, per_head[:, :nope].contiguous(), per_head[:, nope:].contiguous())
    seq_lens = [9, 3, 14]
    cache = torch.zeros(12, block_size, rank + rope, dtype=dtype)
    cache.view(-1, rank + rope)[:] = rand(12 * block_size, rank + rope)
    block_table = torch.tensor([[0, 1, 2, 11], [3, 4, 5, 6], [7, 8, 9, 10]], dtype=torch.int32)
    slots = torch.stack([block_table[i, (n - 1) // block_size] * block_size + (n - 1) % block_size
                         for i, n in enumerate(seq_lens)]).long()
    q_nope, q_pe = rand(3, heads, nope), rand(3, heads, rope)
    latent, k_pe = rand(3, rank), rand(3, rope)
    outputs = []
    for num_decodes in (3, 0):
        metadata = _metadata(num_decodes, [1, 1, 1], seq_lens, block_table, slots)
        outputs.append(mla_attention(q_nope, q_pe, latent, k_pe, cache.clone(), metadata, weights, 0.2, block_size))
    absorbed, expanded = outputs
    assert (absorbed.float() - expanded.float()).abs().max().item() < tolerance * expanded.float().abs().max().item()


@pytest.mark.parametrize("arch", ["deepseek_v2", "deepseek_v3"])
def test_chunked_prefill_with_few_sequences_gives_transformers_tokens(arch, model_dirs):
    """Prompts split over several steps attend to latents already in the cache (bottom-right causal)."""
    llm = LLM(str(model_dirs[arch]), dtype="float32", max_num_batched_tokens=16, max_num_seqs=2,
              show_progress=False)
    for prompt, output in zip(PROMPTS, llm.generate(PROMPTS, GREEDY_32)):
        assert output.token_ids == tiny_models.hf_greedy(model_dirs[arch], prompt, 32)


def test_prefix_caching_over_latent_blocks_gives_same_tokens_and_hits(model_dirs):
    folder = model_dirs["deepseek_v3"]
    shared = list(range(20, 60))
    prompts = [shared + [7, 8], shared + [9]]
    llm = LLM(str(folder), dtype="float32", enable_prefix_caching=True, show_progress=False)
    first = [o.token_ids for o in llm.generate(prompts, GREEDY_32)]
    second = [o.token_ids for o in llm.generate(prompts, GREEDY_32)]
    assert llm.engine.stats()["prefix_cache_hits"] > 0
    assert first == second == [tiny_models.hf_greedy(folder, p, 32) for p in prompts]


def test_latent_cache_is_one_entry_per_token_per_layer(llms, model_dirs):
    runner = llms["deepseek_v3"].engine.executor.runner
    layers = runner.cache_layers
    assert len(layers) == 3 and all(isinstance(layer, MLAAttention) for layer in layers)
    assert all(layer.kv_cache.shape == (runner.num_kv_blocks, runner.block_size, 32 + 8) for layer in layers)
    assert runner.kv_cache_bytes_per_block() == 3 * runner.block_size * (32 + 8) * 4


def test_multi_token_prediction_layer_tensors_are_skipped(model_dirs, tmp_path):
    """DeepSeek-V3 checkpoints store their MTP layer after the last decoder layer (`num_nextn_predict_layers`)."""
    import json
    import shutil
    from safetensors.torch import load_file, save_file
    folder = model_dirs["deepseek_v3"]
    for path in folder.iterdir():
        shutil.copy(path, tmp_path / path.name)
    config = json.loads((folder / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    weights = load_file(str(folder / "model.safetensors"))
    mtp = {name.replace("model.layers.2.", "model.layers.3."): tensor.clone() for name, tensor in weights.items()
           if name.startswith("model.layers.2.")}
    save_file({**weights, **mtp, "model.layers.3.eh_proj.weight": torch.zeros(96, 192)},
              str(tmp_path / "model.safetensors"))
    prompt = list(range(3, 40))

    def logits(path):
        model = build_model(resolve_model(str(path)), torch.float32, torch.device("cpu"), show_progress=False)
        return tiny_models.engine_logits(model, prompt)
    assert torch.equal(logits(tmp_path), logits(folder))


def test_kimi_k2_style_config_loads_as_deepseek_v3_without_remote_code(llms, model_dirs, tmp_path):
    """Kimi-K2 ships DeepseekV3ForCausalLM weights with its own config code (model_type "kimi_k2", an
    auto_map): read with transformers' DeepseekV3Config, never the checkpoint's code, it is the same model."""
    import json
    import shutil
    folder = model_dirs["deepseek_v3"]
    for path in folder.iterdir():
        shutil.copy(path, tmp_path / path.name)
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="kimi_k2", auto_map={"AutoConfig": "configuration_deepseek.DeepseekV3Config"})
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert resolve_model(str(tmp_path)).hf_config.model_type == "deepseek_v3"
    prompts = [list(range(3, 40)), [7, 8, 9]]
    kimi = LLM(str(tmp_path), dtype="float32", show_progress=False).generate(prompts, GREEDY_32)
    assert [o.token_ids for o in kimi] == [o.token_ids for o in llms["deepseek_v3"].generate(prompts, GREEDY_32)]
    config.update(architectures=["NotAModelForCausalLM"])
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="could not read"):
        resolve_model(str(tmp_path))


def test_fp8_kv_cache_is_taken_for_latent_attention(model_dirs):
    """An FP8 latent cache with one per-tensor scale per layer (tests/engine/test_mla_fp8_cache.py has the rest)."""
    llm = LLM(str(model_dirs["deepseek_v2"]), dtype="float32", kv_cache_dtype="fp8", num_kv_blocks=64,
              show_progress=False)
    runner = llm.engine.executor.runner
    assert runner.kv_scale_granularity == "tensor"
    assert {layer.kv_cache.dtype for layer in runner.cache_layers} == {torch.float8_e4m3fn}
    assert len(llm.generate([PROMPTS[1]], GREEDY_32)[0].token_ids) == 32


def test_fp8_kv_cache_is_refused_for_deepseek_v4(tmp_path):
    folder = tiny_models.make_tiny_v4_model(tmp_path / "v4")
    with pytest.raises(ConfigError, match="DeepseekV4Attention layers keep a full-precision cache only"):
        LLM(str(folder), dtype="float32", kv_cache_dtype="fp8", show_progress=False)


@pytest.fixture(scope="module")
def fp8_block_checkpoint(tmp_path_factory):
    """(full-precision folder, the same model written as DeepSeek's FP8 128x128-block checkpoint)."""
    root = tmp_path_factory.mktemp("deepseek-fp8")
    folder = tiny_models.make_trained_tiny_model(root / "bf", "deepseek_v3", **BLOCK_SHAPES)
    quantize_checkpoint(folder, root / "fp8", "fp8-block")
    return folder, root / "fp8"


def test_fp8_block_checkpoint_loads_like_online_block_quantization(fp8_block_checkpoint):
    folder, quantized = fp8_block_checkpoint
    prompt = list(range(3, 70))

    def logits(path, **build_args):
        model = build_model(resolve_model(str(path)), torch.float32, torch.device("cpu"), show_progress=False,
                            **build_args)
        return tiny_models.engine_logits(model, prompt)
    full, stored = logits(folder), logits(quantized)
    assert torch.equal(stored, logits(folder, quantization="fp8_block"))
    assert ((stored - full).norm() / full.norm()).item() < 0.1  # measured 0.074


def test_fp8_block_checkpoint_keeps_teacher_forced_tokens_and_absorbed_decode(fp8_block_checkpoint):
    """Chunked prefill expands latents through the FP8 kv_b_proj GEMM (activations quantized too); decode
    absorbs its dequantized weights: the two paths agree closely, and the model keeps its choices."""
    folder, quantized = fp8_block_checkpoint
    sequence = tiny_models.training_sequence(folder, 96)
    teacher_forced = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)

    def top1(llm):
        entries = llm.generate([sequence], teacher_forced)[0].prompt_logprobs[1:]
        return [min(entry.items(), key=lambda kv: kv[1].rank)[0] for entry in entries]
    chunked = dict(dtype="float32", max_num_batched_tokens=16, max_num_seqs=1, show_progress=False)
    llm = LLM(str(quantized), **chunked)
    expected = top1(LLM(str(folder), **chunked))
    assert sum(a == b for a, b in zip(top1(llm), expected)) / len(expected) >= 0.95  # measured 0.99
    prompt = sequence[:40]
    output = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, logprobs=0, ignore_eos=True))[0]
    prefilled = llm.generate([prompt + output.token_ids], teacher_forced)[0].prompt_logprobs
    for step, (token, entry) in enumerate(zip(output.token_ids, output.logprobs)):
        assert abs(entry[token].logprob - prefilled[len(prompt) + step][token].logprob) < 1e-2  # measured 3e-4


def _prefill_then_decode_logits(model, prompt: list[int], block_size: int = 4) -> torch.Tensor:
    """Logits of the last prompt token decoded (absorbed form) after the rest was prefilled into the cache,
    and of every prefilled position: [len(prompt), vocab]."""
    num_blocks = -(-len(prompt) // block_size)
    layers = [m for m in model.modules() if isinstance(m, MLAAttention)]
    for layer in layers:
        layer.bind_caches({"kv": torch.zeros(layer.cache_specs()["kv"].shape(num_blocks, block_size))})
    block_table = torch.arange(num_blocks, dtype=torch.int32)[None]
    n = len(prompt) - 1
    steps = [(_metadata(0, [n], [n], block_table, torch.arange(n)), prompt[:n], torch.arange(n)),
             (_metadata(1, [1], [n + 1], block_table, torch.tensor([n])), prompt[n:], torch.tensor([n]))]
    logits = []
    with torch.inference_mode():
        for metadata, ids, positions in steps:
            with forward_context(metadata, block_size):
                logits.append(model.compute_logits(model(torch.tensor(ids), positions)))
    return torch.cat(logits)


def _tensor_parallel_worker(rank: int, folder: str, rendezvous: str, out: str) -> None:
    parallel_state.init_parallel(rank, 2, rendezvous, torch.device("cpu"))
    model = build_model(resolve_model(folder), torch.float32, torch.device("cpu"), show_progress=False)
    heads = {m.num_heads for m in model.modules() if isinstance(m, MLAAttention)}
    torch.save({"logits": _prefill_then_decode_logits(model, PROMPTS[1]), "heads": heads}, f"{out}/rank{rank}.pt")
    dist.barrier()  # neither rank tears gloo down while the other may still be using it (seen: SIGABRT)
    dist.destroy_process_group()


def test_tensor_parallel_2_splits_heads_and_matches_one_process(model_dirs, tmp_path):
    """Heads split over two ranks (q and kv_b projections by output heads, o_proj by input heads), the
    latent projections and cache replicated: prefill and absorbed-decode logits equal the single process's."""
    folder = str(model_dirs["deepseek_v3"])
    spawn_two(_tensor_parallel_worker, folder, f"file://{tmp_path}/rendezvous", str(tmp_path))
    single = _prefill_then_decode_logits(
        build_model(resolve_model(folder), torch.float32, torch.device("cpu"), show_progress=False), PROMPTS[1])
    assert (single - tiny_models.hf_logits(model_dirs["deepseek_v3"], PROMPTS[1])).abs().max().item() < 1e-4
    for rank in range(2):
        result = torch.load(tmp_path / f"rank{rank}.pt")
        assert result["heads"] == {3}
        assert (result["logits"] - single).abs().max().item() < 1e-4
