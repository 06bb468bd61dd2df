"""Manifold-constrained hyper-connections (mHC), DeepSeek-V4's residual in place of add + norm
(transformers' `DeepseekV4HyperConnection`, `DeepseekV4HyperHead`).

The residual is `hc_mult` streams per token, [T, n, hidden]. Before a block (attention or MLP) a learned
projection of the normalised, flattened streams (float32) gives per token: `pre` [n] (sigmoid + eps: the
weights that collapse the streams into the block's input), `post` [n] (2 * sigmoid: how the block's output
spreads over the streams) and `comb` [n, n] (softmax + eps, then Sinkhorn-normalised towards a doubly
stochastic matrix: how the streams mix). After the block: streams = post * out + comb^T @ streams. The model's
head collapses the streams a last time with its own `pre` weights."""
from __future__ import annotations

import torch
from torch import nn

from engine.layers.deepseek_v4_rope import unit_rms_norm


class HyperConnection(nn.Module):
    def __init__(self, hf_config) -> None:
        super().__init__()
        n = self.hc_mult = hf_config.hc_mult
        self.sinkhorn_iters = hf_config.hc_sinkhorn_iters
        self.hc_eps, self.norm_eps = hf_config.hc_eps, hf_config.rms_norm_eps
        self.fn = nn.Parameter(torch.zeros((2 + n) * n, n * hf_config.hidden_size, dtype=torch.float32),
                               requires_grad=False)
        self.base = nn.Parameter(torch.zeros((2 + n) * n, dtype=torch.float32), requires_grad=False)
        self.scale = nn.Parameter(torch.ones(3, dtype=torch.float32), requires_grad=False)

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [T, n, hidden] -> (post [T, n] float32, comb [T, n, n] float32, block input [T, hidden])."""
        n = self.hc_mult
        mixes = torch.nn.functional.linear(unit_rms_norm(streams.flatten(1).float(), self.norm_eps), self.fn)
        pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.split([n, n, n * n])
        pre_scale, post_scale, comb_scale = self.scale.unbind(0)
        pre = torch.sigmoid(pre_w * pre_scale + pre_b) + self.hc_eps
        post = 2 * torch.sigmoid(post_w * post_scale + post_b)
        comb = torch.softmax(comb_w.view(-1, n, n) * comb_scale + comb_b.view(n, n), dim=-1) + self.hc_eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        for _ in range(self.sinkhorn_iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.hc_eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        collapsed = (pre[..., None] * streams).sum(dim=1).to(streams.dtype)
        return post, comb, collapsed

    @staticmethod
    def expand(streams: torch.Tensor, block_out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        """The streams after a block: post * out + comb^T @ streams (in the streams' dtype)."""
        dtype = streams.dtype
        return post.to(dtype)[..., None] * block_out[:, None, :] + torch.matmul(comb.to(dtype).transpose(-1, -2),
                                                                               streams)


class HyperHead(nn.Module):
    """The last collapse of the streams into one hidden state, before the final norm."""

    def __init__(self, hf_config) -> None:
        super().__init__()
        n = self.hc_mult = hf_config.hc_mult
        self.hc_eps, self.norm_eps = hf_config.hc_eps, hf_config.rms_norm_eps
        self.hc_fn = nn.Parameter(torch.zeros(n, n * hf_config.hidden_size, dtype=torch.float32), requires_grad=False)
        self.hc_base = nn.Parameter(torch.zeros(n, dtype=torch.float32), requires_grad=False)
        self.hc_scale = nn.Parameter(torch.ones(1, dtype=torch.float32), requires_grad=False)

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        mixes = torch.nn.functional.linear(unit_rms_norm(streams.flatten(1).float(), self.norm_eps), self.hc_fn)
        pre = torch.sigmoid(mixes * self.hc_scale + self.hc_base) + self.hc_eps
        return (pre[..., None] * streams).sum(dim=1).to(streams.dtype)
