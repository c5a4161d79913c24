"""Which kernel runs an attention call, and why.

Kernels:

- ``"sdpa"``: PyTorch's fused ``torch.nn.functional.scaled_dot_product_attention``.
  Mask objects are handed to it as ``is_causal=True`` where that is exact, else as
  a dense bool mask.
- ``"tiled"``: the block-sparse kernel of :mod:`attnkit.kernels.tiled`, for masks
  that remove enough blocks, and for dropout (its keep-mask is drawn per tile,
  reproducibly under ``torch.manual_seed``, in O(L) memory).
- ``"reference"``: the plain formula of :mod:`attnkit.kernels.reference`, in
  float32 for half-precision inputs: empty inputs, and dropout with an additive
  float mask.

``auto`` picks SDPA when there is no mask or a causal mask it can express with
``is_causal``, the tiled kernel when a mask keeps few enough blocks
(``TILED_MAX_KEPT``, by dtype and by whether a backward pass follows), and SDPA
with the dense mask otherwise (thresholds measured by ``benchmarks/cpu.py``).

Before any kernel runs, K/V rows that no query may attend to are zeroed, so NaN
or Inf stored in padding never reaches the output or the gradients.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from attnkit import masks as _masks
from attnkit._validate import AttnkitValueError, Shapes
from attnkit.kernels import reference, tiled

KERNELS = ("auto", "sdpa", "tiled", "reference")
_NAMES = {"sdpa": "fused SDPA", "tiled": "tiled", "reference": "reference"}

#: Below this many (query, key) pairs one fused call beats tiling.
TILED_MIN_PAIRS = 256 * 256
#: The tiled kernel runs when at most this fraction of blocks is kept, by
#: (half precision, with backward). Masked tiles cost more than full ones, most in
#: half precision with backward, so plans with masked tiles get the lower limit;
#: plans of full blocks only (aligned documents, padding) get ``TILED_MAX_KEPT_FULL``.
#: Measured with benchmarks/cpu.py (see the README's table).
TILED_MAX_KEPT = {(False, False): 0.85, (False, True): 0.6, (True, False): 0.6, (True, True): 0.3}
TILED_MAX_KEPT_FULL = 0.85


@dataclass(frozen=True)
class Plan:
    """The kernel chosen for one call and the reason, in words."""

    kernel: str
    reason: str
    tiles: tiled.TilePlan | None = field(default=None, repr=False, compare=False)

    def __str__(self) -> str:
        return self.reason


def choose(mask, dropout_p: float, shapes: Shapes, kernel: str = "auto", device=None, *,
           half: bool = False, backward: bool = False) -> Plan:
    """Pick the kernel for a validated call (see the module docstring for the rules).

    ``half``: the inputs are float16/bfloat16; ``backward``: a gradient will be taken.
    """
    if kernel not in KERNELS:
        raise AttnkitValueError(f"kernel must be one of {KERNELS}, but got {kernel!r}.")
    empty = shapes.lk == 0 or shapes.lq == 0
    tileable = shapes.rank <= 4 and not (isinstance(mask, torch.Tensor) and mask.is_floating_point())
    if kernel == "tiled" and not tileable:
        what = f"rank {shapes.rank}" if shapes.rank > 4 else "an additive float mask"
        raise AttnkitValueError(
            f"kernel='tiled' takes inputs of rank 2 to 4 with a bool or attnkit mask, but got "
            f"{what}. Use kernel='auto' or 'sdpa'."
        )
    if kernel == "tiled" and not empty:
        plan = _tile_plan(mask, shapes, device)
        return Plan("tiled", f"tiled (forced by kernel=): {plan.kept:.0%} of blocks kept", plan)
    if kernel != "auto":
        return Plan(kernel, f"{_NAMES[kernel]} (forced by kernel=)")
    if empty:
        return Plan("reference", f"reference: empty attention matrix (Lq={shapes.lq}, Lk={shapes.lk})")
    if dropout_p > 0.0:
        if not tileable:
            return Plan("reference", f"reference: dropout_p={dropout_p} with an additive float mask")
        plan = _tile_plan(mask, shapes, device)
        return Plan("tiled", f"tiled: dropout_p={dropout_p}, {plan.kept:.0%} of blocks kept", plan)
    if mask is None:
        return Plan("sdpa", "fused SDPA: no mask")
    if _sdpa_causal(mask, shapes):
        return Plan("sdpa", "fused SDPA: is_causal")
    if not tileable:
        return Plan("sdpa", "fused SDPA: additive float mask" if shapes.rank <= 4 else "fused SDPA: rank > 4")
    if shapes.lq * shapes.lk < TILED_MIN_PAIRS:
        return Plan("sdpa", f"fused SDPA with a dense mask: Lq*Lk={shapes.lq * shapes.lk} is small")
    plan = _tile_plan(mask, shapes, device)
    limit = TILED_MAX_KEPT[(half, backward)] if plan.masked else TILED_MAX_KEPT_FULL
    if plan.kept <= limit:
        return Plan("tiled", f"tiled: {plan.kept:.0%} of blocks kept", plan)
    return Plan("sdpa", f"fused SDPA with a dense mask: {plan.kept:.0%} of blocks kept")


def _as_mask_object(mask):
    """None, or the mask as an attnkit mask object of at most 4 dims."""
    if mask is None or isinstance(mask, _masks.Mask):
        return mask
    # a tensor mask aligns with (..., H, Lq, Lk) from the right
    return _masks.dense(mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape)))


def _tile_plan(mask, shapes: Shapes, device) -> tiled.TilePlan:
    return tiled.plan_for(_as_mask_object(mask), shapes.lq, shapes.lk, device)


def _sdpa_causal(mask, shapes: Shapes) -> bool:
    """Whether ``mask`` is exactly SDPA's ``is_causal=True`` (top-left aligned) here."""
    return isinstance(mask, _masks._Causal) and (mask.align == "top_left" or shapes.lq == shapes.lk)


