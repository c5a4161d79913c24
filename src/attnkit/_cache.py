"""Every cache attnkit keeps, in one place, each with the key that decides what it holds.

A cache may only serve a result that its key proves is still right. Keys are values (a
mask's kind and parameters, the contents of the small tensors it holds, shapes, dtypes),
never the identity of a tensor someone else can change: a tensor edited in place, through
``.data`` or through ``tensor.numpy()`` keeps its id and, for the last two, its version
counter. Objects attnkit makes and never changes (a :class:`~attnkit.PreparedMask`, a mask
object, which copies the tensors it is given) may be keys by identity, held weakly, so an
entry dies with its object and a new object at a reused id finds nothing.

=====================================  =====================================================  ==========
cache                                  key                                                    bound
=====================================  =====================================================  ==========
:data:`PREPARED`                       ``(mask value key, Lq, Lk, device, block size)``; a    16 entries
                                       mask whose value has no key but that never changes:
                                       ``("id", id(mask))``, the mask held weakly and checked
                                       (``plan.prepared_for``); any other is not cached
``kernels.fastpath.LEAN`` and its two  a call's signature: shapes, dtypes, devices, the       32 entries
siblings (any key length, any          mask's value key (or a PreparedMask's ``uid``), the    each
padding lengths)                       scale's bits, autograd, inference mode, the
                                       registry's state; see :mod:`attnkit.kernels.fastpath`
``kernels.native.kernel.DENSE_PLANS``  ``(nq, nk, block size)``: the native engine's plan of  32 entries
                                       every block kept (plain tensors, never changed)
:func:`plan_store`                     per PreparedMask (held weakly): the groups, tiles and  64 MiB each
                                       layouts a kernel derives from it (``(what, ...)``)
:data:`PROGRAMS`                       ``(fingerprint of a from_fn predicate, index dtypes)``: 64 entries
                                       the predicate as the native engine's program
                                       (:mod:`attnkit.masks._program`; False: it is not one)
:data:`PER_PAIR`                       a ``mask_mod``/``score_mod`` function (held weakly):    weak
                                       it needs ``torch.vmap`` (broadcasting it failed or was
                                       not proved elementwise: :mod:`attnkit._pointwise`); only
                                       saves a second try (per pair is right for every function)
=====================================  =====================================================  ==========

``masks.from_fn`` keys a predicate by :func:`fingerprint`: its code (nested functions and
comprehensions included) and the *values* of what it reads: the cells it closes over, its
defaults, and each global it names followed through its attribute reads (``cfg.W`` is keyed by
the value of ``cfg.W``; ``torch.where`` by the function). Tensors count by their bytes, floats by
their bits (``0.0`` and ``-0.0`` differ), functions of PyTorch, NumPy and the standard library
by identity. A predicate that reads anything else (a module or class of the user's as a whole, an
``nn.Module``, a bound method of an object that cannot be keyed, a ``np.vectorize``) has no
fingerprint: its mask is prepared again on every call (prepare it once with
:func:`attnkit.prepare` and pass the PreparedMask to reuse it). SDPA's dense-mask path zeroes the
K/V rows no query uses on every call (no copy is reused).
"""

from __future__ import annotations

import dis
import functools
import hashlib
import struct
import threading
import types
import weakref
from collections import OrderedDict
from collections.abc import Hashable
from typing import Any

import numpy as np
import torch

__all__ = [
    "PREPARED",
    "PER_PAIR",
    "PROGRAMS",
    "Bounded",
    "PlanStore",
    "clear",
    "fingerprint",
    "global_reads",
    "plan_store",
]


#: Every bounded cache made (held weakly): what :func:`clear` empties.
_ALL: list[weakref.ref] = []


class Bounded:
    """A thread-safe LRU mapping of at most ``size`` entries."""

    def __init__(self, size: int, what: str):
        self.size, self.what = size, what
        self._items: OrderedDict = OrderedDict()
        self._lock = threading.Lock()
        _ALL.append(weakref.ref(self))

    def get(self, key) -> Any:
        # a hit takes no lock (each OrderedDict operation is atomic; a decoding step looks up a
        # runner per layer): the entry is moved to the end unless another thread evicted it meanwhile
        found = self._items.get(key)
        if found is not None:
            try:
                self._items.move_to_end(key)
            except KeyError:
                pass
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


#: Prepared masks made by :func:`attnkit.plan.prepared_for` (the implicit cache of attention calls).
PREPARED = Bounded(16, "prepared masks")
#: from_fn predicates traced into the native engine's programs, by value (see the table above).
PROGRAMS = Bounded(64, "predicate programs")
#: Predicates and score mods that need one pair at a time (attnkit._pointwise.broadcast_proved).
PER_PAIR: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


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


def clear(*, keep: tuple[Bounded, ...] = ()) -> None:
    """Empty every bounded cache (prepared masks, lean runners, plans, programs; per-mask stores die
    with their masks), but those in ``keep``."""
    for ref in list(_ALL):
        cache = ref()
        if cache is not None and not any(cache is k for k in keep):
            cache.clear()


