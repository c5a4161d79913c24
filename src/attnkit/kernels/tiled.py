"""Block-sparse attention in plain PyTorch: visit only the blocks a mask keeps.

The kernel walks a :class:`~attnkit.prepare.PreparedMask`: for each group of batch
rows (and heads) that share a block map, for each row block of queries, the *runs*
of adjacent key blocks that are all FULL (no element mask needed) or all PARTIAL
(the mask is evaluated on that tile only). Each run is one exact attention call that
returns its output and row log-sum-exp; runs merge exactly by log-sum-exp. Keys past
a sequence's limit (padding, empty cache slots) are never read. Nothing of size
``Lq x Lk`` is allocated: the largest tile is ``bq x Lk``.

Three engines compute it:

- ``native``: attnkit's C++ kernel (:mod:`attnkit.kernels.native`), which walks the
  prepared block lists itself and applies the mask, soft-capping and a bias of ``kv - q``
  inside its tile loop, forward and backward, in float32 (half-precision inputs widened).
  It runs every CPU call without dropout or a general bias or ``score_mod`` once it is
  built (at first use, once per machine), with at least :data:`NATIVE_MIN_ROWS` queries;
- ``fused``: PyTorch's CPU flash-attention kernel (:mod:`attnkit.kernels._aten`) called
  once per run, used where the native engine is not (no compiler, ``ATTNKIT_NATIVE=0``,
  decoding steps) when there is no dropout, the inputs are on the CPU and Dv == D;
- ``math``: matmul, softmax statistics in float32 or float64, matmul; used for
  dropout (a keep-mask drawn per run from a generator seeded once per call from the
  global generator, so ``torch.manual_seed`` reproduces it), off the CPU, for
  Dv != D and float64 off the native engine, and for gradients of a bias's own tensors
  or through the log-sum-exp off the native engine.

Backward recomputes each run from the saved log-sum-exp (FlashAttention's scheme),
so training memory stays O(L). Grouped-query attention folds the Hq/Hkv query heads
of a group into the row axis instead of copying K/V per query head.

Equivalent pytorch code: ``reference.attention(q, k, v, prepared.materialize(), scale=scale)``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from attnkit.kernels import _aten, native, tiles
from attnkit.kernels.lse import merge
from attnkit.kernels.registry import Call, Kernel, Reason, Runner, double_backward_error, first_derivative_only
from attnkit.prepare import Group, PreparedMask, RowBlock, Run, from_handle

if TYPE_CHECKING:
    from attnkit.bias import Bias
    from attnkit.score_mods import ScoreMod


def fused_available(q: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the fused CPU engine can run these inputs (it needs Dv == D)."""
    return q.device.type == "cpu" and q.shape[-1] == v.shape[-1] and _aten.AVAILABLE


def dropout_keep_mask(
    call: tiles.TileCall, gi: int, row: RowBlock, run: Run, shape: Sequence[int], device: torch.device
) -> torch.Tensor:
    """Dropout keep-mask of one run (folded rows, ``shape = (B, Hkv, g*n, S)``): the same on every
    call with the same seed; tests rebuild a call's whole keep-mask from it."""
    g = torch.Generator(device=device)
    g.manual_seed((call.seed + 7_919 * gi + 1_000_003 * row.q0 + run.k0) % (2**63))
    return torch.rand(shape, generator=g, device=device) >= call.dropout_p


#: The native engine runs calls with at least this many queries: it computes 32 query rows
#: at a time, so a decoding step would do 32x its work (the fused engine runs those).
NATIVE_MIN_ROWS = 16
NATIVE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _native_takes(q: torch.Tensor, lq: int) -> bool:
    """Whether the native engine takes these queries: CPU, float32/bf16/fp16, enough of them, built."""
    return q.device.type == "cpu" and q.dtype in NATIVE_DTYPES and lq >= NATIVE_MIN_ROWS and native.available()


def native_runs(q: torch.Tensor, prepared: PreparedMask) -> bool:
    """Whether the native engine can run a call with these 4-D queries and this prepared mask."""
    return prepared.block_size[0] % 32 == 0 and _native_takes(q, q.shape[2])


#: The native engine is preferred to SDPA for calls with at least this many query rows in all
#: (B * Hq * Lq; benchmarks/cpu.py and benchmarks/core.py: unmasked calls 0.76-0.92x SDPA's time
#: from 2048 rows on, causal 0.5-0.75x; at 1024 rows, unmasked, 1.04x). It does not depend on Lk,
#: so a decoding step's choice stays the same as its cache grows (the lean path relies on it).
NATIVE_MIN_QUERIES = 2048


def native_prefers(call: Call) -> bool:
    """Whether the native engine runs ``call`` and is faster than SDPA would be: a mask object
    or none (a tensor mask is prepared again on every call), no dropout, enough queries. An
    unmasked half-precision call with a backward stays on SDPA, whose bf16 backward uses bf16
    dot products: the float32 engine measured 0.95-1.07x its time there (masked calls: 0.1-0.9x)."""
    s = call.shapes
    return (
        call.dropout_p == 0.0
        and not call.tensor_mask
        and not (call.mask is None and call.half and call.backward)
        and math.prod(s.batch) * s.hq * s.lq >= NATIVE_MIN_QUERIES
        and _native_takes(call.q, s.lq)
    )


