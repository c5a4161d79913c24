"""attnkit's kernels and their registry.

Each kernel is one module with a :class:`~attnkit.kernels.registry.Kernel` subclass,
registered here in order of preference for ties: ``sdpa`` (PyTorch's fused kernels),
``tiled`` (block-sparse, CPU), ``triton`` (block-sparse, CUDA; the CPU under
``TRITON_INTERPRET=1``) and ``reference`` (the plain formula, the test oracle).
"""

from attnkit.kernels.reference import ReferenceKernel
from attnkit.kernels.registry import KERNELS, Call, Kernel, Plan, choose, register_kernel, run
from attnkit.kernels.sdpa import SDPAKernel
from attnkit.kernels.tiled import TiledKernel
from attnkit.kernels.triton_attention import TritonKernel

register_kernel(SDPAKernel())
register_kernel(TiledKernel())
register_kernel(TritonKernel())
register_kernel(ReferenceKernel())

__all__ = ["KERNELS", "Call", "Kernel", "Plan", "choose", "register_kernel", "run"]