# --- fingerprints of what a predicate closes over -------------------------------------------------

#: Tensors fingerprinted by their bytes up to this many elements (larger: no fingerprint).
FINGERPRINT_ELEMENTS = 1 << 22


class _Unkeyable(Exception):
    pass


#: Packages whose functions, classes and modules compute the same thing whatever the user does:
#: keyed by identity (a user module named ``torch_utils`` is not one of them).
_LIBRARIES = frozenset({"torch", "numpy", "math", "operator", "builtins", "functools", "itertools"})


def _library(obj: object) -> bool:
    """Whether ``obj`` is a module, class or function of one of :data:`_LIBRARIES`."""
    if isinstance(obj, types.ModuleType):
        name = obj.__name__
    else:
        name = getattr(obj, "__module__", None) or ""
    return isinstance(name, str) and name.split(".")[0] in _LIBRARIES


#: Objects whose key is being made on this thread (a class whose method reads the class itself).
class _Making(threading.local):
    def __init__(self) -> None:  # once per thread: the set is always there (no guard sees it appear)
        self.ids: set[int] = set()


_MAKING = _Making()
#: At most this many attributes of one user class or instance are keyed (more: no fingerprint).
FINGERPRINT_ATTRIBUTES = 64


def _value_of(x: object, depth: int) -> Hashable:
    if x is None or type(x) in (bool, int, str, bytes):  # exact types: an int subclass has attributes
        return (type(x).__name__, x)
    if type(x) is float:
        return ("float", struct.pack("<d", x))  # by its bits: 0.0 and -0.0 differ
    if type(x) is complex:
        return ("complex", struct.pack("<dd", x.real, x.imag))
    if isinstance(x, torch.Tensor):
        if x.device.type != "cpu" or x.numel() > FINGERPRINT_ELEMENTS or x.is_sparse:
            raise _Unkeyable
        if torch._C._functorch.is_functorch_wrapped_tensor(x) or not _has_storage(x):
            raise _Unkeyable  # a tensor of a transform (torch.func) or a fake one: no bytes to read
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
    if isinstance(x, (np.generic, torch.dtype, torch.device)):
        return ("value", repr(x), str(type(x)))
    if isinstance(x, (tuple, list)) and type(x) in (tuple, list) and len(x) <= 64:
        return (type(x).__name__, tuple(_value_of(i, depth) for i in x))
    if isinstance(x, dict) and type(x) is dict and len(x) <= FINGERPRINT_ATTRIBUTES:
        return ("dict", tuple((_value_of(k, depth), _value_of(v, depth)) for k, v in x.items()))
    if isinstance(x, types.FunctionType):
        if _library(x):
            return ("object", id(x))  # torch.nn.functional.relu and the like
        if depth < 3:
            return _following(x, lambda: _function_key(x, depth + 1))
        raise _Unkeyable
    if isinstance(x, types.BuiltinFunctionType):  # also bound methods of builtin objects
        owner = x.__self__
        if owner is None or isinstance(owner, types.ModuleType):
            return ("object", id(x))  # torch.where, math.floor
        return ("method", x.__name__, type(owner).__name__, _value_of(owner, depth))  # ids.index_select
    if isinstance(x, types.MethodType) and depth < 3:  # an instance's method, or a classmethod's class
        return ("method", _value_of(x.__func__, depth), _value_of(x.__self__, depth))
    if isinstance(x, functools.partial) and depth < 3:
        kw = tuple(sorted((k, _value_of(v, depth)) for k, v in x.keywords.items()))
        return ("partial", _value_of(x.func, depth), _value_of(x.args, depth), kw)
    if isinstance(x, (staticmethod, classmethod)):
        return (type(x).__name__, _value_of(x.__func__, depth))
    if isinstance(x, property):
        return ("property", _value_of(x.fget, depth))
    if isinstance(x, (types.ModuleType, type)) and _library(x):
        return ("object", id(x))  # torch, torch.Tensor: what they compute does not change
    if isinstance(x, torch.nn.Module):
        raise _Unkeyable  # parameters, buffers and submodules: state a key cannot follow
    if isinstance(x, type):  # a class of the user's (a library's was keyed above)
        if depth < 3:
            return _following(x, lambda: _class_key(x, depth + 1))
        raise _Unkeyable
    if callable(x) and _library(type(x)) and not isinstance(x, np.vectorize):
        return ("object", id(x))  # torch.ops.aten.add, numpy's ufuncs and dispatchers
    if not _library(type(x)) and depth < 3 and not isinstance(x, (types.ModuleType, np.vectorize)):
        return _following(x, lambda: _instance_key(x, depth + 1))  # a user object: its class and attributes
    raise _Unkeyable


def _has_storage(t: torch.Tensor) -> bool:
    try:
        t.untyped_storage()
        return True
    except (RuntimeError, NotImplementedError):
        return False


def _following(x: object, make) -> Hashable:
    """``make()``, the key of ``x``, unless it is being made on this thread already (a class whose
    method reads the class): then a marker of the object, which its outer key contains in full."""
    making = _MAKING.ids
    if id(x) in making:
        return ("cycle", getattr(x, "__qualname__", type(x).__qualname__))
    making.add(id(x))
    try:
        return make()
    finally:
        making.discard(id(x))


