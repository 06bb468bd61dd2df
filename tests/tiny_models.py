"""Tiny random-weight checkpoints of each supported architecture, saved as HF folders, for parity tests
against transformers' own implementation."""
from __future__ import annotations

import json
from pathlib import Path

import torch

VOCAB_SIZE = 389  # odd on purpose: exercises vocabulary padding
TRAINING_TEXT = (
    "The quick brown fox jumps over the lazy dog. Paris is the capital of France. "
    "Tokyo, Berlin and Madrid are capitals too. 0123456789 numbers, punctuation!? and unicode: "
    "café, naïve, 東京, Привет, 😀. Language models predict the next token from the previous ones. "
) * 4

ARCHITECTURES = {
    "llama": dict(model_type="llama", attention_bias=False),
    "llama3_rope": dict(model_type="llama", rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}),
    "llama_tied": dict(model_type="llama", tie_word_embeddings=True),
    "qwen2": dict(model_type="qwen2"),
    "qwen3": dict(model_type="qwen3", head_dim=48),
    # Mixture of experts: 8 experts of width 64, 2 (or more) per token, so routing decides the output.
    "qwen3_moe": dict(model_type="qwen3_moe", head_dim=48, num_experts=8, num_experts_per_tok=2,
                      moe_intermediate_size=64, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1]),
    # Mixtral and MiniMax-M2 name their experts' width intermediate_size.
    "mixtral": dict(model_type="mixtral", num_local_experts=8, num_experts_per_tok=2, intermediate_size=64),
    # Sigmoid routing with a (random, see make_tiny_model) correction bias, 2 of 4 groups, scaled weights,
    # a shared expert, a dense first layer, RoPE over half of each head, a QKV bias.
    "glm4_moe": dict(model_type="glm4_moe", head_dim=32, attention_bias=True, partial_rotary_factor=0.5,
                     n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=64, n_group=4, topk_group=2,
                     n_shared_experts=1, first_k_dense_replace=1, norm_topk_prob=True, routed_scaling_factor=2.5,
                     use_qk_norm=False),
    # Per-head QK norm, two shared experts, weights not renormalised.
    "glm4_moe_qk_norm": dict(model_type="glm4_moe", attention_bias=False, partial_rotary_factor=0.5,
                             n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, n_group=4,
                             topk_group=2, n_shared_experts=2, first_k_dense_replace=1, norm_topk_prob=False,
                             routed_scaling_factor=1.5, use_qk_norm=True),
    # QK norm over all heads at once, RoPE over rotary_dim = half of each head, sigmoid + bias routing.
    # partial_rotary_factor says the same as rotary_dim: transformers 5.17 ignored rotary_dim (whole-head RoPE).
    "minimax_m2": dict(model_type="minimax_m2", head_dim=32, rotary_dim=16, partial_rotary_factor=0.5,
                       num_local_experts=8, num_experts_per_tok=2, intermediate_size=64),
    # Multi-head latent attention (num_key_value_heads = num_attention_heads: transformers' MLA needs it),
    # v_head_dim unlike qk_nope_head_dim. V2: no q-LoRA, softmax routing limited to 2 of 4 groups (a group's
    # best score), scaled, not renormalised; two shared experts; a dense first layer.
    "deepseek_v2": dict(model_type="deepseek_v2", num_key_value_heads=6, kv_lora_rank=32, q_lora_rank=None,
                        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24, n_routed_experts=8,
                        num_experts_per_tok=2, moe_intermediate_size=64, n_shared_experts=2,
                        first_k_dense_replace=1, topk_method="group_limited_greedy", n_group=4, topk_group=2,
                        routed_scaling_factor=2.0),
    # V2 with greedy routing and DeepSeek's yarn (mscale != mscale_all_dim: rope attention factor and softmax
    # scale both change; yarn moves every frequency, so short prompts test it too).
    "deepseek_v2_yarn": dict(model_type="deepseek_v2", num_key_value_heads=6, kv_lora_rank=32, q_lora_rank=None,
                             qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24, n_routed_experts=8,
                             num_experts_per_tok=2, moe_intermediate_size=64, n_shared_experts=1,
                             first_k_dense_replace=0, topk_method="greedy", routed_scaling_factor=1.5,
                             rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
                                           "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8}),
    # V3: q-LoRA, sigmoid routing with a correction bias, 2 of 4 groups, renormalised and scaled weights.
    "deepseek_v3": dict(model_type="deepseek_v3", num_key_value_heads=6, kv_lora_rank=32, q_lora_rank=48,
                        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24, n_routed_experts=8,
                        num_experts_per_tok=2, moe_intermediate_size=64, n_shared_experts=1,
                        first_k_dense_replace=1, n_group=4, topk_group=2, norm_topk_prob=True,
                        routed_scaling_factor=2.5),
}
MOE_ARCHITECTURES = ["qwen3_moe", "mixtral", "glm4_moe", "glm4_moe_qk_norm", "minimax_m2", "deepseek_v2",
                     "deepseek_v2_yarn", "deepseek_v3"]