#: Dense masks of mask objects up to this many elements are kept for reuse.
DENSE_CACHE_ELEMENTS = 2**26


def dense_mask(mask, shapes: Shapes, device) -> torch.Tensor | None:
    """A bool or float mask tensor with at most the rank of the attention matrix.

    A mask object's dense form is remembered by the object (rebuilt when the tensors
    it holds change in place), so repeated calls do not materialize it again.
    """
    if not isinstance(mask, _masks.Mask):
        return mask
    key = (shapes.lq, shapes.lk, str(device), mask._versions())
    cache = mask.__dict__.setdefault("_dense", {})
    if key in cache:
        return cache[key]
    dense = mask.materialize(shapes.lq, shapes.lk, device=device)  # (B or 1, H or 1, Lq, Lk)
    rank = len(shapes.scores)
    while dense.dim() > rank:
        dense = dense.squeeze(0)
    if dense.numel() <= DENSE_CACHE_ELEMENTS:
        cache.clear()
        cache[key] = dense
    return dense


def run(q, k, v, mask, *, scale: float, dropout_p: float, plan: Plan, shapes: Shapes):
    """Run ``plan`` on validated inputs; returns ``(..., Hq, Lq, Dv)``."""
    if plan.kernel == "reference" or shapes.lk == 0 or shapes.lq == 0:  # SDPA has no empty case
        return run_reference(q, k, v, mask, scale=scale, dropout_p=dropout_p, shapes=shapes)[0]
    if plan.kernel == "tiled":
        lead = (1,) * (4 - shapes.rank)
        q4, k4, v4 = (t.reshape(*lead, *t.shape) for t in (q, k, v))  # (B, H, L, D)
        out, _ = tiled.attention(
            q4, k4, v4, _as_mask_object(mask), scale=scale, dropout_p=dropout_p, plan=plan.tiles
        )
        return out.reshape(shapes.out)
    if _sdpa_causal(mask, shapes):
        return _sdpa(q, k, v, None, scale=scale, dropout_p=dropout_p, shapes=shapes, causal=True)
    dense = dense_mask(mask, shapes, q.device)
    k, v = reference.zero_unused_keys(k, v, dense)
    return _sdpa(q, k, v, dense, scale=scale, dropout_p=dropout_p, shapes=shapes)


def run_reference(q, k, v, mask, *, scale: float, dropout_p: float, shapes: Shapes):
    """The reference kernel on validated inputs: ``(out, weights)`` in q's dtype.

    Half-precision inputs are computed in float32.
    """
    dense = dense_mask(mask, shapes, q.device)
    k, v = reference.zero_unused_keys(k, v, dense)
    dtype = q.dtype
    if dtype in (torch.float16, torch.bfloat16):  # softmax statistics in float32
        q, k, v = q.float(), k.float(), v.float()
        if dense is not None and dense.is_floating_point():
            dense = dense.float()
    out, weights = reference.attention(q, k, v, dense, scale=scale, dropout_p=dropout_p)
    return out.to(dtype), weights.to(dtype)


def _sdpa(q, k, v, mask, *, scale, dropout_p, shapes: Shapes, causal: bool = False):
    """PyTorch's fused kernel on 4-D views of the inputs."""
    batch = shapes.batch
    flat = (math.prod(batch),)
    q4 = q.reshape(*flat, shapes.hq, shapes.lq, shapes.d)  # (B*, Hq, Lq, D)
    k4 = k.reshape(*flat, shapes.hkv, shapes.lk, shapes.d)  # (B*, Hkv, Lk, D)
    v4 = v.reshape(*flat, shapes.hkv, shapes.lk, shapes.dv)  # (B*, Hkv, Lk, Dv)
    m4 = None
    if mask is not None:
        rank = len(shapes.scores)
        m = mask.reshape((1,) * (rank - mask.dim()) + tuple(mask.shape))
        if len(batch) > 1:
            m = m.expand(*batch, *m.shape[-3:]).reshape(-1, *m.shape[-3:])
        m4 = m.reshape((1,) * (4 - m.dim()) + tuple(m.shape))  # (B* or 1, H or 1, Lq or 1, Lk)
    out = F.scaled_dot_product_attention(
        q4,
        k4,
        v4,
        attn_mask=m4,
        dropout_p=dropout_p,
        is_causal=causal,
        scale=scale,
        enable_gqa=shapes.hq != shapes.hkv,
    )
    return out.reshape(shapes.out)
