"""attnkit's functional API: ``attention``, ``attention_weights``, ``explain``, and the
tutorial's helpers (``scaled_dot_product_attention``, ``create_padding_mask``,
``create_causal_mask``) with the tutorial's meaning and its mask bug fixed.

Shapes: ``q: (..., Hq, Lq, D)``, ``k: (..., Hkv, Lk, D)``, ``v: (..., Hkv, Lk, Dv)``;
the result is ``(..., Hq, Lq, Dv)``. Rank-2 inputs ``(L, D)`` are one head.
"""

from __future__ import annotations

import torch

from attnkit import masks as _masks
from attnkit._validate import (
    AttnkitTypeError,
    AttnkitValueError,
    Shapes,
    check_broadcast,
    check_dropout,
    check_nonnegative_int,
    check_qkv,
    check_scale,
    check_tensor_mask,
)
from attnkit.kernels import dispatch

__all__ = [
    "attention",
    "attention_weights",
    "attention_with_weights",
    "explain",
    "scaled_dot_product_attention",
    "create_padding_mask",
    "create_causal_mask",
]


def _check_mask(mask, q: torch.Tensor, shapes: Shapes):
    """Validate ``mask`` for this call; returns it unchanged."""
    if mask is None:
        return None
    if isinstance(mask, _masks.Mask):
        mask.check(shapes.lq, shapes.lk)
        lead = mask.lead_shape()
        rank = len(shapes.scores)
        while len(lead) + 2 > rank and lead and lead[0] == 1:
            lead = lead[1:]
        check_broadcast((*lead, shapes.lq, shapes.lk), shapes, repr(mask))
        return mask
    if isinstance(mask, torch.Tensor):
        check_tensor_mask(mask, q, shapes)
        return mask
    raise AttnkitTypeError(
        "mask must be None, a bool tensor (True = may attend), a float tensor added to the "
        f"scores, or an attnkit.masks object, but got {type(mask).__name__}."
    )


def _prepare(q, k, v, mask, scale):
    shapes = check_qkv(q, k, v)
    return shapes, _check_mask(mask, q, shapes), check_scale(scale, shapes.d)


def attention(q, k, v, mask=None, *, scale=None, dropout_p=0.0, kernel="auto"):
    """Scaled dot-product attention, exact, for any mask.

    Args:
        q: ``(..., Hq, Lq, D)`` queries.
        k: ``(..., Hkv, Lk, D)`` keys; Hq must be a multiple of Hkv (GQA/MQA).
        v: ``(..., Hkv, Lk, Dv)`` values.
        mask: None; a bool tensor broadcastable to ``(..., Hq, Lq, Lk)``, True = may
            attend; a float tensor of q's dtype added to the scores; or a mask object
            from :mod:`attnkit.masks`.
        scale: multiplies ``q @ k^T``; defaults to ``1/sqrt(D)``. 0.0 and negative
            values are used as given.
        dropout_p: probability of zeroing each attention weight (the rest are scaled
            by ``1 / (1 - dropout_p)``). Applied whenever it is > 0; modules pass 0.0
            in eval mode.
        kernel: ``"auto"`` (see :func:`explain`), ``"sdpa"``, ``"tiled"`` or
            ``"reference"``; forcing one is for testing and benchmarking.

    Returns:
        ``(..., Hq, Lq, Dv)``. A query row with every key masked is 0.

    Equivalent pytorch code (up to fully masked rows, which give 0 here, not NaN)::

        scores = q @ k.transpose(-2, -1) * scale
        scores = scores.masked_fill(~mask, float("-inf"))   # bool mask
        out = torch.softmax(scores, dim=-1) @ v

    >>> import torch, attnkit
    >>> from attnkit import masks
    >>> q = torch.randn(2, 8, 5, 16); k = v = torch.randn(2, 8, 5, 16)
    >>> attnkit.attention(q, k, v, masks.causal()).shape
    torch.Size([2, 8, 5, 16])
    """
    shapes, mask, scale = _prepare(q, k, v, mask, scale)
    dropout_p = check_dropout(dropout_p)
    plan = _choose(q, k, v, mask, dropout_p, shapes, kernel)
    return dispatch.run(q, k, v, mask, scale=scale, dropout_p=dropout_p, plan=plan, shapes=shapes)


