"""attnkit's functional API: ``attention``, ``attention_with_weights``,
``attention_weights`` and ``explain``. The tutorial's helpers live in
:mod:`attnkit.tutorial`.

Shapes: ``q: (..., Hq, Lq, D)``, ``k: (..., Hkv, Lk, D)``, ``v: (..., Hkv, Lk, Dv)``;
the result is ``(..., Hq, Lq, Dv)``. Rank-2 inputs ``(L, D)`` are one head.
"""

from __future__ import annotations

import numbers
from typing import Any, Literal, overload

import torch

from attnkit import bias as _bias
from attnkit import masks as _masks
from attnkit._indexing import as4d
from attnkit._types import Index
from attnkit._validate import AttnkitTypeError, AttnkitValueError, short
from attnkit.bias import BiasLike
from attnkit.call import Call, make_call
from attnkit.kernels import fastpath, registry
from attnkit.kernels.contract import Kernel
from attnkit.kernels.reference import run_with_weights
from attnkit.kernels.registry import Plan
from attnkit.plan import MaskLike, PreparedMask
from attnkit.score_mods import ScoreModLike

__all__ = [
    "attention",
    "attention_weights",
    "attention_with_weights",
    "explain",
]


@overload
def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: MaskLike = None,
    *,
    attn_bias: BiasLike = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    score_mod: ScoreModLike = None,
    scale: float | None = None,
    dropout_p: float = 0.0,
    kernel: str | Kernel = "auto",
    return_lse: Literal[False] = False,
) -> torch.Tensor: ...


