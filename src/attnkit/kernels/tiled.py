"""Block-sparse attention in plain PyTorch: visit only the blocks a mask keeps.

The kernel walks a :class:`~attnkit.prepare.PreparedMask`: for each group of batch
rows (and heads) that share a block map, for each row block of queries, the *runs*
of adjacent key blocks that are all FULL (no element mask needed) or all PARTIAL
(the mask is evaluated on that tile only). Each run is one exact attention call that
returns its output and row log-sum-exp; runs merge exactly by log-sum-exp. Keys past
a sequence's limit (padding, empty cache slots) are never read. Nothing of size
``Lq x Lk`` is allocated: the largest tile is ``bq x Lk``.

Two engines compute a run:

- ``fused``: PyTorch's CPU flash-attention kernel (:mod:`attnkit.kernels._aten`),
  used when there is no dropout, the inputs are on the CPU and Dv == D;
- ``math``: matmul, softmax statistics in float32 or float64, matmul; used for
  dropout (a keep-mask drawn per run from a generator seeded once per call from the
  global generator, so ``torch.manual_seed`` reproduces it), off the CPU, for
  Dv != D, and for gradients that flow through the log-sum-exp.

Backward recomputes each run from the saved log-sum-exp (FlashAttention's scheme),
so training memory stays O(L). Grouped-query attention folds the Hq/Hkv query heads
of a group into the row axis instead of copying K/V per query head.

Equivalent pytorch code: ``reference.attention(q, k, v, prepared.materialize(), scale=scale)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attnkit._validate import AttnkitValueError
from attnkit.kernels import _aten
from attnkit.kernels.reference import used_keys
from attnkit.kernels.registry import Call, Kernel, double_backward_error
from attnkit import masks as _masks
from attnkit.masks import _as4d
from attnkit.prepare import Group, PreparedMask, RowBlock, Run

_NEG_INF = float("-inf")


def fused_available(q: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the fused CPU engine can run these inputs (it needs Dv == D)."""
    return q.device.type == "cpu" and q.shape[-1] == v.shape[-1] and _aten.AVAILABLE


# --- folding grouped query heads into rows ----------------------------------------------


