"""The ``fused`` kernel: a prepared mask's runs, each one call of PyTorch's fused CPU flash kernel.

It walks the plan (:mod:`attnkit.kernels.blocksparse`) and computes each run of key blocks with
``aten._scaled_dot_product_flash_attention_for_cpu`` (:mod:`attnkit.kernels._aten`), a partial
run with its tile as the additive mask, and merges the runs by log-sum-exp. A bias of ``kv - q``
alone (ALiBi, T5's relative bias, their sums) is one band per head (:meth:`attnkit.bias.Bias.band`)
taken as the additive mask through a strided view (:func:`attnkit.kernels.tiles.band_mask`).
Stretches of row blocks that form a causal square run as one ``is_causal`` call; an unmasked or
SDPA-causal plan is one call. It needs Dv == D and no dropout, softcap or score_mod; the
gradients of a bias's own tensors and of the lse come from the math kernel's formula in its
backward (PyTorch's fused backward computes neither). Used where the native engine is not
(no compiler, ``ATTNKIT_NATIVE=0``) and for calls of fewer than 16 queries (decoding steps).

Equivalent pytorch code: ``reference.attention(q, k, v, prepared.materialize(), scale=scale)``.
"""

from __future__ import annotations

import torch

from attnkit import _cache
from attnkit.kernels import _aten, blocksparse, tiled_math, tiles
from attnkit.kernels.blocksparse import BLOCK_SIZE, Square
from attnkit.kernels.lse import merge
from attnkit.kernels.registry import Call, Kernel, Reason, Runner, first_derivative_only
from attnkit.prepare import Group, PreparedMask, RowBlock, Run

__all__ = ["SQUARE_MIN_ROWS", "FusedKernel", "squares_and_full"]

#: Causal squares from this many rows on run as one ``is_causal`` call: the fused kernel tiles
#: 256 queries x 512 keys from 768 queries on, and skips the tiles above the diagonal; on
#: smaller squares its 512-key tiles compute the whole square, and the per-row-block runs win
#: (benchmarks/cpu.py, documents of 512 vs 768-2048 tokens with a causal mask).
SQUARE_MIN_ROWS = 768