def engine(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    prepared: PreparedMask,
    bias: Bias | None,
    softcap: float | None,
    score_mod: ScoreMod | None,
    dropout_p: float,
) -> tuple[bool, bool, torch.Tensor | None]:
    """``(native, fused, band)``: whether the native engine runs a call, whether the fused one
    would (where the native one does not), and the band of its bias.

    A bias of ``kv_idx - q_idx`` alone (ALiBi, T5's relative bias, their sums) is one band
    per head (:meth:`attnkit.bias.Bias.band`): the native engine adds it inside its tile loop,
    the fused engine takes it as its additive mask, a strided view (:func:`tiles.band_mask`).
    Other biases, ``score_mod``s and dropout run on the math engine, tile by tile; so does
    soft-capping where the native engine does not run. 4-D inputs.
    """
    simple = dropout_p == 0.0 and score_mod is None
    band = tiles.band_for(bias, q, k) if simple else None
    modifiable = simple and (bias is None or band is not None)
    fused = modifiable and softcap is None and fused_available(q, v)
    return modifiable and native_runs(q, prepared), fused, band


def engine_words(call: Call, prepared: PreparedMask) -> str:
    """Which engine runs a call, and why not the native one, in words (for ``explain``)."""
    q, k, v = _as4d(call)
    nat, fused, band = engine(q, k, v, prepared, call.bias, call.softcap, call.score_mod, call.dropout_p)
    if nat:
        return "native engine (C++)"
    if call.dropout_p > 0.0:
        why = f"dropout_p={call.dropout_p}"
    elif call.score_mod is not None:
        why = "a score_mod"
    elif call.bias is not None and band is None:
        why = "a bias that is not a function of kv - q alone"
    elif q.device.type != "cpu" or q.dtype not in NATIVE_DTYPES:
        why = f"{q.dtype} on {q.device.type}; the native engine takes float32/bfloat16/float16 on the CPU"
    elif q.shape[2] < NATIVE_MIN_ROWS:
        why = f"{q.shape[2]} queries; the native engine runs from {NATIVE_MIN_ROWS}"
    else:
        why = native.status()[1]
    return f"{'fused' if fused else 'math'} engine ({why})"


@dataclass(frozen=True)
class Square:
    """Row blocks ``[a, b)`` that see keys ``[c, a)`` entirely and ``[a, b)`` causally (a document's
    causal square, a prefix-LM's causal rows): one ``is_causal`` call of the fused kernel over the
    square and one unmasked call over the rectangle, instead of one call per row block."""

    a: int
    b: int
    c: int


#: Causal squares from this many rows on run as one ``is_causal`` call: the fused kernel tiles
#: 256 queries x 512 keys from 768 queries on, and skips the tiles above the diagonal; on
#: smaller squares its 512-key tiles compute the whole square, and the per-row-block runs win
#: (benchmarks/cpu.py, documents of 512 vs 768-2048 tokens with a causal mask).
SQUARE_MIN_ROWS = 768


def _is_tril(tile: tiles.Tile | None, left: int) -> bool:
    """Whether a run's tile ending on the diagonal is ``left`` columns kept entirely, then a
    lower-triangular square, for every batch row and head."""
    if tile is None or tile.hidden_rows is not None or tile.used_keys is not None:
        return False
    allowed = tile.allowed
    n = allowed.shape[-2]
    if allowed.shape[-1] != left + n:
        return False
    tril = torch.ones(n, n, dtype=torch.bool, device=allowed.device).tril_()
    return bool(allowed[..., :left].all()) and bool((allowed[..., left:] == tril).all())


def _steps(call: tiles.TileCall, gi: int, group: Group, sel: tiles.Select, q, k) -> list[RowBlock | Square]:
    """The group's row blocks, with runs of row blocks that form a causal square merged into a
    :class:`Square` (fused engine, no bias, Hq == Hkv). Found from the evaluated diagonal tiles
    once per prepared mask and kept in its tile cache."""
    hq, hkv = q.shape[1], k.shape[1]
    if not call.fused or call.band is not None or hq != hkv or len(group.rows) < 2:
        return list(group.rows)
    key = ("squares", gi, hq, hkv, q.dtype, str(q.device))
    found = call.prepared.tiles.get(key)
    if found is not None:
        return found

    def diagonal(row: RowBlock) -> int | None:
        """c when the row block sees keys [c, q0) fully and [q0, q1) causally, else None."""
        runs = row.runs
        if not runs or runs[-1].full or runs[-1].k1 != row.q1 or runs[-1].k0 > row.q0:
            return None
        if len(runs) == 2 and runs[0].full and runs[0].k1 == runs[-1].k0:
            c = runs[0].k0
        elif len(runs) == 1:
            c = runs[0].k0
        else:
            return None
        tile = tiles.mask_tile(call, gi, sel, row, runs[-1], hq, hkv, q.dtype, q.device)
        return c if _is_tril(tile, row.q0 - runs[-1].k0) else None

    steps: list[RowBlock | Square] = []
    pending: list[RowBlock] = []  # row blocks of the square being built
    start = 0

    def close() -> None:
        if pending and pending[-1].q1 - pending[0].q0 >= SQUARE_MIN_ROWS:
            steps.append(Square(pending[0].q0, pending[-1].q1, start))
        else:
            steps.extend(pending)
        pending.clear()

    for row in group.rows:
        c = diagonal(row)
        if c is not None and pending and row.q0 == pending[-1].q1 and c == start:
            pending.append(row)
            continue
        close()
        if c is not None and c <= row.q0:
            pending.append(row)
            start = c
        else:
            steps.append(row)
    close()
    call.prepared.tiles.put(key, steps, 64 * len(steps))
    return steps


