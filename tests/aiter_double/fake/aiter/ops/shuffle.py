"""Weight preshuffle for AITER's CK/asm GEMMs (inverse: aiter._double.layouts.unshuffle_weight)."""
import torch

from .._double.recording import recorded

__all__ = ["shuffle_weight"]


@recorded()
def shuffle_weight(x: torch.Tensor, layout=(16, 16), use_int4=False) -> torch.Tensor:
    """[..., N, K] -> same shape: tiles of BN=layout[0] rows by BK=2*layout[1] columns, each tile
    stored as [BK/P, BN, P] with P = 16 bytes of elements (32 for int4), tiles in row-major order."""
    x_type = x.dtype
    if hasattr(torch, "float4_e2m1fn_x2") and x_type == torch.float4_e2m1fn_x2:
        x = x.view(torch.uint8)
    block_n, block_k = layout[0], layout[1] * 2
    pack = 16 // x.element_size() if not use_int4 else 32
    assert x.shape[-2] % block_n == 0, f"{x.shape[-2]} % {block_n} == {x.shape[-2] % block_n}"
    assert x.shape[-1] % block_k == 0, f"{x.shape[-1]} % {block_k} == {x.shape[-1] % block_k}"
    tiles = x.view(-1, x.shape[-2] // block_n, block_n, x.shape[-1] // block_k, block_k // pack, pack)
    shuffled = tiles.permute(0, 1, 3, 4, 2, 5).contiguous().view(*x.shape).view(x_type)
    shuffled.is_shuffled = True
    return shuffled
