"""The PyTorch context an attention call runs in, read cheaply per call: torch.func transforms,
forward-mode AD and autocast (torch.compile's is :func:`attnkit._validate.compiling`)."""

from __future__ import annotations

from typing import TypeVar

import torch
import torch.autograd.forward_ad as _forward_ad

T = TypeVar("T")

__all__ = ["any_autocast", "autocast_cast", "autocast_dtype", "forward_ad_active", "in_transform", "transform_of"]


def forward_ad_active() -> bool:
    """Whether a forward-mode AD level is open (``torch.autograd.forward_ad.dual_level``): the cheap
    test before asking each input for its tangent."""
    return getattr(_forward_ad, "_current_level", 0) >= 0


def transform_of(*tensors: torch.Tensor | None) -> str | None:
    """The autograd transform a call runs under that only PyTorch's own operations follow:
    ``"torch.func"`` (grad, vjp, jacrev, jacfwd, jvp, vmap, ...), ``"forward-mode AD"``
    (``torch.autograd.forward_ad``: an input has a tangent), else None."""
    if torch._C._functorch.peek_interpreter_stack() is not None:
        return "torch.func"
    if forward_ad_active() and any(t is not None and _forward_ad.unpack_dual(t).tangent is not None for t in tensors):
        return "forward-mode AD"
    return None


def in_transform() -> bool:
    """Whether a torch.func transform or a forward-mode AD level is active (the fast path's test)."""
    return torch._C._functorch.peek_interpreter_stack() is not None or forward_ad_active()


#: Whether any torch.autocast is on (one C call; the public test asks per device type, 3x slower).
_ANY_AUTOCAST = getattr(torch._C, "_is_any_autocast_enabled", None)


def any_autocast() -> bool:
    """Whether torch.autocast is on for some device type (the fast path's test)."""
    if _ANY_AUTOCAST is not None:
        return bool(_ANY_AUTOCAST())
    return torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled("cuda")


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype ``torch.autocast`` runs attention in on this device type, or None where it is off."""
    if not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


def autocast_cast(t: T, dtype: torch.dtype) -> T:
    """``t`` in autocast's ``dtype`` where autocast would cast it (a float tensor other than float64)."""
    if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype not in (dtype, torch.float64):
        return t.to(dtype)  # type: ignore[return-value]
    return t
