"""FlexAttention's API on attnkit's kernels: swap the import, keep the code.

``from attnkit.flex import flex_attention, create_block_mask`` runs code written for
``torch.nn.attention.flex_attention`` unchanged, with what FlexAttention lacks on the CPU: a
backward (eager and compiled; FlexAttention raises ``NotImplementedError`` there), gradients
for the tensors a ``score_mod`` captures, no compile step, and masks that cost what they keep.

- :func:`flex_attention` has torch's signature and semantics: ``(B, H, L, D)`` inputs, GQA with
  ``enable_gqa=True``, ``score_mod(score, b, h, q_idx, kv_idx)``, ``return_lse`` and
  ``return_aux=AuxRequest(lse=, max_scores=)``. ``block_mask`` may be torch's own ``BlockMask``
  (any ``BLOCK_SIZE``; its ``mask_mod`` is asked only on the blocks it lists as partial), the
  result of :func:`create_block_mask`, an attnkit mask or a :class:`attnkit.PreparedMask`.
- :func:`create_block_mask` returns a real torch ``BlockMask`` (torch's ``flex_attention`` runs
  it, on a GPU too) made by attnkit's preparation; attnkit keeps its plan with it, so passing it
  back costs nothing.

What differs from torch: ``kernel_options`` are tuning knobs of torch's Triton kernels; the
ones that only tune (block sizes, warps, stages, ``PRESCALE_QK``, ...) are accepted and mean
nothing here, any other key is refused (``KERNEL_OPTIONS``). The kernel is attnkit's choice
(``attnkit.explain`` says which); numbers agree with torch's to within the float rounding of a
different order of summation (TESTING.md's rule against the float64 formula).

>>> import torch
>>> from attnkit.flex import flex_attention, create_block_mask
>>> def causal(b, h, q_idx, kv_idx):
...     return q_idx >= kv_idx
>>> block_mask = create_block_mask(causal, None, None, 256, 256, device="cpu")
>>> q, k, v = (torch.randn(1, 2, 256, 16, requires_grad=True) for _ in range(3))
>>> out = flex_attention(q, k, v, block_mask=block_mask)
>>> out.sum().backward()  # FlexAttention itself has no backward on the CPU
>>> q.grad.shape
torch.Size([1, 2, 256, 16])
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch.nn.attention import flex_attention as _torch_flex
from torch.nn.attention.flex_attention import (
    AuxOutput,
    AuxRequest,
    BlockMask,
    FlexKernelOptions,
    and_masks,
    create_mask,
    noop_mask,
    or_masks,
)

from attnkit import _cache
from attnkit._bits import pack_queries, tile_coordinates
from attnkit._context import in_transform
from attnkit._pointwise import indexing_per_pair
from attnkit._validate import AttnkitTypeError, AttnkitValueError, compiling
from attnkit.kernels import registry
from attnkit.masks import Mask
from attnkit.masks.blockmask import (
    FULL,
    PARTIAL,
    Blocks,
    FromBlockMask,
    is_block_mask,
    planned,
    planned_block_mask,
    regrid,
)
from attnkit.plan import PreparedMask, prepare

__all__ = [
    "KERNEL_OPTIONS",
    "AuxOutput",
    "AuxRequest",
    "BlockMask",
    "FlexKernelOptions",
    "and_masks",
    "create_block_mask",
    "create_mask",
    "flex_attention",
    "noop_mask",
    "or_masks",
]

#: torch's ``FlexKernelOptions`` keys that tune its Triton kernels and mean nothing to attnkit's
#: kernels (accepted, ignored); any other key is refused with this list.
KERNEL_OPTIONS = frozenset(
    {
        "BLOCK_M", "BLOCK_N", "BLOCK_M1", "BLOCK_N1", "BLOCK_M2", "BLOCK_N2", "num_warps", "num_stages",
        "fwd_BLOCK_M", "fwd_BLOCK_N", "fwd_num_warps", "fwd_num_stages", "bwd_BLOCK_M1", "bwd_BLOCK_N1",
        "bwd_BLOCK_M2", "bwd_BLOCK_N2", "bwd_num_warps", "bwd_num_stages", "PRESCALE_QK",
        "ROWS_GUARANTEED_SAFE", "BLOCKS_ARE_CONTIGUOUS", "WRITE_DQ", "FORCE_USE_FLEX_ATTENTION",
        "USE_TMA", "kpack", "matrix_instr_nonkdim", "waves_per_eu", "BACKEND", "backend",
        "OUTPUT_LOGSUMEXP", "OUTPUT_MAX", "SAFE_HEAD_DIM",
    }
    | set(getattr(FlexKernelOptions, "__annotations__", {}))
)  # fmt: skip

#: torch's block size of the BlockMask it makes for ``block_mask=None`` (``_create_empty_block_mask``).
_WHOLE = getattr(_torch_flex, "_LARGE_SPARSE_BLOCK_SIZE", 1 << 30)
#: torch's own ``create_block_mask``, bound once: what runs while torch.compile traces, even where a
#: program has replaced the module's attribute with this module's function.
_torch_create_block_mask = _torch_flex.create_block_mask


#: What ``block_mask=`` takes.
BlockMaskLike = BlockMask | Mask | PreparedMask | None


def create_block_mask(
    mask_mod: Callable[..., torch.Tensor],
    B: int | None,  # noqa: N803  (torch's names)
    H: int | None,  # noqa: N803
    Q_LEN: int,  # noqa: N803
    KV_LEN: int,  # noqa: N803
    device: str | torch.device | None = "cpu",
    BLOCK_SIZE: int | tuple[int, int] = 128,  # noqa: N803
    _compile: bool = False,
    separate_full_blocks: bool = True,
    compute_dq_write_order: bool = False,
    dq_kv_order: bool = True,
) -> BlockMask:
    """torch's ``create_block_mask``, made by attnkit's preparation: returns a torch ``BlockMask``.

    ``mask_mod(b, h, q_idx, kv_idx) -> bool`` decides each pair, as a function of one pair
    (evaluated by broadcasting only where that is proved to give the same answer:
    :mod:`attnkit._pointwise`); ``B``/``H`` None (or 1) make one map for every sequence/head. The
    result is a real torch ``BlockMask`` (its lists, ``to_dense``, slicing and torch's own
    ``flex_attention`` all work) that carries attnkit's plan, so passing it to
    :func:`flex_attention` costs nothing more, eagerly or under ``torch.compile``.

    ``_compile`` is accepted and ignored (there is no compile step). ``separate_full_blocks`` and
    ``compute_dq_write_order`` / ``dq_kv_order`` make the lists and the dQ write order torch's
    function makes (the write order is torch's own computation; attnkit's kernels do not need it).
    Called while ``torch.compile`` traces (inside a compiled function, or
    ``torch.compile(create_block_mask)``) or under a ``torch.func`` transform, it is torch's own
    ``create_block_mask``, traced: a BlockMask without a plan, read as torch's.
    """
    if not callable(mask_mod):
        raise AttnkitTypeError(
            f"mask_mod must be a function mask_mod(b, h, q_idx, kv_idx), but got {type(mask_mod).__name__}."
        )
    if not isinstance(dq_kv_order, bool):
        raise AttnkitValueError(
            f"dq_kv_order must be a bool for create_block_mask, but got {type(dq_kv_order).__name__} (as torch's: "
            "a tensor order goes to BlockMask.from_kv_blocks with its precomputed dq_write_order)."
        )
    if compiling() or in_transform():
        return _torch_create_block_mask(
            mask_mod, B, H, Q_LEN, KV_LEN, device=device, BLOCK_SIZE=BLOCK_SIZE,
            separate_full_blocks=separate_full_blocks, compute_dq_write_order=compute_dq_write_order,
            dq_kv_order=dq_kv_order,
        )  # fmt: skip
    bq, bk = (BLOCK_SIZE, BLOCK_SIZE) if isinstance(BLOCK_SIZE, int) else tuple(BLOCK_SIZE)
    from attnkit.masks import from_fn

    mask = from_fn(mask_mod, batch_size=None if B in (None, 1) else B, num_heads=None if H in (None, 1) else H)
    device = torch.device("cpu" if device is None else device)
    kernel_size = registry.block_size_for(device) or (bq, bk)  # the plan at the kernels' block size
    prepared = prepare(mask, Q_LEN, KV_LEN, device=device, block_size=kernel_size)
    if bq % kernel_size[0] == 0 and bk % kernel_size[1] == 0:  # torch's lists read from the plan's blocks
        codes = regrid(prepared.codes, kernel_size, Blocks(Q_LEN, KV_LEN, bq, bk, device))
    else:  # blocks that do not tile the plan's: the predicate's own map at torch's block size
        codes = mask.block_map(Q_LEN, KV_LEN, bq, bk, device)
    codes = _padded_blocks_partial(codes, Q_LEN % bq != 0, KV_LEN % bk != 0)
    codes = codes.expand(B or 1, H or 1, *codes.shape[2:]) if codes.shape[:2] != (B or 1, H or 1) else codes
    made = planned_block_mask(
        prepared, codes.contiguous(), (bq, bk), Q_LEN, KV_LEN, mask_mod, _cache.fingerprint(mask_mod),
        separate_full_blocks=separate_full_blocks,
    )  # fmt: skip
    if compute_dq_write_order:
        write_order = getattr(_torch_flex, "_compute_dq_write_order_from_block_mask", None)
        if write_order is None:
            raise AttnkitValueError(
                f"compute_dq_write_order=True needs torch's dQ write order, which torch {torch.__version__} "
                "does not have: leave it False (attnkit's kernels do not use it)."
            )
        made.dq_write_order, made.dq_write_order_full = write_order(made, dq_kv_order=dq_kv_order)
        made.dq_kv_order, made.dq_kv_order_spt = None, dq_kv_order
    return made


def _padded_blocks_partial(codes: torch.Tensor, ragged_q: bool, ragged_kv: bool) -> torch.Tensor:
    """torch's lists for lengths that are not multiples of the block size: its create_block_mask pads
    the mask with hidden pairs, so a last block is never full (partial where anything is kept)."""
    if not (ragged_q or ragged_kv):
        return codes
    edge = torch.zeros(codes.shape[-2:], dtype=torch.bool, device=codes.device)
    if ragged_q:
        edge[-1, :] = True
    if ragged_kv:
        edge[:, -1] = True
    return torch.where(edge & (codes == FULL), torch.tensor(PARTIAL, dtype=codes.dtype, device=codes.device), codes)


def _mask_of(block_mask: BlockMaskLike, q_len: int, kv_len: int, batch: int) -> Mask | PreparedMask | None:
    """``block_mask=`` as what attnkit.attention takes.

    A BlockMask made by :func:`create_block_mask` gives its plan, while its ``mask_mod`` reads what
    it read when it was made (its fingerprint is the same; under torch.compile the plan is taken as
    it is); any other BlockMask, or one whose ``mask_mod`` now reads other values, is read as torch
    reads it: its full blocks as listed, its partial blocks by the ``mask_mod`` now, the rest empty.
    A BlockMask made for more sequences than the call's ``batch`` gives its first ``batch`` (torch's
    kernels read those).
    """
    if block_mask is None or isinstance(block_mask, (Mask, PreparedMask)):
        return block_mask
    if not is_block_mask(block_mask):
        raise AttnkitTypeError(
            "block_mask must be a BlockMask (create_block_mask), an attnkit mask or a PreparedMask, but got "
            f"{type(block_mask).__name__}."
        )
    if tuple(block_mask.BLOCK_SIZE) == (_WHOLE, _WHOLE):
        return None  # torch's BlockMask for block_mask=None: one block, every pair
    if block_mask.mask_mod is getattr(_torch_flex, "_sliced_mask_mod_error", None):
        raise AttnkitValueError(
            "this BlockMask was sliced (block_mask[...]): torch keeps no mask_mod for it, so its partial blocks "
            "cannot be evaluated. Make the mask for the sequences and heads you need with create_block_mask."
        )
    plan, made_from = planned(block_mask)
    if plan is not None and (plan.q_len, plan.kv_len) == (q_len, kv_len) and plan.lead_shape[0] in (1, batch):
        if compiling():
            return _partial_blocks_asked_now(plan, block_mask.mask_mod)
        if made_from is not None and _cache.fingerprint(block_mask.mask_mod) == made_from:
            return plan
    more = int(block_mask.kv_num_blocks.shape[0]) > batch
    return FromBlockMask(block_mask, batch=batch if more else None)


def _partial_blocks_asked_now(plan: PreparedMask, mask_mod) -> PreparedMask:
    """``plan`` with the pairs of its partial blocks asked of ``mask_mod`` again, one pair at a time,
    in the traced graph (so what it reads is read now, as torch's kernels read it): its full and
    empty blocks stay as listed. torch operations with static shapes only."""
    if not plan.masked:
        return plan
    bq, bk = plan.block_size
    tiles = plan.bits.shape[0]
    where = tile_coordinates(plan.tile_ids, plan.kv_indices, tiles)  # (T, 4): b, h, i, j
    dev = where.device
    q_idx = where[:, 2].view(-1, 1, 1) * bq + torch.arange(bq, device=dev).view(1, 1, -1)  # (T, 1, bq)
    kv_idx = where[:, 3].view(-1, 1, 1) * bk + torch.arange(bk, device=dev).view(1, -1, 1)  # (T, bk, 1)
    inside = (q_idx < plan.q_len) & (kv_idx < plan.kv_len)  # (T, bk, bq): key-major, as packed
    shape = (tiles, bk, bq)
    indices = (
        where[:, 0].view(-1, 1, 1),
        where[:, 1].view(-1, 1, 1),
        q_idx.clamp(max=max(plan.q_len - 1, 0)),
        kv_idx.clamp(max=max(plan.kv_len - 1, 0)),
    )
    with indexing_per_pair():
        asked = torch.vmap(mask_mod)(*(i.expand(shape).reshape(-1) for i in indices)).view(shape)
    return dataclasses.replace(plan, bits=pack_queries(asked & inside))


def _check_lengths(block_mask: BlockMask, q_len: int, kv_len: int) -> None:
    """torch's rule for a BlockMask made for other lengths (its messages)."""
    if tuple(block_mask.BLOCK_SIZE) == (_WHOLE, _WHOLE):
        return
    made = block_mask.seq_lengths
    if (q_len, kv_len) != tuple(made):
        crop = (
            ""
            if q_len > made[0] or kv_len > made[1]
            else f", or crop this one to its upper left corner with block_mask._adjust({q_len}, {kv_len}) (right "
            "only for masks that crop that way)"
        )
        raise AttnkitValueError(
            f"the BlockMask was made for Q_LEN={made[0]}, KV_LEN={made[1]} but is used with q_len={q_len}, "
            f"kv_len={kv_len}: make one for these lengths (create_block_mask(..., {q_len}, {kv_len})){crop}."
        )


def flex_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    score_mod: Callable[..., torch.Tensor] | None = None,
    block_mask: BlockMaskLike = None,
    scale: float | None = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
    kernel_options: dict | None = None,
    *,
    return_aux: AuxRequest | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | tuple[torch.Tensor, AuxOutput]:
    """torch's ``flex_attention`` on attnkit's kernels (see the module's docstring).

    ``query (B, Hq, L, E)``, ``key (B or 1, Hkv, S, E)``, ``value (B or 1, Hkv, S, Ev)``: K/V of
    batch 1 serve every query sequence (torch's paged attention keeps one such cache); ``key`` and
    ``value`` of another dtype than ``query`` (float8 caches) are read in ``query``'s dtype, as
    torch's eager kernel does. Returns ``out (B, Hq, L, Ev)``; with ``return_lse=True``
    ``(out, lse)``; with ``return_aux=AuxRequest(...)`` ``(out, AuxOutput(lse=, max_scores=))``.
    ``lse`` is the natural log-sum-exp of each row's modified scores (``-inf`` where a row sees no
    key); ``max_scores`` its largest modified score. Differentiable in query, key, value and the
    tensors ``score_mod`` captures, on every device.
    """
    import attnkit

    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise AttnkitTypeError(f"flex_attention's {name} must be a tensor, but got {type(t).__name__}.")
        if t.dim() != 4:
            raise AttnkitValueError(
                f"flex_attention takes (B, H, L, D) tensors, but {name} has shape {tuple(t.shape)}."
            )
    hq, hkv = query.shape[1], key.shape[1]
    if hq != hkv and not enable_gqa:
        raise AttnkitValueError(
            f"query has {hq} heads and key {hkv}: pass enable_gqa=True for grouped-query attention (as torch's "
            "flex_attention asks)."
        )
    if kernel_options is not None:
        if not isinstance(kernel_options, dict):
            raise AttnkitTypeError(f"kernel_options must be a dict, but got {type(kernel_options).__name__}.")
        unknown = sorted(set(kernel_options) - KERNEL_OPTIONS)
        if unknown:
            raise AttnkitValueError(
                f"kernel_options {unknown} are not torch FlexAttention tuning options attnkit knows; the known "
                "ones tune torch's Triton kernels and are ignored here (attnkit.flex.KERNEL_OPTIONS)."
            )
    if return_aux is not None and return_lse:
        raise AttnkitValueError("pass return_lse=True or return_aux=AuxRequest(lse=True), not both.")
    key, value = _as_query_dtype(query, key, value)
    key, value = _broadcast_batch(query, key, value, block_mask)
    if isinstance(block_mask, BlockMask):
        _check_lengths(block_mask, query.shape[2], key.shape[2])
    want_lse = return_lse or bool(return_aux is not None and return_aux.lse)
    want_max = bool(return_aux is not None and return_aux.max_scores)
    mask = _mask_of(block_mask, query.shape[2], key.shape[2], query.shape[0])
    if not (want_lse or want_max):
        # dropout_p as a literal: under dynamic=True a float read from the function's defaults would be
        # a symbol, fixed only after the graph is made (tracing again)
        return attnkit.attention(query, key, value, mask, score_mod=score_mod, scale=scale, dropout_p=0.0)
    out, lse = attnkit.attention(
        query, key, value, mask, score_mod=score_mod, scale=scale, return_lse=True, dropout_p=0.0
    )
    if return_aux is None:
        return out, lse
    max_scores = None
    if want_max:
        from attnkit.inspect import attention_stats

        with torch.no_grad():
            stats = attention_stats(
                query.detach(), key.detach(), value.detach(), mask, score_mod=score_mod, scale=scale
            )
        max_scores = torch.where(
            stats.max_weight > 0, lse.detach().float() + stats.max_weight.float().log(), float("-inf")
        ).to(lse.dtype)
    return out, AuxOutput(lse=lse if want_lse else None, max_scores=max_scores)


def _as_query_dtype(query, key, value) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V of another floating dtype than the query's (a float8 cache), read in the query's dtype."""
    if key.dtype == value.dtype == query.dtype:
        return key, value
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not t.is_floating_point():
            raise AttnkitTypeError(f"flex_attention's {name} must be a floating-point tensor, but got {t.dtype}.")
    if query.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        raise AttnkitTypeError(
            f"query is {query.dtype} and key/value {key.dtype}/{value.dtype}: with key and value of another dtype, "
            "the query must be float16, bfloat16, float32 or float64 (the dtype the attention is computed in)."
        )
    return key.to(query.dtype), value.to(query.dtype)


def _broadcast_batch(query, key, value, block_mask) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V of batch 1 expanded over the query's batch (no copy), under torch's rule: with another
    batch than the query's, the block mask must be the query's batch."""
    bq, bkv = query.shape[0], key.shape[0]
    if bq == bkv:
        return key, value
    if bkv != 1 or value.shape[0] != 1:
        raise AttnkitValueError(
            f"query has batch {bq} and key/value {bkv}/{value.shape[0]}: key and value must have the query's "
            "batch or batch 1 (one cache every sequence reads)."
        )
    if block_mask is None:
        raise AttnkitValueError(
            f"query has batch {bq} and key/value batch 1 with block_mask=None: as in torch's flex_attention, "
            "pass a block_mask made for the query's batch (create_block_mask(..., B=...))."
        )
    lead = _lead_batch(block_mask)
    if lead != bq and (is_block_mask(block_mask) or lead != 1):
        raise AttnkitValueError(
            f"query has batch {bq} and key/value batch 1, and the block mask is for batch {lead}: as in torch's "
            f"flex_attention, the block mask must be made for the query's batch ({bq})."
        )
    return key.expand(bq, *key.shape[1:]), value.expand(bq, *value.shape[1:])


def _lead_batch(block_mask) -> int:
    if is_block_mask(block_mask):
        return int(block_mask.kv_num_blocks.shape[0])
    if isinstance(block_mask, PreparedMask):
        return int(block_mask.lead_shape[0])
    return int(block_mask.lead_shape()[0])
