"""Writes of new K/V rows into the paged caches pa_fwd_asm reads (csrc/kernels/cache_kernels.cu).

key/value [T, Hk, D]; slot_mapping int64 [T] (the kernels read int64; slot < 0 = padding, skipped);
key_cache [nblk, Hk, D/x, bs, x] with x = key_cache.size(4); value_cache [nblk, Hk, D, bs], or
[nblk, Hk, bs/x, D, x] when asm_layout (the layout pa_fwd_asm reads).

reshape_and_cache: kv_cache_dtype "auto" copies (cache dtype must equal key dtype); "fp8"/"fp8_e4m3"
stores arch fp8 of x * (1 / k_scale) (k_scale/v_scale fp32 [1], None meaning 1.0) into a cache of the
arch fp8 dtype or uint8 bytes.
reshape_and_cache_with_pertoken_quant: per token and head, scale = amax(|x|) / dtype_max (no floor:
an all-zero head stores NaN), stored x * (1 / scale) into an fp8 or int8 cache; the dequant scales go
to [nblk, Hk, bs] when asm_layout, else [Hk, max_kv_tokens] at [head, slot].
concat_and_cache_mla: kv_c [T, L] and k_pe [T, R] (rows may be strided, the last dim contiguous) go to
kv_cache [nblk, bs, L + R] at entry slot % bs of block slot // bs, the latent first; slot < 0 is skipped.
"auto" copies into a cache of the input dtype; "fp8"/"fp8_e4m3" stores x * (1 / scale) (scale fp32 [1]).
"""
from typing import Optional

import torch
from torch import Tensor

from ..utility import dtypes
from .._double import numerics
from .._double.recording import recorded

__all__ = ["reshape_and_cache", "reshape_and_cache_with_pertoken_quant", "concat_and_cache_mla"]


def _slots(slot_mapping: Tensor, block_size: int) -> tuple[Tensor, Tensor, Tensor]:
    if slot_mapping.dtype != torch.int64:
        raise RuntimeError(f"expected scalar type Long but found {slot_mapping.dtype} (slot_mapping must be int64)")
    tokens = torch.nonzero(slot_mapping >= 0).flatten()
    slots = slot_mapping[tokens]
    return tokens, slots // block_size, slots % block_size


