"""Score biases: how much each (query, key) pair counts, beside masks (which pairs count).

A bias is added to the scaled (and soft-capped) score of every kept pair::

    s = q . k * scale
    s = softcap * tanh(s / softcap)          if softcap is given
    s = s + attn_bias(b, h, i, j)

- :func:`alibi`: ``-slope[h] * |p(i) - j|`` (ALiBi; ``causal=True``: ``-slope[h] * (p(i) - j)``);
  :func:`alibi_slopes` gives the published geometric slopes;
- :func:`relative`: T5's bucketed relative position bias from a learnable table;
- :func:`from_fn`: any ``fn(b, h, q_idx, kv_idx) -> float tensor``;
- :func:`dense`: a float tensor broadcastable to ``(B, Hq, Lq, Lk)``;
- sums of these with ``+``.

Biases are evaluated one tile at a time by the block-sparse kernel (never as an
``Lq x Lk`` tensor) and are differentiable: gradients reach the slopes, tables,
dense tensors and the tensors passed to :func:`from_fn`. Unlike masks, a bias holds
*references* to its tensors (they are parameters being learned), not copies.

Positions follow the masks' rules: with ``align="bottom_right"`` (the default) the
last query sits at the last key (decoding), ``q_offset``/``kv_offset`` (int or
``(B,)``) shift the query and key positions.
"""

from __future__ import annotations

import copy
import math
import numbers
from collections.abc import Callable

import torch

from attnkit._indexing import check_align, check_offset, fmt, shifted, span
from attnkit._types import Device, Offset
from attnkit._validate import AttnkitTypeError, AttnkitValueError, broadcasts_to, check_nonnegative_int, short

__all__ = ["Alibi", "Bias", "BiasLike", "alibi", "alibi_slopes", "cached", "dense", "from_fn", "relative"]


