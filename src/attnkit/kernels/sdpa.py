"""PyTorch's fused ``scaled_dot_product_attention`` as an attnkit kernel.

By the call's form (:class:`~attnkit.call.Form`): no mask, or one that hides nothing here, runs
unmasked; a causal mask as ``is_causal=True`` where that is exact; key limits (padding) as calls
over each sequence's own keys, never reading past them; any other mask as a dense bool mask,
with the K/V rows no query may attend zeroed first, so NaN or Inf stored there cannot leak.
Where each row sees exactly one key (a key limit of 1), the output is that key's value, and the
gradients of q and k are exactly 0, as the formula's.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from attnkit.call import Shapes
from attnkit.kernels import dense as _dense
from attnkit.kernels.contract import Call, Form, Kernel, LimitRunner, Reason, Runner, first_derivative_only
from attnkit.kernels.sparsity import limit_groups
from attnkit.plan import DEFAULT_BLOCK_SIZE

__all__ = ["SMALL_PAIRS", "SDPAKernel", "by_limit", "sdpa"]

#: Problems with fewer (query, key) pairs are cheap as one dense masked call (for explain's words).
SMALL_PAIRS = 256 * 256


#: Calls of at most this many queries over grouped K/V heads that see every key run as one query
#: head per K/V head (see :func:`_over_every_key`).
FOLD_ROWS = 8


def _over_every_key(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, dropout_p: float) -> torch.Tensor:
    """SDPA of 4-D inputs where every query sees every key. Over grouped K/V heads with at most
    FOLD_ROWS queries (a decoding step) and no dropout, a group's query heads go to SDPA as the rows
    of one head, ``(B, Hkv, group x Lq, D)``: each K/V row is read once for the group, where
    ``enable_gqa`` reads it once per query head (one query, 8 query heads over 2 K/V heads, 4
    sequences, Intel Xeon: 0.69-0.92x its time in bfloat16, 0.39-0.66x in float32). Each row's
    scores, weights and output are the same formula over the same keys."""
    b, hq, lq, d = q.shape
    hkv = k.shape[1]
    gqa = _grouped(hq, hkv)
    if not gqa or lq > FOLD_ROWS or dropout_p > 0.0:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, scale=scale, enable_gqa=gqa)
    folded = F.scaled_dot_product_attention(q.reshape(b, hkv, (hq // hkv) * lq, d), k, v, scale=scale)
    return folded.reshape(b, hq, lq, v.shape[-1])


def _every_key(call: Call) -> Runner:
    """The runner of a rank-4 call that sees every key as it comes (no mask, or none that hides
    anything): over one key the exact path, else SDPA over them all. It reads Lk from its inputs, so
    the fast path keeps it for any key length."""
    scale = call.scale

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if k.shape[-2] == 1:
            return _own_keys(q, k, v, 1, scale, 0.0)
        return _over_every_key(q, k, v, scale, 0.0)

    return run


def _grouped(hq, hkv) -> bool:
    """Whether K/V heads are shared (GQA), as a Python bool: with dynamic shapes under torch.compile
    the comparison is symbolic, and SDPA's ``enable_gqa`` takes a bool (the branch guards on it)."""
    return True if hq != hkv else False  # noqa: SIM210


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
    gqa = _grouped(shapes.hq, shapes.hkv)
    if shapes.rank == 4 and (mask is None or mask.dim() <= 4):
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=causal, scale=scale, enable_gqa=gqa
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
        q4, k4, v4, attn_mask=m4, dropout_p=dropout_p, is_causal=causal, scale=scale, enable_gqa=gqa
    )
    return out.reshape(shapes.out)