def squares_and_full(prepared: PreparedMask, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the plan runs as causal squares (:func:`_steps`) plus row blocks of full runs
    only: a plan of one group that costs what a plan of full blocks does."""
    groups = prepared.groups
    one = len(groups) == 1 and groups[0].batch is None and groups[0].heads is None
    if not one or q.shape[1] != k.shape[1] or not fused_available(q, v):
        return False
    call = tiles.TileCall(prepared, scale=1.0, dropout_p=0.0, seed=0, fused=True)
    sel = tiles.select(groups[0], prepared, q.shape[0], q.shape[1], k.shape[1], q.device)
    steps = _steps(call, 0, groups[0], sel, q, k)
    return any(isinstance(s, Square) for s in steps) and all(
        isinstance(s, Square) or all(run.full for run in s.runs) for s in steps
    )


def _forward_square(call: tiles.TileCall, sq: Square, q, k, v):
    """``(out, lse)`` of a :class:`Square`'s rows: the causal square and the rectangle before it."""
    rows, square = slice(sq.a, sq.b), slice(sq.a, sq.b)
    parts = [_aten.flash_forward(q[:, :, rows], k[:, :, square], v[:, :, square], scale=call.scale, is_causal=True)]
    if sq.c < sq.a:
        before = slice(sq.c, sq.a)
        parts.append(_aten.flash_forward(q[:, :, rows], k[:, :, before], v[:, :, before], scale=call.scale))
    return merge(parts)


def _forward_group(call: tiles.TileCall, gi: int, group: Group, sel: tiles.Select, q, k, v):
    """``out: (B, Hq, Lq, Dv)`` and ``lse: (B, Hq, Lq)`` of one group's inputs."""
    b, hq, lq, _ = q.shape
    rows = list(group.rows if call.fused else tiles.math_rows(group.rows))
    single = len(rows) == 1 and rows[0].q0 == 0 and rows[0].q1 == lq and rows[0].runs
    steps = _steps(call, gi, group, sel, q, k) if call.fused else rows
    out = lse = torch.empty(0)
    covered = False
    if not single:
        # row blocks are disjoint: where they cover every query, each row is written once below
        covered = sum(s.b - s.a if isinstance(s, Square) else s.q1 - s.q0 for s in steps) == lq
        lse_dtype = tiles.compute_dtype(q.dtype)
        if covered:
            out = q.new_empty(b, hq, lq, v.shape[-1])
            lse = torch.empty((b, hq, lq), dtype=lse_dtype, device=q.device)
        else:
            out = q.new_zeros(b, hq, lq, v.shape[-1])
            lse = torch.full((b, hq, lq), tiles.NEG_INF, dtype=lse_dtype, device=q.device)
    for row in steps:
        if isinstance(row, Square):
            o, lse_r = _forward_square(call, row, q, k, v)
            out[:, :, row.a : row.b] = o
            lse[:, :, row.a : row.b] = lse_r.to(lse.dtype)
            continue
        if not row.runs:  # every query of the block is fully masked
            if covered:
                out[:, :, row.q0 : row.q1] = 0.0
                lse[:, :, row.q0 : row.q1] = tiles.NEG_INF
            continue
        parts = []
        for run in row.runs:
            qf, kr, vr, tile = tiles.run_inputs(call, gi, sel, q, k, v, row, run)
            if call.fused and call.band is not None:  # the bias as the fused engine's additive mask
                per_kv = hq // k.shape[1]
                mask = tiles.band_mask(call, sel, row, run, tile, hq, k.shape[1])
                o, lse_r = _aten.flash_forward(tiles.flip_rows(qf, per_kv), kr, vr, attn_mask=mask, scale=call.scale)
                o, lse_r = tiles.flip_rows(o, per_kv), tiles.flip_rows(lse_r, per_kv)
            elif call.fused:
                o, lse_r = _aten.flash_forward(
                    qf, kr, vr, attn_mask=None if tile is None else tile.additive, scale=call.scale
                )
            else:
                bias_tile = tiles.bias_tile(call, sel, row, run, hq, k.shape[1])
                s, _, _ = tiles.scores(call, qf, kr, tile, bias_tile, where=(sel, row, run))
                m = s.amax(dim=-1, keepdim=True)
                dead = m == tiles.NEG_INF  # rows with no finite score here (hidden, or a -inf bias on every key)
                m = m.masked_fill(dead, 0.0)
                p = tiles.weights(s, m, tile)  # one exp pass: unnormalised weights
                if call.may_empty_rows:  # the exp floor would give those rows weights exp(-60)
                    p = p.masked_fill_(dead, 0.0)
                total = p.sum(dim=-1, keepdim=True)
                lse_r = (m + total.log()).squeeze(-1)  # -inf where every key is hidden
                if call.dropout_p > 0.0:
                    p = p * dropout_keep_mask(call, gi, row, run, p.shape, q.device) / (1.0 - call.dropout_p)
                o = (p @ vr.to(p.dtype)).div_(torch.where(total == 0, 1.0, total))  # (B, Hkv, g*n, S) x (B, Hkv, S, Dv)
            if tile is not None and tile.hidden_rows is not None:
                lse_r = lse_r.masked_fill(tile.hidden_rows, tiles.NEG_INF)  # rows this run hides entirely
                o = o.masked_fill(tile.hidden_rows[..., None], 0.0)
            parts.append((o, lse_r))
        o, lse_r = merge(parts)
        if single:  # one row block: its result is the output
            return tiles.unfold(o, hq).to(q.dtype), tiles.unfold(lse_r, hq)
        out[:, :, row.q0 : row.q1] = tiles.unfold(o, hq).to(q.dtype)
        lse[:, :, row.q0 : row.q1] = tiles.unfold(lse_r, hq)
    return out, lse


def _one_fused_call(call: tiles.TileCall, q, k) -> bool | None:
    """``is_causal`` when one call of the fused kernel computes the whole result (no mask, or
    a causal one that is exactly SDPA's), else None. It returns the lse, which SDPA does not."""
    if not call.fused or call.bias is not None or not call.scale > 0.0:
        return None
    if q.shape[1] != k.shape[1] or q.shape[2] == 0 or k.shape[2] == 0:
        return None
    p = call.prepared
    if p.hides_nothing:
        return False
    if p.causal_shift == 0 and p.q_len <= p.kv_len:
        return True  # SDPA's top-left causal square (a ring's diagonal rectangle: equal, moved offsets)
    return None


def _forward(call: tiles.TileCall, q, k, v):
    """Returns ``out: (B, Hq, Lq, Dv)`` and ``lse: (B, Hq, Lq)`` (-inf for fully masked rows)."""
    if call.native:  # the whole call in one native call: every group, row block and run
        return native.forward(q, k, v, call.prepared, scale=call.scale, softcap=call.softcap, band=call.band)
    hq, hkv = q.shape[1], k.shape[1]
    causal = _one_fused_call(call, q, k)
    if causal is not None:  # the fused kernel's own causal/full loop: no per-run calls
        out, lse = _aten.flash_forward(q, k, v, scale=call.scale, is_causal=causal)
        return out, lse.to(tiles.compute_dtype(q.dtype))
    groups = call.prepared.groups
    b, _, lq, _ = q.shape
    if len(groups) == 1 and groups[0].batch is None and groups[0].heads is None:
        sel = tiles.select(groups[0], call.prepared, b, hq, hkv, q.device, call.indexed)
        return _forward_group(call, 0, groups[0], sel, q, k, v)
    out = q.new_zeros(b, hq, lq, v.shape[-1])
    lse = torch.full((b, hq, lq), tiles.NEG_INF, dtype=tiles.compute_dtype(q.dtype), device=q.device)
    for gi, group in enumerate(groups):
        sel = tiles.select(group, call.prepared, b, hq, hkv, q.device, call.indexed)
        og, lg = _forward_group(call, gi, group, sel, *tiles.group_inputs(sel, q, k, v))
        tiles.put_rows(out, sel, og)
        tiles.put_rows(lse, sel, lg)
    return out, lse


class _Sums:
    """A gradient summed over runs along dim 2 without a zero fill: each position is copied on
    its first write and added to after; :meth:`done` zeroes what no run wrote."""

    def __init__(self, like: torch.Tensor, dtype: torch.dtype):
        self.t = torch.empty(like.shape, dtype=dtype, device=like.device)
        self.written = bytearray(like.shape[2])

    def add(self, i: int, j: int, src: torch.Tensor) -> None:
        seen, at = self.written, i
        while at < j:
            state = seen[at]
            end = seen.find(b"\x00" if state else b"\x01", at, j)
            end = j if end < 0 else end
            dst, part = self.t[:, :, at:end], src[:, :, at - i : end - i]
            dst.add_(part) if state else dst.copy_(part)
            at = end
        seen[i:j] = b"\x01" * (j - i)

    def done(self) -> torch.Tensor:
        seen, at, n = self.written, 0, len(self.written)
        while at < n:
            start = seen.find(b"\x00", at)
            if start < 0:
                break
            end = seen.find(b"\x01", start)
            end = n if end < 0 else end
            self.t[:, :, start:end] = 0.0
            at = end
        return self.t


def _backward_group(
    call: tiles.TileCall, gi, group: Group, sel: tiles.Select, q, k, v, out, lse, grad_out, grad_lse, grads
):
    """``(dq, dk, dv)`` of one group; bias gradients are added to ``grads`` (by tensor id)."""
    lse_safe = torch.where(lse == tiles.NEG_INF, 0.0, lse)
    if call.fused and grad_lse is None and not call.bias_grad:
        return _fused_backward_group(call, gi, group, sel, q, k, v, out, lse_safe, grad_out)
    hq, hkv = q.shape[1], k.shape[1]
    ct = tiles.compute_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=ct, device=q.device)
    dk = torch.zeros(k.shape, dtype=ct, device=q.device)
    dv = torch.zeros(v.shape, dtype=ct, device=q.device)
    for row in tiles.math_rows(group.rows):
        if not row.runs:
            continue
        rows = slice(row.q0, row.q1)
        go = tiles.fold(grad_out[:, :, rows], hkv).to(ct)  # (B, Hkv, g*n, Dv)
        lf = tiles.fold(lse_safe[:, :, rows, None], hkv)[..., 0]  # (B, Hkv, g*n)
        gl = None if grad_lse is None else tiles.fold(grad_lse[:, :, rows, None].to(ct), hkv)
        # the row's delta from its own weights, or (the keys being a part) from the merged output
        delta = None if call.own_lse else (go * tiles.fold(out[:, :, rows], hkv).to(ct)).sum(-1, keepdim=True)
        dqf = _math_backward_row(call, gi, sel, q, k, v, row, go, lf, gl, delta, dk, dv, grads)
        dq[:, :, rows] = tiles.unfold(dqf, hq)
    return dq, dk, dv


