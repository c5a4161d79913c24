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

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.nn.attention.flex_attention import AuxOutput, AuxRequest, BlockMask

from attnkit._validate import AttnkitTypeError, AttnkitValueError
from attnkit.masks import Mask
from attnkit.plan import PreparedMask, prepare

__all__ = ["KERNEL_OPTIONS", "AuxOutput", "AuxRequest", "BlockMask", "create_block_mask", "flex_attention"]

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
)  # fmt: skip


#: What ``block_mask=`` takes.
BlockMaskLike = BlockMask | Mask | PreparedMask | None

#: The plan attnkit made each BlockMask from (create_block_mask), or read it as (flex_attention).
_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def create_block_mask(
    mask_mod: Callable[..., torch.Tensor],
    B: int | None,  # noqa: N803  (torch's names)
    H: int | None,  # noqa: N803
    Q_LEN: int,  # noqa: N803
    KV_LEN: int,  # noqa: N803
    device: str | torch.device | None = "cpu",
    BLOCK_SIZE: int | tuple[int, int] = 128,  # noqa: N803
    _compile: bool = False,
    **torch_only: Any,
) -> BlockMask:
    """torch's ``create_block_mask``, made by attnkit's preparation: returns a torch ``BlockMask``.

    ``mask_mod(b, h, q_idx, kv_idx) -> bool`` decides each pair; ``B``/``H`` None (or 1) make one
    map for every sequence/head. ``_compile`` is accepted and ignored (there is no compile step);
    torch's other options (``separate_full_blocks``, ``compute_dq_write_order``) tune its GPU
    kernel and are accepted.
    """
    from attnkit.masks import from_fn
    from attnkit.masks._flex import to_torch_block_mask

    unknown = set(torch_only) - {"separate_full_blocks", "compute_dq_write_order", "dq_kv_order"}
    if unknown:
        raise AttnkitTypeError(f"create_block_mask got unexpected arguments {sorted(unknown)}.")
    if not callable(mask_mod):
        raise AttnkitTypeError(
            f"mask_mod must be a function mask_mod(b, h, q_idx, kv_idx), but got {type(mask_mod).__name__}."
        )
    bq, bk = (BLOCK_SIZE, BLOCK_SIZE) if isinstance(BLOCK_SIZE, int) else tuple(BLOCK_SIZE)
    mask = from_fn(mask_mod, batch_size=None if B in (None, 1) else B, num_heads=None if H in (None, 1) else H)
    prepared = prepare(mask, Q_LEN, KV_LEN, device=device, block_size=(bq, bk))
    codes = prepared.codes
    if B not in (None, 1) and codes.shape[0] == 1 or H not in (None, 1) and codes.shape[1] == 1:
        codes = codes.expand(
            B if B not in (None, 1) else codes.shape[0], H if H not in (None, 1) else codes.shape[1], *codes.shape[2:]
        )
    block_mask = to_torch_block_mask(codes.contiguous(), (bq, bk), Q_LEN, KV_LEN, mask_mod)
    _PLANS[block_mask] = prepared
    return block_mask


def _mask_of(block_mask: BlockMaskLike, q_len: int, kv_len: int) -> Mask | PreparedMask | None:
    """``block_mask=`` as what attnkit.attention takes."""
    if block_mask is None or isinstance(block_mask, (Mask, PreparedMask)):
        return block_mask
    from attnkit.masks._flex import FromBlockMask, is_block_mask

    if not is_block_mask(block_mask):
        raise AttnkitTypeError(
            "block_mask must be a BlockMask (create_block_mask), an attnkit mask or a PreparedMask, but got "
            f"{type(block_mask).__name__}."
        )
    found = _PLANS.get(block_mask)
    if isinstance(found, PreparedMask) and (found.q_len, found.kv_len) == (q_len, kv_len):
        return found
    if found is None:
        found = _PLANS[block_mask] = FromBlockMask(block_mask)  # its map copied once per BlockMask
    return found


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

    Returns ``out (B, Hq, Lq, Dv)``; with ``return_lse=True`` ``(out, lse)``; with
    ``return_aux=AuxRequest(...)`` ``(out, AuxOutput(lse=, max_scores=))``. ``lse`` is the natural
    log-sum-exp of each row's modified scores (``-inf`` where a row sees no key); ``max_scores``
    its largest modified score. Differentiable in query, key, value and the tensors ``score_mod``
    captures, on every device.
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
    aux = return_aux
    if aux is not None and return_lse:
        raise AttnkitValueError("pass return_lse=True or return_aux=AuxRequest(lse=True), not both.")
    want_lse = return_lse or bool(aux is not None and getattr(aux, "lse", False))
    want_max = bool(aux is not None and getattr(aux, "max_scores", False))
    mask = _mask_of(block_mask, query.shape[2], key.shape[2])
    lse = None
    if want_lse or want_max:
        out, lse = attnkit.attention(query, key, value, mask, score_mod=score_mod, scale=scale, return_lse=True)
    else:
        out = attnkit.attention(query, key, value, mask, score_mod=score_mod, scale=scale)
    if aux is None:
        if return_lse:
            assert lse is not None, "asked for with the output"
            return out, lse
        return out
    max_scores = None
    if want_max:
        from attnkit.inspect import attention_stats

        assert lse is not None, "asked for with the output"
        with torch.no_grad():
            stats = attention_stats(
                query.detach(), key.detach(), value.detach(), mask, score_mod=score_mod, scale=scale
            )
        max_scores = torch.where(
            stats.max_weight > 0, lse.detach().float() + stats.max_weight.float().log(), float("-inf")
        ).to(lse.dtype)
    return out, AuxOutput(lse=lse if want_lse else None, max_scores=max_scores)