def _fold(t: torch.Tensor, hkv: int) -> torch.Tensor:
    """``(B, Hq, n, X) -> (B, Hkv, group * n, X)``; query head h belongs to K/V head h // group."""
    b, hq, n, x = t.shape
    return t.reshape(b, hkv, (hq // hkv) * n, x)


def _unfold(t: torch.Tensor, hq: int) -> torch.Tensor:
    """Inverse of :func:`_fold` for ``(B, Hkv, group * n, ...)`` tensors."""
    b, hkv, rows = t.shape[:3]
    return t.reshape(b, hq, rows * hkv // hq, *t.shape[3:])


def _fold_tile(tile: torch.Tensor, hq: int, hkv: int) -> torch.Tensor:
    """A mask tile ``(Bm, 1 or Hq, n, S)`` laid out like folded queries."""
    group = hq // hkv
    if group == 1:
        return tile
    if tile.shape[1] == 1:
        return tile.repeat(1, 1, group, 1)  # (Bm, 1, group * n, S)
    return _fold(tile, hkv)


# --- selecting the rows and heads of a group ---------------------------------------------


def _index(idx, device):
    """``(start, length)`` for a contiguous run of indices, else an index tensor."""
    if idx[-1] - idx[0] + 1 == len(idx):
        return (idx[0], len(idx))
    return torch.tensor(idx, device=device)


def _take(t: torch.Tensor, dim: int, idx) -> torch.Tensor:
    if idx is None:
        return t
    if isinstance(idx, tuple):
        return t.narrow(dim, idx[0], idx[1])
    return t.index_select(dim, idx)


def _put(dst: torch.Tensor, dim: int, idx, src: torch.Tensor, add: bool = False) -> None:
    if idx is None:
        dst.add_(src) if add else dst.copy_(src)
    elif isinstance(idx, tuple):
        part = dst.narrow(dim, idx[0], idx[1])
        part.add_(src) if add else part.copy_(src)
    else:
        dst.index_add_(dim, idx, src) if add else dst.index_copy_(dim, idx, src)


@dataclass
class _Select:
    """Which rows of the inputs (and of mask tiles) and which heads a group covers."""

    batch: object  # None, (start, length) or an index tensor, on the inputs' batch axis
    tile_batch: object  # the same on the mask's batch axis (None when the mask has 1 row)
    q_heads: object  # None or (start, length) / index tensor of query heads
    kv_heads: object  # the K/V heads they read
    tile_heads: object
    b_idx: torch.Tensor | None = None  # (Bs, 1, 1, 1) batch rows and (1, Hs, 1, 1) query heads,
    h_idx: torch.Tensor | None = None  # the bias's index tensors (only when there is a bias)


def _select(group: Group, prepared: PreparedMask, b: int, hq: int, hkv: int, device, bias=None) -> _Select:
    batch = None if group.batch is None else _index(group.batch, device)
    tile_batch = batch if prepared.codes.shape[0] > 1 else None
    b_idx = h_idx = None
    if bias is not None:
        rows = range(b) if group.batch is None else group.batch
        heads = range(hq) if group.heads is None else group.heads
        b_idx = torch.tensor(list(rows), device=device).view(-1, 1, 1, 1)
        h_idx = torch.tensor(list(heads), device=device).view(1, -1, 1, 1)
    if group.heads is None:
        return _Select(batch, tile_batch, None, None, None, b_idx, h_idx)
    q_heads = _index(group.heads, device)
    kv = [h // (hq // hkv) for h in group.heads]
    kv_heads = q_heads if hq == hkv else torch.tensor(kv, device=device)
    return _Select(batch, tile_batch, q_heads, kv_heads, q_heads, b_idx, h_idx)


# --- one call --------------------------------------------------------------------------


@dataclass
class _Call:
    """Everything a forward or backward pass needs besides the tensors."""

    prepared: PreparedMask
    scale: float
    dropout_p: float
    seed: int
    fused: bool  # the fused engine runs the forward (and the backward unless bias_grad)
    bias: object = None  # an attnkit.bias.Bias, evaluated per tile
    softcap: float | None = None
    params: tuple = ()  # the bias's tensors, inputs of the autograd function
    own_lse: bool = True  # the lse is this call's own (False: the merged lse of several key sets)

    @property
    def bias_grad(self) -> bool:
        return any(t.requires_grad for t in self.params)


@dataclass(frozen=True)
class _Tile:
    """A partial run's mask, laid out like the folded queries ``(Bm, Hkv or 1, g*n, S)``."""

    allowed: torch.Tensor  # bool, True = may attend
    additive: torch.Tensor  # 0 / -inf in the inputs' dtype, for the fused engine
    keep: torch.Tensor  # 1 / 0 in the math engine's dtype: zeroes hidden weights after exp
    hidden_rows: torch.Tensor | None  # (Bm, Hkv or 1, g*n): rows with no key here; None if none
    used_keys: torch.Tensor | None  # (Bm, Hkv or 1, S, 1): keys some row uses; None if all


def _tile(call: _Call, gi: int, sel: _Select, row: RowBlock, run: Run, hq: int, hkv: int, dtype, device):
    """The evaluated mask of a partial run (None for a full one), from the prepared mask's cache."""
    if run.full:
        return None
    key = (gi, row.q0, row.q1, run.k0, run.k1, hq, hkv, dtype, str(device))
    cached = call.prepared.tiles.get(key)
    if cached is not None:
        return cached
    p = call.prepared
    q_idx = torch.arange(row.q0, row.q1, device=device)[:, None]
    kv_idx = torch.arange(run.k0, run.k1, device=device)[None, :]
    tile = _as4d(p.mask._elements(q_idx, kv_idx, p.q_len, p.kv_len))
    tile = _take(_take(tile, 0, sel.tile_batch), 1, sel.tile_heads if tile.shape[1] > 1 else None)
    tile = tile.expand(*tile.shape[:2], row.q1 - row.q0, run.k1 - run.k0)  # (Bm, Hm, n, S)
    used = used_keys(tile, hkv)
    allowed = _fold_tile(tile, hq, hkv)  # (Bm, Hkv or 1, g*n, S)
    visible = allowed.any(dim=-1)
    zero, ninf = torch.zeros((), dtype=dtype, device=device), torch.full((), _NEG_INF, dtype=dtype, device=device)
    additive = torch.where(allowed, zero, ninf)
    keep = allowed.to(_compute_dtype(dtype))
    result = _Tile(allowed, additive, keep, None if visible.all() else ~visible, None if used.all() else used)
    call.prepared.tiles.put(key, result, allowed.numel() * (1 + additive.element_size() + keep.element_size()))
    return result


def _keep_mask(call: _Call, gi: int, row: RowBlock, run: Run, shape, device) -> torch.Tensor:
    """Dropout keep-mask of one run; the same on every call with the same seed."""
    g = torch.Generator(device=device)
    g.manual_seed((call.seed + 7_919 * gi + 1_000_003 * row.q0 + run.k0) % (2**63))
    return torch.rand(shape, generator=g, device=device) >= call.dropout_p


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _run_inputs(call: _Call, gi, sel, q, k, v, row: RowBlock, run: Run):
    """Folded queries, K/V slices (keys no row uses zeroed) and the tile of one run."""
    hq, hkv = q.shape[1], k.shape[1]
    kr, vr = k[:, :, run.k0 : run.k1], v[:, :, run.k0 : run.k1]  # (B, Hkv, S, D)
    tile = _tile(call, gi, sel, row, run, hq, hkv, q.dtype, q.device)
    if tile is not None and tile.used_keys is not None:  # NaN/Inf in keys no query uses
        zero = k.new_zeros(())
        kr, vr = torch.where(tile.used_keys, kr, zero), torch.where(tile.used_keys, vr, zero)
    qf = _fold(q[:, :, row.q0 : row.q1], hkv)  # (B, Hkv, group * n, D)
    if tile is not None and tile.hidden_rows is not None:  # junk (NaN) in queries that see no key here
        qf = torch.where(tile.hidden_rows[..., None], q.new_zeros(()), qf)
    return qf, kr, vr, tile


def _bias_tile(call: _Call, sel: _Select, row: RowBlock, run: Run, hq: int, hkv: int):
    """The bias of one run, laid out like the folded queries ``(Bs or 1, Hkv, g*n, S)``; None without bias."""
    if call.bias is None:
        return None
    device = sel.b_idx.device
    q_idx = torch.arange(row.q0, row.q1, device=device).view(1, 1, -1, 1)
    kv_idx = torch.arange(run.k0, run.k1, device=device).view(1, 1, 1, -1)
    t = _as4d(call.bias._elements(sel.b_idx, sel.h_idx, q_idx, kv_idx, call.prepared.q_len, call.prepared.kv_len))
    t = t.expand(*t.shape[:2], row.q1 - row.q0, run.k1 - run.k0)  # (Bs or 1, Hs or 1, n, S)
    return _fold_tile(t, hq, hkv)


def _math_scores(call: _Call, qf, kr, tile: _Tile | None, bias_tile=None, keep_capped: bool = False):
    """Scores of one run in float32/64, and ``tanh(s / softcap)`` if ``keep_capped`` (else None)."""
    ct = _compute_dtype(qf.dtype)
    pre = call.scale if call.softcap is None else call.scale / call.softcap  # applied to q: n x D, not n x S
    s = torch.matmul(qf.to(ct) * pre, kr.to(ct).transpose(-2, -1))  # (B, Hkv, g*n, S)
    capped = None
    if call.softcap is not None:
        s = s.tanh_()
        if keep_capped:
            capped, s = s, s * call.softcap
        else:
            s = s.mul_(call.softcap)
    if bias_tile is not None:
        s = s.add_(bias_tile.to(ct))
        if tile is not None:  # a bias may hold NaN or +inf at pairs the mask hides: overwrite, never add
            return s.masked_fill_(~tile.allowed, _NEG_INF), capped
    if tile is not None:
        s = s.add_(tile.additive)  # 0 / -inf: a broadcast add is faster than masked_fill_ here
    return s, capped


#: exp() of float32 values below about -87.3 is subnormal, and so are the products of
#: weights near that with values in the next matmul: x86 CPUs compute subnormals
#: 20-70x slower. Weights below exp(-60) = 9e-27 of the row's largest are kept at that
#: floor (far below float32's resolution); hidden pairs are still exactly 0.
_EXP_FLOOR = -60.0


def _weights(s: torch.Tensor, shift: torch.Tensor, tile: _Tile | None) -> torch.Tensor:
    """``exp(s - shift)`` in place, hidden pairs exactly 0 (the softmax numerator)."""
    s = s.sub_(shift)
    if s.dtype == torch.float32:
        s = s.clamp_(min=_EXP_FLOOR)
    p = s.exp_()
    return p if tile is None else p.mul_(tile.keep)


#: Rows of one math-engine tile. The planner merges row blocks with equal runs into one
#: (the fused engine tiles inside); the math engine materialises rows x keys, so it
#: walks merged blocks this many rows at a time.
MATH_ROWS = 128


def _math_rows(rows):
    """Row blocks cut to at most :data:`MATH_ROWS` queries (for the math engine)."""
    for row in rows:
        if row.q1 - row.q0 <= MATH_ROWS:
            yield row
        else:
            for q0 in range(row.q0, row.q1, MATH_ROWS):
                yield RowBlock(q0, min(q0 + MATH_ROWS, row.q1), row.runs)


def _merge(parts):
    """Exact merge of attention over disjoint key sets by their log-sum-exp.

    Each part's output is 0 on the rows it hides entirely, and its lse -inf.
    """
    if len(parts) == 1:
        return parts[0]
    total = torch.logsumexp(torch.stack([lse_r for _, lse_r in parts]), dim=0)
    safe = torch.where(total == _NEG_INF, 0.0, total)
    out = sum(torch.exp(lse_r - safe)[..., None] * o.to(lse_r.dtype) for o, lse_r in parts)
    return out, total


def _forward_group(call: _Call, gi: int, group: Group, sel: _Select, q, k, v):
    """``out: (B, Hq, Lq, Dv)`` and ``lse: (B, Hq, Lq)`` of one group's inputs."""
    b, hq, lq, _ = q.shape
    rows = list(group.rows if call.fused else _math_rows(group.rows))
    single = len(rows) == 1 and rows[0].q0 == 0 and rows[0].q1 == lq and rows[0].runs
    out = lse = None
    if not single:
        out = q.new_zeros(b, hq, lq, v.shape[-1])
        lse = torch.full((b, hq, lq), _NEG_INF, dtype=_compute_dtype(q.dtype), device=q.device)
    for row in rows:
        if not row.runs:  # every query of the block is fully masked
            continue
        parts = []
        for run in row.runs:
            qf, kr, vr, tile = _run_inputs(call, gi, sel, q, k, v, row, run)
            bias_tile = _bias_tile(call, sel, row, run, hq, k.shape[1])
            if call.fused:
                o, lse_r = _aten.flash_forward(
                    qf, kr, vr, attn_mask=None if tile is None else tile.additive, scale=call.scale
                )
            else:
                s, _ = _math_scores(call, qf, kr, tile, bias_tile)
                m = s.amax(dim=-1, keepdim=True)
                dead = m == _NEG_INF  # rows with no finite score here (hidden, or a -inf bias on every key)
                m = m.masked_fill(dead, 0.0)
                p = _weights(s, m, tile)  # one exp pass: unnormalised weights
                if call.bias is not None:  # the exp floor would give those rows weights exp(-60)
                    p = p.masked_fill_(dead, 0.0)
                total = p.sum(dim=-1, keepdim=True)
                lse_r = (m + total.log()).squeeze(-1)  # -inf where every key is hidden
                if call.dropout_p > 0.0:
                    p = p * _keep_mask(call, gi, row, run, p.shape, q.device) / (1.0 - call.dropout_p)
                o = (p @ vr.to(p.dtype)).div_(torch.where(total == 0, 1.0, total))  # (B, Hkv, g*n, S) x (B, Hkv, S, Dv)
            if tile is not None and tile.hidden_rows is not None:
                lse_r = lse_r.masked_fill(tile.hidden_rows, _NEG_INF)  # rows this run hides entirely
                o = o.masked_fill(tile.hidden_rows[..., None], 0.0)
            parts.append((o, lse_r))
        o, lse_r = _merge(parts)
        if single:  # one row block: its result is the output
            return _unfold(o, hq).to(q.dtype), _unfold(lse_r, hq)
        out[:, :, row.q0 : row.q1] = _unfold(o, hq).to(q.dtype)
        lse[:, :, row.q0 : row.q1] = _unfold(lse_r, hq)
    return out, lse


def _group_inputs(sel: _Select, q, k, v):
    q = _take(_take(q, 0, sel.batch), 1, sel.q_heads)
    k = _take(_take(k, 0, sel.batch), 1, sel.kv_heads)
    v = _take(_take(v, 0, sel.batch), 1, sel.kv_heads)
    return q, k, v


def _one_fused_call(call: _Call, q, k) -> bool | None:
    """``is_causal`` when one call of the fused kernel computes the whole result (no mask, or
    a causal one that is exactly SDPA's), else None. It returns the lse, which SDPA does not."""
    if not call.fused or not call.scale > 0.0 or q.shape[1] != k.shape[1] or q.shape[2] == 0 or k.shape[2] == 0:
        return None
    p = call.prepared
    if p.everything:
        return False
    m = p.mask
    if isinstance(m, _masks._Causal) and p.q_len <= p.kv_len and m._shift(p.q_len, p.kv_len) == 0:
        return True  # SDPA's top-left causal square (a ring's diagonal rectangle: equal, moved offsets)
    return None


def _forward(call: _Call, q, k, v):
    """Returns ``out: (B, Hq, Lq, Dv)`` and ``lse: (B, Hq, Lq)`` (-inf for fully masked rows)."""
    hq, hkv = q.shape[1], k.shape[1]
    causal = _one_fused_call(call, q, k)
    if causal is not None:  # the fused kernel's own causal/full loop: no per-run calls
        out, lse = _aten.flash_forward(q, k, v, scale=call.scale, is_causal=causal)
        return out, lse.to(_compute_dtype(q.dtype))
    groups = call.prepared.groups
    b, _, lq, _ = q.shape
    if len(groups) == 1 and groups[0].batch is None and groups[0].heads is None:
        sel = _select(groups[0], call.prepared, b, hq, hkv, q.device, call.bias)
        return _forward_group(call, 0, groups[0], sel, q, k, v)
    out = q.new_zeros(b, hq, lq, v.shape[-1])
    lse = torch.full((b, hq, lq), _NEG_INF, dtype=_compute_dtype(q.dtype), device=q.device)
    for gi, group in enumerate(groups):
        sel = _select(group, call.prepared, b, hq, hkv, q.device, call.bias)
        og, lg = _forward_group(call, gi, group, sel, *_group_inputs(sel, q, k, v))
        _put_rows(out, sel, og)
        _put_rows(lse, sel, lg)
    return out, lse


def _put_rows(dst, sel: _Select, src) -> None:
    if sel.q_heads is None:
        _put(dst, 0, sel.batch, src)
    else:
        part = _take(dst, 0, sel.batch)
        _put(part, 1, sel.q_heads, src)
        if sel.batch is not None and not isinstance(sel.batch, tuple):
            dst.index_copy_(0, sel.batch, part)


def _backward_group(call: _Call, gi, group: Group, sel: _Select, q, k, v, out, lse, grad_out, grad_lse, grads):
    """``(dq, dk, dv)`` of one group; bias gradients are added to ``grads`` (by tensor id)."""
    hq, hkv = q.shape[1], k.shape[1]
    ct = _compute_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=ct, device=q.device)
    dk = torch.zeros(k.shape, dtype=ct, device=q.device)
    dv = torch.zeros(v.shape, dtype=ct, device=q.device)
    lse_safe = torch.where(lse == _NEG_INF, 0.0, lse)
    fused = call.fused and grad_lse is None and not call.bias_grad
    for row in (group.rows if fused else _math_rows(group.rows)):
        if not row.runs:
            continue
        rows = slice(row.q0, row.q1)
        go = _fold(grad_out[:, :, rows], hkv)  # (B, Hkv, g*n, Dv)
        lf = _fold(lse_safe[:, :, rows, None], hkv)[..., 0]  # (B, Hkv, g*n)
        if fused:
            of = _fold(out[:, :, rows], hkv)
            dqf = 0
            for run in row.runs:
                qf, kr, vr, tile = _run_inputs(call, gi, sel, q, k, v, row, run)
                g_q, g_k, g_v = _aten.flash_backward(
                    go.contiguous(), qf, kr, vr, of, lf,
                    attn_mask=None if tile is None else tile.additive, scale=call.scale,
                )
                dqf = dqf + g_q.to(ct)
                dk[:, :, run.k0 : run.k1] += g_k.to(ct)
                dv[:, :, run.k0 : run.k1] += g_v.to(ct)
        else:
            gl = None if grad_lse is None else _fold(grad_lse[:, :, rows, None].to(ct), hkv)
            # the row's delta from its own weights, or (the keys being a part) from the merged output
            delta = None if call.own_lse else (go.to(ct) * _fold(out[:, :, rows], hkv).to(ct)).sum(-1, keepdim=True)
            dqf = _math_backward_row(call, gi, sel, q, k, v, row, go.to(ct), lf, gl, delta, dk, dv, grads)
        dq[:, :, rows] = _unfold(dqf, hq)
    return dq, dk, dv


def _math_backward_row(call: _Call, gi, sel: _Select, q, k, v, row: RowBlock, go, lf, grad_lse, delta, dk, dv,
                       grads):
    """The math engine's backward pass for one row block: returns its folded dQ, adds to dK/dV.

    ``dS = P (dP - delta)`` with ``delta = rowsum(P dP)`` summed over the row's runs (the
    softmax's own backward, as the naive formula computes it: with one key dS is exactly 0),
    lowered by ``grad_lse`` (``d lse / d s = P``). When the row's runs hold all its keys
    (``call.own_lse``), ``P`` is renormalised from the row's own scores rather than taken as
    ``exp(S - lse)``, whose float32 lse carries ``|max score| x 6e-8`` of rounding into every
    weight. Ring attention's parts (``backward_part``) hold some of the keys: they pass
    ``delta = rowsum(dO O)`` of the merged output and use the merged lse. Each run's tiles
    are kept until the row is done: ``rows x (keys of the row)`` values, as in the forward.
    """
    hq, hkv = q.shape[1], k.shape[1]
    ct = go.dtype
    scored = []
    for run in row.runs:
        qf, kr, vr, tile = _run_inputs(call, gi, sel, q, k, v, row, run)
        s, capped = _math_scores(call, qf, kr, tile, _bias_tile(call, sel, row, run, hq, hkv), keep_capped=True)
        scored.append((run, qf, kr, vr, tile, s, capped))
    if call.own_lse:
        m = torch.stack([s.amax(dim=-1) for *_, s, _ in scored]).amax(dim=0)[..., None]  # (B, Hkv, g*n, 1)
        shift = m.masked_fill(m == _NEG_INF, 0.0)
    else:
        shift = lf[..., None]
    own_delta = delta is None
    pieces, total = [], 0
    delta = 0 if own_delta else delta
    for run, qf, kr, vr, tile, s, capped in scored:
        p = _weights(s, shift, tile)  # (B, Hkv, g*n, S)
        if tile is not None and tile.hidden_rows is not None:
            p = p.masked_fill(tile.hidden_rows[..., None], 0.0)
        if call.own_lse:
            total = total + p.sum(dim=-1, keepdim=True)
        pieces.append((run, qf, kr, vr, p, capped))
    if call.own_lse:
        inv = 1.0 / torch.where(total == 0, 1.0, total)
    done = []
    for run, qf, kr, vr, p, capped in pieces:
        if call.own_lse:
            p = p.mul_(inv)
        dp = go @ vr.to(ct).transpose(-2, -1)  # (B, Hkv, g*n, Dv) x (B, Hkv, Dv, S)
        pd = p
        if call.dropout_p > 0.0:
            keep = _keep_mask(call, gi, row, run, p.shape, q.device).to(ct) / (1.0 - call.dropout_p)
            pd, dp = p * keep, dp * keep
        if own_delta:
            delta = delta + (p * dp).sum(dim=-1, keepdim=True)  # (B, Hkv, g*n, 1)
        done.append((run, qf, kr, p, pd, dp, capped))
    if grad_lse is not None:
        delta = delta - grad_lse
    dqf = 0
    for run, qf, kr, p, pd, dp, capped in done:
        keys = slice(run.k0, run.k1)
        dv[:, :, keys] += pd.transpose(-2, -1) @ go
        ds = p * (dp - delta)  # d loss / d (modified score)
        if call.bias_grad:
            index = (sel.b_idx, sel.h_idx, torch.arange(row.q0, row.q1, device=q.device).view(1, 1, -1, 1),
                     torch.arange(run.k0, run.k1, device=q.device).view(1, 1, 1, -1))
            call.bias._add_grad(grads, _unfold(ds, hq), *index, call.prepared.q_len, call.prepared.kv_len)
        if capped is not None:
            ds = ds * (1.0 - capped * capped)  # d (c tanh(s / c)) / ds
        ds = ds * call.scale
        dqf = dqf + ds @ kr.to(ct)
        dk[:, :, keys] += ds.transpose(-2, -1) @ qf.to(ct)
    return dqf


def _backward(call: _Call, q, k, v, out, lse, grad_out, grad_lse, grads):
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    if call.bias is not None:  # rows a -inf bias empties (lse -inf): no gradient flows through them
        dead = lse == _NEG_INF
        grad_out = grad_out.masked_fill(dead[..., None], 0.0)
        grad_lse = None if grad_lse is None else grad_lse.masked_fill(dead, 0.0)
    causal = _one_fused_call(call, q, k) if grad_lse is None else None
    if causal is not None:  # as in _forward: the fused kernel's own loop, one call
        dq, dk, dv = _aten.flash_backward(grad_out.to(q.dtype).contiguous(), q, k, v, out.to(q.dtype),
                                          lse.to(_compute_dtype(q.dtype)), scale=call.scale, is_causal=causal)
        return dq, dk, dv
    b, hq, hkv = q.shape[0], q.shape[1], k.shape[1]
    groups = call.prepared.groups
    if len(groups) == 1 and groups[0].batch is None and groups[0].heads is None:
        sel = _select(groups[0], call.prepared, b, hq, hkv, q.device, call.bias)
        dq, dk, dv = _backward_group(call, 0, groups[0], sel, q, k, v, out, lse, grad_out, grad_lse, grads)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
    ct = _compute_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=ct, device=q.device)
    dk = torch.zeros(k.shape, dtype=ct, device=q.device)
    dv = torch.zeros(v.shape, dtype=ct, device=q.device)
    for gi, group in enumerate(groups):
        sel = _select(group, call.prepared, b, hq, hkv, q.device, call.bias)
        qg, kg, vg = _group_inputs(sel, q, k, v)
        og = _take(_take(out, 0, sel.batch), 1, sel.q_heads)
        lg = _take(_take(lse, 0, sel.batch), 1, sel.q_heads)
        gg = _take(_take(grad_out, 0, sel.batch), 1, sel.q_heads)
        gl = None if grad_lse is None else _take(_take(grad_lse, 0, sel.batch), 1, sel.q_heads)
        g_q, g_k, g_v = _backward_group(call, gi, group, sel, qg, kg, vg, og, lg, gg, gl, grads)
        for dst, src, heads in ((dq, g_q, sel.q_heads), (dk, g_k, sel.kv_heads), (dv, g_v, sel.kv_heads)):
            if heads is None:
                _put(dst, 0, sel.batch, src, add=True)
            else:
                part = _take(dst, 0, sel.batch)
                _put(part, 1, heads, src, add=True)
                if sel.batch is not None and not isinstance(sel.batch, tuple):
                    dst.index_copy_(0, sel.batch, part)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _TiledAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, call: _Call, *params):
        out, lse = _forward(call, q, k, v)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.call = call
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        if torch.is_grad_enabled():  # create_graph=True: a second derivative is wanted
            raise double_backward_error("tiled")
        q, k, v, out, lse = ctx.saved_tensors
        call, grads = ctx.call, {}
        dq, dk, dv = _backward(call, q, k, v, out, lse, grad_out, grad_lse, grads)
        param_grads = []
        for t in call.params:
            g = grads.get(id(t)) if t.requires_grad else None
            if g is None and t.requires_grad:
                g = torch.zeros_like(t)
            param_grads.append(None if g is None else g.reshape(t.shape).to(t.dtype))
        return dq, dk, dv, None, *param_grads


def draw_seed() -> int:
    """One draw from the global generator that seeds a call's dropout."""
    return int(torch.randint(0, 2**62, (1,)).item())


def attention(q, k, v, prepared: PreparedMask, *, scale: float, dropout_p: float = 0.0, seed: int | None = None,
              bias=None, softcap: float | None = None):
    """Block-sparse attention on 4-D inputs; returns ``(out, lse)``.

    q: (B, Hq, Lq, D), k: (B, Hkv, Lk, D), v: (B, Hkv, Lk, Dv); ``prepared`` from
    :func:`attnkit.prepare` for these lengths. ``out: (B, Hq, Lq, Dv)``,
    ``lse: (B, Hq, Lq)`` in float32 (float64 for float64 inputs), -inf where a query
    may attend no key. Both are differentiable, as are the tensors of ``bias`` (an
    :class:`attnkit.bias.Bias`, evaluated one tile at a time). ``softcap`` caps the
    scaled scores with ``softcap * tanh(s / softcap)`` before the bias.
    """
    if dropout_p > 0.0 and seed is None:
        seed = draw_seed()
    # one copy here rather than one per run: the fused engine needs unit-stride rows
    q, k, v = (_aten.rows_contiguous(t) for t in (q, k, v))
    # With a bias the math engine is as fast or faster: the fused kernel would take the
    # bias as an additive mask tile, and biases that grow with distance (ALiBi) push its
    # exp() into subnormal numbers, which the math engine floors (see _EXP_FLOOR).
    fused = dropout_p == 0.0 and softcap is None and bias is None and fused_available(q, v)
    params = () if bias is None else tuple(bias.params())
    call = _Call(prepared, scale, dropout_p, seed or 0, fused, bias, softcap, params)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, *params)):
        return _TiledAttention.apply(q, k, v, call, *params)
    return _forward(call, q, k, v)


