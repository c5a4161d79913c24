"""The kinds of masks: causal, sliding windows, prefix-LM, documents, padding and a KV cache's
alignment (``cached``); ``from_fn`` predicates are in :mod:`attnkit.masks._from_fn`. Each is a
:class:`~attnkit.masks._base.Mask` with its ``elements`` and ``block_codes``; users make them with
:mod:`attnkit.masks`' functions."""

from __future__ import annotations

import copy
import numbers

import torch

from attnkit._indexing import as4d, broadcast, check_offset, fmt, own, per_seq, shifted
from attnkit._validate import (
    AttnkitTypeError,
    AttnkitValueError,
    check_int_tensor,
    check_nonnegative_int,
    compiling,
    short,
)
from attnkit.masks._base import (
    Mask,
    as_mask,
    batch_of,
    block_minmax,
    value_of,
    values_of,
)
from attnkit.masks._positions import RANGE_END, Positional, at_sequence, indexed_positions

__all__ = ["Cached", "Causal", "Document", "Padding", "PrefixLM", "SlidingWindow"]


class Causal(Positional, Mask):
    def __init__(self, align: str, q_offset=0, kv_offset=0):
        self._set_positions(align, q_offset, kv_offset)
        self.batch_size = batch_of(self.q_offset, self.kv_offset)

    def value_key(self):
        key = self._position_value()
        return None if key is None else ("causal", key)

    def band(self, q_len, kv_len):
        shift = self._index_shift(q_len, kv_len)  # key j is visible iff j <= i + shift
        return None if shift is None else (None, shift)

    def elements(self, q_idx, kv_idx, q_len, kv_len):
        return as4d(self._k_pos(kv_idx) <= self._q_pos(q_idx, q_len, kv_len))

    def tiles(self, b, h, q_idx, kv_idx, q_len, kv_len):
        p, j = self._tile_positions(b, q_idx, kv_idx, q_len, kv_len)
        return j <= p

    def query_ranges(self, b, h, kv_idx, q_len, kv_len):
        shift, j = self._range_positions(b, kv_idx, q_len, kv_len)  # j <= i + shift
        return j - shift, torch.full_like(j, RANGE_END)

    def block_codes(self, b):
        p_lo, p_hi, k_lo, k_hi = self._block_positions(b)
        return b.code(full=k_hi <= p_lo, empty=k_lo > p_hi)

    def __repr__(self):
        return f"causal({self._position_repr()})"


class SlidingWindow(Positional, Mask):
    def __init__(self, left: int, right: int, align: str, q_offset=0, kv_offset=0):
        self.left = check_nonnegative_int(left, "left")
        self.right = check_nonnegative_int(right, "right")
        self._set_positions(align, q_offset, kv_offset)
        self.batch_size = batch_of(self.q_offset, self.kv_offset)

    def value_key(self):
        key = self._position_value()
        return None if key is None else ("window", self.left, self.right, key)

    def elements(self, q_idx, kv_idx, q_len, kv_len):
        p, j = self._q_pos(q_idx, q_len, kv_len), self._k_pos(kv_idx)
        return as4d((j >= p - self.left) & (j <= p + self.right))

    def tiles(self, b, h, q_idx, kv_idx, q_len, kv_len):
        p, j = self._tile_positions(b, q_idx, kv_idx, q_len, kv_len)
        return (j >= p - self.left) & (j <= p + self.right)

    def query_ranges(self, b, h, kv_idx, q_len, kv_len):
        shift, j = self._range_positions(b, kv_idx, q_len, kv_len)  # j - right <= i + shift <= j + left
        return j - self.right - shift, j + self.left - shift

    def block_codes(self, b):
        p_lo, p_hi, k_lo, k_hi = self._block_positions(b)
        full = (k_lo >= p_hi - self.left) & (k_hi <= p_lo + self.right)
        empty = (k_hi < p_lo - self.left) | (k_lo > p_hi + self.right)
        return b.code(full, empty)

    def band(self, q_len, kv_len):
        shift = self._index_shift(q_len, kv_len)
        return None if shift is None else (shift - self.left, shift + self.right)

    def __repr__(self):
        return f"sliding_window(left={self.left}, right={self.right}, {self._position_repr()})"


