"""One kernel for a row-parallel layer's all-reduce and the residual add + RMSNorm after it (CUDA only).

At TP=2 decode, each layer's two row-parallel sums are each followed by `fused_add_rms_norm`; done apart
that is a one-shot symmetric-memory all-reduce kernel, then a norm kernel. Here one program per row sends
its float32 partial into every peer's symmetric buffer, meets the peers' programs of the same row on flags,
sums every rank's row in rank order (identical bits on every rank), and adds and normalises it as the
Triton `fused_add_rms_norm` does. ATOM_RAY_FUSED_ALL_REDUCE_NORM=0 turns it off.

Protocol, per row (no host involvement, so calls may follow each other in a CUDA graph): the row's program
counts its calls (an epoch kept in this rank's buffer) and alternates between two slots by the epoch's
parity. It stores its row into slot[epoch % 2] of every peer's buffer (posted writes, no round trip), then
writes the epoch into each peer's flag [row, my rank] with release semantics at system scope, waits until
its own flag [row, peer] holds this epoch for every peer (then acquires), and reads the peers' rows from
its own buffer. No second "done reading" barrier is needed: a rank writes a slot again two calls later,
and it cannot start that call before every peer has signalled the call in between, which each peer does
only after its kernel of this call (and so its reading of the slot) has finished. Every wait is bounded:
past `max_spins` tries the program sets `error_flag` and goes on (outputs are then garbage, and later calls
stop waiting), so a broken mapping or a dead peer can never hang the GPU.
"""
from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from engine.kernels.triton import pdl
from engine.parallel.symmetric_all_reduce import every_rank_agrees
from engine.kernels.triton.ops import _num_warps

logger = logging.getLogger(__name__)

_MAX_HIDDEN = 8192  # one pass from registers
# Polls of one flag before giving up (each a read of local memory, a fraction of a microsecond: seconds in
# all): long enough to outlast a peer that is still compiling a kernel or launching a step, short enough
# that a broken mapping ends in an error rather than a hung GPU.
DEFAULT_MAX_SPINS = 2 ** 26
_PARTIAL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def buffer_numel(world_size: int, max_rows: int, hidden_size: int) -> int:
    """float32 elements of each rank's receiving buffer: [slot (2), row, source rank, hidden]."""
    return 2 * max_rows * world_size * hidden_size


def flags_numel(world_size: int, max_rows: int) -> int:
    """int32 elements of each rank's flags: the epoch each peer signalled per [row, source rank], then this
    rank's own epoch per row."""
    return max_rows * (world_size + 1)


@triton.jit
def _slot_offsets(slot, row, source, n, cols, WORLD_SIZE: tl.constexpr, MAX_ROWS: tl.constexpr):
    return ((slot * MAX_ROWS + row) * WORLD_SIZE + source).to(tl.int64) * n + cols


