"""Block-sparse attention in plain PyTorch: visit only the blocks a mask keeps.

The query axis is cut into row blocks of ``bq`` queries. For each row block the
mask's block map (:meth:`attnkit.masks.Mask.block_map`, ``bk`` keys per block)
gives the key blocks that are not empty, grouped into *runs*: stretches of
adjacent blocks that are all FULL (no element mask needed) or all PARTIAL (the
mask is evaluated on that tile only). Each run is one exact attention call that
returns its output and row log-sum-exp; runs merge exactly by log-sum-exp.
Nothing of size ``Lq x Lk`` is ever allocated: the largest tile is ``bq x Lk``.

Two engines compute a run:

- ``fused``: PyTorch's CPU flash-attention kernel
  (``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward), used
  when there is no dropout and the inputs are on the CPU;
- ``math``: matmul, softmax statistics in float32 or float64, matmul; used for
  dropout (a keep-mask drawn per run from a generator seeded once per call from
  the global generator, so ``torch.manual_seed`` reproduces it) and off the CPU.

Backward recomputes each run from the saved log-sum-exp (FlashAttention's
scheme), so training memory stays O(L). Grouped-query attention folds the Hq/Hkv
query heads of a group into the row axis instead of copying K/V per query head.

Equivalent pytorch code: ``reference.attention(q, k, v, mask.materialize(Lq, Lk), scale=scale)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from attnkit import masks as _masks
from attnkit.kernels.reference import used_keys

_NEG_INF = float("-inf")


@dataclass(frozen=True)
class Run:
    """Keys ``[k0, k1)`` of one row block; ``full`` means every pair may attend."""

    k0: int
    k1: int
    full: bool


@dataclass(frozen=True)
class RowBlock:
    """Queries ``[q0, q1)`` and the runs of keys they attend to."""

    q0: int
    q1: int
    runs: tuple[Run, ...]


@dataclass
class TilePlan:
    """Which tiles a call visits. ``kept`` is the fraction of blocks that are not empty.

    A plan also keeps the mask tiles it has evaluated (up to ``TILE_CACHE_BYTES``), so
    the backward pass and later calls with the same mask and sizes reuse them.
    """

    rows: tuple[RowBlock, ...]
    kept: float
    bq: int
    bk: int
    tiles: dict = field(default_factory=dict, repr=False)
    tile_bytes: int = 0

    @property
    def masked(self) -> bool:
        """Whether any run applies an element mask (else every visited block is full)."""
        return any(not run.full for row in self.rows for run in row.runs)


#: Memory a plan may spend on evaluated mask tiles.
TILE_CACHE_BYTES = 256 * 2**20


def block_sizes(q_len: int, kv_len: int) -> tuple[int, int]:
    """Query and key block sizes, chosen from ``benchmarks/cpu.py`` measurements."""
    return 128, 64


def plan_for(mask, q_len: int, kv_len: int, device=None) -> TilePlan:
    """The plan at the default block sizes, remembered by the mask object.

    A mask object is reused across calls and layers, like FlexAttention's block
    masks; its plan is rebuilt when the tensors it holds change in place.
    """
    bq, bk = block_sizes(q_len, kv_len)
    if mask is None:
        return plan_tiles(None, q_len, kv_len, bq, bk, device)
    key = (q_len, kv_len, bq, bk, str(device), mask._versions())
    cache = mask.__dict__.setdefault("_plans", {})
    if key not in cache:
        if len(cache) >= 8:
            cache.pop(next(iter(cache)))
        cache[key] = plan_tiles(mask, q_len, kv_len, bq, bk, device)
    return cache[key]


def plan_tiles(mask, q_len: int, kv_len: int, bq: int, bk: int, device=None) -> TilePlan:
    """The row blocks and key runs to visit for ``mask`` (a Mask object or None)."""
    nq, nk = -(-q_len // bq), -(-kv_len // bk)
    if mask is None:
        state = torch.full((nq, nk), _masks.FULL, dtype=torch.int8)
    else:
        codes = mask.block_map(q_len, kv_len, bq, bk, device).flatten(0, 1)  # (B*H, nq, nk)
        # a block is visited if any sequence/head needs it, and skips the element mask
        # only if it is full for all of them
        nonempty = (codes != _masks.EMPTY).any(dim=0)
        full = (codes == _masks.FULL).all(dim=0)
        state = torch.where(full, _masks.FULL, nonempty.to(torch.int8) * _masks.PARTIAL)
    kept = float((state != _masks.EMPTY).float().mean()) if state.numel() else 0.0
    rows: list[RowBlock] = []
    for i, row in enumerate(state.tolist()):
        block = RowBlock(i * bq, min((i + 1) * bq, q_len), _runs(row, bk, kv_len))
        if rows and rows[-1].runs == block.runs and _can_grow(rows[-1], block):
            block = RowBlock(rows[-1].q0, block.q1, block.runs)  # one call for both
            rows.pop()
        rows.append(block)
    return TilePlan(tuple(rows), kept, bq, bk)


#: Adjacent row blocks with the same runs are computed as one, up to this many
#: (query, key) pairs per run when the run needs its element mask.
MAX_MASKED_TILE = 2**20
MAX_ROWS = 4096


def _can_grow(prev: RowBlock, block: RowBlock) -> bool:
    rows = block.q1 - prev.q0
    if rows > MAX_ROWS:
        return False
    return all(run.full or rows * (run.k1 - run.k0) <= MAX_MASKED_TILE for run in block.runs)


#: A stretch of FULL key blocks shorter than this is computed with its PARTIAL
#: neighbours under one mask: one masked call is cheaper than splitting and merging.
MIN_FULL_RUN = 1024


def _runs(row: list[int], bk: int, kv_len: int) -> tuple[Run, ...]:
    """The runs of one row of block codes.

    Non-empty blocks that touch form one run; a FULL stretch of at least
    MIN_FULL_RUN keys becomes a run of its own that skips the element mask.
    """
    segments = []  # [k0, k1, full] with one code each
    for j, code in enumerate(row):
        if code == _masks.EMPTY:
            continue
        k0, k1, full = j * bk, min((j + 1) * bk, kv_len), code == _masks.FULL
        if segments and segments[-1][1] == k0 and segments[-1][2] == full:
            segments[-1][1] = k1
        else:
            segments.append([k0, k1, full])
    def touches_partial(i: int) -> bool:
        before = i > 0 and segments[i - 1][1] == segments[i][0] and not segments[i - 1][2]
        after = i + 1 < len(segments) and segments[i + 1][0] == segments[i][1] and not segments[i + 1][2]
        return before or after

    # a full stretch too short to be worth a call of its own joins its partial neighbours
    flags = [full and (k1 - k0 >= MIN_FULL_RUN or not touches_partial(i)) for i, (k0, k1, full) in enumerate(segments)]
    runs: list[list] = []
    for (k0, k1, _), full in zip(segments, flags):
        if runs and runs[-1][1] == k0 and runs[-1][2] == full:
            runs[-1][1] = k1
        else:
            runs.append([k0, k1, full])
    return tuple(Run(k0, k1, full) for k0, k1, full in runs)


def fused_available(q: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the fused CPU engine can run these inputs (it needs Dv == D)."""
    return (
        q.device.type == "cpu"
        and q.shape[-1] == v.shape[-1]
        and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")
    )


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