class PrefixLM(Positional, Mask):
    def __init__(self, prefix_len, align: str, q_offset=0, kv_offset=0):
        if isinstance(prefix_len, torch.Tensor):
            prefix_len = own(check_int_tensor(prefix_len, "prefix_len", (1,)))
            if not compiling() and prefix_len.device.type == "cpu" and bool((prefix_len < 0).any()):
                raise AttnkitValueError(f"prefix_len must be >= 0, but got {short(prefix_len.tolist())}.")
        elif isinstance(prefix_len, numbers.Integral) and not isinstance(prefix_len, bool):
            prefix_len = check_nonnegative_int(int(prefix_len), "prefix_len")
        else:
            prefix_len = check_nonnegative_int(prefix_len, "prefix_len")
        self.prefix_len = prefix_len
        self._set_positions(align, q_offset, kv_offset)
        self.batch_size = batch_of(prefix_len, self.q_offset, self.kv_offset)

    def tensors(self):
        own = (self.prefix_len,) if isinstance(self.prefix_len, torch.Tensor) else ()
        return own + self._position_tensors()

    def value_key(self):
        key, prefix = self._position_value(), value_of(self.prefix_len)
        return None if key is None or prefix is None else ("prefix", prefix, key)

    def elements(self, q_idx, kv_idx, q_len, kv_len):
        j = self._k_pos(kv_idx)
        causal = j <= self._q_pos(q_idx, q_len, kv_len)
        return as4d((j < per_seq(self.prefix_len, kv_idx.device)) | causal)

    def tiles(self, b, h, q_idx, kv_idx, q_len, kv_len):
        p, j = self._tile_positions(b, q_idx, kv_idx, q_len, kv_len)
        return (j < at_sequence(self.prefix_len, b)) | (j <= p)

    def query_ranges(self, b, h, kv_idx, q_len, kv_len):
        shift, j = self._range_positions(b, kv_idx, q_len, kv_len)  # in the prefix, or j <= i + shift
        lo = torch.where(j < at_sequence(self.prefix_len, b), -RANGE_END, j - shift)
        return lo, torch.full_like(lo, RANGE_END)

    def block_codes(self, b):
        prefix = per_seq(self.prefix_len, b.device)
        p_lo, p_hi, k_lo, k_hi = self._block_positions(b)
        full = (k_hi < prefix) | (k_hi <= p_lo)
        empty = (k_lo >= prefix) & (k_lo > p_hi)
        return b.code(full, empty)

    def __repr__(self):
        return f"prefix_lm(prefix_len={fmt(self.prefix_len)}, {self._position_repr()})"


