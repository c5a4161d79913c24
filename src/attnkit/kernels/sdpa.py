"""PyTorch's fused ``scaled_dot_product_attention`` as an attnkit kernel.

Mask objects reach it as ``is_causal=True`` where that is exact, as nothing where
the mask hides nothing, and otherwise as a dense bool mask. K/V rows that no query
may attend to are zeroed first, so NaN or Inf stored there cannot leak.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from attnkit._validate import Shapes
from attnkit.kernels import reference
from attnkit.kernels.registry import Call, Kernel, Reason, Runner, first_derivative_only

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


def _dense_runner(kernel: Kernel, call: Call) -> Runner:
    """Later calls of this signature with a mask object: its dense form, the keys some query uses
    and the queries that see some key are fixed by the mask's value (part of the signature), so
    they are computed here once. Unused K/V rows are zeroed on every call (NaN there must not
    leak): no zeroed copy is kept, since nothing cheaper than zeroing them proves a tensor
    unchanged (an edit through ``.data`` or ``.numpy()`` keeps its identity and version)."""
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

    def masked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if not all_used:
            zero = k.new_zeros(())
            k, v = torch.where(used, k, zero), torch.where(used, v, zero)
        if all_visible:
            return sdpa(q, k, v, dense, scale=scale, dropout_p=0.0, shapes=shapes)
        q = torch.where(visible, q, q.new_zeros(()))
        out = sdpa(q, k, v, dense, scale=scale, dropout_p=0.0, shapes=shapes)
        return torch.where(visible, out, out.new_zeros(()))  # a row that sees nothing gives 0 (0 * NaN)

    return first_derivative_only(masked, kernel) if call.backward else masked


#: Sequences of at most this many different key limits run as one SDPA call per limit (each over
#: its own keys, no mask, no copy of K/V); more run as one call with the dense mask.
MAX_LIMIT_GROUPS = 16


def per_sequence_limits(call: Call) -> tuple[int, ...] | None:
    """The call's key limits when they differ and a few SDPA calls over each sequence's own keys
    run it (see :data:`MAX_LIMIT_GROUPS`), else None."""
    limits = call.key_limits()
    if limits is None or len(set(limits)) > MAX_LIMIT_GROUPS or len(set(limits)) == 1:
        return None
    return limits


def by_limit(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, limits: tuple[int, ...], *, scale: float, dropout_p: float = 0.0
) -> torch.Tensor:
    """SDPA of 4-D inputs whose sequence b sees its first ``limits[b]`` keys: one call per limit over
    those keys (keys past a limit are never read), a sequence that sees none gives 0."""
    gqa = q.shape[1] != k.shape[1]
    out = q.new_zeros(*q.shape[:-1], v.shape[-1])
    rows: dict[int, list[int]] = {}
    for b, n in enumerate(limits):
        rows.setdefault(n, []).append(b)
    for n, batch in rows.items():
        if n == 0:
            continue
        if batch[-1] - batch[0] + 1 == len(batch):  # contiguous rows: views, no gather
            sl = slice(batch[0], batch[-1] + 1)
            part = F.scaled_dot_product_attention(
                q[sl], k[sl, :, :n], v[sl, :, :n], dropout_p=dropout_p, scale=scale, enable_gqa=gqa
            )
            out = out.slice_scatter(part, 0, batch[0], batch[-1] + 1)
        else:
            idx = torch.tensor(batch, device=q.device)
            part = F.scaled_dot_product_attention(
                q[idx], k[idx, :, :n], v[idx, :, :n], dropout_p=dropout_p, scale=scale, enable_gqa=gqa
            )
            out = out.index_copy(0, idx, part)
    return out


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
        limit = call.shared_key_limit()
        if limit is not None:
            return True, f"every sequence's keys end at {limit}: no mask over the first {limit} keys"
        if per_sequence_limits(call) is not None:
            return True, "each sequence's keys end at its own limit: one call per limit over those keys, no mask"
        if call.float_mask:
            return True, "dense mask (additive float mask)"
        if call.shapes.rank > 4:
            return True, f"dense mask (rank {call.shapes.rank})"
        if call.pairs < SMALL_PAIRS:
            return True, f"dense mask: Lq*Lk={call.pairs} is small"
        return True, "dense mask"

    def runner(self, call: Call) -> Runner | None:
        if call.bias is not None or call.dropout_p > 0.0:
            return None
        limit = call.shared_key_limit()
        causal = False
        if call.mask is None or call.hides_nothing_here():
            limit = None
        elif call.causal_shift() == 0 and call.scale > 0.0:
            causal, limit = True, None
        elif limit is None:
            if call.tensor_mask:
                return None  # a tensor's values are not part of the signature: made on every call
            limits = per_sequence_limits(call)
            if limits is not None:
                scale_ = call.scale

                def own_keys(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
                    return by_limit(q, k, v, limits, scale=scale_)

                return first_derivative_only(own_keys, self) if call.backward else own_keys
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
            return reference.zero_empty_rows(out, dense).to(call.q.dtype), None
        if call.mask is None:
            return sdpa(call.q, call.k, call.v, None, **kw), None
        if call.causal_shift() == 0 and call.scale > 0.0:  # PyTorch's is_causal path needs scale > 0
            return sdpa(call.q, call.k, call.v, None, causal=True, **kw), None
        if call.hides_nothing_here():
            return sdpa(call.q, call.k, call.v, None, **kw), None
        limit = call.shared_key_limit()
        if limit is not None:  # the keys past the limit are never read: no zeroing, no mask
            return sdpa(call.q, call.k[..., :limit, :], call.v[..., :limit, :], None, **kw), None
        limits = per_sequence_limits(call)
        if limits is not None:  # the same, one call per limit
            return by_limit(call.q, call.k, call.v, limits, scale=call.scale, dropout_p=call.dropout_p), None
        dense = reference.dense_mask(call)
        k, v = reference.zero_unused_keys(call.k, call.v, dense, sync=not call.compiling)
        q = reference.zero_hidden_queries(call.q, dense)
        return reference.zero_empty_rows(sdpa(q, k, v, dense, **kw), dense), None
