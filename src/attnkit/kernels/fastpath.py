"""The fast path of :func:`attnkit.attention`: calls of a signature already validated and chosen for
run a cached runner, without validating or walking the registry again.

A decoding step repeats the same call in every layer, and validating and choosing again would
cost as much as the attention itself. Three caches, each keyed by what decides the call's
validation and its kernel (never by the identity of a tensor someone can change):

==============================  ===============================================================
cache                           key
==============================  ===============================================================
:data:`LEAN`                    the call's signature (:func:`signature`): shapes, dtypes,
                                devices, the mask's value key (or a PreparedMask's ``uid``), the
                                scale (by its bits), autograd and inference mode, the registry's
                                state (its version and the innermost ``use_kernels``)
:data:`LEAN_ANY_LENGTH`         the same without Lk, for unmasked rank-4 calls SDPA or the native
                                row path runs (the row path takes Lk as every sequence's limit)
:data:`LEAN_LIMITS`             the same with a padding mask's lengths left out (their count
                                kept), and Lk: its runner takes them per call
                                (``Kernel.limit_runner``), reading Lk from its inputs
==============================  ===============================================================

The invariant the last two rely on (:func:`builtin_registry`, tested in
``tests/kernels/test_fastpath.py``): with attnkit's own kernels registered as they are and no
``use_kernels`` active, the choice of an unmasked rank-4 call does not depend on its key length
when SDPA takes it (every kernel before SDPA in the priority list declines or refuses it for a
reason that does not read Lk) or when the native engine's row path takes it (float32, bfloat16 or
float16, at most ``FEW_ROWS`` queries over grouped K/V heads, or one query: it takes them whatever
Lk), and the choice of a call whose mask only cuts keys does not depend on the cut or on Lk when the
native engine's row path takes it (at most ``FEW_ROWS`` queries of those types: it takes them
whatever the limits that cut something) or SDPA takes it (no engine, or another type: each
sequence's first keys, whatever the limits); limits that cut nothing, every one equal to Lk, are
served as no mask, as the registry chooses for them. Entries are made only where that holds.

A mask whose value cannot be keyed (a ``from_fn`` predicate over state that cannot be
fingerprinted, a tensor mask) never takes the fast path: it is validated, chosen and prepared on
every call (prepare it once with :func:`attnkit.prepare` and pass the PreparedMask instead).
"""

from __future__ import annotations

import struct
from collections.abc import Hashable

import torch

from attnkit import _cache
from attnkit import masks as _masks
from attnkit._context import any_autocast, forward_ad_active
from attnkit.call import clamped_limits, make_call
from attnkit.kernels import registry
from attnkit.kernels.contract import Runner
from attnkit.kernels.registry import registry_state
from attnkit.plan import MaskLike, PreparedMask

__all__ = ["LEAN", "LEAN_ANY_LENGTH", "LEAN_LIMITS", "builtin_registry", "runner", "signature"]

#: Validated calls and their kernels' runners.
LEAN = _cache.Bounded(32, "lean runners")
#: The same for unmasked rank-4 calls, keyed without the key length (a growing KV cache).
LEAN_ANY_LENGTH = _cache.Bounded(32, "lean runners, any key length")
#: The same for calls with a padding mask, keyed without its lengths: runners that take them.
LEAN_LIMITS = _cache.Bounded(32, "lean runners, any padding lengths")


def builtin_registry() -> bool:
    """Whether the registry holds attnkit's own kernels as registered, with no use_kernels active:
    then the invariant of this module's docstring holds."""
    priority = registry.PRIORITY
    if registry.active() is not None or len(priority) != len(registry.BUILTIN):
        return False
    return all(a is b for a, b in zip(priority, registry.BUILTIN))  # registered and removed again: True


def _scale_key(scale) -> Hashable:
    """A scale by its value and sign (``0.0`` and ``-0.0`` differ; None is the default)."""
    if scale is None or type(scale) is int:
        return scale
    return struct.pack("<d", scale)


#: The tests of :func:`signature` as single C calls (each Python call it saves is ~50-100 ns of a
#: decoding step's few microseconds of host work).
_is_compiling = torch.compiler.is_compiling
_proxy_mode = torch._C._get_dispatch_mode  # with PROXY: make_fx tracing (attnkit._validate.compiling's test)
_PROXY = torch._C._TorchDispatchModeKey.PROXY
_peek_transform = torch._C._functorch.peek_interpreter_stack
_is_grad_enabled = torch.is_grad_enabled
_is_inference = torch.is_inference_mode_enabled


