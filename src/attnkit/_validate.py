"""The argument checks every module of attnkit shares (ints, integer tensors, probabilities), in
one style; the checks of an attention call (q, k, v, masks, modifications) are
:mod:`attnkit.call`'s.

Errors name the values they got and say how to fix them. Each raises an
:class:`AttnkitError` subclass that is also a ``ValueError`` or ``TypeError``,
so callers can catch either the library's family or the builtin type.
"""

from __future__ import annotations

import numbers
from numbers import Real

import torch

from attnkit.errors import AttnkitError, AttnkitTypeError, AttnkitValueError, MissingExtraError  # noqa: F401


def check_dropout(p, name: str = "dropout_p") -> float:
    """Check a dropout probability lies in [0, 1)."""
    if isinstance(p, bool) or not isinstance(p, Real):
        raise AttnkitTypeError(f"{name} must be a float in [0, 1), but got {p!r}.")
    p = float(p)
    if not 0.0 <= p < 1.0:
        raise AttnkitValueError(f"{name} must be in [0, 1), but got {name}={p}.")
    return p


def broadcasts_to(shape: tuple[int, ...], target: tuple[int, ...]) -> bool:
    """Whether ``shape`` broadcasts to ``target`` without growing it (plain ints, cheap)."""
    if len(shape) > len(target):
        return False
    return all(a == 1 or a == b for a, b in zip(reversed(shape), reversed(target)))


def short(value, limit: int = 80) -> str:
    """``repr(value)`` cut to about ``limit`` characters, for quoting user input in errors."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 5] + "...'"[: 4 if text[:1] in "'\"" else 3]


#: make_fx's proxy mode, read as ``torch.fx.experimental.proxy_tensor.get_proxy_mode`` reads it (a
#: tenth of its cost: ``compiling()`` is asked a few times per call).
_dispatch_mode = torch._C._get_dispatch_mode
_PROXY = torch._C._TorchDispatchModeKey.PROXY


def compiling() -> bool:
    """Whether the current call is being traced into a graph: by ``torch.compile`` / ``torch.export``
    (dynamo), or by ``make_fx`` (a proxy mode is active). Checks that read values are skipped then,
    and nothing reads a tensor on the host."""
    return torch.compiler.is_compiling() or _dispatch_mode(_PROXY) is not None


def traced_as_constant(fn):
    """``torch.compiler.assume_constant_result(fn)`` without importing ``torch._dynamo`` (about 1.5 s,
    which every first call of a process would pay): the decorator sets only this attribute
    (``tests/kernels/test_compile.py`` checks that torch's sets the same).

    Code traced by ``torch.compile`` calls such a function eagerly and takes its answer as a constant
    of the graph: what it reads (the native engine's load state, which the first trace may change by
    loading the engine; a predicate's proof) never becomes a guard of a compiled graph."""
    fn._dynamo_marked_constant = True
    return fn


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
