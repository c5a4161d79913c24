"""Every input check of attnkit's public functions, in one place and one style.

Errors name the values they got and say how to fix them. Each raises an
:class:`AttnkitError` subclass that is also a ``ValueError`` or ``TypeError``,
so callers can catch either the library's family or the builtin type.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from numbers import Real

import torch

from attnkit.errors import AttnkitError, AttnkitTypeError, AttnkitValueError, MissingExtraError  # noqa: F401

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass(frozen=True)
class Shapes:
    """The sizes of one attention call, read from validated q, k, v.

    ``batch`` holds every leading dimension before the head dimension (empty for
    rank-2 and rank-3 inputs); ``hq``/``hkv`` are 1 for rank-2 inputs.
    """

    batch: tuple[int, ...]
    hq: int
    hkv: int
    lq: int
    lk: int
    d: int
    dv: int
    rank: int

    @property
    def scores(self) -> tuple[int, ...]:
        """The shape of the attention matrix, ``(*batch, Hq, Lq, Lk)``."""
        if self.rank == 2:
            return (self.lq, self.lk)
        return (*self.batch, self.hq, self.lq, self.lk)

    @property
    def out(self) -> tuple[int, ...]:
        """The shape of the output, ``(*batch, Hq, Lq, Dv)``."""
        return (*self.scores[:-1], self.dv)


def check_qkv(q, k, v) -> Shapes:
    """Check q: (..., Hq, Lq, D), k: (..., Hkv, Lk, D), v: (..., Hkv, Lk, Dv)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise AttnkitTypeError(f"{name} must be a torch.Tensor, but got {type(t).__name__}.")
    if q.dim() < 2:
        raise AttnkitValueError(f"q must have at least 2 dimensions (..., Lq, D), but got shape {tuple(q.shape)}.")
    if not q.dim() == k.dim() == v.dim():
        raise AttnkitValueError(
            "q, k and v must have the same number of dimensions, but got "
            f"q: {tuple(q.shape)}, k: {tuple(k.shape)}, v: {tuple(v.shape)}."
        )
    if not q.dtype == k.dtype == v.dtype:
        raise AttnkitTypeError(
            f"q, k and v must have the same dtype, but got q: {q.dtype}, k: {k.dtype}, "
            f"v: {v.dtype}. Cast them to one dtype, e.g. k.to(q.dtype)."
        )
    if q.dtype not in FLOAT_DTYPES:
        raise AttnkitTypeError(
            f"q, k and v must be floating point (float16, bfloat16, float32 or float64), but got {q.dtype}."
        )
    if not q.device == k.device == v.device:
        raise AttnkitValueError(
            f"q, k and v must be on the same device, but got q: {q.device}, k: {k.device}, v: {v.device}."
        )
    if q.shape[-1] != k.shape[-1]:
        raise AttnkitValueError(
            f"q and k must have the same head dimension D, but got q: {tuple(q.shape)} "
            f"(D={q.shape[-1]}) and k: {tuple(k.shape)} (D={k.shape[-1]})."
        )
    if k.shape[-2] != v.shape[-2]:
        raise AttnkitValueError(
            f"k and v must have the same length Lk, but got k: {tuple(k.shape)} "
            f"(Lk={k.shape[-2]}) and v: {tuple(v.shape)} (Lk={v.shape[-2]})."
        )
    if k.shape[:-2] != v.shape[:-2]:
        raise AttnkitValueError(
            f"k and v must have the same batch and head sizes, but got k: {tuple(k.shape)} and v: {tuple(v.shape)}."
        )
    rank = q.dim()
    if rank == 2:
        return Shapes((), 1, 1, q.shape[0], k.shape[0], q.shape[1], v.shape[1], 2)
    if q.shape[:-3] != k.shape[:-3]:
        raise AttnkitValueError(
            f"q and k must have the same batch sizes, but got q: {tuple(q.shape)} and k: {tuple(k.shape)}."
        )
    hq, hkv = q.shape[-3], k.shape[-3]
    if hkv == 0 or hq % hkv != 0:
        raise AttnkitValueError(
            f"q has Hq={hq} heads and k/v have Hkv={hkv}, but Hq must be a multiple of Hkv "
            "(grouped-query attention shares each K/V head among Hq/Hkv query heads)."
        )
    return Shapes(tuple(q.shape[:-3]), hq, hkv, q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1], rank)


def check_scale(scale, d: int) -> float:
    """Return the softmax scale: ``scale`` as given (0.0 and negatives honoured) or 1/sqrt(D)."""
    if scale is None:
        return 1.0 / math.sqrt(d) if d > 0 else 1.0
    if isinstance(scale, bool) or not isinstance(scale, Real):
        raise AttnkitTypeError(f"scale must be a real number or None, but got {scale!r}.")
    scale = float(scale)
    if not math.isfinite(scale):
        raise AttnkitValueError(f"scale must be finite, but got {scale}.")
    return scale