def build_tokenizer(folder: Path):
    """A byte-level BPE tokenizer with VOCAB_SIZE entries, trained on a fixed text (deterministic)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator([TRAINING_TEXT], trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                          "{% if add_generation_prompt %}<s>assistant:{% endif %}")
    fast.save_pretrained(str(folder))
    return fast


def make_tiny_model(folder: Path, arch: str, seed: int = 0, **overrides) -> Path:
    """Save a random tiny model of `arch` (a key of ARCHITECTURES) with its tokenizer into `folder`."""
    from transformers import AutoConfig, AutoModelForCausalLM
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(folder)
    settings = dict(ARCHITECTURES[arch])
    model_type = settings.pop("model_type")
    settings = {**dict(
        vocab_size=len(tokenizer), hidden_size=96, intermediate_size=160, num_hidden_layers=3,
        num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5,
        tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, initializer_range=0.2), **settings, **overrides}
    config = AutoConfig.for_model(model_type, **settings)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize_correction_biases(model)
    model.save_pretrained(str(folder), safe_serialization=True)
    return folder


def randomize_correction_biases(model) -> None:
    """transformers starts the MoE routers' selection biases (`e_score_correction_bias`) at zero; random
    ones make the tests see whether a bias steers the choice of experts (and only the choice)."""
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith("e_score_correction_bias"):
                tensor.copy_(torch.randn(tensor.shape) * 0.1)


def hf_greedy(folder: Path, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' own greedy generate, never stopping early."""
    out = hf_model(folder).generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                         do_sample=False, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


_HF_MODELS: dict[str, object] = {}


def hf_model(folder: Path):
    from transformers import AutoModelForCausalLM
    key = str(folder)
    if key not in _HF_MODELS:
        model = AutoModelForCausalLM.from_pretrained(key, dtype=torch.float32)
        model.generation_config.eos_token_id = None
        _HF_MODELS[key] = model.eval()
    return _HF_MODELS[key]


def hf_logits(folder: Path, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(folder)(torch.tensor([token_ids])).logits[0].float()


def engine_logits(model, token_ids: list[int]) -> torch.Tensor:
    """Our built model's (engine.loader.build_model) logits for every position of one sequence: a single
    cache-less prefill on the CPU."""
    from engine.forward_context import forward_context
    from engine.kernels.attention import CommonAttentionMetadata
    n = len(token_ids)
    metadata = CommonAttentionMetadata(
        num_seqs=1, num_decodes=0, num_tokens=n, query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([n], dtype=torch.int32), block_table=torch.zeros(1, 1, dtype=torch.int32),
        slot_mapping=torch.arange(n), max_query_len=n, max_seq_len=n, query_start_loc_cpu=[0, n],
        seq_lens_cpu=[n], num_computed_tokens_cpu=[0])
    with torch.inference_mode(), forward_context(metadata, 16):
        return model.compute_logits(model(torch.tensor(token_ids), torch.arange(n)))


def folder_logits(folder: Path, token_ids: list[int], edit=None) -> torch.Tensor:
    """`engine_logits` of the model built from `folder` (float32, CPU), after `edit(model)` where given (a
    negative control taking a feature out)."""
    from engine.loader import build_model, resolve_model
    model = build_model(resolve_model(str(folder)), torch.float32, torch.device("cpu"), show_progress=False)
    if edit is not None:
        edit(model)
    return engine_logits(model, token_ids)


def logits_close(ours: torch.Tensor, reference: torch.Tensor, tolerance: float = 1e-4) -> bool:
    return ours.shape == reference.shape and (ours - reference).abs().max().item() < tolerance


# Quantization tests need a model whose next-token choices have margins like a real model's: a random one's
# top candidates are near-ties that any rounding flips. These shapes divide into 128x128 FP8 blocks and
# 32-wide MXFP4 groups (q 256 rows, k and v 128 each, MLP 384, experts 128).
QUANT_SHAPES = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                    intermediate_size=384, initializer_range=0.05)


