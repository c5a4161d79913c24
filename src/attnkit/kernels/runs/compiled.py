"""The walk of the PyTorch engines under ``torch.compile``: two custom ops, the plan as tensors.

Compiled code cannot walk the host-side plan, so the walk runs as two custom ops
(``attnkit::tiled_forward``, ``attnkit::tiled_backward``) whose eager implementations do. They take
the plan's tensors (block codes, key limit, the partial blocks' bits) and its sizes as arguments,
so a new PreparedMask of the same shapes runs the same compiled graph, and rebuild the PreparedMask
from them (a plan of ceil(Lq/bq) x ceil(Lk/bk) codes: microseconds). Their fake implementations
give the output shapes.
"""

from __future__ import annotations

import torch

from attnkit.kernels.contract import Call
from attnkit.kernels.runs import aten, tiles, walk
from attnkit.plan import PreparedMask, rebuilt

__all__ = ["compiled_backward", "compiled_forward", "plan_arguments", "run"]

_NONE = -(2**62)  # a band side without bound, as an int


def plan_arguments(prepared: PreparedMask) -> tuple:
    """``(codes, kv_limit, bits, tile_ids, sizes, band)``: a PreparedMask as the custom ops take it."""
    lo, hi = prepared.band if prepared.band is not None else (_NONE, _NONE)
    band = [int(prepared.band is not None), _NONE if lo is None else lo, _NONE if hi is None else hi]
    band.append(int(prepared.limit_only))
    sizes = [prepared.q_len, prepared.kv_len, *prepared.block_size]
    bits, tile_ids = prepared.packed_partial_bits()
    return prepared.codes, prepared.kv_limit, bits, tile_ids, sizes, band


def _rebuilt(codes, kv_limit, bits, tile_ids, sizes, band) -> PreparedMask:
    lq, lk, bq, bk = sizes
    found = None
    if band[0]:
        found = (None if band[1] == _NONE else band[1], None if band[2] == _NONE else band[2])
    return rebuilt(lq, lk, (bq, bk), codes, kv_limit, bits, tile_ids, found, bool(band[3]))


@torch.library.custom_op("attnkit::tiled_forward", mutates_args=())
def compiled_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    codes: torch.Tensor,
    kv_limit: torch.Tensor | None,
    bits: torch.Tensor,
    tile_ids: torch.Tensor,
    sizes: list[int],
    band: list[int],
    engine: str,
    scale: float,
    softcap: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of the fused or math walk for compiled code (``softcap`` 0: none)."""
    q, k, v = (aten.rows_contiguous(t) for t in (q, k, v))
    prepared = _rebuilt(codes, kv_limit, bits, tile_ids, sizes, band)
    call = tiles.TileCall(prepared, scale, 0.0, 0, engine, None, softcap if softcap > 0.0 else None)
    with torch.no_grad():
        out, lse = walk.forward(call, q, k, v)
    return out.contiguous(), lse.contiguous()


@compiled_forward.register_fake
def _(q, k, v, codes, kv_limit, bits, tile_ids, sizes, band, engine, scale, softcap):
    b, hq, lq, _ = q.shape
    return q.new_empty(b, hq, lq, v.shape[-1]), q.new_empty(b, hq, lq, dtype=tiles.compute_dtype(q.dtype))


@torch.library.custom_op("attnkit::tiled_backward", mutates_args=())
def compiled_backward(
    grad_out: torch.Tensor,
    grad_lse: torch.Tensor | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    codes: torch.Tensor,
    kv_limit: torch.Tensor | None,
    bits: torch.Tensor,
    tile_ids: torch.Tensor,
    sizes: list[int],
    band: list[int],
    engine: str,
    scale: float,
    softcap: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of :func:`compiled_forward`, recomputed from its saved lse."""
    q, k, v = (aten.rows_contiguous(t) for t in (q, k, v))
    if grad_lse is not None and not bool(grad_lse.any()):  # compiled autograd hands an unused lse zeros:
        grad_lse = None  # without a gradient the fused engine runs its own backward (2x faster)
    prepared = _rebuilt(codes, kv_limit, bits, tile_ids, sizes, band)
    call = tiles.TileCall(prepared, scale, 0.0, 0, engine, None, softcap if softcap > 0.0 else None)
    dq, dk, dv = walk.backward(call, q, k, v, out, lse, grad_out, grad_lse, {})
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


@compiled_backward.register_fake
def _(grad_out, grad_lse, q, k, v, out, lse, codes, kv_limit, bits, tile_ids, sizes, band, engine, scale, softcap):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_compiled(ctx, inputs, output):
    q, k, v, codes, kv_limit, bits, tile_ids, sizes, band, engine, scale, softcap = inputs
    ctx.save_for_backward(q, k, v, *output, codes, kv_limit, bits, tile_ids)
    ctx.scalars = (sizes, band, engine, scale, softcap)


def _compiled_grad(ctx, grad_out, grad_lse):
    q, k, v, out, lse, codes, kv_limit, bits, tile_ids = ctx.saved_tensors
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    plan = (codes, kv_limit, bits, tile_ids)
    dq, dk, dv = compiled_backward(grad_out, grad_lse, q, k, v, out, lse, *plan, *ctx.scalars)
    return dq, dk, dv, *([None] * 9)


torch.library.register_autograd("attnkit::tiled_forward", _compiled_grad, setup_context=_setup_compiled)


def run(call: Call, engine: str, block_size: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A compiled call (its mask a PreparedMask) through :func:`compiled_forward`."""
    s = call.shapes
    q4, k4, v4 = call.as4d()
    assert isinstance(call.mask, PreparedMask), "compiled calls carry a PreparedMask"
    prepared = call.mask if call.mask.block_size == block_size else call.prepared_at(block_size)
    out, lse = compiled_forward(q4, k4, v4, *plan_arguments(prepared), engine, call.scale, call.softcap or 0.0)
    return out.reshape(s.out), lse.reshape(s.scores[:-1]) if call.return_lse else None