class Document(Mask):
    def __init__(self, ids, q_offset=0, kv_offset=0):
        ids = check_int_tensor(ids, "ids", (1, 2))
        self.ids = own(ids if ids.dim() == 2 else ids[None])  # (B or 1, L)
        self.q_offset = check_offset(q_offset, "q_offset")
        self.kv_offset = check_offset(kv_offset, "kv_offset")
        self.batch_size = batch_of(self.ids, self.q_offset, self.kv_offset)

    def tensors(self):
        return (self.ids,) + tuple(x for x in (self.q_offset, self.kv_offset) if isinstance(x, torch.Tensor))

    def value_key(self):
        values = values_of(self.ids, self.q_offset, self.kv_offset)
        return None if values is None else ("document", self.is_part, values)

    is_part = False

    def check(self, q_len, kv_len):
        length = self.ids.shape[-1]
        plain = all(isinstance(x, int) and x == 0 for x in (self.q_offset, self.kv_offset))
        if plain and not self.is_part and (q_len != length or kv_len != length):
            raise AttnkitValueError(
                f"document mask was built for sequences of length L={length} but is used with "
                f"Lq={q_len}, Lk={kv_len}. A document mask is for self-attention over the "
                "packed sequence: pass ids with one entry per token (or q_offset/kv_offset "
                "for a part of it)."
            )

    def check_values(self, q_len, kv_len):
        length = self.ids.shape[-1]
        for name, off, n in (("q_offset", self.q_offset, q_len), ("kv_offset", self.kv_offset, kv_len)):
            off = torch.as_tensor(off).reshape(-1)
            lo, hi = (int(off.min()), int(off.max())) if off.numel() else (0, 0)
            if lo < 0 or hi + n > length:
                raise AttnkitValueError(
                    f"document mask holds ids for L={length} tokens, but {name} in [{lo}, {hi}] "
                    f"with {n} positions reaches past them."
                )

    def _part(self, q_start, kv_start, q_len, kv_len, q_count, kv_count):
        other = copy.copy(self)
        other.q_offset = shifted(self.q_offset, q_start)
        other.kv_offset = shifted(self.kv_offset, kv_start)
        other.is_part = True
        return other

    def positions(self, q_len, kv_len, device=None):
        return indexed_positions(self.q_offset, self.kv_offset, q_len, kv_len, device or self.ids.device)

    def _in_cache(self, start):
        other = self._part(0, 0, 0, 0, 0, 0)
        other.q_offset = self.q_offset + start  # (B,): query i of sequence b is token start[b] + i
        other.batch_size = batch_of(self.ids, other.q_offset, self.kv_offset)
        return other

    def _ids_at(self, offset, idx: torch.Tensor) -> torch.Tensor:
        """ids of positions ``idx + offset``: ``(B or 1, n)``."""
        ids = self.ids.to(idx.device)
        pos = idx.reshape(1, -1) + per_seq(offset, idx.device, 2)
        pos = pos.expand(ids.shape[0], -1) if pos.shape[0] == 1 else pos
        ids = ids.expand(pos.shape[0], -1) if ids.shape[0] == 1 else ids
        return torch.gather(ids, 1, pos.clamp(0, ids.shape[-1] - 1))

    def elements(self, q_idx, kv_idx, q_len, kv_len):
        qi = self._ids_at(self.q_offset, q_idx[:, 0])  # (B, tq)
        ki = self._ids_at(self.kv_offset, kv_idx[0])  # (B, tk)
        return (qi[:, :, None] == ki[:, None, :])[:, None]  # (B, 1, tq, tk)

    def _runs(self):
        """``(start, end)`` ``(B or 1, L)``: the first and last position of the run of equal ids
        each position is in; None where some id may form more than one run (ids not sorted).
        O(L), made again each time (nothing is stored on the mask)."""
        ids = self.ids
        steps = ids[:, 1:] - ids[:, :-1]
        if ids.device.type != "cpu" or not (bool((steps >= 0).all()) or bool((steps <= 0).all())):
            return None
        pos = torch.arange(ids.shape[-1], dtype=torch.int32).expand_as(ids)
        new = torch.ones_like(ids, dtype=torch.bool)
        new[:, 1:] = steps != 0
        start = torch.where(new, pos, 0).cummax(-1).values
        last = torch.ones_like(new)
        last[:, :-1] = new[:, 1:]
        end = torch.where(last, pos, ids.shape[-1]).flip(-1).cummin(-1).values.flip(-1)
        return start, end

    def query_ranges(self, b, h, kv_idx, q_len, kv_len):
        runs = self._runs()
        if runs is None or kv_idx.device.type != "cpu":
            return None
        start, end = runs  # queries of key j: those whose position lies in j's run (positions clamped)
        last = start.shape[-1] - 1
        at = (kv_idx + at_sequence(self.kv_offset, b)).clamp(0, last)
        if start.shape[0] > 1:  # one row of ids per sequence
            at = b.clamp(max=start.shape[0] - 1) * start.shape[-1] + at
        first, final = start.reshape(-1)[at], end.reshape(-1)[at]
        q_off = at_sequence(self.q_offset, b)
        lo = torch.where(first == 0, -RANGE_END, first - q_off)
        hi = torch.where(final == last, RANGE_END, final - q_off)
        return lo, hi

    def tiles(self, b, h, q_idx, kv_idx, q_len, kv_len):
        ids = self.ids.to(q_idx.device)
        row, last = b.clamp(max=ids.shape[0] - 1), ids.shape[-1] - 1
        qi = ids[row, (q_idx + at_sequence(self.q_offset, b)).clamp(0, last)]
        ki = ids[row, (kv_idx + at_sequence(self.kv_offset, b)).clamp(0, last)]
        return qi == ki

    def block_codes(self, b):
        dev = b.device
        plain = all(isinstance(x, int) and x == 0 for x in (self.q_offset, self.kv_offset))
        if plain and b.q_len == b.keys == self.ids.shape[-1]:
            ids = self.ids.to(dev)
            q_ids = k_ids = ids
        else:
            q_ids = self._ids_at(self.q_offset, torch.arange(b.q_len, device=dev))
            k_ids = self._ids_at(self.kv_offset, torch.arange(b.keys, device=dev))
        q_min, q_max = block_minmax(q_ids, b.bq)  # (B, nq)
        k_min, k_max = block_minmax(k_ids, b.bk)  # (B, nk)
        q_min, q_max = q_min[:, None, :, None], q_max[:, None, :, None]  # (B, 1, nq, 1)
        k_min, k_max = k_min[:, None, None, :], k_max[:, None, None, :]  # (B, 1, 1, nk)
        full = (q_min == q_max) & (k_min == k_max) & (q_min == k_min)
        empty = (q_max < k_min) | (k_max < q_min)  # id ranges that cannot meet
        return b.code(full, empty)

    def __repr__(self):
        ids = self.ids if self.ids.shape[0] > 1 else self.ids[0]
        extra = "".join(
            f", {name}={fmt(x)}"
            for name, x in (("q_offset", self.q_offset), ("kv_offset", self.kv_offset))
            if not (isinstance(x, int) and x == 0)
        )
        return f"document(ids of shape {tuple(ids.shape)}{extra})"