@overload
def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: MaskLike = None,
    *,
    attn_bias: BiasLike = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    score_mod: ScoreModLike = None,
    scale: float | None = None,
    dropout_p: float = 0.0,
    kernel: str | Kernel = "auto",
    return_lse: Literal[True],
) -> tuple[torch.Tensor, torch.Tensor]: ...


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: MaskLike = None,
    *,
    attn_bias: BiasLike = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    score_mod: ScoreModLike = None,
    scale: float | None = None,
    dropout_p: float = 0.0,
    kernel: str | Kernel = "auto",
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Scaled dot-product attention, exact, for any mask.

    Args:
        q: ``(..., Hq, Lq, D)`` queries.
        k: ``(..., Hkv, Lk, D)`` keys; Hq must be a multiple of Hkv (GQA/MQA).
        v: ``(..., Hkv, Lk, Dv)`` values.
        mask: None; a bool tensor broadcastable to ``(..., Hq, Lq, Lk)``, True = may
            attend; a float tensor of q's dtype added to the scores; a mask object
            from :mod:`attnkit.masks`; or a :class:`~attnkit.PreparedMask` from
            :func:`attnkit.prepare` (the fast path when one mask serves many calls).
        attn_bias: an :mod:`attnkit.bias` object (``alibi``, ``relative``,
            ``from_fn``, ``dense``, or a sum of them) or a float tensor, added to the
            scores of the pairs the mask keeps; differentiable. Inputs of rank 2 to 4.
        softcap: soft-capping ``softcap * tanh(s / softcap)`` of the scaled scores,
            before the bias and the mask (Gemma 2).
        sinks: ``(Hq,)`` logits, one per head, of an extra key with value 0 in each
            softmax denominator (gpt-oss); differentiable. The weights of a row then
            sum to less than 1, and ``lse`` includes the sink.
        score_mod: any ``fn(score, b, h, q_idx, kv_idx) -> score`` (FlexAttention's
            ``score_mod``), applied after the bias, before the mask; or a
            :class:`attnkit.score_mods.ScoreMod` with the tensors it closes over (they get
            gradients). Runs on the tiled and reference kernels, tile by tile.
        scale: multiplies ``q @ k^T``; defaults to ``1/sqrt(D)``. 0.0 and negative
            values are used as given.
        dropout_p: probability of zeroing each attention weight (the rest are scaled
            by ``1 / (1 - dropout_p)``). Applied whenever it is > 0; modules pass 0.0
            in eval mode.
        kernel: ``"auto"`` (see :func:`explain`), a registered kernel's name
            (``"sdpa"``, ``"tiled"``, ``"reference"``, ``"triton"``) or a kernel object
            (``attnkit.kernels.TILED``); forcing one is for testing and benchmarking.
        return_lse: also return the row log-sum-exp of the masked, scaled scores.

    Returns:
        ``out: (..., Hq, Lq, Dv)``, or ``(out, lse)`` with ``return_lse=True``:
        ``lse: (..., Hq, Lq)`` in float32 (float64 for float64 inputs), ``-inf`` for a
        query row with every key masked (whose output is 0). Both are differentiable;
        attention over disjoint key sets merges exactly by their lse.

    Equivalent pytorch code (up to fully masked rows, which give 0 here, not NaN)::

        scores = q @ k.transpose(-2, -1) * scale
        scores = softcap * torch.tanh(scores / softcap)     # if softcap
        scores = scores + attn_bias.dense(B, Hq, Lq, Lk)    # if attn_bias
        scores = score_mod(scores, b, h, q_idx, kv_idx)     # if score_mod (index tensors broadcasting)
        scores = scores.masked_fill(~mask, float("-inf"))   # bool mask
        scores = torch.cat([scores, sinks.view(Hq, 1, 1).expand(B, Hq, Lq, 1)], -1)  # if sinks
        out = torch.softmax(scores, dim=-1)[..., :Lk] @ v
        lse = torch.logsumexp(scores, dim=-1)

    >>> import torch, attnkit
    >>> from attnkit import masks
    >>> q = torch.randn(2, 8, 5, 16); k = v = torch.randn(2, 8, 5, 16)
    >>> attnkit.attention(q, k, v, masks.causal()).shape
    torch.Size([2, 8, 5, 16])
    >>> out, lse = attnkit.attention(q, k, v, masks.causal(), return_lse=True)
    >>> lse.shape, lse.dtype
    (torch.Size([2, 8, 5]), torch.float32)
    """
    if (  # plain Python values only: anything else goes through the full checks and their errors
        type(kernel) is str
        and kernel == "auto"
        and attn_bias is None
        and softcap is None
        and sinks is None
        and score_mod is None
        and type(dropout_p) in (float, int)
        and dropout_p == 0
        and return_lse is False
    ):
        runner = fastpath.runner(q, k, v, mask, scale)
        if runner is not None:
            return runner(q, k, v)
    call = make_call(
        q, k, v, mask=mask, scale=scale, dropout_p=dropout_p, return_lse=return_lse, attn_bias=attn_bias,
        softcap=softcap, sinks=sinks, score_mod=score_mod,
    )  # fmt: skip
    out, lse = registry.run(call, registry.choose(call, kernel))
    if call.return_lse:
        assert lse is not None, "the kernel was asked for the lse"
        return out, lse
    return out


def attention_with_weights(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: MaskLike = None,
    *,
    attn_bias: BiasLike = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    score_mod: ScoreModLike = None,
    scale: float | None = None,
    dropout_p: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(out, weights)``: the output ``(..., Hq, Lq, Dv)`` and the probabilities
    ``(..., Hq, Lq, Lk)`` (before dropout) from one pass of the reference kernel.

    Use this when you need both; :func:`attention` alone is faster. The arguments
    are :func:`attention`'s; with ``sinks`` a row's weights sum to less than 1.
    """
    call = make_call(
        q, k, v, mask=mask, scale=scale, dropout_p=dropout_p, attn_bias=attn_bias, softcap=softcap, sinks=sinks,
        score_mod=score_mod,
    )  # fmt: skip
    out, weights, _ = run_with_weights(call)
    return out, weights


