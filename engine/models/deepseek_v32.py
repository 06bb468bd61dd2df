"""DeepSeek-V3.2 and GLM-5 (`GlmMoeDsaForCausalLM`): DeepSeek-V3 (engine/models/deepseek_v2.py: its MoE
routing, dense first layers, its multi-token-prediction layer) with DeepSeek Sparse Attention in every layer
(engine/layers/dsa.py: a lightning indexer picks `index_topk` keys per query, latent attention reads only
those).

Both take the dense/MoE pattern from `mlp_layer_types` (transformers derives it from first_k_dense_replace).
GLM-5 differs in its indexer's RoPE (GPT-J pairs, not neox halves) and in `indexer_types`: a "shared" layer
has no indexer and reuses the selection of the last "full" layer before it (the first layer must be full).
Its other differences (v_head_dim unlike qk_nope_head_dim, one expert group) are MLA and router settings the
V3 layers already read.

The MTP layer (model.layers.{num_hidden_layers}, speculative_config method "mtp") is a DSA layer with a MoE
MLP and an indexer of its own, in both families: it runs in draft passes of its own, where no earlier layer
has selected keys for its tokens, so a GLM-5 MTP layer is "full" whatever the schedule of `indexer_types`
(which covers the decoder layers only) would say at its index. Its latent and index-key caches sit in the
full group beside the target's, and its selection reads only its own index keys."""
from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from engine.layers.dsa import DSAOptions, SparseMLAAttention, TopkRelay
from engine.models.deepseek_v2 import DeepseekV3ForCausalLM

MLP_LAYER_TYPES = ("dense", "sparse")
INDEXER_TYPES = ("full", "shared")


class DeepseekV32ForCausalLM(DeepseekV3ForCausalLM):
    def __init__(self, config, residual_dtype=None, mtp: bool = False) -> None:
        check_layer_types(config, "mlp_layer_types", MLP_LAYER_TYPES)
        self.topk_relay = TopkRelay()  # the step's selection, from a full indexer layer to shared ones
        super().__init__(config, residual_dtype=residual_dtype, mtp=mtp)

    def dsa_options(self, layer_index: int) -> DSAOptions:
        return DSAOptions(index_rope_interleaved=False, reuses_topk=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        try:
            return super().forward(input_ids, positions)
        finally:
            self.topk_relay.slots = None  # [tokens, index_topk] slots: not kept alive between steps

    def mtp_forward(self, input_ids: torch.Tensor, previous_hidden: torch.Tensor, positions: torch.Tensor):
        try:
            return super().mtp_forward(input_ids, previous_hidden, positions)
        finally:
            self.topk_relay.slots = None  # (the MTP layer's own selection: a full layer, it relays to no one)

    def build_attention(self, layer_index: int) -> nn.Module:
        return SparseMLAAttention(self.config, self.dsa_options(layer_index), self.topk_relay)

    def build_mtp_attention(self) -> nn.Module:
        options = replace(self.dsa_options(0), reuses_topk=False)  # layer 0 is always a full indexer layer
        return SparseMLAAttention(self.config, options, self.topk_relay)

    def is_sparse_layer(self, layer_index: int) -> bool:
        layer_types = getattr(self.config, "mlp_layer_types", None)
        if layer_types is None or layer_index >= len(layer_types):  # (the MTP layer: V3's rule, a MoE layer)
            return super().is_sparse_layer(layer_index)
        return layer_types[layer_index] == "sparse"

    @staticmethod
    def mtp_shape_source(config) -> int:
        """The last decoder layer shaped as the MTP layer: a MoE MLP and an indexer of its own."""
        mlp_types = getattr(config, "mlp_layer_types", None)
        indexer_types = getattr(config, "indexer_types", None)
        for index in reversed(range(config.num_hidden_layers)):
            moe = mlp_types[index] == "sparse" if mlp_types else index >= (config.first_k_dense_replace or 0)
            if moe and (not indexer_types or indexer_types[index] == "full"):
                return index
        raise ValueError("no decoder layer has both a MoE MLP and an indexer of its own, as the MTP layer has: "
                         "its tensors' shapes cannot be derived for dummy weights")


class GlmMoeDsaForCausalLM(DeepseekV32ForCausalLM):
    def __init__(self, config, residual_dtype=None, mtp: bool = False) -> None:
        check_layer_types(config, "indexer_types", INDEXER_TYPES)
        types = getattr(config, "indexer_types", None)
        if types and types[0] != "full":
            raise ValueError("indexer_types[0] must be 'full': a 'shared' layer reuses the top-k of a full "
                             f"indexer layer before it, and layer 0 has none (got {types[0]!r})")
        super().__init__(config, residual_dtype=residual_dtype, mtp=mtp)

    def dsa_options(self, layer_index: int) -> DSAOptions:
        types = getattr(self.config, "indexer_types", None)
        return DSAOptions(index_rope_interleaved=True,
                          reuses_topk=bool(types) and types[layer_index] == "shared")


def check_layer_types(config, field: str, allowed: tuple[str, ...]) -> None:
    """A per-layer type list, when the config has one: one known value per decoder layer."""
    types = getattr(config, field, None)
    if types is None:
        return
    if len(types) != config.num_hidden_layers or any(kind not in allowed for kind in types):
        raise ValueError(f"config.{field} must list one of {allowed} for each of the {config.num_hidden_layers} "
                         f"layers, got {list(types)}")
