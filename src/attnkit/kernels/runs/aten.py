"""PyTorch's fused CPU flash-attention kernel, called by keyword behind one wrapper.

``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward are private
ops: :data:`AVAILABLE` says whether this build of PyTorch has both *and* they answer a
tiny call with the keyword interface attnkit uses (probed once, at import); kernels that
use them declare so, and the tiled kernel falls back to its math engine without them.
"""

from __future__ import annotations

from typing import overload

import torch

_ops = torch.ops.aten


def _probe() -> bool:
    """Whether both ops exist and run a 1 x 1 x 2 x 4 call, forward and backward, as called here."""
    if not (
        hasattr(_ops, "_scaled_dot_product_flash_attention_for_cpu")
        and hasattr(_ops, "_scaled_dot_product_flash_attention_for_cpu_backward")
    ):
        return False
    try:
        x = torch.ones(1, 1, 2, 4)
        out, lse = flash_forward(x, x, x, scale=0.5)
        grads = flash_backward(torch.ones_like(out), x, x, x, out, lse, scale=0.5)
        return out.shape == x.shape and lse.shape == (1, 1, 2) and len(grads) == 3
    except (RuntimeError, TypeError):  # another signature in this PyTorch build
        return False


@overload
def rows_contiguous(t: torch.Tensor) -> torch.Tensor: ...
@overload
def rows_contiguous(t: None) -> None: ...
def rows_contiguous(t: torch.Tensor | None) -> torch.Tensor | None:
    """``t`` with a unit stride in its last dimension: the private kernels read each row as
    contiguous memory and give garbage for ``x[..., ::2]`` or a transposed ``(B, H, D, L)``."""
    return t if t is None or t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()


def flash_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    attn_mask: torch.Tensor | None = None,
    scale: float,
    is_causal: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out (B, H, L, Dv), lse (B, H, L) float32)`` of PyTorch's CPU flash kernel.

    q: (B, H, Lq, D), k: (B, H, Lk, D), v: (B, H, Lk, D); ``attn_mask`` additive
    (0 / -inf) in q's dtype, broadcastable to (B, H, Lq, Lk). Any strides.
    """
    q, k, v = rows_contiguous(q), rows_contiguous(k), rows_contiguous(v)
    attn_mask = None if attn_mask is None else rows_contiguous(attn_mask)
    return _ops._scaled_dot_product_flash_attention_for_cpu(
        query=q, key=k, value=v, dropout_p=0.0, is_causal=is_causal, attn_mask=attn_mask, scale=scale
    )


def flash_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    attn_mask: torch.Tensor | None = None,
    scale: float,
    is_causal: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of :func:`flash_forward`, recomputed from its saved ``lse``. Any strides."""
    grad_out, q, k, v, out = (rows_contiguous(t) for t in (grad_out, q, k, v, out))
    attn_mask = None if attn_mask is None else rows_contiguous(attn_mask)
    return _ops._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out=grad_out,
        query=q,
        key=k,
        value=v,
        out=out,
        logsumexp=lse,
        dropout_p=0.0,
        is_causal=is_causal,
        attn_mask=attn_mask,
        scale=scale,
    )


#: Whether the fused CPU ops can be used (see the module docstring).
AVAILABLE = _probe()