def attention_weights(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: MaskLike = None,
    *,
    attn_bias: BiasLike = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    score_mod: ScoreModLike = None,
    scale: float | None = None,
    rows: Index = None,
    heads: Index = None,
) -> torch.Tensor:
    """The attention probabilities ``(..., Hq, Lq, Lk)``: ``softmax(q @ k^T * scale + mask)``.

    Same arguments as :func:`attention`. Each row sums to 1, except a row with every
    key masked, which is all 0. ``v`` is checked but not used.

    ``rows`` / ``heads`` (an int, a slice, a sequence or a 1-D integer tensor; negative
    indices count from the end) select query rows and query heads: the result is
    ``(..., len(heads), len(rows), Lk)``, exactly the slice of the full weights, in
    memory proportional to it (the way to look at a long input: the last token's
    row, a few heads). For statistics over every row see
    :func:`attnkit.inspect.attention_stats`.

    >>> import torch, attnkit
    >>> q = k = v = torch.randn(1, 1, 3, 4)
    >>> w = attnkit.attention_weights(q, k, v, attnkit.masks.causal())
    >>> w[0, 0, 0, 1:].sum().item()  # the first query sees only the first key
    0.0
    >>> attnkit.attention_weights(q, k, v, attnkit.masks.causal(), rows=-1).shape
    torch.Size([1, 1, 1, 3])
    """
    call = make_call(
        q, k, v, mask=mask, scale=scale, attn_bias=attn_bias, softcap=softcap, sinks=sinks, score_mod=score_mod
    )
    if rows is not None or heads is not None:
        if call.score_mod is not None:
            raise AttnkitValueError(
                "rows=/heads= with a score_mod: compute the whole weights (its indices are "
                "the whole problem's) or use attnkit.inspect.attention_stats."
            )
        call = _selected(call, rows, heads)
    out, weights, _ = run_with_weights(call)
    return weights


def _indices(value, size: int, name: str, device) -> torch.Tensor:
    """``rows=`` / ``heads=`` as a 1-D int64 tensor of indices in ``[0, size)``."""
    if value is None:
        return torch.arange(size, device=device)
    if isinstance(value, slice):
        return torch.arange(size, device=device)[value]
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        value = int(value)  # NumPy integers too
    if isinstance(value, bool) or not isinstance(value, (int, list, tuple, range, torch.Tensor)):
        raise AttnkitTypeError(
            f"{name} must be an int, a slice, a sequence of ints or an integer tensor, but got {short(value)}."
        )
    if isinstance(value, (list, tuple, range)):
        items = list(value)
        if not all(isinstance(i, numbers.Integral) and not isinstance(i, bool) for i in items):
            raise AttnkitTypeError(f"{name} must hold integer indices, but got {short(value)}.")
        far = [int(i) for i in items if not -size <= int(i) < size]
        if far:  # also indices too large for int64
            raise AttnkitValueError(f"{name}={short(far)} is out of range for {size} (valid: {-size}..{size - 1}).")
        value = [int(i) for i in items]
    t = torch.as_tensor(
        value, dtype=torch.long if not isinstance(value, torch.Tensor) else None, device=device
    ).reshape(-1)
    if t.is_floating_point() or t.dtype == torch.bool:
        raise AttnkitTypeError(f"{name} must hold integer indices, but got {t.dtype}.")
    bad = (t < -size) | (t >= size)
    if bool(bad.any()):
        raise AttnkitValueError(f"{name}={short(t.tolist())} is out of range for {size} (valid: {-size}..{size - 1}).")
    return (t % max(size, 1)).long()


