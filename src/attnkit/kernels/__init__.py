"""attnkit's kernels and their registry.

Each kernel is one module with a :class:`~attnkit.kernels.registry.Kernel` subclass,
registered here; :data:`~attnkit.kernels.registry.PRIORITY` is the order ``kernel="auto"``
asks them in:

- ``triton``: block-sparse, CUDA (the CPU only when forced, under ``TRITON_INTERPRET=1``);
- ``native``: block-sparse, CPU, attnkit's C++ engine (built once per machine);
- ``fused``: block-sparse, CPU, PyTorch's fused flash kernel per run of the plan;
- ``math``: block-sparse in PyTorch matmuls: every modification, dropout, any device;
- ``sdpa``: PyTorch's fused kernels with dense masks;
- ``reference``: the plain formula, the test oracle.

``tiled`` names the group of the three block-sparse CPU kernels (``kernel="tiled"`` runs the
first of native, fused, math that can run a call). The objects :data:`TRITON`, :data:`NATIVE`,
:data:`FUSED`, :data:`MATH`, :data:`TILED`, :data:`SDPA` and :data:`REFERENCE` name them
wherever a kernel is asked for (``kernel=``, :func:`use_kernels`).

Shared pieces: :mod:`attnkit.kernels.blocksparse` (when block sparsity pays; the plan walk of
the PyTorch engines), :mod:`attnkit.kernels.tiles` (one run's tensors) and
:mod:`attnkit.kernels.lse` (the log-sum-exp merge).
"""

from attnkit.kernels import native_build, registry
from attnkit.kernels.fused import FusedKernel
from attnkit.kernels.native import NativeKernel
from attnkit.kernels.reference import ReferenceKernel
from attnkit.kernels.registry import (
    GROUPS,
    KERNELS,
    PRIORITY,
    Call,
    Kernel,
    KernelGroup,
    Plan,
    backward_part,
    choose,
    refusals,
    register_group,
    register_kernel,
    run,
    unregister_kernel,
    use_kernels,
)
from attnkit.kernels.sdpa import SDPAKernel
from attnkit.kernels.tiled_math import MathKernel
from attnkit.kernels.triton_attention import TritonKernel

# registered last-first: each new kernel goes to the front of the priority list
REFERENCE = register_kernel(ReferenceKernel())
SDPA = register_kernel(SDPAKernel())
MATH = register_kernel(MathKernel())
FUSED = register_kernel(FusedKernel())
NATIVE = register_kernel(NativeKernel())
TRITON = register_kernel(TritonKernel())
TILED = register_group("tiled", ("native", "fused", "math"))
registry.BUILTIN_STATE.append(tuple(registry.PRIORITY))
native_build.load_if_built()  # a cached build is loaded now: code traced by torch.compile finds it

__all__ = [
    "FUSED",
    "GROUPS",
    "KERNELS",
    "MATH",
    "NATIVE",
    "PRIORITY",
    "REFERENCE",
    "SDPA",
    "TILED",
    "TRITON",
    "Call",
    "Kernel",
    "KernelGroup",
    "Plan",
    "backward_part",
    "choose",
    "refusals",
    "register_group",
    "register_kernel",
    "run",
    "unregister_kernel",
    "use_kernels",
]
