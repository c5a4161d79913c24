"""PyTorch's fused CPU flash-attention kernel, called by keyword behind one wrapper.

``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward are private
ops: :data:`AVAILABLE` says whether this build of PyTorch has both, and kernels that
use them declare so (the tiled kernel falls back to its math engine without them).
"""

from __future__ import annotations

import torch

_ops = torch.ops.aten
AVAILABLE = hasattr(_ops, "_scaled_dot_product_flash_attention_for_cpu") and hasattr(
    _ops, "_scaled_dot_product_flash_attention_for_cpu_backward"
)


def flash_forward(q, k, v, *, attn_mask=None, scale: float, is_causal: bool = False):
    """``(out (B, H, L, Dv), lse (B, H, L) float32)`` of PyTorch's CPU flash kernel.

    q: (B, H, Lq, D), k: (B, H, Lk, D), v: (B, H, Lk, D); ``attn_mask`` additive
    (0 / -inf) in q's dtype, broadcastable to (B, H, Lq, Lk).
    """
    return _ops._scaled_dot_product_flash_attention_for_cpu(
        query=q, key=k, value=v, dropout_p=0.0, is_causal=is_causal, attn_mask=attn_mask, scale=scale
    )


def flash_backward(grad_out, q, k, v, out, lse, *, attn_mask=None, scale: float, is_causal: bool = False):
    """``(dq, dk, dv)`` of :func:`flash_forward`, recomputed from its saved ``lse``."""
    return _ops._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out=grad_out, query=q, key=k, value=v, out=out, logsumexp=lse, dropout_p=0.0,
        is_causal=is_causal, attn_mask=attn_mask, scale=scale,
    )
