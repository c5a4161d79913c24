"""PyTorch's fused ``scaled_dot_product_attention`` as an attnkit kernel.

Mask objects reach it as ``is_causal=True`` where that is exact, as nothing where
the mask hides nothing, and otherwise as a dense bool mask. K/V rows that no query
may attend to are zeroed first, so NaN or Inf stored there cannot leak.
"""

from __future__ import annotations

import math
import weakref
from typing import Any

import torch
import torch.nn.functional as F

from attnkit._validate import Shapes
from attnkit.kernels import reference
from attnkit.kernels.registry import Call, Kernel, Reason, Runner, first_derivative_only
from attnkit.prepare import DEFAULT_BLOCK_SIZE

#: Problems with fewer (query, key) pairs are cheap as one dense masked call (for explain's words).
SMALL_PAIRS = 256 * 256


def sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    *,
    scale: float,
    dropout_p: float,
    shapes: Shapes,
    causal: bool = False,
) -> torch.Tensor:
    """PyTorch's fused kernel on 4-D views of ``(..., H, L, D)`` inputs."""
    if shapes.rank == 4 and (mask is None or mask.dim() <= 4):
        return F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            dropout_p=dropout_p,
            is_causal=causal,
            scale=scale,
            enable_gqa=shapes.hq != shapes.hkv,
        )
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


def shared_key_limit(call: Call) -> int | None:
    """``n`` when the call's mask hides exactly the keys from ``n`` on, the same ``n > 0`` for
    every sequence (a padding mask of one length: a decoding step over a cache with room left),
    as prepared by a kernel asked before this one; 4-D inputs. Then SDPA over the first ``n``
    keys, with no mask, is the exact answer."""
    prepared = call._by_block.get(DEFAULT_BLOCK_SIZE)
    if prepared is None or not prepared.limit_only or not prepared.kv_limit_value or call.shapes.rank != 4:
        return None
    return prepared.kv_limit_value


#: Zeroed K/V copies a dense-mask runner keeps for the K/V pairs it saw last (cross-attention over
#: a fixed memory reads the same tensors at every decoding step, one pair per layer): this many
#: pairs, of at most REUSED_ZEROED_ELEMENTS elements in all.
REUSED_PAIRS = 8
REUSED_ZEROED_ELEMENTS = 1 << 24


