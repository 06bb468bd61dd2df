"""A one-shot all-reduce over symmetric memory for the small tensors of decode steps (CUDA only).

At batch 1 a Llama-8B decode step at TP=2 makes 65 all-reduces of 8 KiB each; NCCL spends several
microseconds on each, a third or more of which is protocol and launch cost. Here every rank copies its
input into a buffer that all ranks of the group mapped into their address space (torch's symmetric memory
over CUDA IPC), waits on a barrier in the same kernel, and sums the peers' copies itself: one kernel, no
proxy thread. It needs every GPU of the group visible to every rank (atom_ray's placement keeps them
visible for TP > 1) and peer access between them (NVLink or PCIe P2P); where anything is missing, `create`
returns None and NCCL does the work. Tensors larger than the buffer also go to NCCL, whose ring and tree
algorithms move large tensors with less traffic. ATOM_RAY_SYMMETRIC_ALL_REDUCE=0 leaves everything to NCCL;
ATOM_RAY_SYMMETRIC_ALL_REDUCE_KIB sets the buffer (and so the largest one-shot tensor) in KiB.
"""
from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

# Decode batches up to 64 rows of a 4096-wide hidden state in float32 (the row-parallel partial sums);
# above that a one-shot reduce reads world_size copies of the tensor per rank and NCCL's algorithms win.
DEFAULT_MAX_BYTES = 1024 * 1024


def every_rank_agrees(ok: bool, reason: str, group, device: torch.device, unavailable: str) -> bool:
    """Whether every rank of `group` could set a kernel up (a collective call): every rank must take the same
    path, or their collectives would not match. Logs `unavailable` with this rank's reason otherwise."""
    agreed = torch.tensor([1 if ok else 0], device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=group)
    if agreed.item():
        return True
    logger.warning("%s%s", unavailable, f": {reason}" if reason else " (another rank could not set it up)")
    return False


class SymmetricAllReduce:
    def __init__(self, buffer: torch.Tensor, group_name: str, max_bytes: int) -> None:
        self.buffer = buffer  # uint8, mapped by every rank of the group
        self.group_name = group_name
        self.max_bytes = max_bytes

    @classmethod
    def create(cls, group, device: torch.device, max_bytes: int = DEFAULT_MAX_BYTES) -> "SymmetricAllReduce | None":
        """A collective call on every rank of `group`; None (and a log line saying why) where the one-shot
        reduce cannot run, after which every rank uses NCCL."""
        if device.type != "cuda" or torch.version.hip or os.environ.get("ATOM_RAY_SYMMETRIC_ALL_REDUCE") == "0":
            return None
        max_bytes = int(os.environ.get("ATOM_RAY_SYMMETRIC_ALL_REDUCE_KIB", max_bytes // 1024)) * 1024
        ok, reason, reducer = True, "", None
        try:
            import torch.distributed._symmetric_memory as symm_mem
            buffer = symm_mem.empty(max_bytes, dtype=torch.uint8, device=device)
            symm_mem.rendezvous(buffer, group)
            reducer = cls(buffer, group.group_name, max_bytes)
            reducer._check(group, device)
        except Exception as exc:  # unsupported torch/driver, no peer access, ...: NCCL it is
            ok, reason = False, repr(exc)
        if not every_rank_agrees(ok, reason, group, device, "symmetric-memory all-reduce unavailable, using NCCL "
                                                               "for every all-reduce"):
            return None
        logger.info("small all-reduces (<= %d KiB) use the one-shot symmetric-memory kernel", max_bytes // 1024)
        return reducer

    def fits(self, x: torch.Tensor) -> bool:
        return x.is_cuda and x.is_contiguous() and x.numel() * x.element_size() <= self.max_bytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over the group of `x` (a new tensor; `x` is left as it was)."""
        staging = self.buffer[:x.numel() * x.element_size()].view(x.dtype).view(x.shape)
        return torch.ops.symm_mem.one_shot_all_reduce_copy(staging, x, "sum", self.group_name)

    def _check(self, group, device: torch.device) -> None:
        """One reduce of known values in each dtype it will see (bf16 activations, float32 row-parallel
        sums), so that a mapping or dtype that silently does not work falls back to NCCL."""
        rank = dist.get_rank(group)
        expected = sum(range(1, dist.get_world_size(group) + 1))
        for dtype in (torch.bfloat16, torch.float32):
            x = torch.full((1024,), float(rank + 1), dtype=dtype, device=device)
            if not bool((self(x) == expected).all()):
                raise RuntimeError(f"the one-shot all-reduce returned wrong {dtype} sums")