def _fused_backward_group(call: tiles.TileCall, gi, group: Group, sel: tiles.Select, q, k, v, out, lse_safe, grad_out):
    """``(dq, dk, dv)`` of one group on the fused engine: one fused backward call per run (or per
    causal square and its rectangle), summed into :class:`_Sums`."""
    hq, hkv = q.shape[1], k.shape[1]
    ct = tiles.compute_dtype(q.dtype)
    dq, dk, dv = _Sums(q, ct), _Sums(k, ct), _Sums(v, ct)
    per_kv = hq // hkv
    for row in _steps(call, gi, group, sel, q, k):
        if isinstance(row, Square):  # as in the forward: the causal square and the rectangle before it
            rows, go = slice(row.a, row.b), grad_out[:, :, row.a : row.b].contiguous()
            of, lf = out[:, :, rows], lse_safe[:, :, rows]
            g_q, g_k, g_v = _aten.flash_backward(
                go, q[:, :, rows], k[:, :, rows], v[:, :, rows], of, lf, scale=call.scale, is_causal=True
            )
            dq.add(row.a, row.b, g_q)
            dk.add(row.a, row.b, g_k)
            dv.add(row.a, row.b, g_v)
            if row.c < row.a:
                before = slice(row.c, row.a)
                g_q, g_k, g_v = _aten.flash_backward(
                    go, q[:, :, rows], k[:, :, before], v[:, :, before], of, lf, scale=call.scale
                )
                dq.add(row.a, row.b, g_q)
                dk.add(row.c, row.a, g_k)
                dv.add(row.c, row.a, g_v)
            continue
        if not row.runs:
            continue
        rows = slice(row.q0, row.q1)
        go = tiles.fold(grad_out[:, :, rows], hkv)  # (B, Hkv, g*n, Dv)
        lf = tiles.fold(lse_safe[:, :, rows, None], hkv)[..., 0]  # (B, Hkv, g*n)
        of = tiles.fold(out[:, :, rows], hkv)
        if call.band is not None:  # reversed query order: see tiles.band_mask
            go, of, lf = (tiles.flip_rows(t, per_kv) for t in (go, of, lf))
        go = go.contiguous()
        dqf: torch.Tensor | None = None  # (B, Hkv, g*n, D), summed over the runs in place
        for run in row.runs:
            qf, kr, vr, tile = tiles.run_inputs(call, gi, sel, q, k, v, row, run)
            mask: torch.Tensor | None
            if call.band is not None:
                qf, mask = tiles.flip_rows(qf, per_kv), tiles.band_mask(call, sel, row, run, tile, hq, hkv)
            else:
                mask = None if tile is None else tile.additive
            g_q, g_k, g_v = _aten.flash_backward(go, qf, kr, vr, of, lf, attn_mask=mask, scale=call.scale)
            dqf = g_q.to(ct) if dqf is None else dqf.add_(g_q)
            dk.add(run.k0, run.k1, g_k)
            dv.add(run.k0, run.k1, g_v)
        assert dqf is not None, "a row block with runs"
        if call.band is not None:
            dqf = tiles.flip_rows(dqf, per_kv)
        dq.add(row.q0, row.q1, tiles.unfold(dqf, hq))
    return dq.done(), dk.done(), dv.done()


