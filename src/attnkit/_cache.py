"""Every cache attnkit keeps, in one place, each with the key that decides what it holds.

A cache may only serve a result that its key proves is still right. Keys are values (a
mask's kind and parameters, the contents of the small tensors it holds, shapes, dtypes),
never the identity of a tensor someone else can change: a tensor edited in place, through
``.data`` or through ``tensor.numpy()`` keeps its id and, for the last two, its version
counter. Objects attnkit makes and never changes (a :class:`~attnkit.PreparedMask`, a mask
object, which copies the tensors it is given) may be keys by identity, held weakly, so an
entry dies with its object and a new object at a reused id finds nothing.

=================================  =========================================================  =========
cache                              key                                                        bound
=================================  =========================================================  =========
:data:`PREPARED`                   ``(mask value key, Lq, Lk, device, block size)``; a mask   16 entries
                                   whose value has no key: ``("id", id(mask))`` with the
                                   mask held weakly and checked (``prepare.prepared_for``)
:data:`LEAN`                       a call's signature: shapes, dtypes, devices, the mask's    32 entries
                                   value key (or a PreparedMask's ``uid``), scale,
                                   autograd and inference mode, the registry's state
                                   (``functional._lean_key``)
:data:`LEAN_ANY_LENGTH`            the same without Lk, for unmasked rank-4 calls SDPA runs   32 entries
:data:`LEAN_LIMITS`                the same with a padding mask's lengths left out (their     32 entries
                                   count kept): its runner takes them per call
                                   (``Kernel.limit_runner``)
:data:`DENSE_PLANS`                ``(nq, nk, block size)``: the native engine's plan of      32 entries
                                   every block kept (padding's decoding steps add their
                                   limits to it; ``native.limit_plan``)
:func:`plan_store`                 per PreparedMask (held weakly): the tiles and layouts a    64 MiB each
                                   kernel derives from it (``(kernel, what, ...)``)
:data:`SCORE_MOD_STYLE`            a ``score_mod`` function (held weakly): whether it          weak
                                   broadcasts or needs ``torch.vmap`` (how it evaluates,
                                   not what it returns)
=================================  =========================================================  =========

``masks.from_fn`` keys a predicate by its code and the *contents* of what it closes over
(cells, defaults and the globals it names: tensors by their bytes, numbers and strings by
value; :func:`fingerprint`); a predicate over something that cannot be fingerprinted has no
value key and is prepared again on each call. SDPA's dense-mask path zeroes the K/V rows no
query uses on every call (no copy is reused).
"""

from __future__ import annotations

import hashlib
import threading
import types
import weakref
from collections import OrderedDict
from collections.abc import Hashable
from typing import Any

import numpy as np
import torch

__all__ = [
    "DENSE_PLANS",
    "LEAN",
    "LEAN_ANY_LENGTH",
    "LEAN_LIMITS",
    "PREPARED",
    "SCORE_MOD_STYLE",
    "Bounded",
    "PlanStore",
    "clear",
    "fingerprint",
    "plan_store",
]


class Bounded:
    """A thread-safe LRU mapping of at most ``size`` entries."""

    def __init__(self, size: int, what: str):
        self.size, self.what = size, what
        self._items: OrderedDict = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key) -> Any:
        with self._lock:
            found = self._items.get(key)
            if found is not None:
                self._items.move_to_end(key)
            return found

    def put(self, key, value) -> None:
        with self._lock:
            self._items[key] = value
            self._items.move_to_end(key)
            while len(self._items) > self.size:
                self._items.popitem(last=False)

    def pop(self, key) -> None:
        with self._lock:
            self._items.pop(key, None)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return f"<attnkit cache {self.what}: {len(self)} of {self.size}>"


#: Prepared masks made by :func:`attnkit.prepare.prepared_for` (the implicit cache of attention calls).
PREPARED = Bounded(16, "prepared masks")
#: Validated calls and their kernels' runners (the lean path of :func:`attnkit.attention`).
LEAN = Bounded(32, "lean runners")
#: The same for unmasked rank-4 calls, keyed without the key length (a growing KV cache).
LEAN_ANY_LENGTH = Bounded(32, "lean runners, any key length")
#: The same for calls with a padding mask, keyed without its lengths: runners that take them.
LEAN_LIMITS = Bounded(32, "lean runners, any padding lengths")
#: The native engine's plan of every block kept, by its sizes (plain tensors, never changed).
DENSE_PLANS = Bounded(32, "plans of every block kept")
#: How each score_mod function evaluates: "broadcast" or "vmap".
SCORE_MOD_STYLE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class PlanStore:
    """What kernels derive from one PreparedMask (evaluated tiles, layouts), bounded in bytes."""

    def __init__(self, limit: int):
        self.limit, self.size = limit, 0
        self._items: dict[Hashable, Any] = {}
        self._lock = threading.Lock()

    def get(self, key: Hashable) -> Any:
        return self._items.get(key)

    def put(self, key: Hashable, value: Any, nbytes: int, within: float = 1.0) -> bool:
        """Keep ``value`` if it fits in ``within`` of the bound (returns whether the key is now held)."""
        with self._lock:
            if key in self._items:
                return True
            if self.size + nbytes <= within * self.limit:
                self._items[key] = value
                self.size += nbytes
                return True
            return False

    def values(self) -> list:
        return list(self._items.values())


