"""``from_fn`` masks: a predicate ``fn(b, h, q_idx, kv_idx)`` evaluated on broadcasting index
tensors where that is proved to equal evaluating it one pair at a time (:mod:`attnkit._pointwise`),
else under ``torch.vmap``, one pair at a time (FlexAttention's semantics)."""

from __future__ import annotations

import copy
import math

import torch

from attnkit import _cache
from attnkit._indexing import as4d, broadcast, check_offset, per_seq, shifted
from attnkit._pointwise import broadcast_proved, indexing_per_pair
from attnkit._validate import (
    AttnkitTypeError,
    AttnkitValueError,
    check_nonnegative_int,
    compiling,
    short,
)
from attnkit.masks import _base, _program
from attnkit.masks._base import Mask, values_of
from attnkit.masks._intervals import Interval, Unsupported, block_bounds
from attnkit.masks._positions import at_sequence, indexed_positions

__all__ = ["FromFn"]


def _evaluate(fn, b, h, qi, ki):
    """``fn`` on broadcasting index tensors where that is proved equal to evaluating it per pair;
    otherwise under torch.vmap over every (b, h, q, kv), FlexAttention's semantics."""
    out, why = broadcast_proved(fn, b, h, qi, ki)
    if out is not None:
        shape = broadcast(b.shape, h.shape, qi.shape, ki.shape)
        fits = isinstance(out, torch.Tensor) and out.dim() <= 4
        try:
            fits = fits and broadcast(out.shape, shape) == shape
        except RuntimeError:
            fits = False
        if fits:
            return out
    try:
        with indexing_per_pair():
            return _per_pair(fn, b, h, qi, ki)
    except Exception as err:  # noqa: BLE001 - say both ways it was tried
        name = getattr(fn, "__name__", type(fn).__name__)
        raise AttnkitValueError(
            f"the mask function {name} could not be evaluated one pair at a time under torch.vmap "
            f"({type(err).__name__}: {str(err)[:200]}), and evaluating it on broadcasting index tensors is not "
            f"known to give the same answer ({why or 'its result has the wrong shape'}). Write it with torch "
            "operations on b, h, q_idx and kv_idx (comparisons, arithmetic, where, indexing a captured tensor), "
            "with no host reads (.item(), .numpy(), bool())."
        ) from err


#: Tiles of at least this many pairs in all are first judged by index ranges (:func:`_tiles_by_ranges`).
RANGES_FROM = 1 << 15
#: Calls of at least this many pairs run the predicate as a program on the native engine where it
#: is one (:mod:`._program`): below it, the engine is not loaded for a mask alone.
NATIVE_FROM = 1 << 12
#: Problems of at most this many pairs (B x H x Lq x Lk) have every pair evaluated once by
#: :meth:`FromFn.codes_with_tiles`, no index ranges first.
EVERY_PAIR_UP_TO = 1 << 21
#: Tiles evaluated at once by :meth:`FromFn.codes_with_tiles` (their bits: bq x bk / 8 bytes each).
TILES_AT_ONCE = 4096


def _native(mask, shape, inputs, mode: int, sample, grid=None) -> torch.Tensor | None:
    """``mask.fn`` over every pair of ``shape`` (T, X, Y) on the native engine (``mode``: see
    :func:`._program.evaluate`): its ``inputs`` are ``b, h, q_idx, kv_idx``, or with ``grid``
    ``(q_len, kv_len, clamp, inside)`` the eight of :meth:`._program.Program.on_grid`. None below
    :data:`NATIVE_FROM` pairs, while compiling, without the engine, or where the predicate is not a
    program (the torch path runs). The program is traced on ``sample`` (one pair's ``b, h, q_idx,
    kv_idx``), once per predicate value and index dtypes (``_cache.PROGRAMS``)."""
    if math.prod(shape) < NATIVE_FROM or compiling() or not _program.available():
        return None
    if any(isinstance(x, torch.Tensor) and x.device.type != "cpu" for x in inputs):
        return None  # the engine is the CPU's: a mask made on a device is evaluated by torch there
    found = _cache.fingerprint(mask.fn)
    key = None if found is None else (found, tuple(x.dtype for x in sample))
    program = None if key is None else _cache.PROGRAMS.get(key)
    if program is None:
        program = _program.trace(mask.fn, *sample) or False
        if key is not None:
            _cache.PROGRAMS.put(key, program)
    if not isinstance(program, _program.Program):  # False: not a program
        return None
    return _program.evaluate(program.on_grid(*grid) if grid else program, inputs, shape, mode)


