from .dispatch_combine import (  # noqa: F401
    EpDispatchCombineConfig,
    EpDispatchCombineKernelType,
    EpDispatchCombineOp,
)
