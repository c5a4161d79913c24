"""Dense masks and biases of a call, and the zeroing that keeps what they hide out of a result:
shared by the kernels that read a mask as one tensor (``sdpa``, ``reference``).

Shapes: a dense mask or bias broadcasts to the scores ``(..., Hq, Lq, Lk)``; K/V are
``(..., Hkv, Lk, D)``.
"""

from __future__ import annotations

import torch

from attnkit.kernels.contract import Call
from attnkit.masks import Mask
from attnkit.plan import PreparedMask

__all__ = [
    "allowed_pairs",
    "dense_bias",
    "dense_mask",
    "expand_kv_heads",
    "used_keys",
    "zero_empty_rows",
    "zero_hidden_queries",
    "zero_unused_keys",
]


def expand_kv_heads(t: torch.Tensor, hq: int) -> torch.Tensor:
    """Repeat each of the Hkv heads of ``t: (..., Hkv, L, D)`` Hq/Hkv times (GQA)."""
    if t.dim() < 3 or t.shape[-3] == hq:
        return t
    return t.repeat_interleave(hq // t.shape[-3], dim=-3)  # (..., Hq, L, D)


def allowed_pairs(mask: torch.Tensor | None) -> torch.Tensor | None:
    """The bool "may attend" pattern of a bool or additive float mask (-inf = hidden)."""
    if mask is None or mask.dtype == torch.bool:
        return mask
    return mask != float("-inf")


def used_keys(allowed: torch.Tensor, hkv: int | None) -> torch.Tensor:
    """Which keys some query may attend: ``(..., Hkv or 1, Lk, 1)`` bool.

    ``allowed`` is a bool mask ``(..., H or 1, Lq, Lk)``; with H = Hq > Hkv, a K/V head
    counts as used if any query head of its group uses it.
    """
    used = allowed.any(dim=-2).unsqueeze(-1)  # (..., H or 1, Lk, 1)
    if hkv is not None and used.dim() >= 3 and used.shape[-3] not in (1, hkv):
        group, lk = used.shape[-3] // hkv, used.shape[-2]
        used = used.reshape(*used.shape[:-3], hkv, group, lk, 1).any(dim=-3)  # (..., Hkv, Lk, 1)
    return used


def zero_hidden_queries(q: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Zero the query rows that may attend no key, so junk there (NaN in padded queries)
    cannot reach the output or the key gradients; those rows give 0 either way."""
    allowed = allowed_pairs(mask)
    if allowed is None:
        return q
    visible = allowed.any(dim=-1, keepdim=True)  # (..., Lq or 1, 1)
    return torch.where(visible, q, q.new_zeros(()))


def zero_empty_rows(out: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """The output rows that may attend no key set to 0: a row of weight 0 times a key that holds
    NaN (used by another query) would be NaN in a matmul, and such a row gives 0 by contract."""
    allowed = allowed_pairs(mask)
    if allowed is None:
        return out
    visible = allowed.any(dim=-1, keepdim=True)  # (..., Lq or 1, 1)
    return torch.where(visible, out, out.new_zeros(()))


def zero_unused_keys(
    k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, *, sync: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero the K/V rows that no query may attend to, so NaN/Inf there cannot leak.

    ``mask`` is a bool or float mask broadcastable to ``(..., Hq, Lq, Lk)`` whose head
    dimension is 1, Hkv or Hq (a K/V head is kept if any query head of its group uses it).
    With ``sync=False`` (under ``torch.compile``) the copy is made without first
    asking whether any row needs zeroing.
    """
    allowed = allowed_pairs(mask)
    if allowed is None:
        return k, v
    used = used_keys(allowed, k.shape[-3] if k.dim() >= 3 else None)
    if sync:
        share = float(used.float().mean())  # of the keys used (one host sync)
        if share == 1.0:  # the common case: nothing to zero
            return k, v
        # Padded rows usually hold finite values, which a masked score leaves at weight 0.
        # Where few rows are unused (a decoding step over a long cache), looking at those
        # rows alone is cheaper than copying K and V; where many are, the copy is as cheap.
        if share > 0.875:
            rows = torch.broadcast_to(~used[..., 0], k.shape[:-1]).nonzero(as_tuple=True)
            if bool(torch.isfinite(k[rows]).all()) and bool(torch.isfinite(v[rows]).all()):
                return k, v
    zero = k.new_zeros(())
    return torch.where(used, k, zero), torch.where(used, v, zero)


def dense_mask(call: Call) -> torch.Tensor | None:
    """The call's mask as a bool or float tensor of at most the attention matrix's rank; a
    PreparedMask's from its plan (the mask is not evaluated again)."""
    mask = call.mask
    s = call.shapes
    if isinstance(mask, PreparedMask):
        dense = mask.materialize(call.q.device)  # (Bm, Hm, Lq, Lk)
    elif isinstance(mask, Mask):
        dense = mask.materialize(s.lq, s.lk, call.q.device, check=False)  # (B or 1, H or 1, Lq, Lk)
    else:
        return mask
    rank = len(s.scores)
    while dense.dim() > rank:
        dense = dense.squeeze(0)
    return dense


def dense_bias(call: Call) -> torch.Tensor | None:
    """The call's bias as one tensor broadcastable to the scores (differentiable)."""
    if call.bias is None:
        return None
    s = call.shapes
    batch = s.batch[0] if s.batch else 1
    bias = call.bias.dense(batch, s.hq, s.lq, s.lk, call.q.device)  # (B or 1, Hq or 1, Lq, Lk)
    rank = len(s.scores)
    while bias.dim() > rank:
        bias = bias.squeeze(0)
    return bias