# QUANT_SHAPES with AITER's attention shape: pa_fwd_asm serves head size 128 only (GQA 2 here), so aiter-backend
# tests and benchmarks/validate_rocm.py keep attention on AITER with these.
AITER_SHAPES = dict(hidden_size=256, num_attention_heads=2, num_key_value_heads=1, head_dim=128,
                    intermediate_size=384)
# A tiny DeepSeek whose latent entry is the one AITER's MLA kernels are built for (512 + 64; 4 heads, which the
# decode kernel pads to 16); small per-head dims.
AITER_MLA_SHAPES = dict(num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=512, qk_rope_head_dim=64,
                        qk_nope_head_dim=32, v_head_dim=32)


_TRAINED: dict[tuple, Path] = {}


def make_trained_tiny_model(folder: Path, arch: str, steps: int = 40, seed: int = 0, **overrides) -> Path:
    """A tiny model of `arch` with QUANT_SHAPES, trained for `steps` AdamW steps to predict TRAINING_TEXT
    (seconds on a CPU), saved with its tokenizer into `folder`; the same request again in this process
    returns the first folder (tests only read them)."""
    key = (arch, steps, seed, tuple(sorted(overrides.items())))
    if key in _TRAINED and _TRAINED[key].is_dir():
        return _TRAINED[key]
    _TRAINED[key] = _train(folder, arch, steps, seed, overrides)
    return _TRAINED[key]


def _train(folder: Path, arch: str, steps: int, seed: int, overrides: dict) -> Path:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    extra = {"moe_intermediate_size": 128} if "moe_intermediate_size" in ARCHITECTURES[arch] else {}
    make_tiny_model(folder, arch, seed, **{**QUANT_SHAPES, **extra, **overrides})
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    ids = torch.tensor(tokenizer(TRAINING_TEXT)["input_ids"])
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    generator = torch.Generator().manual_seed(seed)
    window = 64
    # Subnormal numbers in the optimizer's state can make CPU training ~100x slower (seen: 20 steps in 59 s).
    flush = torch.set_flush_denormal(True)
    try:
        for _ in range(steps):
            starts = torch.randint(0, len(ids) - window - 1, (4,), generator=generator)
            batch = torch.stack([ids[s:s + window] for s in starts.tolist()])
            loss = model(batch, labels=batch).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    finally:
        if flush:
            torch.set_flush_denormal(False)
    model.eval()
    model.save_pretrained(str(folder), safe_serialization=True)
    return folder


def training_sequence(folder: Path, length: int = 160) -> list[int]:
    """Token ids of a stretch of TRAINING_TEXT: a teacher-forced sequence the trained model knows."""
    from transformers import AutoTokenizer
    ids = AutoTokenizer.from_pretrained(str(folder))(TRAINING_TEXT)["input_ids"]
    return ids[7:7 + length]


# DeepSeek-V4 (tests/engine/test_deepseek_v4.py describes the model): a transformers config of its own kind.
def tiny_v4_config(**overrides) -> dict:
    """DeepseekV4Config arguments of the tiny test model (any can be overridden)."""
    return {**dict(
        hidden_size=64, moe_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4, head_dim=32,
        q_lora_rank=32, partial_rotary_factor=0.25, num_experts_per_tok=2, n_routed_experts=8, n_shared_experts=1,
        layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                     "compressed_sparse_attention"],
        mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"],
        compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 8},
        sliding_window=8, o_groups=2, o_lora_rank=16, index_n_heads=8, index_head_dim=16, index_topk=4,
        swiglu_limit=1.0, hc_mult=4, hc_sinkhorn_iters=20, routed_scaling_factor=1.5,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
        max_position_embeddings=512, initializer_range=0.2, rms_norm_eps=1e-5), **overrides}


