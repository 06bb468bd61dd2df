"""GGUF checkpoints (llama.cpp's format): config from the metadata, tensors de-quantized to float and
renamed to Hugging Face names, and the tokenizer through transformers' GGUF support."""
from __future__ import annotations

import hashlib
import os
import re
import struct
import tempfile
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from engine.loader.gguf_file import GGUFFile, GGUFFormatError
from engine.loader.source import ModelSourceError

# GGUF architecture -> (HF architecture, transformers config class name)
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "LlamaConfig"),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config"),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config"),
}

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")


def hf_tensor_name(gguf_name: str) -> str | None:
    match = _LAYER_TENSOR.match(gguf_name)
    if match:
        layer, kind, suffix = match.groups()
        target = _LAYER_NAMES.get(kind)
        return f"model.layers.{layer}.{target}.{suffix}" if target else None
    stem, _, suffix = gguf_name.rpartition(".")
    target = _GLOBAL_NAMES.get(stem)
    return f"{target}.{suffix}" if target else None


def tokenizer_cache_dir(path: Path) -> Path:
    """A cache folder for the tokenizer converted from this exact file (path, size, mtime) and
    transformers version. ATOM_RAY_CACHE_DIR overrides the location (default ~/.cache/atom-ray)."""
    import transformers
    stat = path.stat()
    key = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{transformers.__version__}"
    root = Path(os.environ.get("ATOM_RAY_CACHE_DIR") or Path.home() / ".cache" / "atom-ray")
    folder = root / "gguf-tokenizers" / hashlib.sha256(key.encode()).hexdigest()[:24]
    folder.parent.mkdir(parents=True, exist_ok=True)
    return folder


def unpermute_rope_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp stores Llama's Q and K rows interleaved per head for its RoPE; undo that."""
    rows = weight.shape[0]
    head_dim = rows // num_heads
    return (weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:])
            .transpose(1, 2).reshape(rows, *weight.shape[1:]))


class GGUFCheckpoint:
    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        try:
            self.file = GGUFFile(self.path)
        except (GGUFFormatError, OSError, struct.error, UnicodeDecodeError, ValueError) as exc:
            raise ModelSourceError(f"{self.path} is not a readable GGUF file: {exc}") from exc
        self.arch = self.field("general.architecture")
        if self.arch not in ARCHITECTURES:
            raise ModelSourceError(f"GGUF architecture {self.arch!r} is not supported; supported: "
                                   f"{', '.join(ARCHITECTURES)}")

    def field(self, key: str, default=None):
        return self.file.fields.get(key, default)

    def hf_config(self):
        import transformers
        architecture, config_class = ARCHITECTURES[self.arch]
        a = self.arch
        heads = self.field(f"{a}.attention.head_count")
        hidden = self.field(f"{a}.embedding_length")
        names = {t.name for t in self.file.tensors}
        if "rope_freqs.weight" in names:
            raise ModelSourceError("GGUF files with a rope_freqs tensor (Llama 3.1 RoPE scaling) are not "
                                   "supported; use the HF safetensors checkpoint")
        kwargs = dict(
            architectures=[architecture],
            vocab_size=len(self.field("tokenizer.ggml.tokens", ())) or self.field(f"{a}.vocab_size"),
            hidden_size=hidden,
            intermediate_size=self.field(f"{a}.feed_forward_length"),
            num_hidden_layers=self.field(f"{a}.block_count"),
            num_attention_heads=heads,
            num_key_value_heads=self.field(f"{a}.attention.head_count_kv", heads),
            head_dim=self.field(f"{a}.attention.key_length", hidden // heads),
            max_position_embeddings=self.field(f"{a}.context_length"),
            rms_norm_eps=float(self.field(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(self.field(f"{a}.rope.freq_base", 10000.0)),
            tie_word_embeddings="output.weight" not in names,
            bos_token_id=self.field("tokenizer.ggml.bos_token_id"),
            eos_token_id=self.field("tokenizer.ggml.eos_token_id"),
            pad_token_id=self.field("tokenizer.ggml.padding_token_id"),
        )
        scaling = self.field(f"{a}.rope.scaling.type")
        if scaling and scaling != "none":
            kwargs["rope_scaling"] = {
                "rope_type": scaling,
                "factor": float(self.field(f"{a}.rope.scaling.factor", 1.0)),
                "original_max_position_embeddings": self.field(f"{a}.rope.scaling.original_context_length"),
            }
        if self.arch == "llama":
            kwargs["attention_bias"] = "blk.0.attn_q.bias" in names
        return getattr(transformers, config_class)(**kwargs)

    def load_tokenizer(self):
        """transformers' tokenizer for the file, converted once and then read from the cache folder."""
        from transformers import AutoTokenizer
        cache = tokenizer_cache_dir(self.path)
        if (cache / "tokenizer_config.json").is_file():
            return AutoTokenizer.from_pretrained(str(cache))
        tokenizer = AutoTokenizer.from_pretrained(str(self.path.parent), gguf_file=self.path.name)
        try:
            staging = Path(tempfile.mkdtemp(dir=cache.parent.as_posix(), prefix=".tmp-"))
            tokenizer.save_pretrained(str(staging))
            os.replace(staging, cache)
        except OSError:
            pass  # a read-only or racing cache only costs the next start the conversion again
        return tokenizer

    @property
    def num_tensors(self) -> int:
        return len(self.file.tensors)

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize
        heads = self.field(f"{self.arch}.attention.head_count")
        kv_heads = self.field(f"{self.arch}.attention.head_count_kv", heads)
        for tensor in self.file.tensors:
            name = hf_tensor_name(tensor.name)
            if name is None:
                raise ModelSourceError(f"GGUF tensor {tensor.name!r} has no counterpart in the "
                                       f"{self.arch} model; this file is not supported")
            array = dequantize(self.file.tensor_data(tensor), GGMLQuantizationType(tensor.ggml_type))
            weight = torch.from_numpy(np.array(array, dtype=np.float32).reshape(tensor.shape))
            if self.arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
                weight = unpermute_rope_rows(weight, heads)
            elif self.arch == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
                weight = unpermute_rope_rows(weight, kv_heads)
            yield name, weight