class Bias:
    """Base class of score biases. Combine them with ``+``.

    Subclasses implement :meth:`_elements`; the kernels call it with broadcasting
    index tensors ``b: (Bs, 1, 1, 1)``, ``h: (1, Hs, 1, 1)``, ``q_idx: (1, 1, n, 1)``,
    ``kv_idx: (1, 1, 1, S)`` and get a float tensor broadcastable to ``(Bs, Hs, n, S)``.
    """

    def params(self) -> tuple[torch.Tensor, ...]:
        """The tensors the bias is computed from (gradients flow to those that require grad)."""
        return ()

    def elements(
        self, b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor, q_len: int, kv_len: int
    ) -> torch.Tensor:
        """The bias at broadcasting index tensors (see the class docstring)."""
        raise NotImplementedError

    def check(self, batch: int, num_heads: int, q_len: int, kv_len: int, device: torch.device) -> None:
        """Raise a clear error if the bias cannot serve a call with these sizes."""
        for t in self.params():
            if t.device != device:
                raise AttnkitValueError(
                    f"{self.describe()} holds a tensor on {t.device} but q is on {device}: move it with .to()."
                )

    def describe(self) -> str:
        """A short name for :func:`attnkit.explain`."""
        return type(self).__name__.lower()

    def band(self, num_heads: int, q_len: int, kv_len: int) -> torch.Tensor | None:
        """The bias as a function of ``kv_idx - q_idx`` alone, when it is one; else None.

        Returns ``(num_heads or 1, q_len + kv_len - 1)`` float values, column ``t`` the bias
        of every pair with ``kv_idx - q_idx = t - (q_len - 1)`` in every sequence. Kernels lay
        a tile of it out as a strided view (a Toeplitz matrix costs no memory of its own).
        """
        return None

    def _in_cache(self, start: torch.Tensor) -> Bias:
        """This bias for queries at key positions ``start[b] + i`` (see :func:`cached`)."""
        return self

    def add_grad(
        self,
        grads: dict[int, torch.Tensor],
        dtile: torch.Tensor,
        b: torch.Tensor,
        h: torch.Tensor,
        q_idx: torch.Tensor,
        kv_idx: torch.Tensor,
        q_len: int,
        kv_len: int,
    ) -> None:
        """Add this tile's contribution ``d loss / d params`` to ``grads`` (keyed by id)."""
        wanted = [t for t in self.params() if t.requires_grad]
        if not wanted:
            return
        with torch.enable_grad():
            tile = self.elements(b, h, q_idx, kv_idx, q_len, kv_len)
            tile = tile.expand(dtile.shape).to(dtile.dtype)
            found = torch.autograd.grad(tile, wanted, dtile, allow_unused=True)
        for t, g in zip(wanted, found):
            if g is not None:
                grads[id(t)] = g if id(t) not in grads else grads[id(t)] + g

    def dense(self, batch: int, num_heads: int, q_len: int, kv_len: int, device: Device) -> torch.Tensor:
        """The whole bias ``(B or 1, Hq or 1, Lq, Lk)``, differentiable (for the reference kernel)."""
        b = torch.arange(batch, device=device).view(-1, 1, 1, 1)
        h = torch.arange(num_heads, device=device).view(1, -1, 1, 1)
        q_idx = torch.arange(q_len, device=device).view(1, 1, -1, 1)
        kv_idx = torch.arange(kv_len, device=device).view(1, 1, 1, -1)
        out = self.elements(b, h, q_idx, kv_idx, q_len, kv_len)
        while out.dim() < 4:
            out = out[None]
        return out

    def part(self, q_len: int, kv_len: int, q: slice = slice(None), kv: slice = slice(None)) -> Bias:
        """The same bias on a rectangle of a ``(q_len, kv_len)`` problem, as a bias of its own.

        ``b.part(Lq, Lk, q=slice(a, c), kv=slice(d, e)).dense(B, H, c - a, e - d, dev)``
        equals ``b.dense(B, H, Lq, Lk, dev)[..., a:c, d:e]``, gradients included (the
        part holds the same parameters, or slices of them). See :meth:`attnkit.masks.Mask.part`.
        """
        q_len = check_nonnegative_int(q_len, "q_len")
        kv_len = check_nonnegative_int(kv_len, "kv_len")
        (q0, q1), (k0, k1) = span(q, q_len, "q"), span(kv, kv_len, "kv")
        return self._part(q0, k0, q_len, kv_len, q1 - q0, k1 - k0)

    def _part(self, q_start: int, kv_start: int, q_len: int, kv_len: int, q_count: int, kv_count: int) -> Bias:
        raise AttnkitValueError(f"{self.describe()} cannot be split into parts.")

    def __add__(self, other) -> Bias:
        if not isinstance(other, Bias):
            return NotImplemented
        return _Sum((*_parts(self), *_parts(other)))

    def __repr__(self) -> str:
        return self.describe()


def _parts(bias: Bias) -> tuple[Bias, ...]:
    return bias.parts if isinstance(bias, _Sum) else (bias,)


class _Sum(Bias):
    def __init__(self, parts):
        self.parts = tuple(parts)

    def params(self):
        seen, out = set(), []
        for part in self.parts:
            for t in part.params():
                if id(t) not in seen:
                    seen.add(id(t))
                    out.append(t)
        return tuple(out)

    def elements(self, b, h, q_idx, kv_idx, q_len, kv_len):
        total = self.parts[0].elements(b, h, q_idx, kv_idx, q_len, kv_len)
        for part in self.parts[1:]:
            total = total + part.elements(b, h, q_idx, kv_idx, q_len, kv_len)
        return total

    def check(self, batch, num_heads, q_len, kv_len, device):
        for part in self.parts:
            part.check(batch, num_heads, q_len, kv_len, device)

    def _part(self, *where):
        return _Sum(part._part(*where) for part in self.parts)

    def _in_cache(self, start):
        return _Sum(part._in_cache(start) for part in self.parts)

    def add_grad(self, grads, dtile, *index):
        for part in self.parts:
            part.add_grad(grads, dtile, *index)

    def describe(self):
        return " + ".join(part.describe() for part in self.parts)

    def band(self, num_heads, q_len, kv_len):
        bands = [part.band(num_heads, q_len, kv_len) for part in self.parts]
        if any(b is None for b in bands):
            return None
        return sum(bands[1:], start=bands[0])