def signature(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: MaskLike, scale: float | None) -> tuple | None:
    """The key that decides this call's validation and its kernel, or None (no fast path).

    None while compiling or tracing (``compiling``), under a torch.func transform or a forward-mode
    AD level (``in_transform``: the call chooses again, only some kernels follow it) and under
    autocast (the call is cast first, in ``make_call``)."""
    if not (type(q) is type(k) is type(v) is torch.Tensor):
        return None
    if _is_compiling() or _proxy_mode(_PROXY) is not None or _peek_transform() is not None:
        return None  # compiling() and in_transform(), inline
    if forward_ad_active() or any_autocast():
        return None
    scale_key: Hashable
    if scale is None or type(scale) is int:
        scale_key = scale
    elif type(scale) is float:
        scale_key = scale if scale else _scale_key(scale)  # 0.0 and -0.0 by their sign
    else:
        return None
    if mask is None:
        mask_key = None
    elif isinstance(mask, _masks.Mask):
        mask_key = mask.value_key()  # kind, parameters and small CPU tensors by value
        if mask_key is None:
            return None
    elif isinstance(mask, PreparedMask):
        mask_key = ("prepared", mask.uid)  # unique for the process's life, and never changed
    else:
        return None  # tensors: their values decide, and reading them costs what the path saves
    grad = _is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    return (
        q.shape,
        k.shape,
        v.shape,
        q.dtype,
        k.dtype,
        v.dtype,
        q.device,
        k.device,
        v.device,
        mask_key,
        scale_key,
        grad,
        _is_inference(),
        registry_state(),
    )


def _any_length(key: tuple, q, k, v) -> tuple | None:
    """``key`` without the key length, for a rank-4 call with Lk >= 1 (else None)."""
    if not q.dim() == k.dim() == v.dim() == 4:
        return None
    if k.shape[2] != v.shape[2] or k.shape[2] == 0:
        return None
    return (key[0], k.shape[:2] + k.shape[3:], v.shape[:2] + v.shape[3:], *key[3:])


def _limit_free(key: tuple, mask, q, k, v) -> tuple | None:
    """``key`` with a padding mask's lengths left out (``Mask.limit_free_key``) and the key length
    too (a decoding step over a growing cache), or None."""
    if not isinstance(mask, _masks.Mask):
        return None
    free = mask.limit_free_key()
    any_length = None if free is None else _any_length(key, q, k, v)
    return None if any_length is None else (*any_length[:9], free, *any_length[10:])


def runner(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: MaskLike, scale: float | None) -> Runner | None:
    """A cached runner for this call's signature (made on the first call of it), or None."""
    key = signature(q, k, v, mask, scale)
    if key is None:
        return None
    found = LEAN.get(key)
    if found is not None:
        return found
    any_length = _any_length(key, q, k, v) if mask is None else None
    if any_length is not None:
        found = LEAN_ANY_LENGTH.get(any_length)
        if found is not None:
            return found
    limit_free = _limit_free(key, mask, q, k, v)
    if limit_free is not None:
        assert isinstance(mask, _masks.Mask), "a padding mask (_limit_free)"
        lq, lk = q.shape[-2], k.shape[-2]
        every = clamped_limits(mask, lk)
        if every and all(n == lk for n in every):  # every key of every sequence: as no mask
            mask.check_values(lq, lk)  # lengths past Lk raise, as on the full path
            return runner(q, k, v, None, scale)
        by_limits = LEAN_LIMITS.get(limit_free)
        if by_limits is not None:
            mask.check_values(lq, lk)  # the lengths are all that differ: their checks, as the full path's
            return lambda q, k, v: by_limits(q, k, v, every)
    call = make_call(q, k, v, mask=mask, scale=scale)  # raises as the full path does
    chosen = registry.choose(call).chosen
    made = chosen.runner(call)
    if made is None:
        return None
    LEAN.put(key, made)
    if any_length is not None and builtin_registry():
        any_length_runner = chosen.any_length_runner(call)
        if any_length_runner is not None:
            LEAN_ANY_LENGTH.put(any_length, any_length_runner)
    if limit_free is not None and builtin_registry():
        by_limits = chosen.limit_runner(call)
        if by_limits is not None:
            LEAN_LIMITS.put(limit_free, by_limits)
    return made
