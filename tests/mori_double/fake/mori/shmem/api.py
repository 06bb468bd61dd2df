"""MORI's symmetric heap, emulated: initialising it records the registered torch process group, which the
double's dispatch and combine then exchange over."""
import torch.distributed as dist

_group = None


def shmem_torch_process_group_init(group_name: str):
    """As the real one: the group registered as `group_name` (torch._C._distributed_c10d.
    _register_process_group) becomes the shmem world. Initialising twice is refused."""
    global _group
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed not initialized. Call torch.distributed.init_process_group() first")
    if _group is not None:
        raise RuntimeError("the mori double's shmem is initialised already (call shmem_finalize first)")
    _group = dist.distributed_c10d._resolve_process_group(group_name)
    return 0


def shmem_finalize():
    global _group
    _group = None
    return 0


def shmem_mype() -> int:
    return dist.get_rank(_world())


def shmem_npes() -> int:
    return dist.get_world_size(_world())


def _world():
    if _group is None:
        raise RuntimeError("mori shmem is not initialised (shmem_torch_process_group_init)")
    return _group

