"""``KVCache``: preallocated keys and values for decoding one token at a time."""

from __future__ import annotations

from typing import Any

import torch

from attnkit import bias as _bias
from attnkit import masks
from attnkit._types import Device, IntLike
from attnkit._validate import (
    AttnkitTypeError,
    AttnkitValueError,
    check_nonnegative_int,
    compiling,
    short,
)
from attnkit.bias import BiasLike


class KVCache:
    """Keys and values of one attention layer, ``(B, Hkv, max_len, D)`` each, preallocated.

    Each sequence is stored left-aligned with an explicit length (``lengths``, never
    inferred from the contents). :meth:`append` writes new entries after each
    sequence's current end; :meth:`reset` empties the cache. Pass it to
    :class:`~attnkit.nn.MultiHeadAttention` as ``cache=``: the layer appends its new
    keys and values and attends over everything stored, with its mask aligned to each
    sequence's own end, so decoding with a cache equals recomputing the whole prefix.

    >>> cache = KVCache(batch_size=2, num_kv_heads=4, max_len=16, head_dim=8)
    >>> cache.append(torch.randn(2, 4, 3, 8), torch.randn(2, 4, 3, 8), counts=torch.tensor([3, 2]))
    >>> cache.lengths.tolist()
    [3, 2]
    """

    def __init__(
        self,
        batch_size: int,
        num_kv_heads: int,
        max_len: int,
        head_dim: int,
        *,
        v_dim: int | None = None,
        device: Device = None,
        dtype: torch.dtype | None = None,
    ):
        for name, value in (
            ("batch_size", batch_size),
            ("num_kv_heads", num_kv_heads),
            ("max_len", max_len),
            ("head_dim", head_dim),
        ):
            check_nonnegative_int(value, name)
        v_dim = head_dim if v_dim is None else check_nonnegative_int(v_dim, "v_dim")
        self.max_len = max_len
        # one slot more than asked: the padded entries of an append are written there
        self._keys = torch.zeros(batch_size, num_kv_heads, max_len + 1, head_dim, device=device, dtype=dtype)
        self._values = torch.zeros(batch_size, num_kv_heads, max_len + 1, v_dim, device=device, dtype=dtype)
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=self._keys.device)
        self._start = self.lengths.clone()  # lengths before the latest append
        self._bound = 0  # no sequence holds more than this many entries (a host-side int)

    def _fills(self) -> tuple[int, ...] | None:
        """Each sequence's number of entries, read from ``lengths`` as it is now (by value: a write
        through ``.data`` or ``.numpy()`` is seen), where that costs no device sync: on the CPU,
        outside torch.compile. None elsewhere."""
        if self.lengths.device.type != "cpu" or compiling():
            return None
        return tuple(self.lengths.tolist())

    def _common_length(self, fills: tuple[int, ...] | None = None) -> int | None:
        """The number of entries every sequence holds, when they all hold the same (by value)."""
        fills = self._fills() if fills is None else fills
        return fills[0] if fills and all(n == fills[0] for n in fills) else None

    @property
    def keys(self) -> torch.Tensor:
        """All key slots ``(B, Hkv, max_len, D)`` (entries past ``lengths`` are unused)."""
        return self._keys[:, :, : self.max_len]

    @property
    def values(self) -> torch.Tensor:
        """All value slots ``(B, Hkv, max_len, Dv)``."""
        return self._values[:, :, : self.max_len]

    @property
    def dtype(self) -> torch.dtype:
        return self._keys.dtype

    @classmethod
    def for_layers(cls, num_layers: int, *args: Any, **kwargs: Any) -> list[KVCache]:
        """One cache per layer, all of the same sizes."""
        return [cls(*args, **kwargs) for _ in range(num_layers)]

    def reset(self) -> None:
        """Forget every stored entry (the memory stays allocated)."""
        self.lengths.zero_()
        self._start.zero_()
        self._bound = 0

    def _check_counts(self, counts, b: int, t: int) -> torch.Tensor | None:
        if counts is None:
            return None
        if not isinstance(counts, torch.Tensor):
            if isinstance(counts, (str, bytes)) or not hasattr(counts, "__len__"):
                raise AttnkitTypeError(
                    f"counts must be a sequence of {b} ints or a (B,) integer tensor, but got {short(counts)}."
                )
            counts = torch.tensor(counts)
        if counts.dtype == torch.bool or counts.is_floating_point() or counts.is_complex():
            raise AttnkitTypeError(
                f"counts must hold integers (how many of the {t} new entries are real), but got {counts.dtype}."
            )
        if counts.shape != (b,):
            raise AttnkitValueError(
                f"counts must have shape ({b},), one entry per sequence, but got {tuple(counts.shape)}."
            )
        counts = counts.to(self.lengths.device, torch.long)
        if counts.device.type == "cpu" and not compiling():  # reading values on the CPU costs no device sync
            if bool(((counts < 0) | (counts > t)).any()):
                raise AttnkitValueError(f"counts must lie in 0..{t}, but got {short(counts.tolist())}.")
        return counts

    def append(self, k: torch.Tensor, v: torch.Tensor, counts: IntLike | None = None) -> None:
        """Store ``k: (B, Hkv, T, D)`` and ``v: (B, Hkv, T, Dv)`` after each sequence's end.

        ``counts: (B,)`` says how many of the T new entries are real for each sequence
        (the rest is padding and is not stored); default T for every sequence. No host
        sync unless the cache may be full.
        """
        for name, x in (("k", k), ("v", v)):
            if not isinstance(x, torch.Tensor):
                raise AttnkitTypeError(f"{name} must be a tensor (B, Hkv, T, D), but got {type(x).__name__}.")
            if x.dim() != 4:
                raise AttnkitValueError(
                    f"{name} must have 4 dimensions (B, Hkv, T, D), but got shape {tuple(x.shape)}."
                )
            if not x.is_floating_point():
                raise AttnkitTypeError(f"{name} must be a floating point tensor (keys and values), but got {x.dtype}.")
            if x.dtype != self.dtype:
                raise AttnkitTypeError(
                    f"the cache holds {self.dtype} but {name} is {x.dtype}. Build the cache with "
                    f"KVCache(..., dtype={x.dtype}) to match the layer."
                )
        b, h, t = k.shape[:3]
        if (
            k.shape[:2] != self._keys.shape[:2]
            or k.shape[-1] != self._keys.shape[-1]
            or v.shape[:3] != k.shape[:3]
            or v.shape[-1] != self._values.shape[-1]
        ):
            raise AttnkitValueError(
                f"the cache holds keys {tuple(self.keys.shape)} and values {tuple(self.values.shape)} "
                f"(B, Hkv, max_len, D), but got k: {tuple(k.shape)} and v: {tuple(v.shape)}."
            )
        counts = self._check_counts(counts, b, t)
        device = self.lengths.device
        fills = self._fills()
        if fills is not None:  # the lengths as they are now (the user may have rolled them back)
            self._bound = max(fills, default=0)
        if self._bound + t > self.max_len:  # may not fit: look at the real lengths
            end = self.lengths + (t if counts is None else counts)
            if bool((end > self.max_len).any()):
                worst = int(end.argmax())
                raise AttnkitValueError(
                    f"KVCache capacity exceeded: sequence {worst} holds {int(self.lengths[worst])} entries "
                    f"and {int(end[worst] - self.lengths[worst])} more do not fit in max_len={self.max_len}. "
                    "Build the cache with a larger max_len, or reset() it."
                )
        common = self._common_length(fills) if counts is None else None
        if common is not None:  # every sequence at the same fill: a slice, no index tensors
            self._keys[:, :, common : common + t] = k
            self._values[:, :, common : common + t] = v
        else:
            step = torch.arange(t, device=device)
            slot = self.lengths[:, None] + step  # (B, T)
            if counts is not None:
                slot = torch.where(step < counts[:, None], slot, self.max_len)  # padding goes to the spare slot
            rows = torch.arange(b, device=device)[:, None]  # (B, 1)
            self._keys[rows, :, slot] = k.transpose(1, 2)  # (B, T, Hkv, D)
            self._values[rows, :, slot] = v.transpose(1, 2)
        self._start = self.lengths
        self.lengths = self.lengths + (t if counts is None else counts)
        self._bound = min(self._bound + t, self.max_len)

    def stored(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Views ``(B, Hkv, n, D)`` of the filled part of the keys and values.

        ``n`` is at least the longest sequence; entries past a sequence's own length
        are hidden by :meth:`mask` and never read by the block-sparse kernel.
        """
        fills = self._fills()
        bound = self._bound if fills is None else min(max(fills, default=0), self.max_len)
        return self._keys[:, :, :bound], self._values[:, :, :bound]

    def mask(self, mask: masks.Mask | None = None) -> masks.Mask:
        """``mask`` aligned with the entries of the latest :meth:`append` (see :func:`attnkit.masks.cached`)."""
        return masks.cached(mask, self._start, self.lengths)

    def bias(self, attn_bias: BiasLike) -> BiasLike:
        """``attn_bias`` aligned like :meth:`mask`: query i of sequence b at position ``start[b] + i``
        (see :func:`attnkit.bias.cached`). A float tensor is for the call's ``(Lq, Lk)`` as given."""
        if attn_bias is None or isinstance(attn_bias, torch.Tensor):
            return attn_bias
        return _bias.cached(attn_bias, self._start)

    def __repr__(self) -> str:
        b, h, n, d = self.keys.shape
        return (
            f"KVCache(batch_size={b}, num_kv_heads={h}, max_len={n}, head_dim={d}, "
            f"lengths={short(self.lengths.tolist())})"
        )