def attention_with_weights(q, k, v, mask=None, *, scale=None, dropout_p=0.0):
    """Return ``(out, weights)``: the output ``(..., Hq, Lq, Dv)`` and the probabilities
    ``(..., Hq, Lq, Lk)`` (before dropout) from one pass of the reference kernel.

    Use this when you need both; :func:`attention` alone is faster.
    """
    shapes, mask, scale = _prepare(q, k, v, mask, scale)
    dropout_p = check_dropout(dropout_p)
    return dispatch.run_reference(q, k, v, mask, scale=scale, dropout_p=dropout_p, shapes=shapes)


def attention_weights(q, k, v, mask=None, *, scale=None):
    """The attention probabilities ``(..., Hq, Lq, Lk)``: ``softmax(q @ k^T * scale + mask)``.

    Same arguments as :func:`attention`. Each row sums to 1, except a row with every
    key masked, which is all 0. ``v`` is checked but not used.

    >>> import torch, attnkit
    >>> q = k = v = torch.randn(1, 1, 3, 4)
    >>> w = attnkit.attention_weights(q, k, v, attnkit.masks.causal())
    >>> w[0, 0, 0].tolist()[1:]
    [0.0, 0.0]
    """
    shapes, mask, scale = _prepare(q, k, v, mask, scale)
    return dispatch.run_reference(q, k, v, mask, scale=scale, dropout_p=0.0, shapes=shapes)[1]


def explain(q, k, v, mask=None, *, scale=None, dropout_p=0.0, kernel="auto") -> dispatch.Plan:
    """Which kernel :func:`attention` would run for these arguments, and why.

    >>> import torch, attnkit
    >>> q = torch.randn(1, 2, 8, 16)
    >>> print(attnkit.explain(q, q, q))
    fused SDPA: no mask
    """
    shapes, mask, _ = _prepare(q, k, v, mask, scale)
    return _choose(q, k, v, mask, check_dropout(dropout_p), shapes, kernel)


def _choose(q, k, v, mask, dropout_p, shapes, kernel) -> dispatch.Plan:
    backward = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    half = q.dtype in (torch.float16, torch.bfloat16)
    return dispatch.choose(mask, dropout_p, shapes, kernel, q.device, half=half, backward=backward)


# --- the tutorial's API -------------------------------------------------------------


def scaled_dot_product_attention(Q, K, V, mask=None):
    """The tutorial's function: returns ``(output, attention_weights)``.

    ``Q: (..., Lq, D)``, ``K: (..., Lk, D)``, ``V: (..., Lk, Dv)``; ``output`` is
    ``(..., Lq, Dv)`` and ``attention_weights`` ``(..., Lq, Lk)``. As in the
    tutorial, ``mask`` hides the positions where it is 0 (any dtype; nonzero or True
    = may attend), so :func:`create_padding_mask` and :func:`create_causal_mask`
    can be passed directly and combined with ``&``. A fully masked row gives 0,
    not NaN.
    """
    if mask is not None:
        if not isinstance(mask, torch.Tensor):
            raise AttnkitTypeError(f"mask must be a tensor, but got {type(mask).__name__}.")
        if mask.dtype != torch.bool:
            mask = mask != 0
    return attention_with_weights(Q, K, V, mask)


def create_padding_mask(seq: torch.Tensor, pad_idx: int = 0) -> torch.Tensor:
    """``(B, 1, 1, L)`` bool mask of real tokens: True where ``seq != pad_idx``.

    ``seq: (B, L)`` token ids. Broadcasts over heads and queries.

    >>> create_padding_mask(torch.tensor([[5, 7, 0]])).int().tolist()
    [[[[1, 1, 0]]]]
    """
    if not isinstance(seq, torch.Tensor):
        raise AttnkitTypeError(f"seq must be a tensor of token ids, but got {type(seq).__name__}.")
    if seq.dim() != 2:
        raise AttnkitValueError(f"seq must have shape (B, L), but got {tuple(seq.shape)}.")
    return (seq != pad_idx)[:, None, None, :]  # (B, L) -> (B, 1, 1, L)


def create_causal_mask(seq_len: int, *, device=None) -> torch.Tensor:
    """``(L, L)`` bool mask, True = may attend: the lower triangle.

    The tutorial's version marked the *future* positions with True while its
    attention hid the positions where the mask is 0, so the two masks could not be
    used together. attnkit has one convention, True = may attend:

    >>> create_causal_mask(3).int().tolist()
    [[1, 0, 0], [1, 1, 0], [1, 1, 1]]
    """
    seq_len = check_nonnegative_int(seq_len, "seq_len")
    return torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril()
