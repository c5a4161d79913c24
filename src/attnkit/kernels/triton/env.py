"""Whether Triton is installed, and whether it interprets kernels on the CPU (``TRITON_INTERPRET=1``)."""

from __future__ import annotations

import os

try:  # Triton is optional (the "gpu" extra)
    import triton
    import triton.language as tl

    AVAILABLE = True
except ImportError:  # pragma: no cover - depends on the environment
    triton = tl = None
    AVAILABLE = False

__all__ = ["AVAILABLE", "INTERPRETED", "interpreted", "tl", "triton"]

#: Whether Triton runs kernels in its interpreter (``TRITON_INTERPRET=1``, read at import as
#: Triton reads it): CPU tensors are allowed then.
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def interpreted() -> bool:
    """Whether Triton runs kernels in its interpreter (``TRITON_INTERPRET=1`` at import)."""
    return INTERPRETED