def make_tiny_v4_model(folder: Path, seed: int = 0, **overrides) -> Path:
    """Save a random tiny DeepSeek-V4 (tiny_v4_config) with its tokenizer into `folder`. transformers starts
    the sinks, compressor position biases, hyper-connection biases and router biases at zero and every
    token's hash experts at expert 0: random ones here, so that each of them matters."""
    from transformers import AutoConfig, AutoModelForCausalLM
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(folder)
    config = AutoConfig.for_model("deepseek_v4", **tiny_v4_config(
        vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, **overrides))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize_v4_extras(model, seed)
    model.save_pretrained(str(folder), safe_serialization=True)
    return folder


def randomize_v4_extras(model, seed: int = 0) -> None:
    generator = torch.Generator().manual_seed(seed + 1)
    num_experts, top_k = model.config.n_routed_experts, model.config.num_experts_per_tok
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith("tid2eid"):
                tensor.copy_(torch.stack([torch.randperm(num_experts, generator=generator)[:top_k]
                                          for _ in range(tensor.shape[0])]))
            elif name.endswith(("sinks", "position_bias", "e_score_correction_bias", "_hc.base", "hc_base")):
                tensor.copy_(torch.randn(tensor.shape, generator=generator) * 0.5)


def generate_staggered(engine, prompts: list[list[int]], params, every: int) -> list[list[int]]:
    """Drive an LLMEngine step by step, adding the next prompt every `every` steps (so later requests are
    prefilled in the same steps as earlier ones decode); each prompt's output tokens, in order."""
    pending, finished, steps = list(enumerate(prompts)), {}, 0
    while pending or engine.has_unfinished_requests():
        if pending and steps % every == 0:
            index, prompt = pending.pop(0)
            engine.add_request(str(index), prompt, params)
        for output in engine.step():
            if output.finished:
                finished[int(output.request_id)] = output.token_ids
        steps += 1
    return [finished[index] for index in range(len(prompts))]


# DeepSeek-V3.2 / GLM-5 (tests/engine/test_deepseek_v32.py describes them): an index top-k (8) smaller than
# the test prompts, so selection matters.
DSA_INDEX_TOPK = 8


def deepseek_v32_config() -> dict:
    """A tiny DeepSeek-V3.2: V3's MLA (q-LoRA) and routing (sigmoid + bias, 2 of 4 groups, a shared
    expert, a dense first layer), an indexer of 16 heads of 16 dims (8 rotated). 16 index heads make an
    exactly-zero score (every head's ReLU at zero), hence a tie, rare."""
    return dict(model_type="deepseek_v32", hidden_size=96, intermediate_size=160, num_hidden_layers=3,
                num_attention_heads=6, num_key_value_heads=6, kv_lora_rank=32, q_lora_rank=48,
                qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24, n_routed_experts=8, num_experts_per_tok=2,
                moe_intermediate_size=64, n_shared_experts=1, first_k_dense_replace=1, n_group=4, topk_group=2,
                norm_topk_prob=True, routed_scaling_factor=2.5, index_topk=DSA_INDEX_TOPK, index_head_dim=16,
                index_n_heads=16, max_position_embeddings=512, rms_norm_eps=1e-5, initializer_range=0.2,
                tie_word_embeddings=False)


def glm_moe_dsa_config() -> dict:
    """A tiny GLM-5: DeepSeek-V3.2's layers with the indexer's RoPE in GPT-J pairs, one expert group, two
    "shared" layers that reuse the selection of the full layer before them, and MoE layers placed by
    mlp_layer_types (not first_k_dense_replace)."""
    return {**deepseek_v32_config(), "model_type": "glm_moe_dsa", "num_hidden_layers": 4, "n_group": 1,
            "topk_group": 1, "indexer_types": ["full", "shared", "shared", "full"],
            "mlp_layer_types": ["dense", "sparse", "dense", "sparse"]}


def deepseek_v32_yarn_config() -> dict:
    """DeepSeek-V3.2 with DeepSeek's yarn (mscale != mscale_all_dim): the indexer rotates by the same scaled
    cos/sin table as the main attention, whose softmax scale also changes."""
    return {**deepseek_v32_config(), "rope_parameters": {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8}}