def available(q: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether PyTorch's fused CPU kernel can run these inputs (it needs Dv == D)."""
    return q.device.type == "cpu" and q.shape[-1] == v.shape[-1] and _aten.AVAILABLE


# --- causal squares ----------------------------------------------------------------------------


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
    :class:`Square` (no bias, Hq == Hkv). Found from the evaluated diagonal tiles once per
    prepared mask and kept in its store."""
    hq, hkv = q.shape[1], k.shape[1]
    if call.band is not None or hq != hkv or len(group.rows) < 2:
        return list(group.rows)
    store = _cache.plan_store(call.prepared)
    key = ("fused squares", gi, hq, hkv, q.dtype, str(q.device))
    found = store.get(key)
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
    store.put(key, steps, 64 * len(steps))
    return steps


def squares_and_full(prepared: PreparedMask, call: Call) -> bool:
    """Whether the plan runs as causal squares plus row blocks of full runs only: a plan of one
    group that costs what a plan of full blocks does."""
    q, k, v = blocksparse.as4d(call)
    groups = prepared.groups
    one = len(groups) == 1 and groups[0].batch is None and groups[0].heads is None
    if not one or q.shape[1] != k.shape[1] or not available(q, v):
        return False
    tc = tiles.TileCall(prepared, scale=1.0, dropout_p=0.0, seed=0, engine="fused")
    sel = tiles.select(groups[0], prepared, q.shape[0], q.shape[1], k.shape[1], q.device)
    steps = _steps(tc, 0, groups[0], sel, q, k)
    return any(isinstance(s, Square) for s in steps) and all(
        isinstance(s, Square) or all(run.full for run in s.runs) for s in steps
    )


# --- the engine ----------------------------------------------------------------------------------


def _one_call(call: tiles.TileCall, q, k) -> bool | None:
    """``is_causal`` when one call of the fused kernel computes the whole result (no mask, or
    a causal one that is exactly SDPA's), else None. It returns the lse, which SDPA does not."""
    if call.bias is not None or not call.scale > 0.0:
        return None
    if q.shape[1] != k.shape[1] or q.shape[2] == 0 or k.shape[2] == 0:
        return None
    p = call.prepared
    if p.hides_nothing:
        return False
    if p.causal_shift == 0 and p.q_len <= p.kv_len:
        return True  # SDPA's top-left causal square (a ring's diagonal rectangle: equal, moved offsets)
    return None


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


def _backward_lse(lse: torch.Tensor) -> torch.Tensor:
    """The lse as PyTorch's fused backward needs it, with no host sync: 0 for a row that sees no
    key (its weights exp(s - 0) are then 0 under the -inf mask), and NaN for a row whose lse is +inf
    (an Inf that the row sees: its weights are NaN by the formula, where exp(s - inf) would give 0
    for the finite scores); a NaN lse stays NaN and makes the row's weights NaN."""
    return torch.where(lse == tiles.NEG_INF, 0.0, torch.where(lse == float("inf"), float("nan"), lse))


class _FusedEngine:
    """The fused walk's parts (registered in :data:`attnkit.kernels.blocksparse.ENGINES`)."""

    def forward_whole(self, call: tiles.TileCall, q, k, v):
        causal = _one_call(call, q, k)
        if causal is None:
            return None
        out, lse = _aten.flash_forward(q, k, v, scale=call.scale, is_causal=causal)
        return out, lse.to(tiles.compute_dtype(q.dtype))

    steps = staticmethod(_steps)

    def forward_run(self, call: tiles.TileCall, gi: int, sel: tiles.Select, q, k, v, row: RowBlock, run: Run):
        hq, hkv = q.shape[1], k.shape[1]
        qf, kr, vr, tile = tiles.run_inputs(call, gi, sel, q, k, v, row, run)
        if call.band is not None:  # the bias as the additive mask, in reversed query order
            per_kv = hq // hkv
            mask = tiles.band_mask(call, sel, row, run, tile, hq, hkv)
            o, lse_r = _aten.flash_forward(tiles.flip_rows(qf, per_kv), kr, vr, attn_mask=mask, scale=call.scale)
            return tiles.flip_rows(o, per_kv), tiles.flip_rows(lse_r, per_kv)
        return _aten.flash_forward(qf, kr, vr, attn_mask=None if tile is None else tile.additive, scale=call.scale)

    def forward_square(self, call: tiles.TileCall, sq: Square, q, k, v):
        rows, square = slice(sq.a, sq.b), slice(sq.a, sq.b)
        parts = [_aten.flash_forward(q[:, :, rows], k[:, :, square], v[:, :, square], scale=call.scale, is_causal=True)]
        if sq.c < sq.a:
            before = slice(sq.c, sq.a)
            parts.append(_aten.flash_forward(q[:, :, rows], k[:, :, before], v[:, :, before], scale=call.scale))
        return merge(parts)

    def backward_whole(self, call: tiles.TileCall, q, k, v, out, lse, grad_out, grad_lse):
        causal = _one_call(call, q, k) if grad_lse is None else None
        if causal is None:
            return None
        return _aten.flash_backward(
            grad_out.to(q.dtype).contiguous(),
            q,
            k,
            v,
            out.to(q.dtype),
            _backward_lse(lse).to(tiles.compute_dtype(q.dtype)),
            scale=call.scale,
            is_causal=causal,
        )

    def backward_group(
        self, call: tiles.TileCall, gi, group: Group, sel: tiles.Select, q, k, v, out, lse, grad_out, grad_lse, grads
    ):
        """One fused backward call per run (or per causal square and its rectangle), summed into
        :class:`_Sums`; with a gradient of the lse or of the bias's tensors, the math formula."""
        # the math formula for what PyTorch's fused backward cannot compute: gradients of the lse
        # or of a bias's tensors
        if grad_lse is not None or call.bias_grad:
            return tiled_math.ENGINE.backward_group(call, gi, group, sel, q, k, v, out, lse, grad_out, grad_lse, grads)
        lse_safe = _backward_lse(lse)
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


ENGINE = blocksparse.ENGINES["fused"] = _FusedEngine()


class FusedKernel(Kernel):
    """PyTorch's fused CPU flash kernel per run of a prepared mask (see the module's docstring)."""

    name = "fused"
    devices = ("cpu",)
    block_size = BLOCK_SIZE
    supports_lse = True
    supports_backward_part = True
    supports_score_mods = ("bias",)  # a band of kv - q; sinks: added by the registry from the lse
    max_rank = 4

    def _reasons(self, call: Call) -> list[str]:
        reasons = blocksparse.compile_refusals(call)
        if not _aten.AVAILABLE:
            reasons.append("PyTorch's fused CPU flash kernel is not in this build of PyTorch")
        if call.shapes.d != call.shapes.dv:
            reasons.append(f"needs Dv == D, not Dv={call.shapes.dv} and D={call.shapes.d}")
        if call.bias is not None and not call.compiling:
            q, k, _ = blocksparse.as4d(call)
            if tiles.band_for(call.bias, q, k) is None:
                reasons.append("a bias that is not a finite function of kv - q alone")
        return reasons

    def prefers(self, call: Call) -> tuple[bool, Reason]:
        if call.compiling:  # the user prepared the mask for this: no host reads while tracing
            return True, "under torch.compile: block-sparse through a custom op over the PreparedMask's tensors"
        if call.bias is not None:
            p = call.prepared_at(self.block_size)
            return True, lambda: f"{p.kept:.0%} of blocks kept, {blocksparse.modifications_in_words(call, True)}"
        if call.return_lse:
            p = call.prepared_at(self.block_size)
            return True, lambda: f"return_lse=True, {p.kept:.0%} of blocks kept"
        if call.sinks is not None:
            p = call.prepared_at(self.block_size)
            return True, lambda: f"{p.kept:.0%} of blocks kept, sinks from the lse"
        return blocksparse.sparse_pays(call, blocksparse.LIMITS, squares_and_full)

    def runner(self, call: Call) -> Runner | None:
        if call.score_mods() or call.dropout_p > 0.0 or call.compiling:
            return None
        s, prepared, scale = call.shapes, call.prepared_at(self.block_size), call.scale
        lead = (1,) * (4 - s.rank)

        def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            q4, k4, v4 = (t.reshape(*lead, *t.shape) for t in (q, k, v))  # (B, H, L, D)
            return blocksparse.attention(q4, k4, v4, prepared, engine="fused", scale=scale)[0].reshape(s.out)

        return first_derivative_only(run, self) if call.backward else run

    def run(self, call: Call) -> tuple[torch.Tensor, torch.Tensor | None]:
        if call.compiling:
            return blocksparse.compiled_run(call, "fused")
        s = call.shapes
        q4, k4, v4 = blocksparse.as4d(call)
        prepared = call.prepared_at(self.block_size)
        out, lse = blocksparse.attention(q4, k4, v4, prepared, engine="fused", scale=call.scale, bias=call.bias)
        return out.reshape(s.out), lse.reshape(s.scores[:-1]) if call.return_lse else None

    def backward_part(
        self, call: Call, out: torch.Tensor, lse: torch.Tensor, grad_out: torch.Tensor, grad_lse: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q4, k4, v4 = blocksparse.as4d(call)
        prepared = call.prepared_at(self.block_size)
        return blocksparse.backward_part(
            q4, k4, v4, prepared, out, lse, grad_out, grad_lse, engine="fused", scale=call.scale, bias=call.bias
        )