def _math_backward_row(
    call: tiles.TileCall, gi, sel: tiles.Select, q, k, v, row: RowBlock, go, lf, grad_lse, delta, dk, dv, grads
):
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
        qf, kr, vr, tile = tiles.run_inputs(call, gi, sel, q, k, v, row, run)
        s, capped, before = tiles.scores(
            call, qf, kr, tile, tiles.bias_tile(call, sel, row, run, hq, hkv), keep_capped=True, where=(sel, row, run)
        )
        scored.append((run, qf, kr, vr, tile, s, capped, before))
    if call.own_lse:
        m = torch.stack([s.amax(dim=-1) for *_, s, _, _ in scored]).amax(dim=0)[..., None]  # (B, Hkv, g*n, 1)
        shift = m.masked_fill(m == tiles.NEG_INF, 0.0)
    else:
        shift = lf[..., None]
    own_delta = delta is None
    pieces = []
    total: torch.Tensor | float = 0.0
    delta = 0.0 if own_delta else delta
    for run, qf, kr, vr, tile, s, capped, before in scored:
        p = tiles.weights(s, shift, tile)  # (B, Hkv, g*n, S)
        if tile is not None and tile.hidden_rows is not None:
            p = p.masked_fill(tile.hidden_rows[..., None], 0.0)
        if call.own_lse:
            total = total + p.sum(dim=-1, keepdim=True)
        pieces.append((run, qf, kr, vr, p, capped, before))
    if call.own_lse:
        inv = 1.0 / torch.where(torch.as_tensor(total) == 0, 1.0, torch.as_tensor(total))
    done = []
    for run, qf, kr, vr, p, capped, before in pieces:
        if call.own_lse:
            p = p.mul_(inv)
        dp = go @ vr.to(ct).transpose(-2, -1)  # (B, Hkv, g*n, Dv) x (B, Hkv, Dv, S)
        pd = p
        if call.dropout_p > 0.0:
            keep = dropout_keep_mask(call, gi, row, run, p.shape, q.device).to(ct) / (1.0 - call.dropout_p)
            pd, dp = p * keep, dp * keep
        if own_delta:
            delta = delta + (p * dp).sum(dim=-1, keepdim=True)  # (B, Hkv, g*n, 1)
        done.append((run, qf, kr, p, pd, dp, capped, before))
    if grad_lse is not None:
        delta = delta - grad_lse
    dqf: torch.Tensor | None = None  # (B, Hkv, g*n, D), summed over the runs in place
    for run, qf, kr, p, pd, dp, capped, before in done:
        keys = slice(run.k0, run.k1)
        dv[:, :, keys] += pd.transpose(-2, -1) @ go
        ds = p * (dp - delta)  # d loss / d (modified score)
        if before is not None:  # through the score_mod: d loss / d (scores before it), and its params
            ds = _score_mod_backward(call, sel, row, run, before, ds, grads)
        if call.bias_grad:
            index = (
                sel.b_idx,
                sel.h_idx,
                torch.arange(row.q0, row.q1, device=q.device).view(1, 1, -1, 1),
                torch.arange(run.k0, run.k1, device=q.device).view(1, 1, 1, -1),
            )
            assert call.bias is not None and sel.b_idx is not None and sel.h_idx is not None
            call.bias.add_grad(
                grads, tiles.unfold(ds, hq), sel.b_idx, sel.h_idx, *index[2:], call.prepared.q_len, call.prepared.kv_len
            )
        if capped is not None:
            ds = ds * (1.0 - capped * capped)  # d (c tanh(s / c)) / ds
        ds = ds * call.scale
        part = ds @ kr.to(ct)
        dqf = part if dqf is None else dqf.add_(part)
        dk[:, :, keys] += ds.transpose(-2, -1) @ qf.to(ct)
    assert dqf is not None, "a row block with runs"
    return dqf