def check_dropout(p, name: str = "dropout_p") -> float:
    """Check a dropout probability lies in [0, 1)."""
    if isinstance(p, bool) or not isinstance(p, Real):
        raise AttnkitTypeError(f"{name} must be a float in [0, 1), but got {p!r}.")
    p = float(p)
    if not 0.0 <= p < 1.0:
        raise AttnkitValueError(f"{name} must be in [0, 1), but got {name}={p}.")
    return p


def check_tensor_mask(mask: torch.Tensor, q: torch.Tensor, shapes: Shapes) -> None:
    """Check a bool or additive float mask against the attention matrix of this call."""
    if mask.dtype != torch.bool and mask.dtype != q.dtype:
        hint = (
            "Use a bool mask (True = may attend), e.g. mask != 0."
            if not mask.is_floating_point()
            else f"Cast it with mask.to({q.dtype})."
        )
        raise AttnkitTypeError(
            f"mask must be bool (True = may attend) or an additive float mask of the query's "
            f"dtype {q.dtype}, but got {mask.dtype}. {hint}"
        )
    if mask.device != q.device:
        raise AttnkitValueError(f"mask must be on the query's device {q.device}, but got {mask.device}.")
    check_broadcast(tuple(mask.shape), shapes, "mask")


def broadcasts_to(shape: tuple[int, ...], target: tuple[int, ...]) -> bool:
    """Whether ``shape`` broadcasts to ``target`` without growing it (plain ints, cheap)."""
    if len(shape) > len(target):
        return False
    return all(a == 1 or a == b for a, b in zip(reversed(shape), reversed(target)))


def check_broadcast(mask_shape: tuple[int, ...], shapes: Shapes, what: str) -> None:
    """Check ``mask_shape`` broadcasts to the attention matrix without growing it."""
    target = shapes.scores
    if not broadcasts_to(tuple(mask_shape), target):
        names = "(Lq, Lk)" if shapes.rank == 2 else "(..., Hq, Lq, Lk)"
        raise AttnkitValueError(
            f"{what} of shape {mask_shape} does not broadcast to the attention matrix "
            f"{names} = {target}. Each mask dimension must equal the matching size or be 1."
        )


def short(value, limit: int = 80) -> str:
    """``repr(value)`` cut to about ``limit`` characters, for quoting user input in errors."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 5] + "...'"[: 4 if text[:1] in "'\"" else 3]


def compiling() -> bool:
    """Whether ``torch.compile`` is tracing the current call (checks that read values are skipped)."""
    return torch.compiler.is_compiling()


def check_int_tensor(t, name: str, ndims: tuple[int, ...]) -> torch.Tensor:
    """Check an integer tensor argument of a mask constructor (ids, lengths)."""
    if not isinstance(t, torch.Tensor):
        if isinstance(t, (str, bytes)) or t is None:
            raise AttnkitTypeError(f"{name} must be integers (a list or an integer tensor), but got {short(t)}.")
        try:
            t = torch.as_tensor(t)
        except (TypeError, ValueError, RuntimeError):
            raise AttnkitTypeError(
                f"{name} must be integers (a list or an integer tensor), but got {short(t)}."
            ) from None
    if t.dtype == torch.bool or t.is_floating_point() or t.is_complex():
        raise AttnkitTypeError(f"{name} must be an integer tensor, but got {t.dtype}.")
    if t.dim() not in ndims:
        want = " or ".join(str(n) for n in ndims)
        raise AttnkitValueError(f"{name} must have {want} dimension(s), but got shape {tuple(t.shape)}.")
    return t


def check_positive_int(x, name: str) -> int:
    """Check a count argument (``batch_size``, ``k``, ...) is an int >= 1 (NumPy integers accepted)."""
    if isinstance(x, bool) or not isinstance(x, numbers.Integral):
        raise AttnkitTypeError(f"{name} must be an int >= 1, but got {short(x)}.")
    if x < 1:
        raise AttnkitValueError(f"{name} must be >= 1, but got {name}={int(x)}.")
    return int(x)


def check_nonnegative_int(x, name: str) -> int:
    """Check a size argument is a non-negative int."""
    if isinstance(x, bool) or not isinstance(x, int):
        raise AttnkitTypeError(f"{name} must be an int, but got {x!r}.")
    if x < 0:
        raise AttnkitValueError(f"{name} must be >= 0, but got {name}={x}.")
    return x