@dataclass
class _Call:
    """Everything a forward or backward pass needs besides the tensors."""

    mask: object
    plan: TilePlan
    scale: float
    dropout_p: float
    seed: int
    fused: bool
    q_len: int
    kv_len: int


@dataclass(frozen=True)
class _Tile:
    """A partial run's mask, laid out like the folded queries ``(Bm, Hkv or 1, g*n, S)``."""

    allowed: torch.Tensor  # bool, True = may attend
    additive: torch.Tensor  # 0 / -inf in the inputs' dtype, for the fused engine
    hidden_rows: torch.Tensor | None  # (Bm, Hkv or 1, g*n): rows with no key here; None if none
    used_keys: torch.Tensor | None  # (Bm, Hkv or 1, S, 1): keys some row uses; None if all


def _tile(call: _Call, row: RowBlock, run: Run, hq: int, hkv: int, dtype, device) -> _Tile | None:
    """The evaluated mask of a partial run (None for a full one), from the plan's cache."""
    if run.full:
        return None
    key = (row.q0, run.k0, hq, hkv, dtype)
    cached = call.plan.tiles.get(key)
    if cached is not None:
        return cached
    q_idx = torch.arange(row.q0, row.q1, device=device)[:, None]
    kv_idx = torch.arange(run.k0, run.k1, device=device)[None, :]
    tile = call.mask._elements(q_idx, kv_idx, call.q_len, call.kv_len)
    tile = tile.expand(*tile.shape[:2], row.q1 - row.q0, run.k1 - run.k0)  # (Bm, Hm, n, S)
    used = used_keys(tile, hkv)
    allowed = _fold_tile(tile, hq, hkv)  # (Bm, Hkv or 1, g*n, S)
    visible = allowed.any(dim=-1)
    additive = torch.where(
        allowed, torch.zeros((), dtype=dtype, device=device), torch.full((), _NEG_INF, dtype=dtype, device=device)
    )
    result = _Tile(allowed, additive, None if visible.all() else ~visible, None if used.all() else used)
    size = allowed.numel() * (1 + additive.element_size())
    if call.plan.tile_bytes + size <= TILE_CACHE_BYTES:
        call.plan.tiles[key] = result
        call.plan.tile_bytes += size
    return result