def _score_mod_backward(call: tiles.TileCall, sel, row: RowBlock, run: Run, before, ds, grads):
    """The vector-Jacobian product of the score_mod on one tile (autograd on the tile alone); the
    gradients of its params are added to ``grads`` (by tensor id)."""
    assert call.score_mod is not None
    wanted = [t for t in call.score_mod.params if t.requires_grad]
    with torch.enable_grad():
        x = before.detach().requires_grad_()
        y = tiles.score_mod_tile(call, x, sel, row, run)
        found = torch.autograd.grad(y, [x, *wanted], ds, allow_unused=True)
    for t, g in zip(wanted, found[1:]):
        if g is not None:
            grads[id(t)] = g if id(t) not in grads else grads[id(t)] + g
    return torch.zeros_like(ds) if found[0] is None else found[0]


def _backward(call: tiles.TileCall, q, k, v, out, lse, grad_out, grad_lse, grads):
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    if call.may_empty_rows:  # rows a -inf bias or score_mod empties (lse -inf): no gradient flows through them
        dead = lse == tiles.NEG_INF
        grad_out = grad_out.masked_fill(dead[..., None], 0.0)
        grad_lse = None if grad_lse is None else grad_lse.masked_fill(dead, 0.0)
    if call.native and not call.bias_grad:  # a bias's own tensors want the scores' gradient: the math engine
        return native.backward(
            q,
            k,
            v,
            call.prepared,
            out,
            lse,
            grad_out,
            grad_lse,
            scale=call.scale,
            softcap=call.softcap,
            band=call.band,
            own_lse=call.own_lse,
        )
    causal = _one_fused_call(call, q, k) if grad_lse is None else None
    if causal is not None:  # as in _forward: the fused kernel's own loop, one call
        dq, dk, dv = _aten.flash_backward(
            grad_out.to(q.dtype).contiguous(),
            q,
            k,
            v,
            out.to(q.dtype),
            lse.to(tiles.compute_dtype(q.dtype)),
            scale=call.scale,
            is_causal=causal,
        )
        return dq, dk, dv
    b, hq, hkv = q.shape[0], q.shape[1], k.shape[1]
    groups = call.prepared.groups
    if len(groups) == 1 and groups[0].batch is None and groups[0].heads is None:
        sel = tiles.select(groups[0], call.prepared, b, hq, hkv, q.device, call.indexed)
        dq, dk, dv = _backward_group(call, 0, groups[0], sel, q, k, v, out, lse, grad_out, grad_lse, grads)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
    ct = tiles.compute_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=ct, device=q.device)
    dk = torch.zeros(k.shape, dtype=ct, device=q.device)
    dv = torch.zeros(v.shape, dtype=ct, device=q.device)
    for gi, group in enumerate(groups):
        sel = tiles.select(group, call.prepared, b, hq, hkv, q.device, call.indexed)
        qg, kg, vg = tiles.group_inputs(sel, q, k, v)
        og = tiles.take(tiles.take(out, 0, sel.batch), 1, sel.q_heads)
        lg = tiles.take(tiles.take(lse, 0, sel.batch), 1, sel.q_heads)
        gg = tiles.take(tiles.take(grad_out, 0, sel.batch), 1, sel.q_heads)
        gl = None if grad_lse is None else tiles.take(tiles.take(grad_lse, 0, sel.batch), 1, sel.q_heads)
        g_q, g_k, g_v = _backward_group(call, gi, group, sel, qg, kg, vg, og, lg, gg, gl, grads)
        for dst, src, heads in ((dq, g_q, sel.q_heads), (dk, g_k, sel.kv_heads), (dv, g_v, sel.kv_heads)):
            if heads is None:
                tiles.put(dst, 0, sel.batch, src, add=True)
            else:
                part = tiles.take(dst, 0, sel.batch)
                tiles.put(part, 1, heads, src, add=True)
                if sel.batch is not None and not isinstance(sel.batch, tuple):
                    dst.index_copy_(0, sel.batch, part)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _TiledAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, call: tiles.TileCall, *params):
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


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    prepared: PreparedMask,
    *,
    scale: float,
    dropout_p: float = 0.0,
    seed: int | None = None,
    bias: Bias | None = None,
    softcap: float | None = None,
    score_mod: ScoreMod | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-sparse attention on 4-D inputs; returns ``(out, lse)``.

    q: (B, Hq, Lq, D), k: (B, Hkv, Lk, D), v: (B, Hkv, Lk, Dv); ``prepared`` from
    :func:`attnkit.prepare` for these lengths. ``out: (B, Hq, Lq, Dv)``,
    ``lse: (B, Hq, Lq)`` in float32 (float64 for float64 inputs), -inf where a query
    may attend no key. Both are differentiable, as are the tensors of ``bias`` (an
    :class:`attnkit.bias.Bias`, evaluated one tile at a time). ``softcap`` caps the
    scaled scores with ``softcap * tanh(s / softcap)`` before the bias; ``score_mod`` (an
    :class:`attnkit.score_mods.ScoreMod`) modifies them after it, tile by tile, with gradients.
    """
    if dropout_p > 0.0 and seed is None:
        seed = draw_seed()
    # one copy here rather than one per run: the fused engine needs unit-stride rows
    q, k, v = (_aten.rows_contiguous(t) for t in (q, k, v))
    nat, fused, band = engine(q, k, v, prepared, bias, softcap, score_mod, dropout_p)
    params = (() if bias is None else tuple(bias.params())) + (() if score_mod is None else score_mod.params)
    call = tiles.TileCall(
        prepared, scale, dropout_p, seed or 0, fused, bias, softcap, params, score_mod=score_mod, band=band, native=nat
    )
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, *params)):
        return _TiledAttention.apply(q, k, v, call, *params)
    return _forward(call, q, k, v)


def backward_part(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    prepared: PreparedMask,
    out: torch.Tensor,
    lse: torch.Tensor,
    grad_out: torch.Tensor,
    grad_lse: torch.Tensor | None = None,
    *,
    scale: float,
    bias: Bias | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of attention over some of the keys, from the final ``out`` and ``lse``.

    When a softmax spans several key sets (ring attention's ranks), each set's share of
    the gradient is the usual backward pass with the *merged* output and log-sum-exp:
    ``dS = P (dP - rowsum(dO * O))`` with ``P = exp(S - lse)``. No forward is recomputed.
    4-D inputs as :func:`attention`'s; ``prepared`` is this key set's mask; ``grad_lse``
    is the gradient of the merged lse (or None). Bias parameters get no gradient here.
    """
    q, k, v = (_aten.rows_contiguous(t) for t in (q, k, v))
    nat, fused, band = engine(q, k, v, prepared, bias, softcap, None, 0.0)
    call = tiles.TileCall(prepared, scale, 0.0, 0, fused, bias, softcap, (), own_lse=False, band=band, native=nat)
    return _backward(call, q, k, v, out, lse, grad_out, grad_lse, {})


