"""gpt-oss against transformers' GptOssForCausalLM on a tiny random checkpoint (float32, CPU): sliding and full
layers alternating with a window shorter than the prompts, non-zero sinks, a biased router, experts with biases
and the clamped (up + 1) * gate * sigmoid(alpha * gate) activation, norms with random weights, yarn RoPE. Each
feature has a negative control: the same comparison fails once the feature is taken away."""
from __future__ import annotations

import pytest
import torch

import tiny_models
from engine import LLM, SamplingParams
from engine.kernels.attention import AttentionOptions
from engine.loader import build_model, resolve_model

WINDOW = tiny_models.GPT_OSS_CONFIG["sliding_window"]
PROMPTS = [list(range(3, 40)), [5, 6, 7], list(range(50, 75)), [100] * 9 + [200]]


@pytest.fixture(scope="module")
def gpt_oss_dir(tmp_path_factory):
    return tiny_models.make_tiny_gpt_oss(tmp_path_factory.mktemp("gpt_oss"))


engine_logits = tiny_models.folder_logits
close_to_transformers = tiny_models.logits_close


def test_prompt_logits_match_transformers(gpt_oss_dir):
    prompt = list(range(3, 60))  # seven windows long
    assert close_to_transformers(engine_logits(gpt_oss_dir, prompt), tiny_models.hf_logits(gpt_oss_dir, prompt))


def _no_window(model):
    for layer in model.model.layers:
        layer.self_attn.attn.options = AttentionOptions(sinks=layer.self_attn.attn.sinks)


def _window_off_by_one(model):
    for layer in model.model.layers:
        attn = layer.self_attn.attn
        if attn.options.window is not None:
            attn.options = AttentionOptions(window=attn.options.window + 1, sinks=attn.sinks)


def _no_sinks(model):
    for layer in model.model.layers:
        layer.self_attn.attn.options = AttentionOptions(window=layer.self_attn.attn.options.window)


def _no_expert_biases(model):
    for layer in model.model.layers:
        layer.mlp.w13_bias.data.zero_()
        layer.mlp.w2_bias.data.zero_()


def _plain_silu(model):
    for layer in model.model.layers:
        layer.mlp.oai_alpha = None


def _no_clamp(model):
    for layer in model.model.layers:
        layer.mlp.swiglu_limit = None


def _no_router_bias(model):
    for layer in model.model.layers:
        layer.mlp.gate.bias.data.zero_()


@pytest.mark.parametrize("edit", [_no_window, _window_off_by_one, _no_sinks, _no_expert_biases, _plain_silu,
                                  _no_clamp, _no_router_bias])
def test_negative_controls_break_parity(gpt_oss_dir, edit):
    prompt = list(range(3, 60))
    assert not close_to_transformers(engine_logits(gpt_oss_dir, prompt, edit), tiny_models.hf_logits(gpt_oss_dir, prompt))


@pytest.mark.parametrize("chunk", [None, 16])
def test_greedy_tokens_through_paged_window_groups(gpt_oss_dir, chunk):
    """Prefill (whole, or in 16-token chunks: a window's keys come from the cache) then 32 decode steps
    whose windows drop blocks: transformers' tokens, and the window group gives its blocks back."""
    extra = {} if chunk is None else dict(max_num_batched_tokens=chunk, max_num_seqs=4)
    llm = LLM(str(gpt_oss_dir), dtype="float32", block_size=4, show_progress=False, **extra)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params)
    for prompt, output in zip(PROMPTS, outputs):
        assert output.token_ids == tiny_models.hf_greedy(gpt_oss_dir, prompt, 32)
    groups = {(g["ratio"], g["window"]): g for g in llm.engine.stats()["kv_cache_groups"]}
    assert set(groups) == {(1, None), (1, WINDOW)}
    assert all(g["num_free_blocks"] == g["num_blocks"] for g in groups.values())  # nothing leaked


def test_published_mxfp4_layout_loads_as_its_dequantized_weights(gpt_oss_dir, tmp_path):
    """The hub's MXFP4 experts (gate/up rows interleaved, [E, out, in / 32, 16] blocks with [E, out, in / 32]
    scales) give the tokens of the same model with the dequantized weights in the bf16 layout: the loader
    reads the interleave and the blocks as the checkpoint means them."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from engine.kernels.quant import QuantScheme, dequantize_weight, quantize_weight
    scheme = QuantScheme("mxfp4", "none")
    tensors = load_file(str(gpt_oss_dir / "model.safetensors"))
    quantized, dequantized = dict(tensors), dict(tensors)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        stored = tensors[name].transpose(1, 2).contiguous()  # [E, in, out] -> [E, out, in], rows still interleaved
        qw = quantize_weight(stored, scheme)
        del quantized[name]
        quantized[f"{name}_blocks"] = qw.weight.unflatten(-1, (-1, 16))
        quantized[f"{name}_scales"] = qw.scale
        dequantized[name] = dequantize_weight(qw).float().transpose(1, 2).contiguous()
    folders = {}
    for kind, weights in (("mxfp4", quantized), ("dequantized", dequantized)):
        folder = tmp_path / kind
        shutil.copytree(gpt_oss_dir, folder)
        save_file(weights, str(folder / "model.safetensors"))
        if kind == "mxfp4":
            config = json.loads((folder / "config.json").read_text())
            config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
                "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
            (folder / "config.json").write_text(json.dumps(config))
        folders[kind] = folder
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    tokens = {kind: [o.token_ids for o in LLM(str(folder), dtype="float32", show_progress=False).generate(PROMPTS, params)]
              for kind, folder in folders.items()}
    assert tokens["mxfp4"] == tokens["dequantized"]
    # Quantizing the bf16 layout online (quantization="mxfp4", as dummy-weight benchmarks do) stores the very
    # codes and scales of the published layout.
    published = build_model(resolve_model(str(folders["mxfp4"])), torch.float32, torch.device("cpu"),
                            show_progress=False)
    online = build_model(resolve_model(str(gpt_oss_dir)), torch.float32, torch.device("cpu"), show_progress=False,
                         quantization="mxfp4")
    for ours, theirs in zip(online.model.layers, published.model.layers):
        for name in ("w13", "w2", "w13_scale", "w2_scale", "w13_bias", "w2_bias"):
            assert torch.equal(getattr(ours.mlp, name), getattr(theirs.mlp, name)), name
    # The dequantized model is still a gpt-oss that transformers runs: our tokens are its tokens.
    assert tokens["dequantized"][0] == tiny_models.hf_greedy(folders["dequantized"], PROMPTS[0], 16)