def make_dsa_model(folder: Path, settings: dict, seed: int = 0, random_index_norm: bool = True) -> Path:
    """Save a random model of `settings` (one of the configs above, model_type included) with the tiny
    tokenizer into `folder`; routers' correction biases random too, and (`random_index_norm`) the indexer's
    key norm."""
    from transformers import AutoConfig, AutoModelForCausalLM
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(folder)
    settings = dict(settings)
    model_type = settings.pop("model_type")
    config = AutoConfig.for_model(model_type, vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                                  eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **settings)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize_correction_biases(model)
    with torch.no_grad():  # transformers starts the indexer's LayerNorm at weight 1, bias 0: make both count
        for name, param in model.named_parameters():
            if random_index_norm and ".indexer.k_norm." in name:
                param.copy_(torch.randn(param.shape) * 0.5 + (1.0 if name.endswith("weight") else 0.0))
    model.save_pretrained(str(folder), safe_serialization=True)
    return folder


# gpt-oss: alternating sliding (window 8) and full layers, sinks, biased router and experts, yarn RoPE.
GPT_OSS_CONFIG = dict(
    hidden_size=64, intermediate_size=64,  # multiples of 32: MXFP4 groups
    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, sliding_window=8, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=512,
    swiglu_limit=1.5,  # low enough that the random activations reach the clamp
    rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                     "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 128})


def make_tiny_gpt_oss(folder: Path, seed: int = 0) -> Path:
    """A tiny gpt-oss (sliding and full layers, the window shorter than the tests' prompts) with every bias,
    sink and norm weight random (transformers starts some at 0 or 1)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(folder)
    config = AutoConfig.for_model(
        "gpt_oss", vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, initializer_range=0.2,
        tie_word_embeddings=False, rms_norm_eps=1e-5, **GPT_OSS_CONFIG)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("_bias", "router.bias", "sinks")):
                param.copy_(torch.randn(param.shape) * (1.0 if name.endswith("sinks") else 0.2))
            elif "norm" in name:
                param.copy_(1 + torch.randn(param.shape) * 0.2)
    assert model.config.layer_types[:2] == ["sliding_attention", "full_attention"]
    model.save_pretrained(str(folder), safe_serialization=True)
    return folder


# Gemma 4 (dense): sliding layers (window 8, heads of 16, 2 KV heads) and full layers (heads of 32, 1 KV head,
# K as V, proportional RoPE over a quarter of the pairs), soft-capped logits.
GEMMA4_CONFIG = dict(
    hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True, sliding_window=8,
    layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    hidden_size_per_layer_input=0, final_logit_softcapping=3.0, max_position_embeddings=512)


def make_tiny_gemma4(folder: Path, seed: int = 0, **overrides) -> Path:
    """A tiny Gemma4ForCausalLM with random norm weights and layer scalars (transformers starts them at 1)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(folder)
    config = AutoConfig.for_model(
        "gemma4_text", vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, initializer_range=0.2,
        rms_norm_eps=1e-6, **{**GEMMA4_CONFIG, **overrides})
    config.architectures = ["Gemma4ForCausalLM"]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if ("norm" in name and name.endswith("weight") or name.endswith(("layer_scalar", "router.scale",
                                                                                "per_expert_scale"))):
                tensor.copy_(1 + torch.randn(tensor.shape) * 0.3)
    model.save_pretrained(str(folder), safe_serialization=True)
    return folder


# Qwen3-Next: three Gated DeltaNet layers then a gated full-attention layer, 2 key heads of 4 value heads each,
# MoE with a gated shared expert (layer 1 dense), partial RoPE.
QWEN3_NEXT_CONFIG = dict(
    hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
    linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2,
    moe_intermediate_size=32, shared_expert_intermediate_size=32, decoder_sparse_step=1, mlp_only_layers=[1],
    norm_topk_prob=True, max_position_embeddings=512)


def as_gemma4_multimodal(text_dir: Path, folder: Path, edit=None) -> Path:
    """Gemma4ForConditionalGeneration in the hub's layout around a tiny text model's folder: its weights under
    model.language_model., a vision tower and an audio embedder beside them (never read), its config as
    text_config. `edit(tensors, text)` may add or change tensors (text: the text model's own)."""
    import shutil

    from safetensors.torch import load_file, save_file
    shutil.copytree(text_dir, folder)
    text = load_file(str(text_dir / "model.safetensors"))
    tensors = {name.replace("model.", "model.language_model.", 1): tensor for name, tensor in text.items()}
    tensors["model.vision_tower.encoder.layers.0.mlp.gate_proj.linear.weight"] = torch.randn(7, 5)
    tensors["model.embed_audio.embedding_projection.weight"] = torch.randn(64, 11)
    if edit is not None:
        edit(tensors, text)
    save_file(tensors, str(folder / "model.safetensors"))
    text_config = json.loads((text_dir / "config.json").read_text())
    text_config.pop("architectures")
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["Gemma4ForConditionalGeneration"], "model_type": "gemma4", "text_config": text_config,
        "vision_config": {"model_type": "gemma4_vision", "hidden_size": 32},
        "tie_word_embeddings": text_config.get("tie_word_embeddings", True)}))
    return folder


