"""The plain attention formula: the float64 oracle of the test suite and the fallback kernel.

Equivalent pytorch code::

    scores = q @ k.transpose(-2, -1) * scale             # (..., Hq, Lq, Lk)
    scores = softcap * torch.tanh(scores / softcap)      # if softcap is given
    scores = scores + attn_bias + mask                   # bias, then -inf where hidden
    out = torch.softmax(scores, dim=-1) @ v              # (..., Hq, Lq, Dv)

with one difference: a query row whose every key is masked gets weights 0 and
output 0 (``torch.softmax`` would give NaN). Inputs are computed in the dtype they
come in; call it on float64 tensors to get the oracle.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from attnkit.kernels.contract import Call, Kernel, Reason
from attnkit.kernels.dense import (
    allowed_pairs,
    dense_bias,
    dense_mask,
    expand_kv_heads,
    zero_empty_rows,
    zero_hidden_queries,
    zero_unused_keys,
)
from attnkit.kernels.lse import sink_factor


def scores(
    q: torch.Tensor,
    k: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    scale: float,
    softcap: float | None = None,
    bias: torch.Tensor | None = None,
    score_mod: Callable[..., torch.Tensor] | None = None,
) -> torch.Tensor:
    """The masked scores ``(..., Hq, Lq, Lk)``: ``q k^T * scale``, soft-capped, plus bias, modified, masked.

    ``bias`` is a float tensor broadcastable to the scores (a bias object's
    ``dense()``); ``score_mod`` a function of the whole scores; ``mask`` is None, bool
    (True = may attend) or additive float.
    """
    k = expand_kv_heads(k, q.shape[-3] if q.dim() >= 3 else 1)
    s = (q @ k.transpose(-2, -1)) * scale  # (..., Hq, Lq, D) x (..., Hq, D, Lk) -> (..., Hq, Lq, Lk)
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    if bias is not None:
        s = s + bias.to(s.dtype)
    if score_mod is not None:
        s = score_mod(s)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask
    return s


def _normalise(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(softmax(s), logsumexp(s))`` over the last dim; a row of all ``-inf`` gives 0 / ``-inf``."""
    if s.shape[-1] == 0:
        return s, s.sum(dim=-1).fill_(float("-inf"))
    hidden = (s == float("-inf")).all(dim=-1, keepdim=True)  # fully masked rows: weights 0, lse -inf
    row_max = s.detach().amax(dim=-1, keepdim=True).masked_fill(hidden, 0.0)
    p = torch.exp(s - row_max)
    total = p.sum(dim=-1, keepdim=True)
    weights = p / torch.where(total == 0, 1.0, total)
    # logsumexp from the same pass: max + log(sum exp(s - max)), as torch.logsumexp computes it
    # (a row with no finite score has total 0: log(1) keeps its gradient finite, then -inf)
    lse = (
        (row_max + torch.log(torch.where(total == 0, 1.0, total)))
        .squeeze(-1)
        .masked_fill(hidden[..., 0], float("-inf"))
    )
    return weights, lse