@triton.jit(do_not_specialize=["rank", "max_spins"])
def _all_reduce_add_norm_kernel(partial_ptr, residual_ptr, weight_ptr, out_ptr, res_out_ptr,
                                buffer_ptrs, flag_ptrs, error_ptr, rank, n, eps, max_spins,
                                WORLD_SIZE: tl.constexpr, MAX_ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                                USE_PDL: tl.constexpr):
    if USE_PDL:
        pdl.enter()  # the previous kernel (maybe this one's last call) has finished
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)[None, :]  # [1, BLOCK_N] as the norm kernel, so both reduce alike
    mask = cols < n
    offsets = row.to(tl.int64) * n + cols
    own = tl.load(partial_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    own_flags = tl.load(flag_ptrs + rank).to(tl.pointer_type(tl.int32))
    counter = own_flags + MAX_ROWS * WORLD_SIZE + row
    epoch = tl.load(counter, volatile=True) + 1  # int32 arithmetic: wraps, and the waits compare modulo 2**32
    tl.store(counter, epoch)
    slot = epoch & 1

    # Send this rank's row to every peer, then signal it.
    for peer in tl.static_range(WORLD_SIZE):
        if peer != rank:
            peer_data = tl.load(buffer_ptrs + peer).to(tl.pointer_type(tl.float32))
            tl.store(peer_data + _slot_offsets(slot, row, rank, n, cols, WORLD_SIZE, MAX_ROWS), own, mask=mask)
    tl.debug_barrier()  # every thread's stores precede the release below (scalar atomics run once per program)
    for peer in tl.static_range(WORLD_SIZE):
        if peer != rank:
            peer_flags = tl.load(flag_ptrs + peer).to(tl.pointer_type(tl.int32))
            tl.atomic_xchg(peer_flags + row * WORLD_SIZE + rank, epoch, sem="release", scope="sys")

    # Wait for every peer's row of this epoch. After a time-out, stop waiting: the peers are gone or the
    # mapping is broken.
    spin_limit = tl.where(tl.load(error_ptr, volatile=True) == 0, max_spins, 1)
    for peer in tl.static_range(WORLD_SIZE):
        if peer != rank:
            flag = own_flags + row * WORLD_SIZE + peer
            seen = tl.load(flag, volatile=True)
            spins = 1
            while ((seen - epoch) < 0) & (spins < spin_limit):  # a peer may already be one epoch ahead
                seen = tl.load(flag, volatile=True)
                spins += 1
            if (seen - epoch) < 0:
                tl.store(error_ptr, 1)
            tl.atomic_add(flag, 0, sem="acquire", scope="sys")  # pairs with the peer's release
    tl.debug_barrier()  # every thread's reads below follow the acquire above

    # Volatile reads: no line of this slot cached two calls ago may be reused.
    own_data = tl.load(buffer_ptrs + rank).to(tl.pointer_type(tl.float32))
    total = own
    if rank != 0:
        total = tl.load(own_data + _slot_offsets(slot, row, 0, n, cols, WORLD_SIZE, MAX_ROWS),
                        mask=mask, other=0.0, volatile=True)
    for source in tl.static_range(1, WORLD_SIZE):  # rank order: the same bits on every rank
        is_peer = tl.full(offsets.shape, source, tl.int32) != rank  # a block: the interpreter rejects a scalar
        received = tl.load(own_data + _slot_offsets(slot, row, source, n, cols, WORLD_SIZE, MAX_ROWS),
                           mask=mask & is_peer, other=0.0, volatile=True)
        total += tl.where(is_peer, received, own)

    # From here as the single-pass branch of engine/kernels/triton/ops.py's _rms_norm_kernel: the sum
    # rounded to the activations' dtype (the weight's), added in the residual's dtype, float32 statistics.
    x = total.to(weight_ptr.dtype.element_ty).to(tl.float32)
    x = (x + tl.load(residual_ptr + offsets, mask=mask, other=0.0).to(tl.float32)).to(residual_ptr.dtype.element_ty)
    tl.store(res_out_ptr + offsets, x, mask=mask)
    x32 = x.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(x32 * x32, axis=1) / n + eps)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = (x32 * rstd[:, None]).to(out_ptr.dtype.element_ty).to(tl.float32) * w
    tl.store(out_ptr + offsets, y.to(out_ptr.dtype.element_ty), mask=mask)