def _selected(call: Call, rows, heads) -> Call:
    """The call restricted to some query rows and heads (mask and bias evaluated on them only)."""
    q, k, v, s = call.q, call.k, call.v, call.shapes
    if heads is not None and q.dim() < 3:
        raise AttnkitValueError("heads= needs inputs with a head axis (..., H, L, D).")
    dev = q.device
    r = _indices(rows, s.lq, "rows", dev)
    h = _indices(heads, s.hq, "heads", dev) if q.dim() >= 3 else None
    kv_h = None if h is None else h // (s.hq // s.hkv)
    q = q.index_select(-2, r) if h is None else q.index_select(-3, h).index_select(-2, r)
    if kv_h is not None:
        k, v = k.index_select(-3, kv_h), v.index_select(-3, kv_h)
    mask = call.mask
    if isinstance(mask, PreparedMask):  # the plan's pairs (the mask is not evaluated again)
        mask = mask.allowed_at(r, torch.arange(s.lk, device=dev))  # (Bm, Hm, R, Lk)
        if h is not None and mask.shape[1] > 1:
            mask = mask.index_select(1, h)
        while mask.dim() > q.dim():
            mask = mask.squeeze(0)
    elif isinstance(mask, _masks.Mask):
        kv_idx = torch.arange(s.lk, device=dev)[None, :]
        mask = as4d(mask.elements(r[:, None], kv_idx, s.lq, s.lk))  # (Bm, Hm, R, Lk)
        if h is not None and mask.shape[1] > 1:
            mask = mask.index_select(1, h)
        while mask.dim() > q.dim():
            mask = mask.squeeze(0)
    elif isinstance(mask, torch.Tensor):
        mask = mask.reshape((1,) * (len(s.scores) - mask.dim()) + tuple(mask.shape))
        if mask.shape[-2] > 1:
            mask = mask.index_select(-2, r)
        if h is not None and mask.shape[-3] > 1:
            mask = mask.index_select(-3, h)
    attn_bias = None
    if call.bias is not None:
        batch = s.batch[0] if s.batch else 1
        b_idx = torch.arange(batch, device=dev).view(-1, 1, 1, 1)
        h_idx = (torch.arange(s.hq, device=dev) if h is None else h).view(1, -1, 1, 1)
        kv_idx = torch.arange(s.lk, device=dev).view(1, 1, 1, -1)
        parts = [as4d(call.bias.elements(b_idx, h_idx, i.view(1, 1, 1, 1), kv_idx, s.lq, s.lk)) for i in r]
        dense = torch.cat([p.expand(*p.shape[:2], 1, s.lk) for p in parts], dim=-2) if parts else None
        if dense is not None:
            while dense.dim() > q.dim():
                dense = dense.squeeze(0)
            attn_bias = _bias.dense(dense)
    sinks = None if call.sinks is None else (call.sinks if h is None else call.sinks.index_select(0, h))
    return make_call(q, k, v, mask=mask, scale=call.scale, attn_bias=attn_bias, softcap=call.softcap, sinks=sinks)


def explain(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: MaskLike = None,
    *,
    attn_bias: BiasLike = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    score_mod: ScoreModLike = None,
    scale: float | None = None,
    dropout_p: float = 0.0,
    kernel: str | Kernel = "auto",
    return_lse: bool = False,
    stats: bool = False,
) -> Plan:
    """Which kernel :func:`attention` would run for these arguments, and why.

    The result prints as the reason; ``.kernel`` names the kernel, ``.rejected``
    maps every other registered kernel to why it was not chosen, and
    ``.report()`` shows all of it. With ``stats=True``: which kernel
    :func:`attnkit.inspect.attention_stats` would compute the statistics with.

    >>> import torch, attnkit
    >>> q = torch.randn(1, 2, 8, 16)
    >>> print(attnkit.explain(q, q, q))
    sdpa: no mask
    >>> attnkit.explain(q, q, q, return_lse=True).rejected["sdpa"]
    ('does not return the log-sum-exp (return_lse=True)',)
    >>> attnkit.explain(q, q, q, stats=True).kernel in ("native", "math")
    True
    """
    if stats:
        return registry.choose_stats(
            stats_call(
                q, k, v, mask, scale=scale, attn_bias=attn_bias, softcap=softcap, sinks=sinks, score_mod=score_mod
            )
        )
    call = make_call(
        q, k, v, mask=mask, scale=scale, dropout_p=dropout_p, return_lse=return_lse, attn_bias=attn_bias,
        softcap=softcap, sinks=sinks, score_mod=score_mod,
    )  # fmt: skip
    return registry.choose(call, kernel)


def stats_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: MaskLike = None, **kwargs: Any) -> Call:
    """The validated 4-D call of :func:`attention_stats` (rank-2 and rank-3 inputs lifted, a bool
    tensor mask with them)."""
    if isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor):
        if q.dim() == k.dim() == v.dim() and 2 <= q.dim() < 4:
            lead = (1,) * (4 - q.dim())
            q, k, v = (t.reshape(*lead, *t.shape) for t in (q, k, v))
            if isinstance(mask, torch.Tensor) and mask.dim() < 4:
                mask = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
    return make_call(q, k, v, mask=mask, return_lse=True, **kwargs)