def _dense_runner(kernel: Kernel, call: Call) -> Runner:
    """Later calls of this signature with a mask object: its dense form, the keys some query uses
    and the queries that see some key are fixed by the mask's value (part of the signature), so
    they are computed here once. Unused K/V rows are zeroed on every call (NaN there must not
    leak), except that the zeroed copies of the K/V seen last are reused while the same tensors
    come back unmodified (identity and version counter) and no gradient is wanted."""
    dense = reference.dense_mask(call)
    allowed = reference.allowed_pairs(dense)
    assert allowed is not None, "a masked call"
    scale, shapes = call.scale, call.shapes
    if bool(allowed.all()):  # hides nothing here (a decoding step over a cache it fills)

        def plain(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return sdpa(q, k, v, None, scale=scale, dropout_p=0.0, shapes=shapes)

        return first_derivative_only(plain, kernel) if call.backward else plain
    used = reference.used_keys(allowed, shapes.hkv if shapes.rank >= 3 else None)
    visible = allowed.any(dim=-1, keepdim=True)  # (..., Lq or 1, 1)
    all_used, all_visible = bool(used.all()), bool(visible.all())
    # the K/V seen last (each layer of a decoder has its own): (k, its version, v, its version,
    # zeroed k, zeroed v), k and v held weakly
    recent: list[tuple] = []

    def zeroed(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # inference tensors keep no version counter, and a gradient wants a graph of its own
        tracked = not (k.is_inference() or v.is_inference() or k.requires_grad or v.requires_grad)
        if tracked:
            for rk, version_k, rv, version_v, zk, zv in recent:
                if rk() is k and rv() is v and k._version == version_k and v._version == version_v:
                    return zk, zv
        zero = k.new_zeros(())
        zk, zv = torch.where(used, k, zero), torch.where(used, v, zero)
        if tracked and k.numel() + v.numel() <= REUSED_ZEROED_ELEMENTS // REUSED_PAIRS:
            recent.insert(0, (weakref.ref(k), k._version, weakref.ref(v), v._version, zk, zv))
            del recent[REUSED_PAIRS:]
        return zk, zv

    def masked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if not all_used:
            k, v = zeroed(k, v)
        if not all_visible:
            q = torch.where(visible, q, q.new_zeros(()))
        return sdpa(q, k, v, dense, scale=scale, dropout_p=0.0, shapes=shapes)

    return first_derivative_only(masked, kernel) if call.backward else masked


class SDPAKernel(Kernel):
    """``torch.nn.functional.scaled_dot_product_attention``: any device; no lse."""

    name = "sdpa"
    supports_dropout = True
    supports_float_mask = True
    supports_score_mods = ("bias",)  # as a dense float mask

    def prefers(self, call: Call) -> tuple[bool, Reason]:
        cuda = call.q.device.type == "cuda"
        if call.compiling:
            return True, "under torch.compile (mask objects become dense masks in the graph)"
        if call.dropout_p > 0.0:  # attnkit's own seeded dropout (tiled, reference) reproduces by seed
            return False, f"dropout_p={call.dropout_p}: attnkit's seeded dropout runs on the tiled or reference kernel"
        if call.bias is not None:
            return True, "the bias as a dense float mask"
        if call.mask is None:
            return True, "no mask: PyTorch's flash/cuDNN kernels" if cuda else "no mask"
        if call.causal_shift() == 0 and call.scale > 0.0:
            return True, "is_causal: PyTorch's flash/cuDNN kernels" if cuda else "is_causal"
        if call.hides_nothing_here():
            return True, "the mask hides nothing here"
        limit = shared_key_limit(call)
        if limit is not None:
            return True, f"every sequence's keys end at {limit}: no mask over the first {limit} keys"
        if call.float_mask:
            return True, "dense mask (additive float mask)"
        if call.shapes.rank > 4:
            return True, f"dense mask (rank {call.shapes.rank})"
        prepared = call._by_block.get(DEFAULT_BLOCK_SIZE)  # looked at by a kernel before this one
        if prepared is not None and prepared.hides_nothing:
            return True, "the mask hides nothing here"
        if call.pairs < SMALL_PAIRS:
            return True, f"dense mask: Lq*Lk={call.pairs} is small"
        if prepared is not None:
            return True, f"dense mask: {prepared.kept:.0%} of blocks kept"
        return True, "dense mask"

    def runner(self, call: Call) -> Runner | None:
        if call.bias is not None or call.dropout_p > 0.0:
            return None
        prepared = call._by_block.get(DEFAULT_BLOCK_SIZE)
        limit = shared_key_limit(call)
        causal = False
        if call.mask is None or call.hides_nothing_here() or (prepared is not None and prepared.hides_nothing):
            limit = None
        elif call.causal_shift() == 0 and call.scale > 0.0:
            causal, limit = True, None
        elif limit is None:
            if call.tensor_mask:
                return None  # a tensor's values are not part of the signature: made on every call
            return _dense_runner(self, call)
        scale, shapes, gqa = call.scale, call.shapes, call.shapes.hq != call.shapes.hkv
        if limit is not None:

            def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
                return F.scaled_dot_product_attention(
                    q, k[..., :limit, :], v[..., :limit, :], scale=scale, enable_gqa=gqa
                )
        elif shapes.rank == 4:

            def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
                return F.scaled_dot_product_attention(q, k, v, scale=scale, is_causal=causal, enable_gqa=gqa)
        else:

            def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
                return sdpa(q, k, v, None, scale=scale, dropout_p=0.0, shapes=shapes, causal=causal)

        return first_derivative_only(run, self) if call.backward else run

    def run(self, call: Call) -> tuple[torch.Tensor, torch.Tensor | None]:
        kw: dict[str, Any] = dict(scale=call.scale, dropout_p=call.dropout_p, shapes=call.shapes)
        if call.bias is not None:
            dense = reference.dense_mask(call)
            k, v = reference.zero_unused_keys(call.k, call.v, dense, sync=not call.compiling)
            q = reference.zero_hidden_queries(call.q, dense)
            # A bias grows with distance (ALiBi: -slope * 256 at L=257): in bfloat16 it would lose
            # whole units, so a biased call runs in float32 and only the output is cast back.
            work = torch.float32 if call.half else call.q.dtype
            found = reference.dense_bias(call)
            assert found is not None
            bias = found.to(work)  # (B or 1, Hq or 1, Lq, Lk)
            if dense is not None:
                bias = bias.masked_fill(~dense, float("-inf")) if dense.dtype == torch.bool else bias + dense.to(work)
            out = sdpa(q.to(work), k.to(work), v.to(work), bias, **kw)
            return out.to(call.q.dtype), None
        if call.mask is None:
            return sdpa(call.q, call.k, call.v, None, **kw), None
        if call.causal_shift() == 0 and call.scale > 0.0:  # PyTorch's is_causal path needs scale > 0
            return sdpa(call.q, call.k, call.v, None, causal=True, **kw), None
        prepared = call._by_block.get(DEFAULT_BLOCK_SIZE)
        if call.hides_nothing_here() or (prepared is not None and prepared.hides_nothing):
            return sdpa(call.q, call.k, call.v, None, **kw), None
        limit = shared_key_limit(call)
        if limit is not None:  # the keys past the limit are never read: no zeroing, no mask
            return sdpa(call.q, call.k[..., :limit, :], call.v[..., :limit, :], None, **kw), None
        dense = reference.dense_mask(call)
        k, v = reference.zero_unused_keys(call.k, call.v, dense, sync=not call.compiling)
        q = reference.zero_hidden_queries(call.q, dense)
        return sdpa(q, k, v, dense, **kw), None