# --- positions -------------------------------------------------------------------------


class _Positional(Bias):
    """Query and key positions with the masks' alignment and offsets."""

    def _set_positions(self, align, q_offset, kv_offset):
        self.align = check_align(align)
        self.q_offset = check_offset(q_offset, "q_offset")
        self.kv_offset = check_offset(kv_offset, "kv_offset")

    @staticmethod
    def _offset(x, b):
        if isinstance(x, torch.Tensor):
            return x.to(b.device)[b] if x.numel() > 1 else x.to(b.device).reshape(1, 1, 1, 1)
        return x

    def _positions(self, b, q_idx, kv_idx, q_len, kv_len):
        p = q_idx + self._offset(self.q_offset, b)
        if self.align == "bottom_right":
            p = p + (kv_len - q_len)
        return p, kv_idx + self._offset(self.kv_offset, b)

    def _part(self, q_start, kv_start, q_len, kv_len, q_count, kv_count):
        other = copy.copy(self)  # the same parameters, positions moved (see masks' _part)
        shift = q_start + (kv_len - q_len if self.align == "bottom_right" else 0)
        other.align = "top_left"
        other.q_offset = shifted(self.q_offset, shift)
        other.kv_offset = shifted(self.kv_offset, kv_start)
        return other

    def _in_cache(self, start):
        if self.align != "bottom_right":
            return self  # top-left positions are the ones the offsets give
        other = copy.copy(self)
        other.align = "top_left"
        other.q_offset = self.q_offset + start  # (B,): each sequence's own end
        return other

    def _by_distance(self, distance: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """``(Hs, m)`` bias of each head for each ``key position - query position``."""
        raise NotImplementedError

    #: Whether the bias depends on the distance alone (``_by_distance`` is defined).
    _of_distance = False

    def band(self, num_heads, q_len, kv_len):
        if not self._of_distance or isinstance(self.q_offset, torch.Tensor) or isinstance(self.kv_offset, torch.Tensor):
            return None  # per-sequence offsets: each sequence has its own band
        device = self.params()[0].device if self.params() else None
        shift = self.kv_offset - self.q_offset - (kv_len - q_len if self.align == "bottom_right" else 0)
        distance = torch.arange(shift - (q_len - 1), shift + kv_len, device=device)  # kv - q = -(Lq - 1) .. Lk - 1
        return self._by_distance(distance, torch.arange(num_heads, device=device))

    def elements(self, b, h, q_idx, kv_idx, q_len, kv_len):
        # A bias of the distance alone is a Toeplitz matrix per head: evaluate it on the
        # n + S - 1 distances of the tile and lay those out as (n, S) with unfold.
        # q_idx and kv_idx are consecutive ranges (the kernels' tiles, dense()).
        if isinstance(self.q_offset, torch.Tensor) or isinstance(self.kv_offset, torch.Tensor):
            qp, kp = self._positions(b, q_idx, kv_idx, q_len, kv_len)
            return self._elementwise(kp - qp, h)
        n, span = q_idx.shape[2], kv_idx.shape[3]
        if n == 0 or span == 0:
            return torch.zeros(1, h.shape[1], n, span, device=q_idx.device)
        qp, kp = self._positions(b, q_idx.view(-1)[-1:], kv_idx.view(-1)[:1], q_len, kv_len)
        first = kp - qp  # distance at (last query, first key)
        distance = first.view(-1) + torch.arange(n + span - 1, device=q_idx.device)  # (n + S - 1,)
        values = self._by_distance(distance, h.view(-1))  # (Hs, n + S - 1)
        return values.unfold(-1, span, 1).flip(-2)[None]  # [i, j] = values[n - 1 - i + j]: (1, Hs, n, S)

    def _elementwise(self, distance: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """The bias for a ``(Bs, 1, n, S)`` tensor of distances (per-sequence offsets)."""
        raise NotImplementedError

    def check(self, batch, num_heads, q_len, kv_len, device):
        super().check(batch, num_heads, q_len, kv_len, device)
        for name in ("q_offset", "kv_offset"):
            x = getattr(self, name)
            if isinstance(x, torch.Tensor) and x.numel() not in (1, batch):
                raise AttnkitValueError(f"{self.describe()}: {name} has {x.numel()} entries but the batch has {batch}.")

    def _position_repr(self) -> str:
        extra = f"align={self.align!r}"
        for name in ("q_offset", "kv_offset"):
            x = getattr(self, name)
            if not (isinstance(x, int) and x == 0):
                extra += f", {name}={fmt(x)}"
        return extra


def _float_tensor(t, name: str, shape_doc: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise AttnkitTypeError(f"{name} must be a float tensor {shape_doc}, but got {type(t).__name__}.")
    if not t.is_floating_point():
        raise AttnkitTypeError(f"{name} must be a float tensor {shape_doc}, but got dtype {t.dtype}.")
    return t


def _check_heads(t: torch.Tensor, axis: int, num_heads: int, what: str) -> None:
    if t.shape[axis] != num_heads:
        raise AttnkitValueError(
            f"{what} has {t.shape[axis]} heads (shape {tuple(t.shape)}) but q has {num_heads} heads."
        )


# --- ALiBi -----------------------------------------------------------------------------


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """The published ALiBi slopes ``(num_heads,)``: a geometric sequence from ``2^(-8/n)``.

    For a power of two ``n`` the slopes are ``2^(-8/n)``, ``2^(-16/n)``, ... For
    other ``n``, the slopes of the nearest lower power of two ``m`` followed by every
    other slope of ``2m`` (as in the BLOOM and ALiBi code).

    >>> alibi_slopes(4).tolist()
    [0.25, 0.0625, 0.015625, 0.00390625]
    """
    if isinstance(num_heads, bool) or not isinstance(num_heads, numbers.Integral) or num_heads <= 0:
        raise AttnkitValueError(f"num_heads must be a positive int, but got {short(num_heads)}.")

    def powers(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    m = 2 ** int(math.floor(math.log2(num_heads)))
    slopes = powers(m)
    if m < num_heads:
        slopes += powers(2 * m)[0::2][: num_heads - m]
    return torch.tensor(slopes, dtype=torch.float32)


class Alibi(_Positional):
    """ALiBi (see :func:`alibi`): ``slopes (Hq,)``, ``causal``, and the positions' ``align``,
    ``q_offset`` and ``kv_offset``; public so kernels that compute it in their tile loop
    (the Triton kernel) can read its parameters."""

    def __init__(self, slopes: torch.Tensor, causal: bool, align: str, q_offset: Offset, kv_offset: Offset):
        self.slopes = _float_tensor(slopes, "slopes", "of shape (num_heads,)")
        if self.slopes.dim() != 1:
            raise AttnkitValueError(f"slopes must have shape (num_heads,), but got {tuple(self.slopes.shape)}.")
        self.causal = bool(causal)
        self._set_positions(align, q_offset, kv_offset)

    def params(self) -> tuple[torch.Tensor, ...]:
        return (self.slopes,)

    _of_distance = True

    def _by_distance(self, distance: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        d = distance.to(self.slopes.dtype)  # the same arithmetic as elements()
        penalty = d.neg() if self.causal else d.abs()
        return penalty[None, :] * -self.slopes[h][:, None]

    def elements(
        self, b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor, q_len: int, kv_len: int
    ) -> torch.Tensor:
        # One broadcast pass is cheaper here than the Toeplitz layout of _Positional.
        qp, kp = self._positions(b, q_idx, kv_idx, q_len, kv_len)
        dt = self.slopes.dtype
        distance = kp.to(dt) - qp.to(dt)  # (Bs or 1, 1, n, S)
        penalty = distance.neg_() if self.causal else distance.abs_()
        return penalty * -self.slopes[h]  # (Bs or 1, 1, n, S) * (1, Hs, 1, 1)

    def check(self, batch: int, num_heads: int, q_len: int, kv_len: int, device: torch.device) -> None:
        super().check(batch, num_heads, q_len, kv_len, device)
        _check_heads(self.slopes, 0, num_heads, "the ALiBi slopes")

    def describe(self) -> str:
        return "alibi(causal)" if self.causal else "alibi"


def alibi(
    slopes: torch.Tensor,
    *,
    causal: bool = False,
    align: str = "bottom_right",
    q_offset: Offset = 0,
    kv_offset: Offset = 0,
) -> Bias:
    """ALiBi: ``-slopes[h] * |p(i) - j|``, a penalty linear in the distance.

    ``slopes: (Hq,)`` float tensor (it may require grad); :func:`alibi_slopes` gives
    the published ones. ``causal=True`` uses ``-slopes[h] * (p(i) - j)``, the form of
    decoder models (equal to the symmetric one on every pair a causal mask keeps,
    and, up to a constant per row, to BLOOM's ``slopes[h] * j``).
    """
    return Alibi(slopes, causal, align, q_offset, kv_offset)


# --- T5's relative position bias -------------------------------------------------------


def relative_buckets(
    relative_position: torch.Tensor, num_buckets: int, max_distance: int, bidirectional: bool
) -> torch.Tensor:
    """T5's bucket of each ``key position - query position`` (an int64 tensor).

    Half the buckets (``num_buckets // 2``) hold exact distances; the rest grow
    logarithmically up to ``max_distance``, beyond which all distances share the
    last bucket. With ``bidirectional`` keys after the query get buckets of their own.
    """
    buckets = torch.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        buckets = buckets + (relative_position > 0).long() * num_buckets
        distance = relative_position.abs()
    else:
        distance = (-relative_position).clamp(min=0)
    exact = num_buckets // 2
    log_ratio = torch.log(distance.clamp(min=1).float() / exact) / math.log(max_distance / exact)
    far = exact + (log_ratio * (num_buckets - exact)).long()
    far = far.clamp(max=num_buckets - 1)
    return buckets + torch.where(distance < exact, distance, far)


class _Relative(_Positional):
    def __init__(self, table, num_buckets, max_distance, bidirectional, align, q_offset, kv_offset):
        self.table = _float_tensor(table, "table", "of shape (num_buckets, num_heads)")
        if self.table.dim() != 2 or self.table.shape[0] != num_buckets:
            raise AttnkitValueError(
                f"table must have shape (num_buckets={num_buckets}, num_heads), but got {tuple(self.table.shape)}."
            )
        for name, value, low in (
            ("num_buckets", num_buckets, 4 if bidirectional else 2),
            ("max_distance", max_distance, 1),
        ):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
                raise AttnkitValueError(f"{name} must be an int >= {low}, but got {short(value)}.")
        self.num_buckets, self.max_distance, self.bidirectional = (
            int(num_buckets),
            int(max_distance),
            bool(bidirectional),
        )
        if self.max_distance <= (self.num_buckets // (2 if bidirectional else 1)) // 2:
            raise AttnkitValueError(
                f"max_distance={max_distance} must exceed the exact range, num_buckets // "
                f"{4 if bidirectional else 2} = {self.num_buckets // (4 if bidirectional else 2)}."
            )
        self._set_positions(align, q_offset, kv_offset)

    def params(self):
        return (self.table,)

    _of_distance = True

    def _bucket(self, distance):
        return relative_buckets(distance, self.num_buckets, self.max_distance, self.bidirectional)

    def _by_distance(self, distance, h):
        return self.table.t()[h][:, self._bucket(distance)]  # (Hs, nb)[:, (m,)] -> (Hs, m)

    def _elementwise(self, distance, h):
        return self.table.t()[h, self._bucket(distance)]  # (Hq, nb)[(1, Hs, 1, 1), (Bs or 1, 1, n, S)]

    def check(self, batch, num_heads, q_len, kv_len, device):
        super().check(batch, num_heads, q_len, kv_len, device)
        _check_heads(self.table, 1, num_heads, "the relative position table")

    def describe(self):
        return f"relative({self.num_buckets} buckets)"


def relative(
    table: torch.Tensor,
    num_buckets: int = 32,
    max_distance: int = 128,
    bidirectional: bool = True,
    *,
    align: str = "bottom_right",
    q_offset: Offset = 0,
    kv_offset: Offset = 0,
) -> Bias:
    """T5's relative position bias: ``table[bucket(j - p(i)), h]``.

    ``table: (num_buckets, Hq)`` float tensor, learnable (T5's
    ``relative_attention_bias.weight``); :func:`relative_buckets` is the bucket
    function. ``bidirectional=False`` for decoders (keys after the query share
    bucket 0).
    """
    return _Relative(table, num_buckets, max_distance, bidirectional, align, q_offset, kv_offset)


# --- any function, any dense tensor -------------------------------------------------------


class _FromFn(_Positional):
    def __init__(self, fn, params, q_offset, kv_offset):
        if not callable(fn):
            raise AttnkitTypeError(f"fn must be callable as fn(b, h, q_idx, kv_idx), but got {type(fn).__name__}.")
        for i, t in enumerate(params):
            if not isinstance(t, torch.Tensor):
                raise AttnkitTypeError(
                    f"params must be tensors (those fn closes over), but params[{i}] is {type(t).__name__}."
                )
        self.fn, self._params = fn, tuple(params)
        self._set_positions("top_left", q_offset, kv_offset)

    def params(self):
        return self._params

    def elements(self, b, h, q_idx, kv_idx, q_len, kv_len):
        qp, kp = self._positions(b, q_idx, kv_idx, q_len, kv_len)
        out = self.fn(b, h, qp, kp)
        if not isinstance(out, torch.Tensor) or not out.is_floating_point():
            raise AttnkitTypeError(
                f"the bias function must return a float tensor, but returned {type(out).__name__}"
                f"{'' if not isinstance(out, torch.Tensor) else ' of dtype ' + str(out.dtype)}."
            )
        shape = (b.shape[0], h.shape[1], q_idx.shape[2], kv_idx.shape[3])
        if not broadcasts_to(tuple(out.shape), shape):
            raise AttnkitValueError(
                f"the bias function returned shape {tuple(out.shape)}, which does not broadcast to "
                f"(B, H, n, S) = {shape} for index tensors b {tuple(b.shape)}, h {tuple(h.shape)}, "
                f"q_idx {tuple(q_idx.shape)}, kv_idx {tuple(kv_idx.shape)}."
            )
        return out

    def _in_cache(self, start):
        other = copy.copy(self)
        other.q_offset = self.q_offset + start  # q_idx is each query's position in its sequence
        return other

    def describe(self):
        return f"from_fn({getattr(self.fn, '__name__', 'fn')})"


def from_fn(
    fn: Callable[..., torch.Tensor], *params: torch.Tensor, q_offset: Offset = 0, kv_offset: Offset = 0
) -> Bias:
    """Any bias ``fn(b, h, q_idx, kv_idx) -> float tensor``, evaluated one tile at a time.

    The arguments are broadcasting int64 index tensors ``b: (Bs, 1, 1, 1)``,
    ``h: (1, Hs, 1, 1)``, ``q_idx: (1, 1, n, 1)`` (plus ``q_offset``) and
    ``kv_idx: (1, 1, 1, S)`` (plus ``kv_offset``); the result must broadcast to
    ``(Bs, Hs, n, S)``. Pass the tensors ``fn`` closes over as ``params`` for their
    gradients to flow (``fn`` is recomputed tile by tile in the backward pass).

    >>> import torch
    >>> scale = torch.tensor(0.5, requires_grad=True)
    >>> distance = from_fn(lambda b, h, i, j: -scale * (i - j).abs(), scale)
    """
    return _FromFn(fn, params, q_offset, kv_offset)


class _Dense(Bias):
    def __init__(self, tensor):
        self.tensor = _float_tensor(tensor, "the dense bias", "broadcastable to (B, Hq, Lq, Lk)")
        if not 2 <= self.tensor.dim() <= 4:
            raise AttnkitValueError(
                f"a dense bias must have 2 to 4 dims, broadcastable to (B, Hq, Lq, Lk), but got {tuple(tensor.shape)}."
            )

    def params(self):
        return (self.tensor,)

    def _t4(self):
        t = self.tensor
        return t.reshape((1,) * (4 - t.dim()) + tuple(t.shape))

    def _index(self, b, h, q_idx, kv_idx):
        t = self._t4()
        bi = b if t.shape[0] > 1 else torch.zeros_like(b)
        hi = h if t.shape[1] > 1 else torch.zeros_like(h)
        qi = q_idx if t.shape[2] > 1 else torch.zeros_like(q_idx)
        ki = kv_idx if t.shape[3] > 1 else torch.zeros_like(kv_idx)
        return t, (bi, hi, qi, ki)

    def elements(self, b, h, q_idx, kv_idx, q_len, kv_len):
        t, index = self._index(b, h, q_idx, kv_idx)
        return t[index]

    def add_grad(self, grads, dtile, b, h, q_idx, kv_idx, q_len, kv_len):
        if not self.tensor.requires_grad:
            return
        t, index = self._index(b, h, q_idx, kv_idx)
        key = id(self.tensor)
        if key not in grads:
            grads[key] = torch.zeros(t.shape, dtype=dtile.dtype, device=dtile.device)
        index = tuple(i.expand(dtile.shape) for i in index)
        grads[key].index_put_(index, dtile, accumulate=True)  # (B, H, Lq, Lk) += one tile

    def dense(self, batch, num_heads, q_len, kv_len, device):
        return self._t4()

    def _part(self, q_start, kv_start, q_len, kv_len, q_count, kv_count):
        t = self._t4()
        if t.shape[2] != 1:
            t = t[:, :, q_start : q_start + q_count]
        if t.shape[3] != 1:
            t = t[..., kv_start : kv_start + kv_count]
        other = copy.copy(self)
        other.tensor = t  # a view: gradients reach the whole tensor
        return other

    def check(self, batch, num_heads, q_len, kv_len, device):
        super().check(batch, num_heads, q_len, kv_len, device)
        if not broadcasts_to(tuple(self._t4().shape), (batch, num_heads, q_len, kv_len)):
            raise AttnkitValueError(
                f"the dense bias has shape {tuple(self.tensor.shape)}, which does not broadcast to "
                f"(B, Hq, Lq, Lk) = {(batch, num_heads, q_len, kv_len)}."
            )

    def describe(self):
        return f"dense{tuple(self.tensor.shape)}"


def cached(bias: Bias, start: torch.Tensor) -> Bias:
    """``bias`` for queries stored in a KV cache after ``start[b]`` entries of sequence b.

    Query i of sequence b sits at key position ``start[b] + i``, as in
    :func:`attnkit.masks.cached`: bottom-right aligned biases (ALiBi, relative) measure
    distances from each sequence's own end, and :func:`from_fn` sees ``start[b] + i`` as
    the query's index; top-left aligned biases keep the positions their offsets give, and
    a dense bias is for the call's ``(Lq, Lk)`` as given. ``start: (B,)`` integers.
    :class:`attnkit.nn.KVCache` (``cache.bias(b)``) and
    :class:`~attnkit.MultiHeadAttention` with ``cache=`` apply it for you.
    """
    if not isinstance(bias, Bias):
        raise AttnkitTypeError(f"cached() takes an attnkit.bias object, but got {type(bias).__name__}.")
    from attnkit._validate import check_int_tensor

    return bias._in_cache(check_int_tensor(start, "start", (1,)).detach().clone())


def dense(tensor: torch.Tensor) -> Bias:
    """A float tensor broadcastable to ``(B, Hq, Lq, Lk)``, added to the scores (with gradient).

    This is what an additive float mask is, as a bias: the block-sparse kernel reads
    only the tiles it visits, and masks still decide which pairs count.
    """
    return _Dense(tensor)


#: What ``attn_bias=`` takes: an :mod:`attnkit.bias` object, a float tensor, or None.
BiasLike = Bias | torch.Tensor | None