def _grid(mask, b, h, q_start, q_local, kv_start, kv_local, q_len: int, kv_len: int, clamp: bool):
    """The inputs of :meth:`._program.Program.on_grid` (offsets added per sequence) and one pair's
    indices to trace the predicate on (the grid's first)."""
    q_off = torch.as_tensor(at_sequence(mask.q_offset, b), dtype=torch.int64)
    kv_off = torch.as_tensor(at_sequence(mask.kv_offset, b), dtype=torch.int64)
    inputs = (b, h, q_start, q_local, q_off, kv_start, kv_local, kv_off)
    first = [x.reshape(-1)[0] for x in inputs]
    q0 = min(int(first[2] + first[3]), q_len - 1) if clamp else int(first[2] + first[3])
    kv0 = min(int(first[5] + first[6]), kv_len - 1) if clamp else int(first[5] + first[6])
    sample = (first[0], first[1], torch.tensor(q0 + int(first[4])), torch.tensor(kv0 + int(first[7])))
    return inputs, sample


def _tiles_by_ranges(fn, shape, b, h, qi, ki, group: int = 16):
    """Allowed pairs of tiles ``shape = (T, X, Y)`` from the predicate on the index ranges of its
    ``group x group`` parts (:mod:`._intervals`: every index tensor's min and max over a part), the
    parts left undecided evaluated pair by pair; None where the ranges cannot be taken."""
    t, x, y = shape
    gx, gy = min(group, x), min(group, y)
    if x % gx or y % gy:
        return None

    def ranges(v):
        v = v.view(*(1,) * (3 - v.dim()), *v.shape)
        lo = hi = v
        if v.shape[1] > 1:
            lo, hi = (z.unflatten(1, (x // gx, gx)) for z in (lo, hi))
            lo, hi = lo.amin(2), hi.amax(2)
        if v.shape[2] > 1:
            lo, hi = (z.unflatten(2, (y // gy, gy)) for z in (lo, hi))
            lo, hi = lo.amin(3), hi.amax(3)
        return Interval(lo.unsqueeze(1), hi.unsqueeze(1))  # (T', 1, X', Y'): four dims, as blocks

    try:
        out = block_bounds(fn, *(ranges(v) for v in (b, h, qi, ki)))
    except Unsupported:
        return None
    sure, maybe = torch.broadcast_tensors(out.lo, out.hi)
    sure, maybe = sure.expand(t, 1, x // gx, y // gy)[:, 0], maybe.expand(t, 1, x // gx, y // gy)[:, 0]
    parts = sure.unsqueeze(-1).unsqueeze(-1).expand(t, x // gx, y // gy, gx, gy).clone()
    where = (sure != maybe).nonzero()
    if where.shape[0]:
        ti, xi, yi = where.unbind(1)

        def gathered(v):  # (N, gx or 1, gy or 1): each index along its own dims only
            v = v.view(*(1,) * (3 - v.dim()), *v.shape)
            at = [ti if v.shape[0] > 1 else torch.zeros_like(ti)]  # a tensor: every index advanced, (N, ...) first
            if v.shape[1] > 1:
                v, at = v.unflatten(1, (x // gx, gx)), [*at, xi, slice(None)]
            else:
                at = [*at, slice(None)]
            if v.shape[-1] > 1:
                v, at = v.unflatten(-1, (y // gy, gy)), [*at, yi, slice(None)]
            else:
                at = [*at, slice(None)]
            return v[tuple(at)]

        flat = [gathered(v) for v in (b, h, qi, ki)]
        wanted = (where.shape[0], gx, gy)
        exact = _exact_pairs(fn, wanted, *flat)  # (finer parts judged again cost more than they saved)
        if exact is None:
            return None
        parts[ti, xi, yi] = exact.expand(wanted)
    return parts.transpose(2, 3).reshape(shape)


def _exact_pairs(fn, shape, b, h, qi, ki, per_pair: bool = True):
    """``fn`` on every pair of ``shape``: by broadcasting where that is proved, else under torch.vmap
    (``per_pair=False``: None instead)."""
    exact, _ = broadcast_proved(fn, b, h, qi, ki)
    if isinstance(exact, torch.Tensor) and exact.dtype == torch.bool and exact.dim() <= len(shape):
        try:
            return exact.expand(shape)
        except RuntimeError:
            pass
    return _flat_pairs(fn, shape, b, h, qi, ki) if per_pair else None


def _flat_pairs(fn, shape, b, h, qi, ki):
    """``fn`` under one torch.vmap over every pair of the broadcast ``shape`` (None where it fails
    there or returns something else than one bool per pair: the caller evaluates by rows and says why)."""
    flat = [x.expand(shape).reshape(-1) for x in (b, h, qi, ki)]
    try:
        with indexing_per_pair():
            out = torch.vmap(fn)(*flat)
    except Exception:  # noqa: BLE001 - evaluated again by rows, where the error is explained
        return None
    if not isinstance(out, torch.Tensor) or out.dtype != torch.bool or out.shape != flat[0].shape:
        return None
    return out.view(shape)


def _per_pair(fn, b, h, qi, ki):
    """``fn`` under torch.vmap over every (b, h, q, kv)."""
    qn, kn = qi.shape[2], ki.shape[3]
    f = torch.vmap(fn, in_dims=(None, None, None, 0))  # keys
    f = torch.vmap(f, in_dims=(None, None, 0, None))  # queries
    f = torch.vmap(f, in_dims=(None, 0, None, None))  # heads
    f = torch.vmap(f, in_dims=(0, None, None, None))  # sequences
    per_b = qi.shape[0] > 1 or ki.shape[0] > 1  # offsets per sequence: one evaluation per sequence
    if per_b:
        rows = [
            f(
                b.reshape(-1)[i : i + 1],
                h.reshape(-1),
                qi[min(i, qi.shape[0] - 1)].reshape(qn),
                ki[min(i, ki.shape[0] - 1)].reshape(kn),
            )
            for i in range(b.shape[0])
        ]
        return torch.cat(rows)
    return f(b.reshape(-1), h.reshape(-1), qi.reshape(qn), ki.reshape(kn))


class FromFn(Mask):
    def __init__(self, fn, batch_size, num_heads, q_offset, kv_offset):
        if not callable(fn):
            raise AttnkitTypeError(f"from_fn takes a function fn(b, h, q_idx, kv_idx), but got {short(fn)}.")
        self.fn = fn
        self.batch_size = None if batch_size is None else check_nonnegative_int(batch_size, "batch_size")
        self.num_heads = None if num_heads is None else check_nonnegative_int(num_heads, "num_heads")
        self.q_offset = check_offset(q_offset, "q_offset")
        self.kv_offset = check_offset(kv_offset, "kv_offset")

    def tensors(self):
        return tuple(x for x in (self.q_offset, self.kv_offset) if isinstance(x, torch.Tensor))

    def lead_shape(self):
        return (self.batch_size or 1, self.num_heads or 1)

    def value_key(self):
        # the function's code and the contents of what it closes over (attnkit._cache.fingerprint):
        # a closure whose captured tensor changes has another key; None where that cannot be known
        offsets = values_of(self.q_offset, self.kv_offset)
        fn = _cache.fingerprint(self.fn)
        return None if offsets is None or fn is None else ("from_fn", fn, self.batch_size, self.num_heads, offsets)

    def cacheable(self) -> bool:
        # without a value key the predicate may change behind the mask's back: never cached by identity
        return self.value_key() is not None

    def _part(self, q_start, kv_start, q_len, kv_len, q_count, kv_count):
        other = copy.copy(self)
        other.q_offset = shifted(self.q_offset, q_start)
        other.kv_offset = shifted(self.kv_offset, kv_start)
        return other

    def positions(self, q_len, kv_len, device=None):
        return indexed_positions(self.q_offset, self.kv_offset, q_len, kv_len, device or self._device())

    def _in_cache(self, start):
        other = copy.copy(self)
        other.q_offset = self.q_offset + start  # (B,): q_idx is each query's position in its sequence
        return other

    def elements(self, q_idx, kv_idx, q_len, kv_len):
        dev = q_idx.device
        b = torch.arange(self.batch_size or 1, device=dev).view(-1, 1, 1, 1)
        h = torch.arange(self.num_heads or 1, device=dev).view(1, -1, 1, 1)
        qi = q_idx.reshape(1, 1, -1, 1) + per_seq(self.q_offset, dev)
        ki = kv_idx.reshape(1, 1, 1, -1) + per_seq(self.kv_offset, dev)
        out = _evaluate(self.fn, b, h, qi, ki)
        if not isinstance(out, torch.Tensor) or out.dtype != torch.bool:
            what = out.dtype if isinstance(out, torch.Tensor) else type(out).__name__
            raise AttnkitTypeError(
                f"a from_fn mask function must return a bool tensor (True = may attend), but got {what}."
            )
        out = as4d(out)
        shape = (b.shape[0], h.shape[0], q_idx.shape[0], kv_idx.shape[1])
        try:
            return out.expand(broadcast(out.shape, (out.shape[0], out.shape[1], *shape[2:])))
        except RuntimeError:
            raise AttnkitValueError(
                f"a from_fn mask function returned shape {tuple(out.shape)}, which does not broadcast "
                f"to (B, H, tq, tk) = {shape}. Combine the index tensors b, h, q_idx, kv_idx by broadcasting."
            ) from None

    def tiles(self, b, h, q_idx, kv_idx, q_len, kv_len):
        qi, ki = q_idx + at_sequence(self.q_offset, b), kv_idx + at_sequence(self.kv_offset, b)
        shape = broadcast(b.shape, h.shape, q_idx.shape, kv_idx.shape)
        if len(shape) == 3:
            out = _native(self, shape, (b, h, qi, ki), 0, sample=(b, h, qi, ki))
            if out is not None:
                return out
        if len(shape) == 3 and math.prod(shape) >= RANGES_FROM and not compiling():
            out = _tiles_by_ranges(self.fn, shape, b, h, qi, ki)
            if out is not None:
                return out
        # by broadcasting where proved, else every pair under one torch.vmap (not while tracing: None)
        return _exact_pairs(self.fn, shape, b, h, qi, ki, per_pair=not compiling())

    def packed_tiles(self, where, q_len, kv_len, block_size):
        bq, bk = block_size
        part = where.to(torch.int64)
        b, h = part[:, 0].view(-1, 1, 1), part[:, 1].view(-1, 1, 1)
        ragged = q_len % bq != 0 or kv_len % bk != 0  # the last blocks hold rows or keys past the lengths
        q_local, kv_local = torch.arange(bq).view(1, 1, -1), torch.arange(bk).view(1, -1, 1)  # key-major
        inputs, sample = _grid(
            self, b, h, part[:, 2].view(-1, 1, 1) * bq, q_local, part[:, 3].view(-1, 1, 1) * bk, kv_local,
            q_len, kv_len, ragged,
        )  # fmt: skip
        return _native(self, (part.shape[0], bk, bq), inputs, 1, sample, (q_len, kv_len, ragged, ragged))

    def block_codes(self, b):
        codes = self._codes_by_ranges(b)
        return codes if codes is not None else self._codes_by_rows(b)

    def codes_with_tiles(self, q_len, kv_len, bq, bk, device):
        """The block codes and the partial blocks' packed bits from one evaluation of each pair the
        index ranges leave undecided (the native engine's program, :meth:`packed_tiles`): a block's
        code is read from its bits (every bit set: full, none: empty). Where the lengths are
        multiples of the blocks; problems of at most :data:`EVERY_PAIR_UP_TO` pairs skip the ranges
        (every pair evaluated once costs less than the ranges' host work). None where the
        predicate is not a program (the block codes, then :func:`attnkit._bits.partial_bits`)."""
        if q_len == 0 or kv_len == 0 or q_len % bq or kv_len % bk or bq % 8 or torch.device(device).type != "cpu":
            return None
        if torch.compiler.is_compiling() or not _program.available():
            return None
        # per-sequence offsets (a mask in a KV cache, a part of one) give each sequence its own map
        lead = (max([self.batch_size or 1] + [t.shape[0] for t in self.tensors() if t.dim()]), self.num_heads or 1)
        b = _base.Blocks(q_len, kv_len, bq, bk, device)
        if math.prod(lead) * q_len * kv_len <= EVERY_PAIR_UP_TO:
            full = torch.zeros(*lead, b.nq, b.nk, dtype=torch.bool)
            empty = full.clone()
        else:
            found = self._part_bounds(b)
            if found is None:
                return None
            full_parts, empty_parts, sq, sk = found
            full, empty = (self._blocks_of_parts(x, b, sq, sk) for x in (full_parts, empty_parts))
        where = (~(full | empty)).nonzero()  # (N, 4): the blocks the ranges leave undecided
        kept, packs = [], []
        for start in range(0, where.shape[0], TILES_AT_ONCE):
            part = where[start : start + TILES_AT_ONCE]
            packed = self.packed_tiles(part, q_len, kv_len, (bq, bk))
            if packed is None:
                return None
            flat = packed.view(packed.shape[0], -1)
            every, none = flat.amin(1) == 255, flat.amax(1) == 0
            bi, hi, qi, ki = part.unbind(1)
            full[bi, hi, qi, ki], empty[bi, hi, qi, ki] = every, none
            mixed = (~(every | none)).nonzero().view(-1)
            if mixed.shape[0] < part.shape[0]:
                part, packed = part.index_select(0, mixed), packed.index_select(0, mixed)
            kept.append(part)
            packs.append(packed)
        if kept:
            where, packed = (x[0] if len(x) == 1 else torch.cat(x) for x in (kept, packs))
        else:  # the ranges decided every block
            packed = torch.zeros(0, bk, bq // 8, dtype=torch.uint8)
        return b.code(full, empty), where, packed

    def _part_bounds(self, b, grid: int = 64):
        """The predicate run once on the index ranges of every ``grid``-sized part of the blocks
        (:mod:`._intervals`): ``(full, empty, sq, sk)``, each part's bool "every pair allowed" / "none
        allowed" as far as the ranges decide, and the parts' sizes; None where the predicate leaves the
        expression language (or is being traced)."""
        if b.nq == 0 or b.nk == 0 or torch.compiler.is_compiling():
            return None
        dev = b.device
        sq = grid if b.bq > grid and b.bq % grid == 0 else b.bq  # finer parts: tighter ranges
        sk = grid if b.bk > grid and b.bk % grid == 0 else b.bk
        nq, nk = -(-b.q_len // sq), -(-b.keys // sk)
        q0, k0 = torch.arange(nq, device=dev) * sq, torch.arange(nk, device=dev) * sk
        q_off, k_off = per_seq(self.q_offset, dev), per_seq(self.kv_offset, dev)
        q = Interval(q0.view(1, 1, -1, 1) + q_off, (q0 + sq).clamp(max=b.q_len).sub(1).view(1, 1, -1, 1) + q_off)
        kv = Interval(k0.view(1, 1, 1, -1) + k_off, (k0 + sk).clamp(max=b.keys).sub(1).view(1, 1, 1, -1) + k_off)
        bs = torch.arange(self.batch_size or 1, device=dev).view(-1, 1, 1, 1)
        hs = torch.arange(self.num_heads or 1, device=dev).view(1, -1, 1, 1)
        try:
            out = block_bounds(self.fn, Interval(bs, bs), Interval(hs, hs), q, kv)
        except Unsupported:
            return None
        sure, maybe = (as4d(x) for x in torch.broadcast_tensors(out.lo, out.hi))
        sure, maybe = (x.expand(*x.shape[:2], nq, nk) for x in (sure, maybe))
        return sure.clone(), ~maybe, sq, sk

    def _codes_by_ranges(self, b, chunk_pairs: int = 1 << 22):
        """Codes from the predicate run once on the index ranges of every part of the blocks
        (:meth:`_part_bounds`); the parts it leaves undecided evaluated pair by pair, in
        batches of ``chunk_pairs``; None where the predicate leaves the expression language (or
        is being traced)."""
        found = self._part_bounds(b)
        if found is None:
            return None
        full, empty, sq, sk = found
        dev = b.device
        where = (~(full | empty)).nonzero()  # (N, 4): the parts the ranges leave undecided
        step = max(1, chunk_pairs // (sq * sk))
        q_in, k_in = torch.arange(sq, device=dev), torch.arange(sk, device=dev)
        if where.shape[0] == 0:
            return b.code(*(self._blocks_of_parts(x, b, sq, sk) for x in (full, empty)))
        bi, hi, qi, ki = (where[:, i] for i in range(4))
        inputs, sample = _grid(  # a short last part repeats its last index (the same min / max)
            self, bi.view(-1, 1, 1), hi.view(-1, 1, 1), qi.view(-1, 1, 1) * sq, q_in.view(1, -1, 1),
            ki.view(-1, 1, 1) * sk, k_in.view(1, 1, -1), b.q_len, b.keys, True,
        )  # fmt: skip
        seen = _native(self, (where.shape[0], sq, sk), inputs, 2, sample, (b.q_len, b.keys, True, False))
        if seen is not None:  # bit 0: some pair allowed, bit 1: some hidden
            full[bi, hi, qi, ki] = (seen & 2) == 0
            empty[bi, hi, qi, ki] = (seen & 1) == 0
            return b.code(*(self._blocks_of_parts(x, b, sq, sk) for x in (full, empty)))
        q_idx = (qi.view(-1, 1) * sq + q_in).clamp(max=b.q_len - 1)  # a short last part repeats its
        kv_idx = (ki.view(-1, 1) * sk + k_in).clamp(max=b.keys - 1)  # last index (the same min / max)
        # witnesses first: each undecided part's first row and first column, pair by pair; a part
        # where they hold an allowed and a hidden pair is partial, with no other pair evaluated
        row = self._pairs(bi, hi, q_idx[:, :1], kv_idx, ranges=False)
        col = self._pairs(bi, hi, q_idx, kv_idx[:, :1], ranges=False)
        if row is None or col is None:
            return None
        seen = torch.cat([row.flatten(1), col.flatten(1)], dim=1)
        mixed = seen.any(dim=1) & ~seen.all(dim=1)
        full[bi[mixed], hi[mixed], qi[mixed], ki[mixed]] = False
        empty[bi[mixed], hi[mixed], qi[mixed], ki[mixed]] = False
        rest = (~mixed).nonzero().view(-1)
        for start in range(0, rest.shape[0], step):
            at = rest[start : start + step]
            pairs = self._pairs(bi[at], hi[at], q_idx[at], kv_idx[at])
            if pairs is None:
                return None
            pairs = pairs.flatten(1)
            full[bi[at], hi[at], qi[at], ki[at]] = pairs.all(dim=1)
            empty[bi[at], hi[at], qi[at], ki[at]] = ~pairs.any(dim=1)
        return b.code(*(self._blocks_of_parts(x, b, sq, sk) for x in (full, empty)))

    @staticmethod
    def _blocks_of_parts(x, b, sq, sk):
        """A block is full (empty) where every part of it is; a missing part of a short last block counts as both."""
        rq, rk = b.bq // sq, b.bk // sk
        pad = (0, b.nk * rk - x.shape[-1], 0, b.nq * rq - x.shape[-2])
        x = torch.nn.functional.pad(x, pad, value=True).view(*x.shape[:2], b.nq, rq, b.nk, rk)
        return x.all(dim=-1).all(dim=-2)

    def _pairs(self, b, h, q_idx, kv_idx, ranges: bool = True):
        """Allowed pairs of T tiles: ``b``, ``h`` ``(T,)``, ``q_idx`` ``(T, tq)``, ``kv_idx`` ``(T, tk)``
        (before the offsets) -> ``(T, tq, tk)`` (:meth:`tiles`; ``ranges=False``: every pair, no ranges)."""
        b, h, q_idx, kv_idx = b.view(-1, 1, 1), h.view(-1, 1, 1), q_idx[:, :, None], kv_idx[:, None, :]
        if ranges:
            return self.tiles(b, h, q_idx, kv_idx, 0, 0)
        qi, ki = q_idx + at_sequence(self.q_offset, b), kv_idx + at_sequence(self.kv_offset, b)
        return _exact_pairs(self.fn, broadcast(b.shape, h.shape, q_idx.shape, kv_idx.shape), b, h, qi, ki)

    def _codes_by_rows(self, b):
        rows = []
        k_len = b.keys
        pad = -k_len % b.bk
        kv_idx = torch.arange(k_len, device=b.device)[None, :]
        for i in range(b.nq):  # one row of blocks at a time: O(bq x Lk) memory, in cache
            q_idx = torch.arange(i * b.bq, min((i + 1) * b.bq, b.q_len), device=b.device)[:, None]
            e = self.elements(q_idx, kv_idx, b.q_len, b.kv_len).view(torch.uint8)  # (B, H, tq, Lk)
            # over the rows first (one pass each over the tile), then over each block's keys
            lo, hi = e.amin(dim=-2), e.amax(dim=-2)  # (B, H, Lk)
            lo = torch.nn.functional.pad(lo, (0, pad), value=1).view(*lo.shape[:2], -1, b.bk).amin(-1)
            hi = torch.nn.functional.pad(hi, (0, pad), value=0).view(*hi.shape[:2], -1, b.bk).amax(-1)
            rows.append(b.code(lo == 1, hi == 0))  # (B, H, nk)
        if not rows:
            return torch.zeros(1, 1, 0, b.nk, dtype=torch.int8, device=b.device)
        return torch.stack(rows, dim=-2)  # (B, H, nq, nk)

    def __repr__(self):
        name = getattr(self.fn, "__name__", type(self.fn).__name__)
        return f"from_fn({name}, batch_size={self.batch_size}, num_heads={self.num_heads})"
