"""``KVCache``: preallocated keys and values for decoding one token at a time."""

from __future__ import annotations

import torch

from attnkit import masks
from attnkit._validate import AttnkitTypeError, AttnkitValueError, check_nonnegative_int


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

    def __init__(self, batch_size: int, num_kv_heads: int, max_len: int, head_dim: int, *,
                 v_dim: int | None = None, device=None, dtype=None):
        for name, value in (("batch_size", batch_size), ("num_kv_heads", num_kv_heads),
                            ("max_len", max_len), ("head_dim", head_dim)):
            check_nonnegative_int(value, name)
        self.max_len = max_len
        v_dim = head_dim if v_dim is None else v_dim
        self.keys = torch.zeros(batch_size, num_kv_heads, max_len, head_dim, device=device, dtype=dtype)
        self.values = torch.zeros(batch_size, num_kv_heads, max_len, v_dim, device=device, dtype=dtype)
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=self.keys.device)
        self._start = self.lengths.clone()  # lengths before the latest append

    @classmethod
    def for_layers(cls, num_layers: int, *args, **kwargs) -> list[KVCache]:
        """One cache per layer, all of the same sizes."""
        return [cls(*args, **kwargs) for _ in range(num_layers)]

    def reset(self) -> None:
        """Forget every stored entry (the memory stays allocated)."""
        self.lengths.zero_()
        self._start.zero_()

    def append(self, k: torch.Tensor, v: torch.Tensor, counts: torch.Tensor | None = None) -> None:
        """Store ``k: (B, Hkv, T, D)`` and ``v: (B, Hkv, T, Dv)`` after each sequence's end.

        ``counts: (B,)`` says how many of the T new entries are real for each sequence
        (the rest is padding and is not stored); default T for every sequence.
        """
        if not isinstance(k, torch.Tensor) or not isinstance(v, torch.Tensor):
            raise AttnkitTypeError("k and v must be tensors.")
        b, h, t = k.shape[:3]
        if k.shape[:2] != self.keys.shape[:2] or k.shape[-1] != self.keys.shape[-1] or v.shape[:3] != k.shape[:3] or v.shape[-1] != self.values.shape[-1]:
            raise AttnkitValueError(
                f"the cache holds keys {tuple(self.keys.shape)} and values {tuple(self.values.shape)} "
                f"(B, Hkv, max_len, D), but got k: {tuple(k.shape)} and v: {tuple(v.shape)}."
            )
        if counts is None:
            counts = torch.full((b,), t, dtype=torch.long, device=self.lengths.device)
        counts = counts.to(self.lengths.device, torch.long)
        if counts.shape != (b,) or (counts < 0).any() or (counts > t).any():
            raise AttnkitValueError(f"counts must have shape ({b},) with values in 0..{t}, but got {counts.tolist()}.")
        end = self.lengths + counts
        if (end > self.max_len).any():
            worst = int(end.argmax())
            raise AttnkitValueError(
                f"KVCache capacity exceeded: sequence {worst} holds {int(self.lengths[worst])} entries "
                f"and {int(counts[worst])} more do not fit in max_len={self.max_len}. "
                "Build the cache with a larger max_len, or reset() it."
            )
        offsets = torch.arange(t, device=self.lengths.device)
        real = offsets[None] < counts[:, None]  # (B, T)
        batch, step = real.nonzero(as_tuple=True)
        slot = self.lengths[batch] + step
        self.keys[batch, :, slot] = k[batch, :, step].to(self.keys.dtype)  # (n, Hkv, D)
        self.values[batch, :, slot] = v[batch, :, step].to(self.values.dtype)
        self._start = self.lengths.clone()
        self.lengths = end

    def stored(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Views ``(B, Hkv, longest, D)`` of the filled part of the keys and values."""
        longest = int(self.lengths.max()) if self.lengths.numel() else 0
        return self.keys[:, :, :longest], self.values[:, :, :longest]

    def mask(self, mask=None) -> masks.Mask:
        """``mask`` aligned with the entries of the latest :meth:`append` (see :func:`attnkit.masks.cached`)."""
        return masks.cached(mask, self._start, self.lengths)

    def __repr__(self):
        b, h, n, d = self.keys.shape
        return f"KVCache(batch_size={b}, num_kv_heads={h}, max_len={n}, head_dim={d}, lengths={self.lengths.tolist()})"