def _write(key_cache: Tensor, value_cache: Tensor, asm_layout: bool, tokens: Tensor, blocks: Tensor,
           offsets: Tensor, key: Tensor, value: Tensor) -> None:
    x = key_cache.shape[4]
    n, heads, head_size = len(tokens), key.shape[1], key.shape[2]
    key_cache[blocks, :, :, offsets, :] = key[tokens].reshape(n, heads, head_size // x, x)
    if asm_layout:
        value_cache[blocks, :, offsets // x, :, offsets % x] = value[tokens]
    else:
        value_cache[blocks, :, :, offsets] = value[tokens]


def _check_layout(key: Tensor, key_cache: Tensor, value_cache: Tensor, asm_layout: bool) -> None:
    nblk, heads, d_outer, bs, x = key_cache.shape
    head_size = key.shape[2]
    expected_v = (nblk, heads, bs // x, head_size, x) if asm_layout else (nblk, heads, head_size, bs)
    if key.shape[1] != heads or d_outer * x != head_size or tuple(value_cache.shape) != expected_v:
        raise RuntimeError(
            f"cache layout: key {tuple(key.shape)}, key_cache {tuple(key_cache.shape)}, value_cache "
            f"{tuple(value_cache.shape)}; expected value_cache {expected_v} (asm_layout={asm_layout})")


@recorded()
def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache_dtype: str,
    k_scale: Optional[torch.Tensor] = None,
    v_scale: Optional[torch.Tensor] = None,
    asm_layout: bool = False,
) -> None:
    if key.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise RuntimeError(f"Unsupported input type of kv cache: {key.dtype}")
    _check_layout(key, key_cache, value_cache, asm_layout)
    tokens, blocks, offsets = _slots(slot_mapping, key_cache.shape[3])
    if kv_cache_dtype == "auto":
        if key_cache.dtype != key.dtype or value_cache.dtype != value.dtype:
            raise RuntimeError(f'kv_cache_dtype "auto" copies raw {key.dtype}; the cache is {key_cache.dtype}')
        _write(key_cache, value_cache, asm_layout, tokens, blocks, offsets, key, value)
    elif kv_cache_dtype in ("fp8", "fp8_e4m3"):
        if key_cache.dtype not in (dtypes.fp8, torch.uint8):
            raise RuntimeError(f"fp8 kv cache must be {dtypes.fp8} (or uint8 bytes), got {key_cache.dtype}")
        k_inv = 1.0 if k_scale is None else 1.0 / k_scale.float().reshape(-1)[0]
        v_inv = 1.0 if v_scale is None else 1.0 / v_scale.float().reshape(-1)[0]
        k8 = numerics.convert(key.float() * k_inv, dtypes.fp8)
        v8 = numerics.convert(value.float() * v_inv, dtypes.fp8)
        _write(key_cache.view(dtypes.fp8), value_cache.view(dtypes.fp8), asm_layout, tokens, blocks, offsets, k8, v8)
    else:
        raise RuntimeError(f"Unsupported data type of kv cache: {kv_cache_dtype}")


@recorded()
def reshape_and_cache_with_pertoken_quant(
    key: Tensor,
    value: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    k_dequant_scales: Tensor,
    v_dequant_scales: Tensor,
    slot_mapping: Tensor,
    asm_layout: bool,
) -> None:
    if key.shape[2] > 512:
        raise RuntimeError(f"reshape_and_cache_with_pertoken_quant Unsupported head_size: {key.shape[2]}")
    if key_cache.dtype not in (dtypes.fp8, torch.int8):
        raise RuntimeError(f"Unsupported data type of kv cache: {key_cache.dtype} (arch fp8 is {dtypes.fp8}, or int8)")
    if key.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise RuntimeError(f"Unsupported input type of kv: {key.dtype}")
    _check_layout(key, key_cache, value_cache, asm_layout)
    nblk, heads, _, block_size, _ = key_cache.shape
    if asm_layout and tuple(k_dequant_scales.shape) != (nblk, heads, block_size):
        raise RuntimeError(f"asm_layout dequant scales must be [nblk, Hk, bs] = {(nblk, heads, block_size)}, "
                           f"got {tuple(k_dequant_scales.shape)}")
    tokens, blocks, offsets = _slots(slot_mapping, block_size)
    limit = numerics.dtype_max(key_cache.dtype)
    quantised, scales = [], []
    for x in (key, value):
        xf = x[tokens].float()
        scale = xf.abs().amax(dim=-1, keepdim=True) / limit
        quantised.append(numerics.convert(xf * (1.0 / scale), key_cache.dtype))
        scales.append(scale.squeeze(-1))
    everyone = torch.arange(len(tokens))
    _write(key_cache, value_cache, asm_layout, everyone, blocks, offsets, *quantised)
    for target, scale in zip((k_dequant_scales, v_dequant_scales), scales):
        if asm_layout:
            target[blocks, :, offsets] = scale
        else:
            target[:, blocks * block_size + offsets] = scale.t()


@recorded()
def concat_and_cache_mla(
    kv_c: Tensor,
    k_pe: Tensor,
    kv_cache: Tensor,
    slot_mapping: Tensor,
    kv_cache_dtype: str,
    scale: Tensor,
) -> None:
    kv_lora_rank, pe_dim = kv_c.shape[1], k_pe.shape[1]
    if kv_cache.dim() != 3 or kv_cache.shape[2] != kv_lora_rank + pe_dim:
        raise RuntimeError(f"kv_cache must be [num_blocks, block_size, {kv_lora_rank} + {pe_dim}], "
                           f"got {tuple(kv_cache.shape)}")
    if kv_c.stride(1) != 1 or k_pe.stride(1) != 1:
        raise RuntimeError("concat_and_cache_mla reads rows of kv_c and k_pe with unit stride along the last dim")
    if kv_c.dtype not in (torch.float32, torch.float16, torch.bfloat16) or k_pe.dtype != kv_c.dtype:
        raise RuntimeError(f"Unsupported input type of kv cache: {kv_c.dtype}, {k_pe.dtype}")
    tokens, blocks, offsets = _slots(slot_mapping, kv_cache.shape[1])
    entries = torch.cat((kv_c[tokens].float(), k_pe[tokens].float()), dim=-1)
    if kv_cache_dtype == "auto":
        if kv_cache.dtype != kv_c.dtype:
            raise RuntimeError(f'kv_cache_dtype "auto" copies raw {kv_c.dtype}; the cache is {kv_cache.dtype}')
        kv_cache[blocks, offsets] = entries.to(kv_cache.dtype)
    elif kv_cache_dtype in ("fp8", "fp8_e4m3"):
        if kv_cache.dtype not in (dtypes.fp8, torch.uint8):
            raise RuntimeError(f"fp8 kv cache must be {dtypes.fp8} (or uint8 bytes), got {kv_cache.dtype}")
        inverted = 1.0 / scale.float().reshape(-1)[0]
        kv_cache.view(dtypes.fp8)[blocks, offsets] = numerics.convert(entries * inverted, dtypes.fp8)
    else:
        raise RuntimeError(f"Unsupported data type of kv cache: {kv_cache_dtype}")
