"""RoPE tables against transformers' rotary embeddings, including configs that give rope settings per layer
type (transformers 5's nested `rope_parameters`: Gemma 3 / Gemma 4), and the errors for a layer that does not
name its type or names one the config lacks (a silent default theta was the trap)."""
from __future__ import annotations

import pytest
import torch

from engine.layers.rotary_embedding import RotaryEmbedding, rope_parameters

POSITIONS = 40


def our_cos_sin(config, head_dim: int, layer_type: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    cache = RotaryEmbedding(config, head_dim, head_dim, POSITIONS, layer_type=layer_type).cos_sin_cache
    half = cache.shape[1] // 2
    return cache[:, :half], cache[:, half:]


def their_cos_sin(rotary, head_dim: int, layer_type: str) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = rotary(torch.zeros(1, POSITIONS, head_dim), torch.arange(POSITIONS)[None], layer_type=layer_type)
    return cos[0, :, :head_dim // 2], sin[0, :, :head_dim // 2]  # transformers repeats the half


@pytest.mark.parametrize("layer_type", ["sliding_attention", "full_attention"])
def test_gemma3_tables_follow_each_layer_types_theta(layer_type):
    from transformers import Gemma3TextConfig
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding
    config = Gemma3TextConfig(head_dim=16, hidden_size=64, num_attention_heads=4)
    ours = our_cos_sin(config, 16, layer_type)
    theirs = their_cos_sin(Gemma3RotaryEmbedding(config), 16, layer_type)
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-5)


def test_the_two_layer_types_get_different_tables():
    from transformers import Gemma3TextConfig
    config = Gemma3TextConfig(head_dim=16, hidden_size=64, num_attention_heads=4)
    sliding, full = (our_cos_sin(config, 16, kind)[0] for kind in ("sliding_attention", "full_attention"))
    assert not torch.allclose(sliding, full)  # theta 1e4 against 1e6


@pytest.mark.parametrize("layer_type, head_dim", [("sliding_attention", 32), ("full_attention", 64)])
def test_gemma4_proportional_rope_rotates_the_first_pairs_of_the_whole_head(layer_type, head_dim):
    """Gemma 4's full layers: exponents over the whole (global) head, a quarter of its pairs rotating and
    the rest at frequency 0 (cos 1, sin 0), as transformers' proportional RoPE."""
    from transformers import Gemma4TextConfig
    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextRotaryEmbedding
    config = Gemma4TextConfig(head_dim=32, global_head_dim=64, hidden_size=64, num_attention_heads=2)
    cos, sin = our_cos_sin(config, head_dim, layer_type)
    torch.testing.assert_close((cos, sin), their_cos_sin(Gemma4TextRotaryEmbedding(config), head_dim, layer_type),
                               atol=1e-6, rtol=1e-5)
    if layer_type == "full_attention":
        assert cos[:, 8:].eq(1).all() and sin[:, 8:].eq(0).all() and not cos[1:, :8].eq(1).all()


def test_a_layer_that_does_not_name_its_type_is_refused_naming_the_types():
    from transformers import Gemma3TextConfig
    config = Gemma3TextConfig(head_dim=16, hidden_size=64, num_attention_heads=4)
    with pytest.raises(ValueError, match="per layer type .*full_attention, sliding_attention.* did not name its type"):
        RotaryEmbedding(config, 16, 16, POSITIONS)
    with pytest.raises(ValueError, match="no entry for layer type 'chunked_attention'"):
        rope_parameters(config, "chunked_attention")


def test_flat_rope_settings_serve_any_layer_type():
    from transformers import LlamaConfig
    config = LlamaConfig(hidden_size=64, num_attention_heads=4, rope_theta=5e5)
    assert rope_parameters(config)["rope_theta"] == rope_parameters(config, "full_attention")["rope_theta"] == 5e5
