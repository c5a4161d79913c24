"""attnkit's functional API: ``attention``, ``attention_with_weights``,
``attention_weights`` and ``explain``. The tutorial's helpers live in
:mod:`attnkit.tutorial`.

Shapes: ``q: (..., Hq, Lq, D)``, ``k: (..., Hkv, Lk, D)``, ``v: (..., Hkv, Lk, Dv)``;
the result is ``(..., Hq, Lq, Dv)``. Rank-2 inputs ``(L, D)`` are one head.
"""

from __future__ import annotations

import math
import numbers
from numbers import Real
from typing import Literal, overload

import torch

from attnkit import _cache
from attnkit import bias as _bias
from attnkit import masks as _masks
from attnkit._indexing import as4d
from attnkit._types import Index
from attnkit._validate import (
    AttnkitTypeError,
    AttnkitValueError,
    Shapes,
    broadcasts_to,
    check_broadcast,
    check_dropout,
    check_qkv,
    check_scale,
    check_tensor_mask,
    compiling,
    short,
)
from attnkit.bias import BiasLike
from attnkit.kernels import Call, Kernel, Plan, choose, run
from attnkit.kernels.reference import run_with_weights
from attnkit.kernels.registry import builtin_registry, registry_state
from attnkit.prepare import MaskLike, PreparedMask
from attnkit.score_mods import ScoreModLike, as_score_mod

__all__ = [
    "attention",
    "attention_weights",
    "attention_with_weights",
    "explain",
]


def _lead_fits(lead: tuple[int, ...], shapes: Shapes) -> bool:
    """Whether a mask's ``(B or 1, H or 1)`` broadcasts to the call's batch and heads."""
    rank = len(shapes.scores)
    while len(lead) + 2 > rank and lead and lead[0] == 1:
        lead = lead[1:]
    return broadcasts_to((*lead, shapes.lq, shapes.lk), shapes.scores)


def _check_mask(mask, q: torch.Tensor, shapes: Shapes):
    """Validate ``mask`` for this call (shapes only: no host sync); returns it unchanged."""
    if mask is None:
        return None
    if isinstance(mask, PreparedMask):
        if (mask.q_len, mask.kv_len) != (shapes.lq, shapes.lk):
            raise AttnkitValueError(
                f"the prepared mask was prepared for Lq={mask.q_len}, Lk={mask.kv_len} but is used "
                f"with Lq={shapes.lq}, Lk={shapes.lk}. Prepare it for these lengths."
            )
        if mask.device != q.device:
            raise AttnkitValueError(
                f"the prepared mask is on {mask.device} but q is on {q.device}: use prepared.to({str(q.device)!r})."
            )
        if not _lead_fits(mask.lead_shape, shapes):
            check_broadcast((*mask.lead_shape, shapes.lq, shapes.lk), shapes, "the prepared mask")
        return mask
    if isinstance(mask, _masks.Mask):
        for t in mask.tensors():
            if t.device != q.device and t.device.type != "cpu":  # CPU tensors are moved as needed
                raise AttnkitValueError(
                    f"the {type(mask).__name__.strip('_').lower()} mask holds a tensor on {t.device} but q is "
                    f"on {q.device}: build the mask "
                    f"from tensors on {q.device} or on the CPU."
                )
        mask.check(shapes.lq, shapes.lk)
        if not _lead_fits(mask.lead_shape(), shapes):
            check_broadcast((*mask.lead_shape(), shapes.lq, shapes.lk), shapes, repr(mask))
        return mask
    if isinstance(mask, torch.Tensor):
        if mask.dim() < 2:  # (Lk,) or a scalar: broadcast like SDPA's attn_mask
            mask = mask.reshape(1, -1) if mask.dim() == 1 else mask.reshape(1, 1)
        while mask.dim() > len(shapes.scores) and mask.shape[0] == 1:  # e.g. (1, Lq, Lk) for 2-D inputs
            mask = mask[0]
        check_tensor_mask(mask, q, shapes)
        if mask.is_floating_point() and not compiling():
            bad = torch.isnan(mask) | (mask == float("inf"))
            if bool(bad.any()):
                index = tuple(int(i) for i in bad.nonzero()[0])
                raise AttnkitValueError(
                    f"the additive float mask holds {mask[index].item()} at {index}: a float mask is "
                    "added to the scores, so it may hold finite values and -inf (hidden), not NaN or +inf."
                )
        return mask
    raise AttnkitTypeError(
        "mask must be None, a bool tensor (True = may attend), a float tensor added to the "
        "scores, an attnkit.masks object or a PreparedMask, but got "
        f"{type(mask).__name__}."
    )


def _check_score_mod(score_mod, q: torch.Tensor):
    """``score_mod=`` as a :class:`~attnkit.score_mods.ScoreMod` (its params on q's device), or None."""
    score_mod = as_score_mod(score_mod)
    if score_mod is not None:
        for t in score_mod.params:
            if t.device != q.device:
                raise AttnkitValueError(
                    f"score_mod {score_mod.__name__} holds a tensor on {t.device} but q is on "
                    f"{q.device}: move it with .to()."
                )
    return score_mod