#: Bytes of derived tiles one prepared mask may hold.
PLAN_STORE_BYTES = 64 * 2**20
_stores: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_stores_lock = threading.Lock()


def plan_store(prepared: object) -> PlanStore:
    """The store of one prepared mask (made on first use; it dies with the mask)."""
    found = _stores.get(prepared)
    if found is None:
        with _stores_lock:
            found = _stores.get(prepared)
            if found is None:
                found = _stores[prepared] = PlanStore(PLAN_STORE_BYTES)
    return found


def clear() -> None:
    """Empty every cache (the prepared masks and lean runners; per-mask stores die with their masks)."""
    for cache in (PREPARED, LEAN, LEAN_ANY_LENGTH, LEAN_LIMITS, DENSE_PLANS):
        cache.clear()


# --- fingerprints of what a predicate closes over -------------------------------------------------

#: Tensors fingerprinted by their bytes up to this many elements (larger: no fingerprint).
FINGERPRINT_ELEMENTS = 1 << 22


class _Unkeyable(Exception):
    pass


def _value_of(x: object, depth: int) -> Hashable:
    if x is None or isinstance(x, (bool, int, float, complex, str, bytes)):
        return (type(x).__name__, x)
    if isinstance(x, torch.Tensor):
        if x.device.type != "cpu" or x.numel() > FINGERPRINT_ELEMENTS or x.is_sparse:
            raise _Unkeyable
        data = x.detach().contiguous()
        if data.dtype == torch.bfloat16:
            data = data.view(torch.int16)
        digest = hashlib.blake2b(data.numpy().tobytes(), digest_size=16).hexdigest()
        return ("tensor", str(x.dtype), tuple(x.shape), digest)
    if isinstance(x, np.ndarray):
        if x.size > FINGERPRINT_ELEMENTS or x.dtype == object:
            raise _Unkeyable
        return (
            "array",
            str(x.dtype),
            x.shape,
            hashlib.blake2b(np.ascontiguousarray(x).tobytes(), digest_size=16).hexdigest(),
        )
    if isinstance(x, (tuple, list)) and len(x) <= 64:
        return (type(x).__name__, tuple(_value_of(i, depth) for i in x))
    if isinstance(x, (types.ModuleType, type, types.BuiltinFunctionType)):
        return ("object", id(x))  # modules, classes and builtins do not change what they compute
    if isinstance(x, types.FunctionType) and depth < 3:
        return _function_key(x, depth + 1)
    if callable(x) and getattr(x, "__module__", "").startswith(("torch", "numpy", "math")):
        return ("object", id(x))  # torch.where and the like
    raise _Unkeyable


def _function_key(fn: types.FunctionType, depth: int) -> Hashable:
    code = fn.__code__
    cells = tuple(_value_of(c.cell_contents, depth) for c in fn.__closure__ or ())
    defaults = tuple(_value_of(d, depth) for d in fn.__defaults__ or ())
    kwdefaults = tuple(sorted((k, _value_of(v, depth)) for k, v in (fn.__kwdefaults__ or {}).items()))
    names = tuple((name, _value_of(fn.__globals__[name], depth)) for name in code.co_names if name in fn.__globals__)
    return ("function", code, cells, defaults, kwdefaults, names)  # code objects compare by value


def fingerprint(fn: object) -> Hashable | None:
    """A value key of a predicate: its code and the contents of what it closes over, or None
    where some of that cannot be fingerprinted (a device tensor, an object of unknown kind).

    Equal fingerprints mean the function computes the same thing: a closure whose captured
    tensor is edited in any way (in place, through ``.data``, through ``.numpy()``), or whose
    cell is rebound, has another fingerprint.
    """
    try:
        if isinstance(fn, types.FunctionType):
            return _function_key(fn, 0)
        return _value_of(fn, 0)
    except (_Unkeyable, ValueError, RuntimeError, TypeError):
        return None
