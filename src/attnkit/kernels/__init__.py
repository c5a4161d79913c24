"""attnkit's kernels and their registry.

Each kernel is one module with a :class:`~attnkit.kernels.registry.Kernel` subclass,
registered here; :data:`~attnkit.kernels.registry.PRIORITY` is the order ``kernel="auto"``
asks them in: ``triton`` (block-sparse, CUDA; the CPU only when forced, under
``TRITON_INTERPRET=1``), ``tiled`` (block-sparse, CPU), ``sdpa`` (PyTorch's fused
kernels) and ``reference`` (the plain formula, the test oracle). The objects
:data:`TRITON`, :data:`TILED`, :data:`SDPA` and :data:`REFERENCE` name them wherever a
kernel is asked for (``kernel=``, :func:`use_kernels`).

Shared pieces: :mod:`attnkit.kernels.tiles` (walking a prepared mask's tiles) and
:mod:`attnkit.kernels.lse` (the log-sum-exp merge).
"""

from attnkit.kernels import registry
from attnkit.kernels.reference import ReferenceKernel
from attnkit.kernels.registry import (
    KERNELS,
    PRIORITY,
    Call,
    Kernel,
    Plan,
    choose,
    register_kernel,
    run,
    unregister_kernel,
    use_kernels,
)
from attnkit.kernels.sdpa import SDPAKernel
from attnkit.kernels.tiled import TiledKernel
from attnkit.kernels.triton_attention import TritonKernel

# registered last-first: each new kernel goes to the front of the priority list
REFERENCE = register_kernel(ReferenceKernel())
SDPA = register_kernel(SDPAKernel())
TILED = register_kernel(TiledKernel())
TRITON = register_kernel(TritonKernel())
registry.BUILTIN_STATE.append(tuple(registry.PRIORITY))

__all__ = [
    "KERNELS",
    "PRIORITY",
    "REFERENCE",
    "SDPA",
    "TILED",
    "TRITON",
    "Call",
    "Kernel",
    "Plan",
    "choose",
    "register_kernel",
    "run",
    "unregister_kernel",
    "use_kernels",
]