def _check_mods(shapes: Shapes, q: torch.Tensor, attn_bias, softcap, sinks):
    """Validate the score modifications; returns ``(bias object or None, softcap, sinks)``."""
    if softcap is not None:
        if isinstance(softcap, bool) or not isinstance(softcap, Real) or not math.isfinite(softcap) or softcap <= 0:
            raise AttnkitValueError(
                f"softcap must be a positive finite number (e.g. 50.0) or None, but got {short(softcap)}."
            )
        softcap = float(softcap)
        # scores are soft-capped in float32 (float64 for float64 inputs): softcap and 1/softcap must be finite there
        info = torch.finfo(torch.float64 if q.dtype == torch.float64 else torch.float32)
        if not info.tiny <= softcap <= info.max:
            raise AttnkitValueError(
                f"softcap={softcap:g} cannot be represented in {q.dtype} attention (scores are capped in "
                f"{info.dtype}, whose range is {info.tiny:g} to {info.max:g}); use a softcap in that range, "
                "e.g. 50.0, or None."
            )
    if sinks is not None:
        if not isinstance(sinks, torch.Tensor) or not sinks.is_floating_point():
            raise AttnkitTypeError(
                f"sinks must be a float tensor of shape (Hq,) = ({shapes.hq},), one logit per query head, "
                f"but got {type(sinks).__name__ if not isinstance(sinks, torch.Tensor) else sinks.dtype}."
            )
        if tuple(sinks.shape) != (shapes.hq,):
            raise AttnkitValueError(
                f"sinks must have shape (Hq,) = ({shapes.hq},), one logit per query head, but got {tuple(sinks.shape)}."
            )
        if sinks.device != q.device:
            raise AttnkitValueError(f"sinks are on {sinks.device} but q is on {q.device}: use sinks.to(q.device).")
    if attn_bias is None:
        return None, softcap, sinks
    if isinstance(attn_bias, torch.Tensor):
        attn_bias = _bias.dense(attn_bias)
    if not isinstance(attn_bias, _bias.Bias):
        raise AttnkitTypeError(
            "attn_bias must be an attnkit.bias object (alibi, relative, from_fn, dense, or a sum) "
            f"or a float tensor, but got {type(attn_bias).__name__}."
        )
    if shapes.rank > 4:
        raise AttnkitValueError(f"attn_bias takes inputs of rank 2 to 4, but q has rank {shapes.rank}.")
    attn_bias.check(shapes.batch[0] if shapes.batch else 1, shapes.hq, shapes.lq, shapes.lk, q.device)
    return attn_bias, softcap, sinks


def validated_call(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: MaskLike,
    scale: float | None,
    dropout_p: float,
    return_lse: bool,
    attn_bias: BiasLike = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    score_mod: ScoreModLike = None,
) -> Call:
    """The arguments of one :func:`attention` call, validated, as the :class:`~attnkit.kernels.Call`
    kernels read (raises the clear errors of the public functions)."""
    shapes = check_qkv(q, k, v)
    mask = _check_mask(mask, q, shapes)
    tracing = compiling()
    if not tracing and isinstance(mask, _masks.Mask):
        mask.check_values(shapes.lq, shapes.lk)
    bias_object, softcap, sinks = _check_mods(shapes, q, attn_bias, softcap, sinks)
    mod = _check_score_mod(score_mod, q)
    if mod is not None and shapes.rank > 4:
        raise AttnkitValueError(f"score_mod takes inputs of rank 2 to 4, but q has rank {shapes.rank}.")
    learned = [
        t
        for t in (
            *(bias_object.params() if bias_object is not None else ()),
            sinks,
            *(mod.params if mod is not None else ()),
        )
        if t is not None
    ]
    backward = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, *learned))
    return Call(
        q,
        k,
        v,
        mask,
        shapes,
        check_scale(scale, shapes.d),
        check_dropout(dropout_p),
        bool(return_lse),
        backward,
        tracing,
        bias=bias_object,
        softcap=softcap,
        sinks=sinks,
        score_mod=mod,
    )


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
        runner = _lean_runner(q, k, v, mask, scale)
        if runner is not None:
            return runner(q, k, v)
    call = validated_call(q, k, v, mask, scale, dropout_p, return_lse, attn_bias, softcap, sinks, score_mod)
    out, lse = run(call, choose(call, kernel))
    if call.return_lse:
        assert lse is not None, "the kernel was asked for the lse"
        return out, lse
    return out