#: Padding masks of at most this many sequences (on the CPU) keep their lengths as ints too.
SMALL_LENGTHS = 64


class Padding(Mask):
    def __init__(self, lengths, kv_offset=0):
        if lengths is None or isinstance(lengths, (str, bytes)):
            raise AttnkitTypeError(
                f"lengths must be a sequence of ints or an integer tensor of shape (B,), but got {short(lengths)}."
            )
        listed = isinstance(lengths, (list, tuple))  # made into a new tensor here: nothing to copy
        lengths = check_int_tensor(lengths, "lengths", (1,))
        lengths = lengths if listed else own(lengths)
        # a decoding step's few lengths, read once as ints (masks are values): its checks, value
        # key and key limits need no further host read. Under torch.compile nothing is read (the
        # constructor traces: no data-dependent Python)
        tracing = compiling()
        small = not tracing and lengths.device.type == "cpu" and lengths.numel() <= SMALL_LENGTHS
        self._values = tuple(lengths.tolist()) if small else None
        if small:
            negative = min(self._values, default=0) < 0
        else:
            negative = not tracing and lengths.device.type == "cpu" and bool((lengths < 0).any())
        if negative:
            raise AttnkitValueError(f"lengths must be >= 0, but got {short(lengths.tolist())}.")
        self.lengths = lengths
        self.kv_offset = check_offset(kv_offset, "kv_offset")
        self.batch_size = batch_of(self.lengths, self.kv_offset) or lengths.shape[0]

    def tensors(self):
        return (self.lengths,) + ((self.kv_offset,) if isinstance(self.kv_offset, torch.Tensor) else ())

    def value_key(self):
        if self._values is not None and not isinstance(self.kv_offset, torch.Tensor):  # value_of's form
            return ("padding", self.is_part, ((self.lengths.shape, self.lengths.dtype, self._values), self.kv_offset))
        values = values_of(self.lengths, self.kv_offset)
        return None if values is None else ("padding", self.is_part, values)

    is_part = False

    def check_values(self, q_len, kv_len):
        if self.is_part or isinstance(self.kv_offset, torch.Tensor) or self.kv_offset:
            return  # a shard of the keys: lengths count from the sequence's start
        if self._values is not None:
            longest = max(self._values, default=0)
        else:
            longest = int(self.lengths.max()) if self.lengths.numel() else 0
        if longest > kv_len:
            raise AttnkitValueError(
                f"padding mask has a sequence of length {longest} but the keys have only "
                f"Lk={kv_len} positions. lengths must be <= Lk."
            )

    def _part(self, q_start, kv_start, q_len, kv_len, q_count, kv_count):
        other = copy.copy(self)
        other.kv_offset = shifted(self.kv_offset, kv_start)
        other.is_part = True  # lengths may reach past the part's keys
        return other

    def key_limit(self):
        if isinstance(self.kv_offset, int) and self.kv_offset == 0:
            return self.lengths
        return self.lengths - self.kv_offset

    def key_limit_values(self):
        if self._values is not None and isinstance(self.kv_offset, int):
            return tuple(n - self.kv_offset for n in self._values)
        return super().key_limit_values()

    def limit_free_key(self):
        if self._values is None or not isinstance(self.kv_offset, int):
            return None
        return ("padding without lengths", self.is_part, len(self._values), self.lengths.dtype, self.kv_offset)

    def limit_only(self):
        return True

    def elements(self, q_idx, kv_idx, q_len, kv_len):
        lengths = self.lengths.to(kv_idx.device)[:, None, None, None]  # (B, 1, 1, 1)
        return kv_idx + per_seq(self.kv_offset, kv_idx.device) < lengths  # (B, 1, 1, tk)

    def tiles(self, b, h, q_idx, kv_idx, q_len, kv_len):
        keys = kv_idx + at_sequence(self.kv_offset, b) < at_sequence(self.lengths, b)
        return keys.expand(broadcast(keys.shape, q_idx.shape))

    def query_ranges(self, b, h, kv_idx, q_len, kv_len):
        seen = kv_idx + at_sequence(self.kv_offset, b) < at_sequence(self.lengths, b)  # by every query, or none
        return torch.where(seen, -RANGE_END, RANGE_END), torch.full_like(kv_idx, RANGE_END)

    def block_codes(self, b):
        lengths = self.lengths.to(b.device)[:, None, None, None]  # (B, 1, 1, 1)
        off = per_seq(self.kv_offset, b.device)
        return b.code(full=b.k_hi + off < lengths, empty=b.k_lo + off >= lengths)

    def __repr__(self):
        extra = "" if isinstance(self.kv_offset, int) and self.kv_offset == 0 else f", kv_offset={fmt(self.kv_offset)}"
        return f"padding(lengths={short(self.lengths.tolist())}{extra})"


