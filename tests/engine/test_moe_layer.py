"""The FusedMoE layer's pieces on their own: routers against transformers' routers, expert-parallel shards
with uneven expert counts adding up to the whole layer, and the per-expert load count."""
from __future__ import annotations

import pytest
import torch

from engine.forward_context import MoEStep, forward_context
from engine.kernels.torch import moe as torch_moe
from engine.layers import fused_moe
from engine.layers.fused_moe import FusedMoE, RouterConfig
from engine.parallel import state as parallel_state


def test_grouped_sigmoid_router_matches_transformers_glm4_moe():
    from transformers import Glm4MoeConfig
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter
    config = Glm4MoeConfig(hidden_size=32, n_routed_experts=16, num_experts_per_tok=3, n_group=4, topk_group=2,
                           routed_scaling_factor=2.5, norm_topk_prob=True)
    torch.manual_seed(0)
    hf = Glm4MoeTopkRouter(config)
    hf.weight.data.normal_(0, 0.5)
    hf.e_score_correction_bias.copy_(torch.randn(16) * 0.3)
    x = torch.randn(40, 32)
    _, hf_weights, hf_ids = hf(x)
    router = RouterConfig("grouped_topk", 3, renormalize=True, scoring="sigmoid", num_groups=4, topk_groups=2,
                          routed_scaling_factor=2.5, correction_bias=True)
    weights, ids = torch_moe.moe_grouped_topk(x @ hf.weight.T, 3, True, 4, 2, "sigmoid",
                                              hf.e_score_correction_bias, 2.5)
    order, hf_order = ids.long().argsort(-1), hf_ids.argsort(-1)
    assert torch.equal(ids.long().gather(1, order), hf_ids.gather(1, hf_order))
    assert torch.allclose(weights.gather(1, order), hf_weights.gather(1, hf_order), atol=1e-6)
    assert router.kind in fused_moe.ROUTERS


def test_softmax_router_matches_transformers_qwen3_moe():
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter
    for renormalize in (True, False):
        config = Qwen3MoeConfig(hidden_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=renormalize)
        hf = Qwen3MoeTopKRouter(config)
        hf.weight.data.normal_(0, 0.5)
        x = torch.randn(20, 32)
        _, hf_weights, hf_ids = hf(x)
        weights, ids = torch_moe.moe_topk_softmax(x @ hf.weight.T, 2, renormalize)
        assert torch.equal(ids.long(), hf_ids) and torch.allclose(weights, hf_weights, atol=1e-6)


def _layer(num_experts: int, ep_rank: int, ep_size: int, monkeypatch) -> FusedMoE:
    """A FusedMoE as EP rank `ep_rank` of `ep_size` would build it (no process group needed to build)."""
    monkeypatch.setattr(parallel_state, "_state",
                        parallel_state.ParallelState(ep_rank=ep_rank, ep_size=ep_size, ep_group=object()))
    return FusedMoE(num_experts, 24, 16, RouterConfig("softmax_topk", 3))


@pytest.mark.parametrize("num_experts, ep_size", [(9, 4), (8, 3), (5, 5)])
def test_uneven_expert_parallel_shards_add_up_to_the_whole_layer(num_experts, ep_size, monkeypatch):
    torch.manual_seed(1)
    per_expert = {(e, part): torch.randn(16, 24) if part != "down" else torch.randn(24, 16)
                  for e in range(num_experts) for part in ("gate", "up", "down")}
    monkeypatch.setattr(parallel_state, "_state", parallel_state.ParallelState())
    whole = FusedMoE(num_experts, 24, 16, RouterConfig("softmax_topk", 3))
    for (expert, part), tensor in per_expert.items():
        whole.expert_weight_loader(whole.w2 if part == "down" else whole.w13, tensor, (expert, part))
    x = torch.randn(13, 24)
    weights, ids = torch_moe.moe_topk_softmax(torch.randn(13, num_experts), 3, True)
    expected = torch_moe.fused_experts(x, whole.w13, whole.w2, weights, ids)
    total, counts = torch.zeros_like(expected), []
    for rank in range(ep_size):
        shard = _layer(num_experts, rank, ep_size, monkeypatch)
        for (expert, part), tensor in per_expert.items():
            shard.expert_weight_loader(shard.w2 if part == "down" else shard.w13, tensor, (expert, part))
        counts.append(shard.num_local_experts)
        local = ids.long() - shard.expert_start
        mine = (local >= 0) & (local < shard.num_local_experts)
        total += torch_moe.fused_experts(x, shard.w13, shard.w2, weights, torch.where(mine, local, -1).int())
    assert sum(counts) == num_experts and max(counts) - min(counts) <= 1
    assert torch.allclose(total, expected, atol=1e-5)
    assert fused_moe.experts_per_rank(num_experts, ep_size) == dict(enumerate(counts))


def test_expert_load_counts_every_routed_token(monkeypatch):
    monkeypatch.setattr(parallel_state, "_state", parallel_state.ParallelState())
    layer = FusedMoE(8, 24, 16, RouterConfig("softmax_topk", 2))
    for param in (layer.gate.weight, layer.w13, layer.w2):
        param.data.normal_(0, 0.1)
    layer.count_expert_load()
    layer(torch.randn(10, 24))
    layer(torch.randn(5, 24))
    counts = layer.load_counts
    assert counts.numel() == 8 + 1 and int(counts[:8].sum()) == 15 * 2 and int(counts[8]) == 0


def test_expert_load_leaves_out_padding_rows(monkeypatch):
    """Rows past the step's real tokens (a CUDA graph's padding) reach no expert and are not counted."""
    monkeypatch.setattr(parallel_state, "_state", parallel_state.ParallelState())
    layer = FusedMoE(8, 24, 16, RouterConfig("softmax_topk", 2))
    for param in (layer.gate.weight, layer.w13, layer.w2):
        param.data.normal_(0, 0.1)
    layer.count_expert_load()
    x = torch.randn(6, 24)
    real = layer(x[:4])
    x[4:] = 1e30  # padding rows hold anything
    with forward_context(None, 16, MoEStep(6, valid_tokens=torch.tensor([4]))):
        padded = layer(x)
    torch.testing.assert_close(padded[:4], real)
    assert torch.isfinite(padded).all() and not padded[4:].any()
    assert int(layer.load_counts[:8].sum()) == 2 * 4 * 2 and int(layer.load_counts[8]) == 2 * 2


def test_a_misshaped_or_unknown_expert_tensor_is_refused(monkeypatch):
    monkeypatch.setattr(parallel_state, "_state", parallel_state.ParallelState())
    layer = FusedMoE(4, 24, 16, RouterConfig("softmax_topk", 2))
    with pytest.raises(ValueError, match=r"expert 2 up has shape \(24, 16\), expected \(16, 24\)"):
        layer.expert_weight_loader(layer.w13, torch.zeros(24, 16), (2, "up"))
    with pytest.raises(ValueError, match=r"expert 7 is outside \[0, 4\)"):
        layer.expert_weight_loader(layer.w13, torch.zeros(16, 24), (7, "up"))
    with pytest.raises(ValueError, match="num_experts_per_tok=5"):
        FusedMoE(4, 24, 16, RouterConfig("softmax_topk", 5))
    with pytest.raises(ValueError, match="cannot form 3 groups"):
        FusedMoE(8, 24, 16, RouterConfig("grouped_topk", 2, num_groups=3, topk_groups=1))