# Calls of one signature (shapes, dtypes, devices, the mask's value, scale, autograd) that were
# validated and whose kernel was chosen, with a runner specialised to that kernel, are kept in
# attnkit._cache.LEAN: a decoding step repeats the same call in every layer, and validating and
# walking the registry again would cost as much as the attention itself. A new registration or
# use_kernels changes the key. attnkit._cache.LEAN_ANY_LENGTH keeps unmasked rank-4 calls keyed
# without their key length: a decoding step over a growing cache has a new Lk every step, and
# only its first layer would find no entry. It is filled only when the built-in registry chose
# SDPA, whose choice and runner are the same for any Lk >= 1 there. attnkit._cache.LEAN_LIMITS
# keeps calls with a padding mask keyed without its lengths (a decoding step's new mask each
# step), filled only when the built-in registry chose a kernel whose Kernel.limit_runner takes
# the lengths per call (the native engine's row path, chosen for any lengths there).


def _lean_key(q, k, v, mask, scale):
    """The signature that decides validation and the kernel's choice, or None (no lean path)."""
    if not (type(q) is type(k) is type(v) is torch.Tensor) or compiling():
        return None
    if scale is not None and type(scale) not in (float, int):
        return None
    if mask is None:
        mask_key = None
    elif isinstance(mask, _masks.Mask):
        mask_key = mask.value_key()  # kind, parameters and small CPU tensors by value
        if mask_key is None:
            return None
    elif isinstance(mask, PreparedMask):
        mask_key = ("prepared", mask.uid)  # unique for the process's life
    else:
        return None  # tensors: their values decide, and reading them costs what the path saves
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    return (
        q.shape,
        k.shape,
        v.shape,
        q.dtype,
        k.dtype,
        v.dtype,
        q.device,
        k.device,
        v.device,
        mask_key,
        scale,
        grad,
        torch.is_inference_mode_enabled(),
        registry_state(),
    )


def _any_length_key(key: tuple, q, k, v) -> tuple | None:
    """``key`` without the key length, for a rank-4 call with Lk >= 1 (else None)."""
    if not q.dim() == k.dim() == v.dim() == 4:
        return None
    if k.shape[2] != v.shape[2] or k.shape[2] == 0:
        return None
    return (key[0], k.shape[:2] + k.shape[3:], v.shape[:2] + v.shape[3:], *key[3:])


def _limit_free_key(key: tuple, mask) -> tuple | None:
    """``key`` with a padding mask's lengths left out (``Mask.limit_free_key``), or None."""
    if not isinstance(mask, _masks.Mask):
        return None
    free = mask.limit_free_key()
    return None if free is None else (*key[:9], free, *key[10:])


def _lean_runner(q, k, v, mask, scale):
    """A cached runner for this call's signature (made on the first call of it), or None."""
    key = _lean_key(q, k, v, mask, scale)
    if key is None:
        return None
    found = _cache.LEAN.get(key)
    if found is not None:
        return found
    any_length = _any_length_key(key, q, k, v) if mask is None else None
    if any_length is not None:
        found = _cache.LEAN_ANY_LENGTH.get(any_length)
        if found is not None:
            return found
    limit_free = _limit_free_key(key, mask)
    if limit_free is not None:
        by_limits = _cache.LEAN_LIMITS.get(limit_free)
        if by_limits is not None:
            lq, lk = q.shape[-2], k.shape[-2]
            mask.check_values(lq, lk)  # the lengths are all that differ: their checks, as the full path's
            limits = tuple(min(max(n, 0), lk) for n in mask.key_limit_values())
            return lambda q, k, v: by_limits(q, k, v, limits)
    call = validated_call(q, k, v, mask, scale, 0.0, False)  # raises as the full path does
    chosen = choose(call).chosen
    runner = chosen.runner(call)
    if runner is None:
        return None
    _cache.LEAN.put(key, runner)
    if any_length is not None and chosen.name == "sdpa" and builtin_registry():
        _cache.LEAN_ANY_LENGTH.put(any_length, runner)
    if limit_free is not None and builtin_registry():
        by_limits = chosen.limit_runner(call)
        if by_limits is not None:
            _cache.LEAN_LIMITS.put(limit_free, by_limits)
    return runner


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
    call = validated_call(q, k, v, mask, scale, dropout_p, False, attn_bias, softcap, sinks, score_mod)
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
    call = validated_call(q, k, v, mask, scale, 0.0, False, attn_bias, softcap, sinks, score_mod)
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
    mask = call.mask.mask if isinstance(call.mask, PreparedMask) else call.mask
    if isinstance(mask, _masks.Mask):
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
    return validated_call(q, k, v, mask, call.scale, 0.0, False, attn_bias, call.softcap, sinks)


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
) -> Plan:
    """Which kernel :func:`attention` would run for these arguments, and why.

    The result prints as the reason; ``.kernel`` names the kernel, ``.rejected``
    maps every other registered kernel to why it was not chosen, and
    ``.report()`` shows all of it.

    >>> import torch, attnkit
    >>> q = torch.randn(1, 2, 8, 16)
    >>> print(attnkit.explain(q, q, q))
    sdpa: no mask
    >>> attnkit.explain(q, q, q, return_lse=True).rejected["sdpa"]
    ('does not return the log-sum-exp (return_lse=True)',)
    """
    return choose(
        validated_call(q, k, v, mask, scale, dropout_p, return_lse, attn_bias, softcap, sinks, score_mod), kernel
    )
