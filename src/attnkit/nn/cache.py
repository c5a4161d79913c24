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
        # entries compress() dropped per sequence: a new token's position is lengths + dropped
        self.dropped = torch.zeros_like(self.lengths)
        self._compressed = False  # whether compress() dropped entries since the last reset (a host-side bool)
        self._bound = 0  # no sequence holds more than this many entries (a host-side int)
        # compress(allocate="heads"): entries each (sequence, KV head) kept (B, Hkv), and where each
        # sequence's kept entries ended (B,): slots [head_kept, kept_end) hold nothing for that head
        self.head_kept: torch.Tensor | None = None
        self._kept_end: torch.Tensor | None = None

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
        self.dropped.zero_()
        self._compressed = False
        self._bound = 0
        self.head_kept = self._kept_end = None

    @property
    def positions(self) -> torch.Tensor:
        """``(B,)`` the position of each sequence's next token: ``lengths`` plus the entries
        :meth:`compress` dropped. :class:`~attnkit.nn.MultiHeadAttention` rotates new queries and
        keys (RoPE) at these positions, so a compressed cache goes on at the text's true position."""
        return self.lengths + self.dropped

    @property
    def compressed(self) -> bool:
        """Whether :meth:`compress` dropped entries since the last :meth:`reset`."""
        return self._compressed

    def clone(self) -> KVCache:
        """A copy with its own memory (compress one, keep the other)."""
        new = object.__new__(KVCache)
        new.__dict__.update(self.__dict__)
        for name in ("_keys", "_values", "lengths", "_start", "dropped", "head_kept", "_kept_end"):
            found = getattr(self, name)
            setattr(new, name, None if found is None else found.clone())
        return new

    def compress(
        self, keep: int | float, scores: torch.Tensor, *, allocate: str = "sequence", alpha: float = 0.2
    ) -> None:
        """Keep the ``keep`` highest-scored entries of each sequence and KV head; drop the rest.

        ``scores: (B, Hkv, n)`` scores the stored entries (``n`` at least the longest sequence;
        entries past a sequence's length are ignored), e.g. :func:`attnkit.inspect.kv_scores` of
        the prefill's queries and keys. ``keep``: an int (entries per sequence, at most its length)
        or a float in (0, 1] (that share of each sequence's entries, rounded down, at least 1).
        Every head of a sequence keeps the same number, in their original order, so decoding goes
        on: new entries are appended after the kept ones, new tokens get their true positions
        (:attr:`positions`) and a causal mask still sees every kept entry. Ties go to the earlier
        entry. In place, like :meth:`append`; :meth:`clone` first to keep the full cache.

        A compressed cache holds keys out of their positions, so afterwards it takes no mask other
        than ``None`` or ``masks.causal()`` and no position bias (a ``ValueError`` says so).

        ``allocate="heads"`` (AdaKV, Feng et al. 2024): a sequence's budget, ``keep`` entries times
        its KV heads, goes to its best-scored entries over all heads together, each head keeping at
        least ``floor(alpha * keep)`` of its own (the safeguard); heads whose entries score higher
        keep more. The heads then hold different numbers of entries: :attr:`head_kept` ``(B, Hkv)``,
        and :meth:`mask` hides each head's unused slots (a per-head mask, so decoding steps are
        prepared instead of taking the lengths-only fast path). Such a cache cannot be compressed
        again (compress a :meth:`clone` made before, or :meth:`reset` it).

        >>> cache = KVCache(batch_size=1, num_kv_heads=2, max_len=8, head_dim=4)
        >>> cache.append(torch.randn(1, 2, 6, 4), torch.randn(1, 2, 6, 4))
        >>> cache.compress(keep=0.5, scores=torch.arange(12.0).view(1, 2, 6))
        >>> cache.lengths.tolist(), cache.positions.tolist()
        ([3], [6])
        """
        b, h = self._keys.shape[:2]
        if allocate not in ALLOCATIONS:
            raise AttnkitValueError(f"allocate must be one of {ALLOCATIONS}, but got {allocate!r}.")
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0.0 <= alpha <= 1.0:
            raise AttnkitValueError(f"alpha (each head's guaranteed share of keep) must lie in [0, 1], got {alpha!r}.")
        if self.head_kept is not None:
            raise AttnkitValueError(
                "this cache holds per-head budgets from compress(allocate='heads'): its heads' entries no longer "
                "line up, so it cannot be compressed again. Compress a clone() made before, or reset() it."
            )
        if not isinstance(scores, torch.Tensor) or not scores.is_floating_point():
            raise AttnkitTypeError(
                f"scores must be a floating point tensor (B, Hkv, n) of the stored entries, but got {short(scores)}."
            )
        fills = self.lengths.tolist()  # a host read: compression is a step between calls, not the hot path
        longest = max(fills, default=0)
        if scores.dim() != 3 or scores.shape[:2] != (b, h) or not longest <= scores.shape[2] <= self.max_len:
            raise AttnkitValueError(
                f"scores must have shape ({b}, {h}, n) with {longest} <= n <= {self.max_len} (one score per stored "
                f"entry of each sequence and KV head), but got {tuple(scores.shape)}."
            )
        if isinstance(keep, bool) or not isinstance(keep, (int, float)):
            raise AttnkitTypeError(f"keep must be an int (entries) or a float in (0, 1] (a share), but got {keep!r}.")
        if isinstance(keep, float):
            if not 0.0 < keep <= 1.0:
                raise AttnkitValueError(f"keep as a share must lie in (0, 1], but got keep={keep}.")
            kept = [min(n, max(1, int(keep * n))) for n in fills]
        else:
            if keep < 0:
                raise AttnkitValueError(f"keep must be >= 0 entries, but got keep={keep}.")
            if keep > longest:
                raise AttnkitValueError(
                    f"keep={keep} entries, but the longest sequence holds {longest}: nothing to drop. Pass at most "
                    f"{longest}, or a share such as keep=0.5."
                )
            kept = [min(n, keep) for n in fills]
        if bool(torch.isnan(scores).any()):
            raise AttnkitValueError("scores hold NaN: every stored entry needs a comparable score.")
        most = max(kept, default=0)
        self._compressed = self._compressed or kept != fills
        if most == 0:
            self.dropped = self.dropped + self.lengths
            self.lengths = torch.zeros_like(self.lengths)
            self._start, self._bound = self.lengths.clone(), 0
            return
        device = self.lengths.device
        n = scores.shape[2]
        slot = torch.arange(n, device=device)
        lengths = self.lengths.to(device)
        # rank by score, then by position (stable sort: ties go to the earlier entry); empty slots last
        ranked = scores.to(device, torch.float64).nan_to_num(neginf=torch.finfo(torch.float64).min)
        ranked = ranked.masked_fill(slot >= lengths[:, None, None], float("-inf"))
        kept_t = torch.tensor(kept, device=device)
        counts = kept_t[:, None].expand(b, h)  # entries each (sequence, head) keeps
        if allocate == "heads":
            counts = _head_counts(ranked, kept_t, alpha)
            most = int(counts.max()) if counts.numel() else 0
        order = torch.sort(ranked, dim=-1, descending=True, stable=True).indices[..., :most]
        rank = torch.arange(most, device=device)
        order = torch.where(rank < counts[:, :, None], order, n + rank)  # past a head's budget: sorted last
        index = order.sort(dim=-1).values.clamp_max(n - 1)  # kept entries in their original order
        keys = self._keys.gather(2, index[..., None].expand(-1, -1, -1, self._keys.shape[-1]))
        values = self._values.gather(2, index[..., None].expand(-1, -1, -1, self._values.shape[-1]))
        self._keys[:, :, :most] = keys
        self._values[:, :, :most] = values
        new_lengths = counts.amax(dim=1) if b and h else kept_t
        self.dropped = self.dropped + (self.lengths - new_lengths.to(self.lengths.device))
        self.lengths = new_lengths.to(self.lengths.device)
        self._start = self.lengths.clone()
        self._bound = most
        if allocate == "heads":
            self.head_kept, self._kept_end = counts.to(self.lengths.device), self.lengths.clone()

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

    def mask(self, mask: masks.Mask | None = None, *, num_heads: int | None = None) -> masks.Mask:
        """``mask`` aligned with the entries of the latest :meth:`append` (see :func:`attnkit.masks.cached`);
        after ``compress(allocate="heads")`` also each head's unused slots hidden, for ``num_heads`` query
        heads (default: one per KV head; :class:`~attnkit.nn.MultiHeadAttention` passes its own)."""
        if mask is not None and self._compressed and not _slot_causal(mask):
            raise AttnkitValueError(
                f"this cache was compressed: its entries are no longer at their positions, so {mask!r} cannot be "
                "aligned with them. A compressed cache takes mask=None or masks.causal() (new tokens see every "
                "kept entry); reset() it, or keep an uncompressed clone() for other masks."
            )
        if mask is not None and _slot_causal(mask) and self._one_entry_each():
            # a decoding step: each sequence's one new query sits at its last entry, so the causal mask
            # hides exactly the entries past each sequence's length: the limits alone, which the fast
            # path serves without preparing anything (the lengths are all that change between steps)
            mask = None
        aligned = masks.cached(mask, self._start, self.lengths)
        if self.head_kept is None or self._kept_end is None:
            return aligned
        kv_heads = self.head_kept.shape[1]
        heads = kv_heads if num_heads is None else num_heads
        if isinstance(heads, bool) or not isinstance(heads, int) or heads < 1 or heads % kv_heads:
            raise AttnkitValueError(f"num_heads must be a multiple of the cache's {kv_heads} KV heads, got {heads!r}.")
        slot = torch.arange(self.stored()[0].shape[2], device=self.head_kept.device)
        per_head = self.head_kept.repeat_interleave(heads // kv_heads, dim=1)[..., None]  # (B, Hq, 1)
        seen = (slot < per_head) | (slot >= self._kept_end[:, None, None])  # (B, Hq, Lk)
        return aligned & masks.dense(seen[:, :, None, :])

    def _one_entry_each(self) -> bool:
        """Whether the latest append added exactly one entry to every sequence (read on the host where
        that costs no device sync; False elsewhere)."""
        fills = self._fills()
        if fills is None:
            return False
        return all(n - s == 1 for n, s in zip(fills, self._start.tolist()))

    def bias(self, attn_bias: BiasLike) -> BiasLike:
        """``attn_bias`` aligned like :meth:`mask`: query i of sequence b at position ``start[b] + i``
        (see :func:`attnkit.bias.cached`). A float tensor is for the call's ``(Lq, Lk)`` as given."""
        if attn_bias is None or isinstance(attn_bias, torch.Tensor):
            return attn_bias
        if self._compressed:
            raise AttnkitValueError(
                f"this cache was compressed: its entries are no longer at their positions, so the position bias "
                f"{attn_bias!r} cannot be aligned with them. Use rotary embeddings (positions are kept), or an "
                "uncompressed cache."
            )
        return _bias.cached(attn_bias, self._start)

    def __repr__(self) -> str:
        b, h, n, d = self.keys.shape
        dropped = f", dropped={short(self.dropped.tolist())}" if self._compressed else ""
        return (
            f"KVCache(batch_size={b}, num_kv_heads={h}, max_len={n}, head_dim={d}, "
            f"lengths={short(self.lengths.tolist())}{dropped})"
        )


def _slot_causal(mask) -> bool:
    """Whether ``mask`` is plain ``masks.causal()``: defined by the order of the entries alone, so it
    holds over a compressed cache's slots as over positions."""
    return (
        isinstance(mask, masks.Causal)
        and mask.align == "bottom_right"
        and isinstance(mask.q_offset, int) and mask.q_offset == 0
        and isinstance(mask.kv_offset, int) and mask.kv_offset == 0
    )  # fmt: skip


#: How :func:`layer_budgets` spreads a cache budget over the layers.
BUDGETS = ("uniform", "pyramid")

#: How :meth:`KVCache.compress` spreads a sequence's budget over its KV heads.
ALLOCATIONS = ("sequence", "heads")


def _head_counts(ranked: torch.Tensor, kept: torch.Tensor, alpha: float) -> torch.Tensor:
    """``(B, Hkv)`` entries each head keeps under AdaKV's rule: ``kept[b] * Hkv`` in all, each head at
    least ``floor(alpha * kept[b])`` of its best, the rest to the best scores over every head
    (``ranked (B, Hkv, n)``: -inf only past a sequence's entries; ties to the lower head, then the
    earlier entry)."""
    b, h, n = ranked.shape
    floor = (alpha * kept.to(torch.float64)).floor().long().clamp(max=kept)  # (B,)
    best = ranked.sort(dim=-1, descending=True, stable=True).values  # (B, Hkv, n)
    rank = torch.arange(n, device=ranked.device)
    pooled = best.masked_fill(rank < floor[:, None, None], float("-inf")).flatten(1)  # past each head's floor
    order = pooled.sort(dim=-1, descending=True, stable=True).indices
    taken = torch.zeros_like(pooled, dtype=torch.bool)
    taken.scatter_(1, order, torch.arange(h * n, device=ranked.device) < (kept * h - floor * h)[:, None])
    return floor[:, None] + taken.view(b, h, n).sum(dim=-1)


def layer_budgets(keep: float, num_layers: int, shape: str = "uniform", *, beta: float = 20.0) -> list[float]:
    """The share of its entries each layer's cache keeps, averaging ``keep`` over ``num_layers``
    layers: ``"uniform"`` gives every layer ``keep``; ``"pyramid"`` (PyramidKV, Cai et al. 2024)
    gives the first layer most and the last ``keep / beta``, in equal steps (lower layers attend
    broadly, upper ones to a few entries). Shares above 1 are cut to 1 (their excess is not moved).

    >>> tuple(round(x, 2) for x in layer_budgets(0.25, 4, "pyramid"))
    (0.49, 0.33, 0.17, 0.01)
    """
    if isinstance(keep, bool) or not isinstance(keep, (int, float)) or not 0.0 < keep <= 1.0:
        raise AttnkitValueError(f"keep must be a share in (0, 1], but got {keep!r}.")
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
        raise AttnkitValueError(f"num_layers must be a positive int, but got {num_layers!r}.")
    if shape not in BUDGETS:
        raise AttnkitValueError(f"shape must be one of {BUDGETS}, but got {shape!r}.")
    if shape == "uniform" or num_layers == 1:
        return [float(keep)] * num_layers
    if not beta >= 1.0:
        raise AttnkitValueError(f"beta must be >= 1 (the last layer keeps keep / beta), but got {beta!r}.")
    low = keep / beta
    high = 2 * keep - low
    step = (high - low) / (num_layers - 1)
    return [min(1.0, high - i * step) for i in range(num_layers)]
