"""attnkit's kernels and their registry.

Each kernel is a :class:`~attnkit.kernels.contract.Kernel` subclass in a module or folder of its
own, registered by :mod:`attnkit.kernels.registry`; :data:`PRIORITY` is the order ``kernel="auto"``
asks them in:

- ``triton``: block-sparse, CUDA (the CPU only when forced, under ``TRITON_INTERPRET=1``);
  :mod:`attnkit.kernels.triton`;
- ``native``: block-sparse, CPU, attnkit's C++ engine (built once per machine);
  :mod:`attnkit.kernels.native`;
- ``fused``: block-sparse, CPU, PyTorch's fused flash kernel per run of the plan;
  :mod:`attnkit.kernels.runs.fused`;
- ``math``: block-sparse in PyTorch matmuls: every modification, dropout, any device;
  :mod:`attnkit.kernels.runs.math`;
- ``sdpa``: PyTorch's fused kernels with dense masks or key limits; :mod:`attnkit.kernels.sdpa`;
- ``reference``: the plain formula, the test oracle; :mod:`attnkit.kernels.reference`.

``tiled`` names the group of the three block-sparse CPU kernels (``kernel="tiled"`` runs the
first of native, fused, math that can run a call). The objects :data:`TRITON`, :data:`NATIVE`,
:data:`FUSED`, :data:`MATH`, :data:`TILED`, :data:`SDPA` and :data:`REFERENCE` name them
wherever a kernel is asked for (``kernel=``, :func:`use_kernels`).

Kernels import only the contract (:mod:`attnkit.kernels.contract`) and the shared parts:
:mod:`~attnkit.kernels.sparsity` (when block sparsity pays), :mod:`~attnkit.kernels.dense` (dense
masks and zeroing), :mod:`~attnkit.kernels.blocks` (the host-side reading of a plan) and
:mod:`~attnkit.kernels.lse` (the log-sum-exp merge). The fast path of repeated calls is
:mod:`attnkit.kernels.fastpath`.
"""

from attnkit.kernels.contract import Call, Kernel, StatsRequest
from attnkit.kernels.registry import (
    FUSED,
    GROUPS,
    KERNELS,
    MATH,
    NATIVE,
    PRIORITY,
    REFERENCE,
    SDPA,
    TILED,
    TRITON,
    KernelGroup,
    Plan,
    backward_part,
    choose,
    choose_stats,
    refusals,
    register_group,
    register_kernel,
    run,
    stats,
    unregister_kernel,
    use_kernels,
)

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
    "StatsRequest",
    "backward_part",
    "choose",
    "choose_stats",
    "refusals",
    "register_group",
    "register_kernel",
    "run",
    "stats",
    "unregister_kernel",
    "use_kernels",
]