def make_tiny_qwen3_next(folder: Path, seed: int = 0, model_type: str = "qwen3_next", **overrides) -> Path:
    """A tiny Qwen3-Next (or, with model_type qwen3_5_text / qwen3_5_moe_text, Qwen3.5) with random norm weights
    (transformers starts the zero-centred ones at 0), decay parameters and gates."""
    from transformers import AutoConfig, AutoModelForCausalLM
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(folder)
    settings = {**QWEN3_NEXT_CONFIG, **overrides}
    config = AutoConfig.for_model(
        model_type, vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, initializer_range=0.2, rms_norm_eps=1e-6, tie_word_embeddings=False,
        **settings)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                param.copy_(torch.randn(param.shape) * 0.3 + (1.0 if "linear_attn.norm" in name else 0.0))
            elif name.endswith(("A_log", "dt_bias")):
                param.copy_(torch.randn(param.shape) * 0.5)
    model.save_pretrained(str(folder), safe_serialization=True)
    return folder


def add_random_mtp_layer(folder: Path, seed: int = 0) -> Path:
    """Random weights for a DeepSeek-V3 or GLM-4.5 checkpoint's multi-token-prediction layer (model.layers.{N}.*,
    which transformers neither builds nor writes), in a file of their own beside the model's."""
    from safetensors.torch import save_file
    from engine.loader import dummy_checkpoint_layout
    from engine.loader.source import resolve_model
    from engine.models import model_class_for
    config = resolve_model(str(folder)).hf_config
    layout = dummy_checkpoint_layout(config)
    generator = torch.Generator().manual_seed(seed)
    extra = model_class_for(config).mtp_checkpoint_layout(config, layout)[len(layout):]
    tensors = {name: torch.ones(shape) if "norm" in name else torch.randn(*shape, generator=generator) * 0.1
               for name, shape in extra}
    for name in [n for n in tensors if n.endswith(".experts.gate_up_proj")]:
        # Released checkpoints store the MTP layer's routed experts one by one (2-D, as quantized releases do),
        # not in transformers' fused 3-D tensors.
        prefix = name[:-len("gate_up_proj")]
        gate_up, down = tensors.pop(name), tensors.pop(prefix + "down_proj")
        gate, up = gate_up.chunk(2, dim=1)
        for expert in range(gate_up.shape[0]):
            tensors[f"{prefix}{expert}.gate_proj.weight"] = gate[expert].contiguous()
            tensors[f"{prefix}{expert}.up_proj.weight"] = up[expert].contiguous()
            tensors[f"{prefix}{expert}.down_proj.weight"] = down[expert].contiguous()
    save_file(tensors, str(folder / "model-mtp.safetensors"))
    return folder


def make_random_eagle3_draft(folder: Path, target_folder: Path, seed: int = 0) -> Path:
    """An EAGLE3 draft checkpoint in the published layout with random weights for the Llama target at
    `target_folder` (benchmarks/spec_decode_bench.py writes the same at real shapes)."""
    from benchmarks.spec_decode_bench import write_random_eagle3_draft
    from engine.loader.source import resolve_model
    return write_random_eagle3_draft(folder, resolve_model(str(target_folder)).hf_config, torch.float32, seed)
