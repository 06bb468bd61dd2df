"""Test double of AMD's aiter 0.1.7.post2.dev18 (PyPI amd-aiter): the kernels the atom-ray aiter
backend calls, with the real module paths, signatures and tensor layouts, computed in torch on CPU.

Activate it through tests/aiter_double.activate(); the re-exports below mirror the real
aiter/__init__.py (which star-imports its ops modules) for the modules the double implements.
"""
import logging

__atom_ray_double__ = True
logger = logging.getLogger("aiter")

from .utility import dtypes as dtypes  # noqa: E402
from .ops.enum import *  # noqa: E402,F401,F403
from .ops.quant import *  # noqa: E402,F401,F403
from .ops.gemm_op_a8w8 import *  # noqa: E402,F401,F403
from .ops.gemm_op_a4w4 import *  # noqa: E402,F401,F403
from .ops.activation import *  # noqa: E402,F401,F403
from .ops.attention import *  # noqa: E402,F401,F403
from .ops.moe_op import *  # noqa: E402,F401,F403
from .ops.cache import *  # noqa: E402,F401,F403
from .ops.rmsnorm import *  # noqa: E402,F401,F403
from .ops.rope import *  # noqa: E402,F401,F403
from .ops.topk import *  # noqa: E402,F401,F403
from .ops.mha import *  # noqa: E402,F401,F403
from .ops.sample import *  # noqa: E402,F401,F403
from . import mla  # noqa: E402,F401