def _attributes(namespace: dict, depth: int) -> tuple:
    items = [(k, v) for k, v in namespace.items() if not (k.startswith("__") and k.endswith("__"))]
    if len(items) > FINGERPRINT_ATTRIBUTES:
        raise _Unkeyable
    return tuple((k, _value_of(v, depth)) for k, v in sorted(items, key=lambda kv: str(kv[0])))


def _class_key(cls: type, depth: int) -> Hashable:
    """A user class by what it holds: its attributes (class variables by value, methods by their
    code and what they read) and its bases'. ``Cfg.W = 9`` changes the key."""
    bases = tuple(_value_of(b, depth) for b in cls.__bases__ if b is not object)
    return ("class", cls.__module__, cls.__qualname__, bases, _attributes(dict(vars(cls)), depth))


def _instance_key(obj: object, depth: int) -> Hashable:
    """A user object by its class and its attributes (``__dict__`` and ``__slots__``); an int or str
    subclass by its value too. An object with no attributes to read (of a C type) has no key."""
    cls = type(obj)
    base = None
    builtins: tuple[Any, ...] = (int, float, str, bytes, tuple)
    for builtin in builtins:
        if isinstance(obj, builtin):
            base = _value_of(builtin(obj), depth)  # the value, without the subclass
    namespace = dict(getattr(obj, "__dict__", {}))
    for name in getattr(cls, "__slots__", ()):
        if hasattr(obj, name):
            namespace[name] = getattr(obj, name)
    if base is None and not namespace and not hasattr(obj, "__dict__"):
        raise _Unkeyable  # state held where Python cannot read it
    return ("instance", _value_of(cls, depth), base, _attributes(namespace, depth))


#: The opcodes that read a global by name, and those that read an attribute of what is on the stack.
_GLOBAL_LOADS = frozenset({"LOAD_GLOBAL", "LOAD_NAME"})
_ATTRIBUTE_LOADS = frozenset({"LOAD_ATTR", "LOAD_METHOD"})


@functools.lru_cache(maxsize=256)
def global_reads(code: types.CodeType) -> tuple[tuple[str, ...], ...]:
    """Each global a code object (and every function, lambda and comprehension nested in it) reads,
    with the attributes read from it right after: ``("cfg", "W")`` for ``cfg.W``."""
    found: list[tuple[str, ...]] = []
    chain: list[str] | None = None
    for ins in dis.get_instructions(code):
        if ins.opname in _GLOBAL_LOADS:
            if chain:
                found.append(tuple(chain))
            chain = [ins.argval]
        elif ins.opname in _ATTRIBUTE_LOADS and chain:
            chain.append(ins.argval)
        else:
            if chain:
                found.append(tuple(chain))
            chain = None
    if chain:
        found.append(tuple(chain))
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            found += global_reads(const)
    return tuple(found)


def _global_values(fn: types.FunctionType, depth: int) -> tuple:
    """The values of the globals ``fn`` reads, each followed through its attribute reads while it
    is a module or class (those are keyed by what is read from them, not by themselves)."""
    out: list[tuple[tuple[str, ...], Hashable]] = []
    for chain in sorted(set(global_reads(fn.__code__))):
        if chain[0] not in fn.__globals__:  # a builtin (abs, len) or a name not bound yet
            out.append((chain[:1], ("unbound",)))  # binding it later changes the key
            continue
        value = fn.__globals__[chain[0]]
        read = 1
        while read < len(chain) and isinstance(value, (types.ModuleType, type)) and not _library(value):
            try:
                value = getattr(value, chain[read])
            except AttributeError:
                raise _Unkeyable from None
            read += 1
        out.append((chain[:read], _value_of(value, depth)))
    return tuple(out)


def _function_key(fn: types.FunctionType, depth: int) -> Hashable:
    code = fn.__code__
    cells = tuple(_value_of(c.cell_contents, depth) for c in fn.__closure__ or ())
    defaults = tuple(_value_of(d, depth) for d in fn.__defaults__ or ())
    kwdefaults = tuple(sorted((k, _value_of(v, depth)) for k, v in (fn.__kwdefaults__ or {}).items()))
    return ("function", code, cells, defaults, kwdefaults, _global_values(fn, depth))  # code compares by value


def fingerprint(fn: object) -> Hashable | None:
    """A value key of a predicate: its code and the values of what it reads (see the module), or
    None where some of that cannot be fingerprinted (a device tensor, a module of the user's as a
    whole, an object of unknown kind).

    Equal fingerprints mean the function computes the same thing: a closure whose captured
    tensor is edited in any way (in place, through ``.data``, through ``.numpy()``), whose cell is
    rebound, or a global (or a module's attribute) it reads that is rebound, has another
    fingerprint.
    """
    try:
        if isinstance(fn, types.FunctionType):
            return _function_key(fn, 0)
        return _value_of(fn, 0)
    except (_Unkeyable, ValueError, RuntimeError, TypeError, RecursionError):
        return None
