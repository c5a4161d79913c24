"""KV-cache compression scores from the tile reduction: SnapKV, TOVA and observed attention.

Each method scores every key of a layer by the attention weights it receives; a compressed cache
keeps the highest-scored keys. Eager implementations (NVIDIA kvpress's ``SnapKVPress``,
``TOVAPress``, ``ObservedAttentionPress``) compute the weights as a matrix; here they come from
:func:`attnkit.inspect.attention_stats`' ``received`` (the mass each key receives, one more pass
over the tiles the mask keeps), so no more than a tile of weights exists at once, whatever the
mask, bias, softcap or sinks. The conventions are kvpress's (the formulas are in
``docs/attribution.md``, "Scoring keys for KV-cache compression"):

- ``snapkv``: the last ``window`` queries' mean weight on each key before the window,
  ``avg_pool1d(kernel_size, padding=kernel_size // 2)`` along the keys, the mean over the query
  heads sharing a KV head; the window's own keys get ``max + 1`` (always kept);
- ``tova``: the last query's weights averaged over every query head, the same for each KV head;
  the last key gets ``max + 1``;
- ``observed``: the weights summed over every query, divided by the number of queries that can
  see the key under causal attention (``Lk - j``), averaged over each KV head's query heads (H2O's
  accumulated attention, normalised).

``max`` is the largest score of the whole result (every sequence and head), as in kvpress.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from attnkit._validate import AttnkitTypeError, AttnkitValueError, check_nonnegative_int
from attnkit.inspect.stats import attention_stats
from attnkit.plan import MaskLike

__all__ = ["METHODS", "kv_scores"]

#: The scoring methods :func:`kv_scores` knows (``knorm`` reads the keys alone: query-agnostic).
METHODS = ("snapkv", "tova", "observed", "knorm")


def kv_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: MaskLike = None,
    *,
    method: str = "snapkv",
    window: int = 64,
    kernel_size: int = 5,
    scale: float | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    """Scores ``(B, Hkv, Lk)`` of every key for KV-cache compression (higher: keep).

    ``q (B, H, Lq, D)``, ``k``, ``v (B, Hkv, Lk, D)`` and ``mask`` are one attention call's, as
    for :func:`attnkit.attention` (``mask`` for the whole ``Lq x Lk`` problem; ``None`` means no
    mask, kvpress's prefill uses ``masks.causal()``); ``attn_bias``, ``softcap``, ``sinks`` and
    ``score_mod`` pass through. ``method``: ``"snapkv"`` (the last ``window`` queries, pooled
    over ``kernel_size`` keys), ``"tova"`` (the last query), ``"observed"`` (every query) or
    ``"knorm"`` (the keys alone: minus each key's L2 norm, kvpress's ``KnormPress``; no query is
    read, so the score holds for any question asked later). Memory is O(B x H x (Lq + Lk));
    float32 (float64 for float64 inputs).

    >>> import torch, attnkit
    >>> from attnkit.inspect import kv_scores
    >>> q, k = torch.randn(1, 4, 100, 16), torch.randn(1, 2, 100, 16)
    >>> kv_scores(q, k, k, attnkit.masks.causal(), method="snapkv", window=8).shape
    torch.Size([1, 2, 100])
    """
    if method not in METHODS:
        raise AttnkitValueError(f"method must be one of {', '.join(map(repr, METHODS))}, but got {method!r}.")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise AttnkitTypeError(f"kv_scores takes 4-D q, k, v (B, H, L, D), but {name} is {got}.")
    b, h, lq, _ = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    if hkv == 0 or h % hkv:
        raise AttnkitValueError(f"q's {h} heads must be a multiple of k's {hkv} heads (GQA).")
    groups = h // hkv
    if method == "knorm":
        return -k.to(torch.float64 if k.dtype == torch.float64 else torch.float32).norm(dim=-1)
    if method == "snapkv":
        window = check_nonnegative_int(window, "window")
        kernel_size = check_nonnegative_int(kernel_size, "kernel_size")
        if not 0 < window < min(lq, lk):
            raise AttnkitValueError(
                f"snapkv's window must be between 1 and min(Lq, Lk) - 1 = {min(lq, lk) - 1} (some keys must lie "
                f"before it), but got window={window} with Lq={lq}, Lk={lk}."
            )
        if kernel_size % 2 == 0:
            raise AttnkitValueError(f"kernel_size must be odd (pooled scores keep their length), got {kernel_size}.")
        weights = _received(q, k, v, mask, lq - window, scale, kwargs) / window  # mean over the window's rows
        scores = F.avg_pool1d(
            weights[..., : lk - window].reshape(b * h, 1, lk - window), kernel_size, 1, kernel_size // 2
        ).view(b, hkv, groups, lk - window)
        return _keep_last(scores.mean(2), window)
    if method == "tova":
        if lk < 2:
            raise AttnkitValueError(f"tova scores the keys before the last one, but Lk={lk}.")
        weights = _received(q, k, v, mask, lq - 1, scale, kwargs)  # the last query's weights
        scores = weights[..., : lk - 1].mean(1, keepdim=True).expand(b, hkv, lk - 1)
        return _keep_last(scores, 1)
    weights = _received(q, k, v, mask, 0, scale, kwargs)
    seen_by = torch.arange(lk, 0, -1, device=weights.device, dtype=weights.dtype)  # causal: Lk - j queries
    return (weights / seen_by).view(b, hkv, groups, lk).mean(2)


def _received(q, k, v, mask, first_row, scale, kwargs) -> torch.Tensor:
    """``(B, H, Lk)``: the weight each key receives from queries ``first_row..Lq - 1`` of the call."""
    lq, lk = q.shape[2], k.shape[2]
    if first_row and mask is not None:
        if isinstance(mask, torch.Tensor):
            mask = mask[..., first_row:, :] if mask.dim() >= 2 and mask.shape[-2] == lq else mask
        elif hasattr(mask, "part"):  # the rows' rectangle of the whole problem, as a mask of its own
            try:
                mask = mask.part(lq, lk, q=slice(first_row, lq))
            except AttnkitValueError as error:
                raise AttnkitValueError(
                    f"kv_scores scores the last {lq - first_row} queries of the call, but {mask!r} cannot be cut to "
                    "those rows (a KV cache's mask, aligned per sequence): pass the mask of the problem itself, "
                    "e.g. masks.causal() for a prefill into an empty cache, or use method='observed'."
                ) from error
        else:
            raise AttnkitTypeError(
                "kv_scores takes a mask object or a bool tensor (a PreparedMask holds one problem's plan: "
                f"pass the mask it came from), but got {type(mask).__name__}."
            )
    bias = kwargs.get("attn_bias")
    if first_row and bias is not None:
        if not hasattr(bias, "part"):
            raise AttnkitTypeError(
                "kv_scores takes attn_bias as an attnkit bias object (its rows are cut to the scored "
                f"queries); got {type(bias).__name__}: wrap a tensor with attnkit.bias.dense(tensor)."
            )
        kwargs = {**kwargs, "attn_bias": bias.part(lq, lk, q=slice(first_row, lq))}
    if first_row and kwargs.get("score_mod") is not None:
        raise AttnkitValueError(
            "kv_scores cannot cut a score_mod to the last queries (its q_idx would start at 0): "
            "use method='observed', or an attn_bias / mask object, which know their positions."
        )
    return attention_stats(q[:, :, first_row:], k, v, mask, scale=scale, **kwargs).received


def _keep_last(scores: torch.Tensor, count: int) -> torch.Tensor:
    """``scores`` with ``count`` more keys at the end scored ``max + 1`` (kept by any top-k)."""
    top = scores.max() + 1 if scores.numel() else torch.ones((), dtype=scores.dtype, device=scores.device)
    return torch.cat([scores, top.expand(*scores.shape[:-1], count)], dim=-1)