class Cached(Mask):
    def __init__(self, mask, start, lengths):
        self.start = own(check_int_tensor(start, "start", (1,)))
        self.lengths = own(check_int_tensor(lengths, "lengths", (1,)))
        if self.start.shape != self.lengths.shape:
            raise AttnkitValueError(
                f"start and lengths must have one entry per sequence, but got shapes "
                f"{tuple(self.start.shape)} and {tuple(self.lengths.shape)}."
            )
        self.mask = None if mask is None else as_mask(mask)._in_cache(self.start)
        self.batch_size = self.start.shape[0]

    def tensors(self):
        return (self.start, self.lengths) + (self.mask.tensors() if self.mask else ())

    def value_key(self):
        values = values_of(self.start, self.lengths)
        inner = None if self.mask is None else self.mask.value_key()
        if values is None or (self.mask is not None and inner is None):
            return None
        return ("cached", values, inner)

    def cacheable(self):
        return self.mask is None or self.mask.cacheable()

    def key_limit(self):
        return self.lengths

    def lead_shape(self):
        own = (self.batch_size, 1)
        return own if self.mask is None else tuple(torch.broadcast_shapes(own, self.mask.lead_shape()))

    def check_values(self, q_len, kv_len):
        longest = int(self.lengths.max()) if self.lengths.numel() else 0
        if longest > kv_len:
            raise AttnkitValueError(f"cached mask has a sequence of length {longest} but only Lk={kv_len} keys.")

    def limit_only(self):
        return self.mask is None

    def limit_free_key(self):
        # with no inner mask the lengths decide alone (``start`` places queries no mask reads), read on
        # the host where they are few and there
        if self.mask is None and self.lengths.device.type == "cpu" and self.lengths.numel() <= SMALL_LENGTHS:
            return ("cached without lengths", self.batch_size, self.lengths.dtype)
        return None

    def positions(self, q_len, kv_len, device=None):
        device = device or self.start.device
        q = self.start.to(device)[:, None] + torch.arange(q_len, device=device)  # (B, Lq): after each fill
        return q, torch.arange(kv_len, device=device)[None, :]

    def _ends(self, q_len, device):
        """Where each sequence's queries end, ``(B, 1, 1, 1)``."""
        return (self.start.to(device) + q_len).view(-1, 1, 1, 1)

    def elements(self, q_idx, kv_idx, q_len, kv_len):
        device = kv_idx.device
        valid = as4d(kv_idx < self.lengths.to(device).view(-1, 1, 1, 1))  # (B, 1, 1, tk)
        if self.mask is None:
            return valid
        return as4d(self.mask.elements(q_idx, kv_idx, q_len, self._ends(q_len, device))) & valid

    def block_codes(self, b):
        lengths = self.lengths.to(b.device).view(-1, 1, 1, 1)
        valid = b.code(full=b.k_hi < lengths, empty=b.k_lo >= lengths)  # (B, 1, 1, nk)
        if self.mask is None:
            return valid
        inner = as4d(self.mask.block_codes(b.with_kv_len(self._ends(b.q_len, b.device))))
        return torch.minimum(inner, valid)

    def __repr__(self):
        return f"cached({self.mask!r}, start={short(self.start.tolist())}, lengths={short(self.lengths.tolist())})"