def backward_part(q, k, v, prepared: PreparedMask, out, lse, grad_out, grad_lse=None, *, scale: float,
                  bias=None, softcap: float | None = None):
    """``(dq, dk, dv)`` of attention over some of the keys, from the final ``out`` and ``lse``.

    When a softmax spans several key sets (ring attention's ranks), each set's share of
    the gradient is the usual backward pass with the *merged* output and log-sum-exp:
    ``dS = P (dP - rowsum(dO * O))`` with ``P = exp(S - lse)``. No forward is recomputed.
    4-D inputs as :func:`attention`'s; ``prepared`` is this key set's mask; ``grad_lse``
    is the gradient of the merged lse (or None). Bias parameters get no gradient here.
    """
    fused = softcap is None and bias is None and fused_available(q, v)
    call = _Call(prepared, scale, 0.0, 0, fused, bias, softcap, (), own_lse=False)
    q, k, v = (_aten.rows_contiguous(t) for t in (q, k, v))
    return _backward(call, q, k, v, out, lse, grad_out, grad_lse, {})


class TiledKernel(Kernel):
    """The block-sparse kernel: inputs of rank 2 to 4, bool or mask-object masks."""

    name = "tiled"
    supports_dropout = True
    supports_lse = True
    supports_score_mods = ("bias", "softcap")  # sinks: added by the registry from the lse
    max_rank = 4

    def _reasons(self, call: Call) -> list[str]:
        reasons = []
        if call.compiling:
            reasons.append("walks a host-side plan, which torch.compile cannot trace")
        return reasons

    def run(self, call: Call):
        s = call.shapes
        lead = (1,) * (4 - s.rank)
        q4, k4, v4 = (t.reshape(*lead, *t.shape) for t in (call.q, call.k, call.v))  # (B, H, L, D)
        out, lse = attention(q4, k4, v4, call.get_prepared(), scale=call.scale, dropout_p=call.dropout_p,
                             bias=call.bias, softcap=call.softcap)
        return out.reshape(s.out), lse.reshape(s.scores[:-1]) if call.return_lse else None
