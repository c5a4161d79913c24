"""Masks defined by positions: the offsets and alignment they share (:class:`Positional`)."""

from __future__ import annotations

import copy

import torch

from attnkit._indexing import check_align, check_offset, fmt, per_seq, shifted
from attnkit.masks._base import values_of

__all__ = ["RANGE_END", "Positional", "at_sequence", "indexed_positions", "rows_of"]

#: "No bound" in :meth:`attnkit.masks.Mask.query_ranges` (beyond every query index).
RANGE_END = 2**30


def rows_of(t: torch.Tensor) -> torch.Tensor:
    """Positions ``(..., L)`` with per-sequence leading dims as ``(B or 1, L)``."""
    return t.reshape(-1, t.shape[-1])


def indexed_positions(q_offset, kv_offset, q_len: int, kv_len: int, device):
    """``(q_idx + q_offset, kv_idx + kv_offset)`` as ``(B or 1, L)``: masks whose indices are positions."""
    q = torch.arange(q_len, device=device)[None, :] + per_seq(q_offset, device, 2)
    k = torch.arange(kv_len, device=device)[None, :] + per_seq(kv_offset, device, 2)
    return q, k


def at_sequence(x, b: torch.Tensor):
    """An offset (an int, or a ``(B,)`` tensor) for the sequences ``b`` of a batch of tiles."""
    if isinstance(x, torch.Tensor):
        return x.to(b.device)[b.clamp(max=x.shape[0] - 1)]
    return x


class Positional:
    """Offsets and alignment shared by the masks defined by positions."""

    align: str = "bottom_right"
    q_offset = 0
    kv_offset = 0

    def _set_positions(self, align, q_offset, kv_offset):
        self.align = check_align(align)
        self.q_offset = check_offset(q_offset, "q_offset")
        self.kv_offset = check_offset(kv_offset, "kv_offset")

    def _q_pos(self, q_idx, q_len, kv_len):
        """Key-axis position of each query index (``kv_len`` may be a per-sequence tensor)."""
        p = q_idx + per_seq(self.q_offset, q_idx.device)
        return p + (kv_len - q_len) if self.align == "bottom_right" else p

    def _k_pos(self, kv_idx):
        return kv_idx + per_seq(self.kv_offset, kv_idx.device)

    def positions(self, q_len, kv_len, device=None):
        if device is None:
            device = self._device()
        q_pos = self._q_pos(torch.arange(q_len, device=device)[None, :], q_len, kv_len)  # (B or 1, Lq)
        k_pos = self._k_pos(torch.arange(kv_len, device=device)[None, :])  # (B or 1, Lk)
        return rows_of(q_pos), rows_of(k_pos)

    def _position_repr(self) -> str:
        extra = f"align={self.align!r}"
        if not (isinstance(self.q_offset, int) and self.q_offset == 0):
            extra += f", q_offset={fmt(self.q_offset)}"
        if not (isinstance(self.kv_offset, int) and self.kv_offset == 0):
            extra += f", kv_offset={fmt(self.kv_offset)}"
        return extra

    def _index_shift(self, q_len, kv_len) -> int | None:
        """``p(i) - k(j) - (i - j)``: the key index query i sits at, minus i (None: per-sequence offsets)."""
        if self._position_key() is None:
            return None
        return self.q_offset - self.kv_offset + (kv_len - q_len if self.align == "bottom_right" else 0)

    def _position_key(self):
        """Alignment and int offsets (None with per-sequence offsets: see :meth:`_position_value`)."""
        if isinstance(self.q_offset, torch.Tensor) or isinstance(self.kv_offset, torch.Tensor):
            return None
        return (self.align, self.q_offset, self.kv_offset)

    def _position_value(self):
        """Alignment and offsets, tensors by value where small (None where they cannot be keyed)."""
        if type(self.q_offset) is int and type(self.kv_offset) is int:  # the common case, once per call
            return (self.align, self.q_offset, self.kv_offset)
        offsets = values_of(self.q_offset, self.kv_offset)
        return None if offsets is None else (self.align, *offsets)

    def _position_tensors(self):
        return tuple(x for x in (self.q_offset, self.kv_offset) if isinstance(x, torch.Tensor))

    def tensors(self):
        return self._position_tensors()

    def _part(self, q_start, kv_start, q_len, kv_len, q_count, kv_count):
        # In the part, positions are the global ones: keys move by kv_start, queries by
        # q_start (plus the bottom-right shift of the whole problem), aligned top-left.
        other = copy.copy(self)
        shift = q_start + (kv_len - q_len if self.align == "bottom_right" else 0)
        other.align = "top_left"
        other.q_offset = shifted(self.q_offset, shift)
        other.kv_offset = shifted(self.kv_offset, kv_start)
        return other

    def _tile_positions(self, b, q_idx, kv_idx, q_len, kv_len):
        """Key-axis positions of tiles' queries and keys (``b``: each tile's sequence)."""
        p = q_idx + at_sequence(self.q_offset, b) + (kv_len - q_len if self.align == "bottom_right" else 0)
        return p, kv_idx + at_sequence(self.kv_offset, b)

    def _range_positions(self, b, kv_idx, q_len, kv_len):
        """``(shift, j)``: query i sits at key position ``i + shift`` (per tile), keys at ``j``."""
        shift = at_sequence(self.q_offset, b) + (kv_len - q_len if self.align == "bottom_right" else 0)
        return shift, kv_idx + at_sequence(self.kv_offset, b)

    def _block_positions(self, b):
        """Query positions of each block's first and last row, key positions of its first and last key."""
        p_lo, p_hi = self._q_pos(b.q_lo, b.q_len, b.kv_len), self._q_pos(b.q_hi, b.q_len, b.kv_len)
        return p_lo, p_hi, self._k_pos(b.k_lo), self._k_pos(b.k_hi)
