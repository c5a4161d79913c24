"""Index and offset helpers shared by masks and biases (positions, offsets, alignment)."""

from __future__ import annotations

import numbers

import torch

from attnkit._validate import AttnkitTypeError, AttnkitValueError, check_int_tensor, short

ALIGNS = ("bottom_right", "top_left")


def as4d(t: torch.Tensor) -> torch.Tensor:
    """Left-pad an element mask to 4 dims, aligned from the right like SDPA's masks.

    ``(tq, tk) -> (1, 1, tq, tk)`` and ``(H, tq, tk) -> (1, H, tq, tk)``.
    """
    while t.dim() < 4:
        t = t[None]
    return t


def check_align(align: str) -> str:
    if align not in ALIGNS:
        raise AttnkitValueError(f"align must be 'bottom_right' or 'top_left', but got {short(align)}.")
    return align


def own(t: torch.Tensor) -> torch.Tensor:
    """A private copy of a tensor a mask is built from (masks are values).

    Broadcast dimensions (stride 0, as ``expand`` makes them) stay broadcast: the copy
    holds the distinct elements only, so ``dense(t.expand(B, H, L, L))`` costs ``L x L``.
    """
    t = t.detach()
    compact = t
    for dim in range(t.dim()):
        if t.stride(dim) == 0 and t.shape[dim] > 1:
            compact = compact.narrow(dim, 0, 1)
    return compact.clone().expand(t.shape)


def check_offset(x, name: str):
    """An offset: an int, or an integer tensor of shape (B,) (one per sequence)."""
    if isinstance(x, torch.Tensor):
        return own(check_int_tensor(x, name, (0, 1)).reshape(-1))
    if isinstance(x, bool) or not isinstance(x, numbers.Integral):
        raise AttnkitTypeError(f"{name} must be an int or an integer tensor of shape (B,), but got {short(x)}.")
    return int(x)


def per_seq(x, device, ndim: int = 4):
    """An int as is, a ``(B,)`` tensor as ``(B, 1, ..., 1)`` with ``ndim`` dims on ``device``."""
    if isinstance(x, torch.Tensor):
        return x.to(device).view(-1, *([1] * (ndim - 1)))
    return x


def fmt(x) -> str:
    return repr(x.tolist()) if isinstance(x, torch.Tensor) else repr(x)


def span(index, length: int, name: str) -> tuple[int, int]:
    """``(start, stop)`` of a step-1 slice of ``range(length)``."""
    if not isinstance(index, slice):
        raise AttnkitTypeError(f"{name} must be a slice, e.g. slice(128, 256), but got {short(index)}.")
    start, stop, step = index.indices(length)
    if step != 1:
        raise AttnkitValueError(f"{name} must be a contiguous slice (step 1), but got {index}.")
    return start, max(start, stop)


def shifted(x, by: int):
    """An offset (int or per-sequence tensor) moved by ``by``."""
    return x + by if by else x


def broadcast(*shapes) -> tuple[int, ...]:
    """``torch.broadcast_shapes`` for plain int shapes, without its symbolic-shape machinery (tens of
    microseconds a call, on the mask evaluation's hot loop); RuntimeError where they do not broadcast."""
    ndim = 0
    for shape in shapes:  # no max(..., default=): torch.compile traces this loop, not that builtin's keyword
        ndim = max(ndim, len(shape))
    out = [1] * ndim
    for shape in shapes:
        for i, n in enumerate(shape, ndim - len(shape)):
            if n != 1:
                if out[i] not in (1, n):
                    raise RuntimeError(f"shapes {[tuple(s) for s in shapes]} do not broadcast")
                out[i] = n
    return tuple(out)