def all_reduce_add_norm(partial: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                        buffer_ptrs: torch.Tensor, flag_ptrs: torch.Tensor, error_flag: torch.Tensor,
                        rank: int, max_rows: int, max_spins: int = DEFAULT_MAX_SPINS
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """The launcher: `fused_add_rms_norm(sum over ranks of partial, residual, weight, eps)` as
    (normed, new residual), fresh tensors. `buffer_ptrs` and `flag_ptrs` are int64 tensors of one address per
    rank (on partial's device): each rank's float32 buffer of `buffer_numel` elements for this hidden size
    and its int32 flags of `flags_numel` (zero before the first call). `error_flag`: an int32 tensor set to 1
    where a wait gave up after `max_spins` polls."""
    rows, n = partial.shape
    world_size = buffer_ptrs.numel()
    assert partial.is_contiguous() and partial.dtype in _PARTIAL_DTYPES and rows <= max_rows, (
        partial.shape, partial.dtype, max_rows)
    assert residual.shape == partial.shape and weight.shape == (n,), (residual.shape, weight.shape)
    assert residual.dtype in (weight.dtype, torch.float32), (residual.dtype, weight.dtype)
    block_n = triton.next_power_of_2(n)
    assert block_n <= _MAX_HIDDEN, f"hidden size {n} is over the one-pass limit {_MAX_HIDDEN}"
    assert flag_ptrs.numel() == world_size and 0 <= rank < world_size, (flag_ptrs.numel(), world_size, rank)
    normed = torch.empty(partial.shape, dtype=weight.dtype, device=partial.device)
    new_residual = torch.empty(partial.shape, dtype=residual.dtype, device=partial.device)
    if rows == 0:
        return normed, new_residual
    _all_reduce_add_norm_kernel[(rows,)](
        partial, residual.contiguous(), weight.contiguous(), normed, new_residual,
        buffer_ptrs, flag_ptrs, error_flag, rank, n, eps, max_spins,
        WORLD_SIZE=world_size, MAX_ROWS=max_rows, BLOCK_N=block_n,
        num_warps=_num_warps(block_n), **pdl.launch_options(partial))
    return normed, new_residual


class AllReduceAddNorm:
    """`fused_add_rms_norm(all_reduce(partial), residual, weight, eps)` in one kernel over a symmetric buffer
    (two slots of max_rows x world_size rows of hidden_size float32, and the flags) that every rank of the
    group mapped."""

    def __init__(self, handle, views: list[torch.Tensor], rank: int, world_size: int, hidden_size: int,
                 max_rows: int, device: torch.device) -> None:
        self.handle = handle  # keeps the peers' mappings alive
        self.views = views  # every rank's data and flags, as tensors of this device
        self.rank, self.world_size = rank, world_size
        self.hidden_size, self.max_rows = hidden_size, max_rows
        data, flags = views[:world_size], views[world_size:]
        self.buffer_ptrs = torch.tensor([v.data_ptr() for v in data], dtype=torch.int64, device=device)
        self.flag_ptrs = torch.tensor([v.data_ptr() for v in flags], dtype=torch.int64, device=device)
        self.error_flag = torch.zeros(1, dtype=torch.int32, device=device)
        self.max_spins = DEFAULT_MAX_SPINS

    @classmethod
    def create(cls, group, device: torch.device, hidden_size: int, max_rows: int = 64) -> "AllReduceAddNorm | None":
        """A collective call on every rank of `group`; None (and a log line saying why) where the fused
        kernel cannot run, after which every rank keeps the all-reduce and the norm apart."""
        if device.type != "cuda" or torch.version.hip:
            logger.info("fused all-reduce + RMSNorm is off: it needs CUDA (device %s)", device)
            return None
        if os.environ.get("ATOM_RAY_FUSED_ALL_REDUCE_NORM") == "0":
            logger.info("fused all-reduce + RMSNorm is off: ATOM_RAY_FUSED_ALL_REDUCE_NORM=0")
            return None
        ok, reason, fused = True, "", None
        try:
            assert triton.next_power_of_2(hidden_size) <= _MAX_HIDDEN, f"hidden size {hidden_size} > {_MAX_HIDDEN}"
            fused = cls._map(group, device, hidden_size, max_rows)
            fused._check(group, device)
        except Exception as exc:  # unsupported torch/driver, no peer access, a failed check: kept apart
            ok, reason = False, repr(exc)
        if not every_rank_agrees(ok, reason, group, device, "fused all-reduce + RMSNorm unavailable, the "
                                                               "all-reduce and the norm stay apart"):
            return None
        logger.info("all-reduces of <= %d rows of %d are fused with the residual add and RMSNorm",
                    max_rows, hidden_size)
        return fused

    @classmethod
    def _map(cls, group, device: torch.device, hidden_size: int, max_rows: int) -> "AllReduceAddNorm":
        import torch.distributed._symmetric_memory as symm_mem
        rank, world_size = dist.get_rank(group), dist.get_world_size(group)
        data_numel, flag_numel = buffer_numel(world_size, max_rows, hidden_size), flags_numel(world_size, max_rows)
        # The flags live in the buffer itself rather than in torch's signal pad: their number grows with
        # rows x ranks past the pad's default size, and torch's own kernels use the pad.
        buffer = symm_mem.empty(data_numel + flag_numel, dtype=torch.float32, device=device)
        handle = symm_mem.rendezvous(buffer, group)
        data = [handle.get_buffer(r, (data_numel,), torch.float32, 0) for r in range(world_size)]
        flags = [handle.get_buffer(r, (flag_numel,), torch.int32, data_numel) for r in range(world_size)]
        if data[rank].data_ptr() != buffer.data_ptr():
            raise RuntimeError("the symmetric handle's own buffer is not the allocated tensor")
        flags[rank].zero_()
        torch.cuda.synchronize(device)
        dist.all_reduce(torch.zeros(1, device=device), group=group)  # no peer signals before the zeroing
        torch.cuda.synchronize(device)
        return cls(handle, data + flags, rank, world_size, hidden_size, max_rows, device)

    def fits(self, partial: torch.Tensor) -> bool:
        return (partial.is_cuda and partial.is_contiguous() and partial.dim() == 2
                and partial.shape[1] == self.hidden_size and partial.shape[0] <= self.max_rows
                and partial.dtype in _PARTIAL_DTYPES)

    def __call__(self, partial: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(normed, new residual) of the sum over the group of `partial` (see `all_reduce_add_norm`)."""
        return all_reduce_add_norm(partial, residual, weight, eps, self.buffer_ptrs, self.flag_ptrs,
                                   self.error_flag, self.rank, self.max_rows, self.max_spins)

    def _check(self, group, device: torch.device) -> None:
        """Known values through the kernel, against the torch reference, in each dtype combination of a
        float32 or bf16 residual stream, with back-to-back calls of different row counts; and no wait may
        have timed out. Every rank makes every call before judging, so that no peer is left waiting."""
        from engine.kernels.torch import ops as reference
        hidden, problems = self.hidden_size, []

        def pattern(rows: int, modulus: int, scale: float) -> torch.Tensor:  # exact in bf16
            index = torch.arange(rows * hidden, device=device, dtype=torch.float32).view(rows, hidden)
            return (index % modulus - modulus // 2) * scale

        for weight_dtype, residual_dtype in ((torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                             (torch.bfloat16, torch.bfloat16)):
            weight = (1 + torch.arange(hidden, device=device) % 5 / 8).to(weight_dtype)
            for rows in (1, self.max_rows, 3):
                partials = [pattern(rows, 23 + r, (r + 1) / 8) for r in range(self.world_size)]
                residual = pattern(rows, 7, 0.25).to(residual_dtype)
                total = partials[0]
                for p in partials[1:]:
                    total = total + p
                expected_normed, expected_residual = reference.fused_add_rms_norm(total, residual, weight, 1e-6)
                normed, new_residual = self(partials[self.rank], residual, weight, 1e-6)
                tolerance = 1e-5 if weight_dtype == torch.float32 else 2e-2
                if not (torch.equal(new_residual, expected_residual)
                        and torch.allclose(normed, expected_normed, rtol=tolerance, atol=tolerance)):
                    problems.append(f"{rows} rows, {weight_dtype} weight, {residual_dtype} residual")
        torch.cuda.synchronize(device)
        if self.error_flag.item():
            raise RuntimeError("a wait of the fused all-reduce timed out")
        if problems:
            raise RuntimeError(f"the fused all-reduce + RMSNorm gave wrong results for {problems}")
