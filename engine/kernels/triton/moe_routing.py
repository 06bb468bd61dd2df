"""Routing bookkeeping around the Triton MoE experts (engine/kernels/triton/moe.py): padding rows routed
nowhere, expert-parallel local slots, and the load counts. Contracts: engine/kernels/torch/moe.py."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["num_rows", "first_row", "valid"])
def _route_mask_kernel(weights_ptr, ids_ptr, weights_out, ids_out, counts_ptr, valid_ptr, num_rows, first_row,
                       valid, TOP_K: tl.constexpr, NUM_EXPERTS: tl.constexpr, VALID_ON_DEVICE: tl.constexpr,
                       COUNT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    slots = tl.arange(0, BLOCK_K)
    mask = (rows < num_rows)[:, None] & (slots < TOP_K)[None, :]
    offsets = rows.to(tl.int64)[:, None] * TOP_K + slots[None, :]
    if VALID_ON_DEVICE:
        valid = tl.load(valid_ptr)
    real = ((first_row + rows) < valid)[:, None]
    ids = tl.where(real, tl.load(ids_ptr + offsets, mask=mask, other=-1), -1)
    tl.store(ids_out + offsets, ids, mask=mask)
    tl.store(weights_out + offsets, tl.where(real, tl.load(weights_ptr + offsets, mask=mask, other=0.0), 0.0),
             mask=mask)
    if COUNT:
        tl.atomic_add(counts_ptr + tl.where(ids >= 0, ids, NUM_EXPERTS), tl.full(ids.shape, 1, tl.int64), mask=mask)


def moe_route_mask(weights: torch.Tensor, ids: torch.Tensor, first_row: int, valid: torch.Tensor | int | None,
                   counts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's padding mask and load count in one launch (the torch version is ~8 small kernels)."""
    num_rows, top_k = ids.shape
    weights_out, ids_out = torch.empty_like(weights, dtype=torch.float32), torch.empty_like(ids, dtype=torch.int32)
    if num_rows == 0:
        return weights_out, ids_out
    on_device = isinstance(valid, torch.Tensor)
    block_r = min(64, triton.next_power_of_2(num_rows))
    _route_mask_kernel[(triton.cdiv(num_rows, block_r),)](
        weights.float().contiguous(), ids.to(torch.int32).contiguous(), weights_out, ids_out,
        counts if counts is not None else ids_out, valid if on_device else ids_out, num_rows, first_row,
        0 if on_device else (2**62 if valid is None else int(valid)),
        TOP_K=top_k, NUM_EXPERTS=counts.numel() - 1 if counts is not None else 0, VALID_ON_DEVICE=on_device,
        COUNT=counts is not None, BLOCK_R=block_r, BLOCK_K=triton.next_power_of_2(top_k))
    return weights_out, ids_out


@triton.jit(do_not_specialize=["num_rows"])
def _local_slots_kernel(routing_ptr, stride_routing, ids_out, weights_out, counts_ptr, num_rows, expert_start,
                        num_local, TOP_K: tl.constexpr, NUM_EXPERTS: tl.constexpr, COUNT: tl.constexpr,
                        BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    slots = tl.arange(0, BLOCK_K)
    mask = (rows < num_rows)[:, None] & (slots < TOP_K)[None, :]
    source = routing_ptr + rows.to(tl.int64)[:, None] * stride_routing + slots[None, :]
    ids = tl.load(source, mask=mask, other=-1.0).to(tl.int32)
    weights = tl.load(source + TOP_K, mask=mask, other=0.0)
    local = ids - expert_start
    mine = (ids >= 0) & (local >= 0) & (local < num_local)
    offsets = rows.to(tl.int64)[:, None] * TOP_K + slots[None, :]
    tl.store(ids_out + offsets, tl.where(mine, local, -1), mask=mask)
    tl.store(weights_out + offsets, tl.where(mine, weights, 0.0), mask=mask)
    if COUNT:
        tl.atomic_add(counts_ptr + tl.where(ids >= 0, ids, NUM_EXPERTS), tl.full(ids.shape, 1, tl.int64), mask=mask)


def moe_local_slots(routing: torch.Tensor, expert_start: int, num_local: int,
                    counts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's expert-parallel slots (and load count) in one launch; `routing` may be a column slice."""
    num_rows, top_k = routing.shape[0], routing.shape[1] // 2
    assert routing.dtype == torch.float32 and routing.stride(1) == 1
    ids_out = torch.empty(num_rows, top_k, dtype=torch.int32, device=routing.device)
    weights_out = torch.empty(num_rows, top_k, dtype=torch.float32, device=routing.device)
    if num_rows == 0:
        return ids_out, weights_out
    block_r = min(64, triton.next_power_of_2(num_rows))
    _local_slots_kernel[(triton.cdiv(num_rows, block_r),)](
        routing, routing.stride(0), ids_out, weights_out, counts if counts is not None else ids_out, num_rows,
        expert_start, num_local, TOP_K=top_k, NUM_EXPERTS=counts.numel() - 1 if counts is not None else 0,
        COUNT=counts is not None, BLOCK_R=block_r, BLOCK_K=triton.next_power_of_2(top_k))
    return ids_out, weights_out