def _keep_mask(call: _Call, row: RowBlock, run: Run, shape, device) -> torch.Tensor:
    """Dropout keep-mask of one run; the same on every call with the same seed."""
    g = torch.Generator(device=device)
    g.manual_seed((call.seed + 1_000_003 * row.q0 + run.k0) % (2**63))
    return torch.rand(shape, generator=g, device=device) >= call.dropout_p


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _run_inputs(call: _Call, q, k, v, row: RowBlock, run: Run):
    """Folded queries, K/V slices (keys no row uses zeroed) and the tile of one run."""
    hq, hkv = q.shape[1], k.shape[1]
    kr, vr = k[:, :, run.k0 : run.k1], v[:, :, run.k0 : run.k1]  # (B, Hkv, S, D)
    tile = _tile(call, row, run, hq, hkv, q.dtype, q.device)
    if tile is not None and tile.used_keys is not None:  # NaN/Inf in keys no query uses
        zero = k.new_zeros(())
        kr, vr = torch.where(tile.used_keys, kr, zero), torch.where(tile.used_keys, vr, zero)
    qf = _fold(q[:, :, row.q0 : row.q1], hkv)  # (B, Hkv, group * n, D)
    return qf, kr, vr, tile


def _math_scores(call: _Call, qf, kr, tile: _Tile | None):
    ct = _compute_dtype(qf.dtype)
    s = (qf.to(ct) @ kr.to(ct).transpose(-2, -1)) * call.scale  # (B, Hkv, g*n, D) x (B, Hkv, D, S)
    if tile is not None:
        s = s.masked_fill(~tile.allowed, _NEG_INF)
    return s


def _forward(call: _Call, q, k, v):
    """Returns ``out: (B, Hq, Lq, Dv)`` and ``lse: (B, Hq, Lq)`` (-inf for fully masked rows)."""
    b, hq, lq, _ = q.shape
    dv = v.shape[-1]
    out = q.new_empty(b, hq, lq, dv)
    lse = torch.empty((b, hq, lq), dtype=_compute_dtype(q.dtype), device=q.device)
    for row in call.plan.rows:
        if not row.runs:  # every query of the block is fully masked
            out[:, :, row.q0 : row.q1] = 0.0
            lse[:, :, row.q0 : row.q1] = _NEG_INF
            continue
        parts = []
        for run in row.runs:
            qf, kr, vr, tile = _run_inputs(call, q, k, v, row, run)
            if call.fused:
                o, lse_r = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                    qf, kr, vr, attn_mask=None if tile is None else tile.additive, scale=call.scale
                )
            else:
                s = _math_scores(call, qf, kr, tile)
                lse_r = torch.logsumexp(s, dim=-1)
                p = torch.exp(s - torch.where(lse_r == _NEG_INF, 0.0, lse_r)[..., None])
                if call.dropout_p > 0.0:
                    p = p * _keep_mask(call, row, run, p.shape, q.device) / (1.0 - call.dropout_p)
                o = p @ vr.to(p.dtype)  # (B, Hkv, g*n, S) x (B, Hkv, S, Dv)
            if tile is not None and tile.hidden_rows is not None:
                lse_r = lse_r.masked_fill(tile.hidden_rows, _NEG_INF)  # rows this run hides entirely
            parts.append((o, lse_r))
        o, lse_r = _merge(parts)
        out[:, :, row.q0 : row.q1] = _unfold(o, hq).to(q.dtype)
        lse[:, :, row.q0 : row.q1] = _unfold(lse_r, hq)
    return out, lse


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