# --- under torch.compile: the kernel as custom ops ------------------------------------------------
#
# Compiled code cannot walk the host-side plan, so the kernel runs as two custom ops whose
# eager implementations do: they take the tensors and the PreparedMask's handle (a 0-d
# tensor, so a new mask of the same shapes runs the same compiled graph) and find the
# prepared plan from it. Their fake implementations give the output shapes.

BLOCK_SIZE = (128, 64)


def _compiled_call(handle, q, v, scale: float, softcap: float) -> tiles.TileCall:
    prepared = from_handle(handle).with_block_size(BLOCK_SIZE)
    capped = softcap if softcap > 0.0 else None
    fused = capped is None and fused_available(q, v)
    return tiles.TileCall(prepared, scale, 0.0, 0, fused, None, capped, native=native_runs(q, prepared))


@torch.library.custom_op("attnkit::tiled_forward", mutates_args=())
def compiled_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, handle: torch.Tensor, scale: float, softcap: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of the block-sparse kernel for compiled code (``softcap`` 0: none)."""
    q, k, v = (_aten.rows_contiguous(t) for t in (q, k, v))
    with torch.no_grad():
        out, lse = _forward(_compiled_call(handle, q, v, scale, softcap), q, k, v)
    return out.contiguous(), lse.contiguous()


@compiled_forward.register_fake
def _(q, k, v, handle, scale, softcap):
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
    handle: torch.Tensor,
    scale: float,
    softcap: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of :func:`compiled_forward`, recomputed from its saved lse."""
    q, k, v = (_aten.rows_contiguous(t) for t in (q, k, v))
    if grad_lse is not None and not bool(grad_lse.any()):  # compiled autograd hands an unused lse zeros:
        grad_lse = None  # without a gradient the fused engine runs the backward (2x faster)
    dq, dk, dv = _backward(_compiled_call(handle, q, v, scale, softcap), q, k, v, out, lse, grad_out, grad_lse, {})
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


@compiled_backward.register_fake
def _(grad_out, grad_lse, q, k, v, out, lse, handle, scale, softcap):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_compiled(ctx, inputs, output):
    q, k, v, handle, scale, softcap = inputs
    ctx.save_for_backward(q, k, v, *output, handle)
    ctx.scale, ctx.softcap = scale, softcap


def _compiled_grad(ctx, grad_out, grad_lse):
    q, k, v, out, lse, handle = ctx.saved_tensors
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    dq, dk, dv = compiled_backward(grad_out, grad_lse, q, k, v, out, lse, handle, ctx.scale, ctx.softcap)
    return dq, dk, dv, None, None, None


torch.library.register_autograd("attnkit::tiled_forward", _compiled_grad, setup_context=_setup_compiled)


#: Below this many (query, key) pairs one fused dense call beats tiling a masked plan ...
MIN_PAIRS = 256 * 256
#: ... unless the keys are many (decoding over a long padded cache reads only each
#: sequence's own keys here).
MIN_KEYS = 1024
#: ... and for a mask that only cuts each sequence's keys (padding) from this many keys on
#: (decoding: 1.3-6x faster than the dense mask at 128-1024 keys and batches of 1-64; the
#: dense mask wins at ~32 keys).
PADDING_MIN_KEYS = 128
#: Masked plans run here when at most this fraction of blocks is kept, by (half precision,
#: with backward); plans of full blocks, or of causal squares and full blocks (a prefix-LM:
#: 1.6-2x faster than the dense mask at 54-69% kept, bf16 and fp32 with backward), get
#: MAX_KEPT_FULL. From benchmarks/cpu.py.
MAX_KEPT = {(False, False): 0.85, (False, True): 0.6, (True, False): 0.6, (True, True): 0.3}
MAX_KEPT_FULL = 0.85


def _as4d(call: Call) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The call's q, k and v as (B, H, L, D) views."""
    lead = (1,) * (4 - call.shapes.rank)
    return tuple(t.reshape(*lead, *t.shape) for t in (call.q, call.k, call.v))  # type: ignore[return-value]


