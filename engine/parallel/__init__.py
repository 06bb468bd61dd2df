"""Parallel groups over torch.distributed. The engine is handed its rank and a rendezvous address; it
never spawns processes. At world size 1 every collective is a no-op."""
from engine.parallel.state import (
    ParallelState,
    get_parallel_state,
    init_parallel,
    destroy_parallel,
    dp_agree,
    PartialSum,
    enable_fused_all_reduce_norm,
    tensor_parallel_all_reduce_add_norm,
    tensor_parallel_all_gather,
    tensor_parallel_all_reduce,
)

__all__ = [
    "ParallelState", "get_parallel_state", "init_parallel", "destroy_parallel", "dp_agree", "PartialSum",
    "enable_fused_all_reduce_norm", "tensor_parallel_all_reduce_add_norm",
    "tensor_parallel_all_gather", "tensor_parallel_all_reduce",
]