def _backward(call: _Call, q, k, v, out, lse, grad_out):
    hq, hkv = q.shape[1], k.shape[1]
    ct = _compute_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=ct, device=q.device)
    dk = torch.zeros(k.shape, dtype=ct, device=q.device)
    dv = torch.zeros(v.shape, dtype=ct, device=q.device)
    lse_safe = torch.where(lse == _NEG_INF, 0.0, lse)
    for row in call.plan.rows:
        if not row.runs:
            continue
        rows = slice(row.q0, row.q1)
        go = _fold(grad_out[:, :, rows], hkv)  # (B, Hkv, g*n, Dv)
        of = _fold(out[:, :, rows], hkv)
        lf = _fold(lse_safe[:, :, rows, None], hkv)[..., 0]  # (B, Hkv, g*n)
        dqf = 0
        delta = (go.to(ct) * of.to(ct)).sum(dim=-1, keepdim=True)  # (B, Hkv, g*n, 1)
        for run in row.runs:
            qf, kr, vr, tile = _run_inputs(call, q, k, v, row, run)
            keys = slice(run.k0, run.k1)
            if call.fused:
                g_q, g_k, g_v = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                    go.contiguous(), qf, kr, vr, of, lf, 0.0, False,
                    attn_mask=None if tile is None else tile.additive, scale=call.scale,
                )
            else:
                s = _math_scores(call, qf, kr, tile)
                p = torch.exp(s - lf[..., None])  # (B, Hkv, g*n, S)
                dp = go.to(ct) @ vr.to(ct).transpose(-2, -1)
                pd = p
                if call.dropout_p > 0.0:
                    keep = _keep_mask(call, row, run, p.shape, q.device).to(ct) / (1.0 - call.dropout_p)
                    pd, dp = p * keep, dp * keep
                g_v = pd.transpose(-2, -1) @ go.to(ct)
                ds = p * (dp - delta) * call.scale
                g_q = ds @ kr.to(ct)
                g_k = ds.transpose(-2, -1) @ qf.to(ct)
            dqf = dqf + g_q.to(ct)
            dk[:, :, keys] += g_k.to(ct)
            dv[:, :, keys] += g_v.to(ct)
        dq[:, :, rows] = _unfold(dqf, hq)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _TiledAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, call: _Call):
        out, lse = _forward(call, q, k, v)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.call = call
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _backward(ctx.call, q, k, v, out, lse, grad_out)
        return dq, dk, dv, None


def draw_seed() -> int:
    """One draw from the global generator that seeds a call's dropout."""
    return int(torch.randint(0, 2**62, (1,)).item())


def attention(
    q, k, v, mask=None, *, scale: float, dropout_p: float = 0.0, plan: TilePlan | None = None,
    seed: int | None = None,
):
    """Block-sparse attention on 4-D inputs; returns ``(out, lse)``.

    q: (B, Hq, Lq, D), k: (B, Hkv, Lk, D), v: (B, Hkv, Lk, Dv); mask: an attnkit mask
    object or None. ``out: (B, Hq, Lq, Dv)``, ``lse: (B, Hq, Lq)`` in float32 (float64 for
    float64 inputs), -inf where a query may attend no key.
    """
    lq, lk = q.shape[-2], k.shape[-2]
    if plan is None:
        plan = plan_for(mask, lq, lk, q.device)
    if dropout_p > 0.0 and seed is None:
        seed = draw_seed()
    call = _Call(
        mask=mask,
        plan=plan,
        scale=scale,
        dropout_p=dropout_p,
        seed=seed or 0,
        fused=dropout_p == 0.0 and fused_available(q, v),
        q_len=lq,
        kv_len=lk,
    )
    return _TiledAttention.apply(q, k, v, call)


def dropout_keep_mask(q, k, mask, *, dropout_p: float, seed: int, plan: TilePlan | None = None):
    """The full ``(B, Hq, Lq, Lk)`` keep-mask a call with this seed uses (for tests; O(L^2)).

    Entries outside the visited tiles are False.
    """
    b, hq, lq, _ = q.shape
    hkv, lk = k.shape[1], k.shape[-2]
    if plan is None:
        plan = plan_tiles(mask, lq, lk, *block_sizes(lq, lk), q.device)
    call = _Call(mask, plan, 1.0, dropout_p, seed, False, lq, lk)
    keep = torch.zeros(b, hq, lq, lk, dtype=torch.bool, device=q.device)
    for row in plan.rows:
        for run in row.runs:
            shape = (b, hkv, (hq // hkv) * (row.q1 - row.q0), run.k1 - run.k0)
            tile = _keep_mask(call, row, run, shape, q.device)
            keep[:, :, row.q0 : row.q1, run.k0 : run.k1] = _unfold(tile, hq)
    return keep