class TiledKernel(Kernel):
    """The block-sparse kernel: inputs of rank 2 to 4, bool or mask-object masks."""

    name = "tiled"
    block_size = BLOCK_SIZE
    supports_dropout = True
    supports_lse = True
    supports_score_mods = ("bias", "softcap", "score_mod")  # sinks: added by the registry from the lse
    max_rank = 4

    def _reasons(self, call: Call) -> list[str]:
        reasons = []
        if call.compiling:
            if not isinstance(call.mask, PreparedMask):
                reasons.append(
                    "under torch.compile it reads a PreparedMask made outside the compiled function "
                    "(attnkit.prepare); mask objects become dense masks in the graph"
                )
            if call.bias is not None or call.score_mod is not None or call.dropout_p > 0.0:
                reasons.append("under torch.compile: no attn_bias, score_mod or dropout (they run eagerly only)")
        return reasons

    def engine(self, call: Call) -> str | None:
        return engine_words(call, call.prepared_at(self.block_size))

    def prefers(self, call: Call) -> tuple[bool, Reason]:
        yes, why = self._prefers(call)
        if not yes or call.compiling:
            return yes, why

        def with_engine() -> str:
            return f"{why if isinstance(why, str) else why()}; {self.engine(call)}"

        return True, with_engine

    def _prefers(self, call: Call) -> tuple[bool, Reason]:
        s = call.shapes
        if call.compiling:  # the user prepared the mask for this: no host reads while tracing
            return True, "under torch.compile: block-sparse through a custom op over the PreparedMask"
        if call.q.device.type != "cpu":
            return (
                False,
                lambda: (
                    f"on {call.q.device.type} its math engine is a Python loop of small matmuls "
                    "(kernel='tiled' forces it)"
                ),
            )

        def prepared():
            return call.prepared_at(self.block_size)

        if call.score_mods():
            p = prepared()

            def how() -> str:
                q4, k4, v4 = _as4d(call)
                _, _, band = engine(q4, k4, v4, p, call.bias, call.softcap, call.score_mod, call.dropout_p)
                parts = []
                if call.bias is not None:
                    parts.append(f"attn_bias {'as a band of kv - q' if band is not None else 'on each tile'}")
                if call.softcap is not None or call.score_mod is not None:
                    parts.append("softcap/score_mod on each tile")
                if call.sinks is not None:
                    parts.append("sinks from the lse")
                return f"{p.kept:.0%} of blocks kept, " + ", ".join(parts)

            return True, how
        if call.dropout_p > 0.0 or call.return_lse:
            p = prepared()
            why = f"dropout_p={call.dropout_p}" if call.dropout_p > 0.0 else "return_lse=True"
            return True, lambda: f"{why}, {p.kept:.0%} of blocks kept"
        if native_prefers(call):
            p = prepared()
            rows = math.prod(s.batch) * s.hq * s.lq
            what = "no mask" if call.mask is None else f"{p.kept:.0%} of blocks kept"
            return True, lambda: f"{what}, {rows} query rows"
        if call.mask is None:
            return False, "no mask: SDPA's fused kernel"
        if call.causal_shift() == 0 and call.scale > 0.0:
            return False, "is_causal: SDPA's fused kernel"
        small = lambda: f"dense mask: Lq*Lk={call.pairs} is small"  # noqa: E731
        if call.tensor_mask and call.pairs < MIN_PAIRS:
            return False, small
        if call.hides_nothing_here():
            return False, "the mask hides nothing here"
        padding = call.limit_only() and s.lk >= PADDING_MIN_KEYS
        if call.pairs < MIN_PAIRS and s.lk <= MIN_KEYS and not padding:
            return False, small
        p = prepared()
        if p.hides_nothing:
            return False, "the mask hides nothing here"
        if p.limit_only and p.kv_limit_value and s.rank == 4:
            return False, lambda: f"every sequence's keys end at {p.kv_limit_value}: SDPA over those keys"
        if not p.masked and p.kv_limit is not None:
            return True, lambda: f"{p.kept:.0%} of blocks kept, all full, keys past each sequence's end unread"
        if not p.masked and p.kept <= MAX_KEPT_FULL:
            return True, lambda: f"{p.kept:.0%} of blocks kept, all full"
        if call.pairs < MIN_PAIRS:
            return False, small
        if p.kept <= MAX_KEPT[(call.half, call.backward)]:
            return True, lambda: f"{p.kept:.0%} of blocks kept"
        if p.kept <= MAX_KEPT_FULL and squares_and_full(p, *_as4d(call)):
            return True, lambda: f"{p.kept:.0%} of blocks kept: causal squares and full blocks"
        return False, lambda: f"{p.kept:.0%} of blocks kept: the dense mask is faster"

    def runner(self, call: Call) -> Runner | None:
        if call.score_mods() or call.dropout_p > 0.0 or call.compiling:
            return None
        s, prepared, scale = call.shapes, call.prepared_at(self.block_size), call.scale
        lead = (1,) * (4 - s.rank)

        def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            q4, k4, v4 = (t.reshape(*lead, *t.shape) for t in (q, k, v))  # (B, H, L, D)
            return attention(q4, k4, v4, prepared, scale=scale)[0].reshape(s.out)

        return first_derivative_only(run, self) if call.backward else run

    def run(self, call: Call) -> tuple[torch.Tensor, torch.Tensor | None]:
        s = call.shapes
        q4, k4, v4 = _as4d(call)
        if call.compiling:
            assert isinstance(call.mask, PreparedMask), "compiled calls carry a PreparedMask"
            out, lse = compiled_forward(q4, k4, v4, call.mask.handle, call.scale, call.softcap or 0.0)
            return out.reshape(s.out), lse.reshape(s.scores[:-1]) if call.return_lse else None
        out, lse = attention(
            q4,
            k4,
            v4,
            call.prepared_at(self.block_size),
            scale=call.scale,
            dropout_p=call.dropout_p,
            bias=call.bias,
            softcap=call.softcap,
            score_mod=call.score_mod,
        )
        return out.reshape(s.out), lse.reshape(s.scores[:-1]) if call.return_lse else None
