"""``from_fn`` masks: a predicate ``fn(b, h, q_idx, kv_idx)`` evaluated on broadcasting index
tensors where that is proved to equal evaluating it one pair at a time (:mod:`attnkit._pointwise`),
else under ``torch.vmap``, one pair at a time (FlexAttention's semantics)."""

from __future__ import annotations

import copy

import torch

from attnkit import _cache
from attnkit._indexing import as4d, broadcast, check_offset, per_seq, shifted
from attnkit._pointwise import broadcast_proved, indexing_per_pair
from attnkit._validate import (
    AttnkitTypeError,
    AttnkitValueError,
    check_nonnegative_int,
    short,
)
from attnkit.masks._base import Mask, values_of
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
        out, _ = broadcast_proved(self.fn, b, h, qi, ki)  # None: per row of blocks (elements), one pair at a time
        if out is None:
            return None
        shape = broadcast(b.shape, h.shape, q_idx.shape, kv_idx.shape)
        try:
            fits = isinstance(out, torch.Tensor) and out.dtype == torch.bool and out.dim() <= 3
            fits = fits and broadcast(out.shape, shape) == shape
        except RuntimeError:
            fits = False
        return out.expand(shape) if fits else None

    def block_codes(self, b):
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
