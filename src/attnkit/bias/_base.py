"""The bias protocol every kind of score bias implements (:class:`Bias`), sums, and the positional
base the kinds share. The constructors users call are in :mod:`attnkit.bias`."""

from __future__ import annotations

import copy

import torch

from attnkit._indexing import check_align, check_offset, fmt, shifted, span
from attnkit._types import Device
from attnkit._validate import AttnkitTypeError, AttnkitValueError, check_nonnegative_int

__all__ = ["Bias", "Positional", "Sum", "check_heads", "float_tensor", "parts_of"]


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
        return Sum((*parts_of(self), *parts_of(other)))

    def __repr__(self) -> str:
        return self.describe()


def parts_of(bias: Bias) -> tuple[Bias, ...]:
    return bias.parts if isinstance(bias, Sum) else (bias,)


class Sum(Bias):
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
        return Sum(part._part(*where) for part in self.parts)

    def _in_cache(self, start):
        return Sum(part._in_cache(start) for part in self.parts)

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


class Positional(Bias):
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


def float_tensor(t, name: str, shape_doc: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise AttnkitTypeError(f"{name} must be a float tensor {shape_doc}, but got {type(t).__name__}.")
    if not t.is_floating_point():
        raise AttnkitTypeError(f"{name} must be a float tensor {shape_doc}, but got dtype {t.dtype}.")
    return t


def check_heads(t: torch.Tensor, axis: int, num_heads: int, what: str) -> None:
    if t.shape[axis] != num_heads:
        raise AttnkitValueError(
            f"{what} has {t.shape[axis]} heads (shape {tuple(t.shape)}) but q has {num_heads} heads."
        )