def _own_keys(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n: int, scale: float, dropout_p: float):
    """SDPA of 4-D inputs over their first ``n`` keys: ``n >= 1``. With one key every row's weight is
    exactly 1: the output is that key's value (gradients of q and k exactly 0)."""
    if n == 1 and dropout_p == 0.0:
        b, hq, lq, d = q.shape
        hkv = k.shape[1]
        qf = q.reshape(b, hkv, (hq // hkv) * lq, d)  # (B, Hkv, g*Lq, D): a group's query heads as rows
        s = (qf @ k[:, :, :1].transpose(-2, -1)) * scale  # (B, Hkv, g*Lq, D) x (B, Hkv, D, 1)
        w = torch.exp(s - s)  # the weight exp(s - lse) with lse = s: 1, or NaN as the formula's
        # (B, Hkv, g*Lq, 1) * (B, Hkv, 1, Dv): the output is that key's value; its gradient, the sum of
        # dO over every row that sees it, is summed in a wider dtype (one rounding, as the formula's)
        wide = torch.float64 if v.dtype in (torch.float32, torch.float64) else torch.float32
        out = (w.to(wide) * v[:, :, :1].to(wide)).to(v.dtype)
        return out.reshape(b, hq, lq, v.shape[-1])
    return _over_every_key(q, k[:, :, :n], v[:, :, :n], scale, dropout_p)


def by_limit(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, limits: tuple[int, ...], *, scale: float, dropout_p: float = 0.0
) -> torch.Tensor:
    """SDPA of 4-D inputs whose sequence b sees its first ``limits[b]`` keys: one call per limit over
    those keys (keys past a limit are never read), a sequence that sees none gives 0."""
    # zeros in the graph of q, k and v (sums of empty slices: 0 whatever they hold), so a call whose
    # every sequence sees no key still has gradients (zero ones)
    nothing = q.narrow(-1, 0, 0).sum() + k.narrow(-2, 0, 0).sum() + v.narrow(-2, 0, 0).sum()
    out = q.new_zeros(*q.shape[:-1], v.shape[-1]) + nothing
    rows: dict[int, list[int]] = {}
    for b, n in enumerate(limits):
        rows.setdefault(n, []).append(b)
    for n, batch in rows.items():
        if n == 0:
            continue
        if batch[-1] - batch[0] + 1 == len(batch):  # contiguous rows: views, no gather
            sl = slice(batch[0], batch[-1] + 1)
            part = _own_keys(q[sl], k[sl], v[sl], n, scale, dropout_p)
            out = out.slice_scatter(part, 0, batch[0], batch[-1] + 1)
        else:
            idx = torch.tensor(batch, device=q.device)
            part = _own_keys(q[idx], k[idx], v[idx], n, scale, dropout_p)
            out = out.index_copy(0, idx, part)
    return out


def _plain(call: Call) -> str | None:
    """How the call runs without a mask tensor: "plain" (no mask), "all" (a mask that hides nothing
    here), "causal", "limit", "limits"; None: with its dense mask."""
    form = call.form
    if form in (Form.NONE, Form.ALL) and call.shapes.lk == 1 and call.shapes.rank == 4:
        return "limit"  # one key, which every row sees: its weight is exactly 1
    if form is Form.NONE:
        return "plain"
    if form is Form.ALL:
        return "all"
    if form is Form.CAUSAL and call.scale > 0.0:  # PyTorch's is_causal path needs scale > 0
        return "causal"
    if form is Form.LIMIT and call.shapes.rank == 4:
        return "limit"
    if limit_groups(call) is not None:
        return "limits"
    if _hides_nothing(call):
        return "all"
    return None


def _hides_nothing(call: Call) -> bool:
    """Whether a large bool mask (a tensor, or an object of blocks) hides nothing here, by its plan
    (prepared once; the same answer whichever kernel prepared it): SDPA then runs without it. On
    the CPU only, where reading the plan costs no device sync."""
    if call.form not in (Form.DENSE, Form.BLOCKS) or call.float_mask or call.compiling:
        return False
    if call.q.device.type != "cpu" or call.shapes.rank > 4 or call.pairs < SMALL_PAIRS:
        return False
    return call.prepared_at(DEFAULT_BLOCK_SIZE).hides_nothing


def _dense_runner(kernel: Kernel, call: Call) -> Runner:
    """Later calls of this signature with a mask object: its dense form, the keys some query uses
    and the queries that see some key are fixed by the mask's value (part of the signature), so
    they are computed here once. Unused K/V rows are zeroed on every call (NaN there must not
    leak): no zeroed copy is kept, since nothing cheaper than zeroing them proves a tensor
    unchanged (an edit through ``.data`` or ``.numpy()`` keeps its identity and version)."""
    dense = _dense.dense_mask(call)
    allowed = _dense.allowed_pairs(dense)
    assert allowed is not None, "a masked call"
    scale, shapes = call.scale, call.shapes
    if bool(allowed.all()):  # hides nothing here (a decoding step over a cache it fills)

        def plain(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return sdpa(q, k, v, None, scale=scale, dropout_p=0.0, shapes=shapes)

        return first_derivative_only(plain, kernel) if call.backward else plain
    used = _dense.used_keys(allowed, shapes.hkv if shapes.rank >= 3 else None)
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
        how = _plain(call)
        if how == "all":
            return True, "the mask hides nothing here"
        if how == "plain":
            return True, "no mask: PyTorch's flash/cuDNN kernels" if cuda else "no mask"
        if how == "causal":
            return True, "is_causal: PyTorch's flash/cuDNN kernels" if cuda else "is_causal"
        if how == "limit":
            limit = call.shared_key_limit() or 1
            return True, f"every sequence's keys end at {limit}: no mask over the first {limit} keys"
        if how == "limits":
            return True, "each sequence's keys end at its own limit: one call per limit over those keys, no mask"
        if call.float_mask:
            return True, "dense mask (additive float mask)"
        if call.shapes.rank > 4:
            return True, f"dense mask (rank {call.shapes.rank})"
        if call.pairs < SMALL_PAIRS:
            return True, f"dense mask: Lq*Lk={call.pairs} is small"
        return True, "dense mask"

    def any_length_runner(self, call: Call) -> Runner | None:
        # an unmasked rank-4 call's runner reads every key as it comes: any Lk
        if call.mask is not None or call.shapes.rank != 4 or call.bias is not None or call.dropout_p > 0.0:
            return None
        run = _every_key(call)
        return first_derivative_only(run, self) if call.backward else run

    def limit_runner(self, call: Call) -> LimitRunner | None:
        # a rank-4 call whose mask cuts each sequence's keys at a limit, with no gradient: SDPA over
        # each sequence's first keys whatever the limits (the registry's choice for any of them:
        # attnkit.kernels.fastpath); one call when they are equal (a StaticCache's step)
        if call.backward or call.shapes.rank != 4 or _plain(call) not in ("limit", "limits"):
            return None
        scale = call.scale

        def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, limits: tuple) -> torch.Tensor:
            first = limits[0]
            if first > 0 and limits.count(first) == len(limits):
                return _own_keys(q, k, v, first, scale, 0.0)
            return by_limit(q, k, v, limits, scale=scale)

        return run

    def runner(self, call: Call) -> Runner | None:
        if call.bias is not None or call.dropout_p > 0.0:
            return None
        how = _plain(call)
        scale, shapes = call.scale, call.shapes
        if how is None:
            if call.tensor_mask:
                return None  # a tensor's values are not part of the signature: made on every call
            return _dense_runner(self, call)
        gqa = _grouped(shapes.hq, shapes.hkv)
        run: Runner
        if how == "limits":
            limits = call.limits
            assert limits is not None

            def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
                return by_limit(q, k, v, limits, scale=scale)
        elif shapes.rank == 4 and (how in ("plain", "all") or (how == "limit" and call.shared_key_limit() is None)):
            run = _every_key(call)  # no mask (or none that hides anything): every key as it comes
        elif how == "limit":
            limit = call.shared_key_limit()
            assert limit is not None

            def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
                return _own_keys(q, k, v, limit, scale, 0.0)
        elif shapes.rank == 4:  # causal

            def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
                return F.scaled_dot_product_attention(q, k, v, scale=scale, is_causal=True, enable_gqa=gqa)
        else:
            causal = how == "causal"

            def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
                return sdpa(q, k, v, None, scale=scale, dropout_p=0.0, shapes=shapes, causal=causal)

        return first_derivative_only(run, self) if call.backward else run

    def run(self, call: Call) -> tuple[torch.Tensor, torch.Tensor | None]:
        kw: dict[str, Any] = dict(scale=call.scale, dropout_p=call.dropout_p, shapes=call.shapes)
        if call.bias is not None:
            dense = _dense.dense_mask(call)
            k, v = _dense.zero_unused_keys(call.k, call.v, dense, sync=not call.compiling)
            q = _dense.zero_hidden_queries(call.q, dense)
            # A bias grows with distance (ALiBi: -slope * 256 at L=257): in bfloat16 it would lose
            # whole units, so a biased call runs in float32 and only the output is cast back.
            work = torch.float32 if call.half else call.q.dtype
            found = _dense.dense_bias(call)
            assert found is not None
            bias = found.to(work)  # (B or 1, Hq or 1, Lq, Lk)
            if dense is not None:
                bias = bias.masked_fill(~dense, float("-inf")) if dense.dtype == torch.bool else bias + dense.to(work)
            out = sdpa(q.to(work), k.to(work), v.to(work), bias, **kw)
            return _dense.zero_empty_rows(out, dense).to(call.q.dtype), None
        how = _plain(call)
        if how in ("plain", "all"):
            if call.shapes.rank == 4:
                return _over_every_key(call.q, call.k, call.v, call.scale, call.dropout_p), None
            return sdpa(call.q, call.k, call.v, None, **kw), None
        if how == "causal":
            return sdpa(call.q, call.k, call.v, None, causal=True, **kw), None
        if how == "limit":  # the keys past the limit are never read: no zeroing, no mask
            limit = call.shared_key_limit() or 1  # (None: one key, no mask)
            return _own_keys(call.q, call.k, call.v, limit, call.scale, call.dropout_p), None
        if how == "limits":  # the same, one call per limit
            assert call.limits is not None
            return by_limit(call.q, call.k, call.v, call.limits, scale=call.scale, dropout_p=call.dropout_p), None
        dense = _dense.dense_mask(call)
        k, v = _dense.zero_unused_keys(call.k, call.v, dense, sync=not call.compiling)
        q = _dense.zero_hidden_queries(call.q, dense)
        return _dense.zero_empty_rows(sdpa(q, k, v, dense, **kw), dense), None