def softmax_weights(
    q: torch.Tensor,
    k: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    scale: float,
    softcap: float | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention probabilities ``(..., Hq, Lq, Lk)``; fully masked rows are 0.

    q: (..., Hq, Lq, D), k: (..., Hkv, Lk, D); mask: None, bool (True = may attend)
    or additive float, broadcastable to (..., Hq, Lq, Lk); ``softcap`` and ``bias``
    as in :func:`scores`.
    """
    return _normalise(scores(q, k, mask, scale=scale, softcap=softcap, bias=bias))[0]


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    scale: float,
    dropout_p: float = 0.0,
    dropout_mask: torch.Tensor | None = None,
    softcap: float | None = None,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(out, weights)``: out (..., Hq, Lq, Dv), weights (..., Hq, Lq, Lk) before dropout.

    Dropout keeps each weight with probability ``1 - dropout_p`` and rescales by
    ``1 / (1 - dropout_p)``; ``dropout_mask`` (bool, True = keep) fixes which, else it
    is drawn by :func:`draw_dropout_mask` from the global generator.
    """
    weights = softmax_weights(q, k, mask, scale=scale, softcap=softcap, bias=bias)
    return _weighted(weights, v, dropout_p, dropout_mask), weights


def _weighted(weights: torch.Tensor, v: torch.Tensor, dropout_p: float, dropout_mask=None) -> torch.Tensor:
    """``dropout(weights) @ v`` (K/V heads repeated for GQA): the output, computed from ``weights``."""
    v = expand_kv_heads(v, weights.shape[-3] if weights.dim() >= 3 else 1)
    dropped = weights
    if dropout_p > 0.0:
        if dropout_mask is None:
            dropout_mask = draw_dropout_mask(weights.shape, dropout_p, weights.device)
        dropped = weights * dropout_mask / (1.0 - dropout_p)
    return dropped @ v  # (..., Hq, Lq, Lk) x (..., Hq, Lk, Dv) -> (..., Hq, Lq, Dv)


def draw_dropout_mask(shape: Sequence[int], p: float, device: torch.device) -> torch.Tensor:
    """Bool keep-mask of ``shape``, each entry True with probability ``1 - p``."""
    return torch.rand(shape, device=device) >= p


def log_sum_exp(
    q: torch.Tensor,
    k: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    scale: float,
    softcap: float | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Row log-sum-exp of the masked scores, ``(..., Hq, Lq)``; -inf for fully masked rows.

    Equivalent pytorch code: ``torch.logsumexp(q @ k.transpose(-2, -1) * scale + bias, dim=-1)``.
    Two attention outputs over disjoint key sets merge exactly with these weights.
    """
    return _normalise(scores(q, k, mask, scale=scale, softcap=softcap, bias=bias))[1]


# --- as a kernel of the registry -------------------------------------------------------


def run_with_weights(call: Call, *, out_from_weights: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(out, weights, lse)`` of the plain formula on a validated call.

    Half-precision inputs are computed in float32; ``out`` and ``weights`` come back
    in q's dtype, ``lse`` in float32 (float64 for float64 inputs). Soft-capping, the
    bias (evaluated whole: ``(B, Hq, Lq, Lk)``) and sinks follow the formula of
    :func:`attnkit.attention`. ``out`` is computed from the returned ``weights`` (as
    eager attention does), so the output's gradient reaches them; with
    ``out_from_weights=False`` (the kernel) from the float32 weights, before rounding.
    """
    q, k, v = call.q, call.k, call.v
    dense = dense_mask(call)
    k, v = zero_unused_keys(k, v, dense, sync=not call.compiling and call.transform is None)
    q = zero_hidden_queries(q, dense)
    dtype = q.dtype
    if dtype in (torch.float16, torch.bfloat16):  # softmax statistics in float32
        q, k, v = q.float(), k.float(), v.float()
        if dense is not None and dense.is_floating_point():
            dense = dense.float()
    s = scores(
        q,
        k,
        dense,
        scale=call.scale,
        softcap=call.softcap,
        bias=dense_bias(call),
        score_mod=None if call.score_mod is None else _whole(call, dense),
    )
    weights, lse = _normalise(s)
    if call.sinks is not None:  # the sink's share of each row: weights * sigmoid(lse - sink)
        factor, lse = sink_factor(lse, call.sinks)
        weights = weights * factor[..., None]
    if out_from_weights:
        weights = weights.to(dtype)  # what the caller gets; the output is made from it
        out = _weighted(weights.to(v.dtype), v, call.dropout_p)
    else:
        out = _weighted(weights, v, call.dropout_p)
        weights = weights.to(dtype)
    return zero_empty_rows(out, dense).to(dtype), weights, lse


def _whole(call, dense: torch.Tensor | None = None):
    """The call's score_mod on the whole scores ``(..., Hq, Lq, Lk)``, with the whole index tensors.

    Where ``dense`` hides a pair, the score_mod is asked at a pair the mask keeps instead (its
    answer there is discarded): FlexAttention never evaluates a score_mod on the blocks a mask
    leaves out, and a score_mod may index its tensors out of range there (torch's paged attention
    maps unassigned pages to ``-1``)."""

    def modify(s):
        shape, device = s.shape, s.device
        s4 = s.reshape((1,) * (4 - s.dim()) + tuple(shape))  # (B, Hq, Lq, Lk)
        b = torch.arange(s4.shape[0], device=device).view(-1, 1, 1, 1)
        h = torch.arange(s4.shape[1], device=device).view(1, -1, 1, 1)
        q_idx = torch.arange(s4.shape[2], device=device).view(1, 1, -1, 1)
        kv_idx = torch.arange(s4.shape[3], device=device).view(1, 1, 1, -1)
        allowed = allowed_pairs(dense)
        if allowed is not None:
            allowed = allowed.reshape((1,) * (4 - allowed.dim()) + tuple(allowed.shape))
            b, h, q_idx, kv_idx = kept_coordinates(allowed, b, h, q_idx, kv_idx)
        return call.score_mod(s4, b, h, q_idx, kv_idx).to(s.dtype).reshape(shape)

    return modify


def kept_coordinates(
    allowed: torch.Tensor, b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """``(b, h, q_idx, kv_idx)`` with every pair ``allowed`` hides moved to a pair it keeps: the
    row's first kept key; for a row that keeps none, the first kept pair of its (batch, head); for
    a (batch, head) that keeps none, the first kept pair of all. Static shapes, no host reads."""
    lq, lk = allowed.shape[-2:]
    first_kv = allowed.to(torch.uint8).argmax(-1, keepdim=True)  # (Bm, Hm, Lq, 1)
    row_keeps = allowed.any(-1, keepdim=True)
    first_q = row_keeps.to(torch.uint8).argmax(-2, keepdim=True)  # (Bm, Hm, 1, 1)
    first_q_kv = first_kv.gather(-2, first_q)
    slab_keeps = row_keeps.any(-2, keepdim=True)
    first = allowed.reshape(-1).to(torch.uint8).argmax()  # the first kept pair of all
    b0 = first // (allowed.shape[1] * lq * lk)
    h0 = first // (lq * lk) % allowed.shape[1]
    q0, kv0 = first // lk % lq, first % lk
    kv_idx = torch.where(allowed, kv_idx, torch.where(row_keeps, first_kv, first_q_kv))
    q_idx = torch.where(row_keeps, q_idx, first_q)
    return (
        torch.where(slab_keeps, b, b0 if allowed.shape[0] > 1 else b),
        torch.where(slab_keeps, h, h0 if allowed.shape[1] > 1 else h),
        torch.where(slab_keeps, q_idx, q0),
        torch.where(slab_keeps, kv_idx, kv0),
    )


class ReferenceKernel(Kernel):
    """The plain formula: any device, dtype, mask, dropout, lse, score modification; O(Lq x Lk) memory."""

    name = "reference"
    supports_double_backward = True
    supports_transforms = True  # plain PyTorch operations: torch.func and forward-mode AD follow them
    supports_dropout = True
    supports_float_mask = True
    supports_lse = True
    supports_score_mods = ("bias", "softcap", "sinks", "score_mod")

    def prefers(self, call: Call) -> tuple[bool, Reason]:
        return True, "under torch.compile" if call.compiling else "the plain formula"

    def run(self, call: Call) -> tuple[torch.Tensor, torch.Tensor | None]:
        out, _, lse = run_with_weights(call, out_from_weights=False)
        return out, lse
