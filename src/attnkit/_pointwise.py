"""Whether a function written for one pair may be evaluated by broadcasting, proved by recording it.

FlexAttention defines a ``mask_mod(b, h, q_idx, kv_idx)`` and a ``score_mod(score, b, h, q_idx,
kv_idx)`` for one pair, evaluated under ``torch.vmap``. attnkit evaluates them once for a whole tile
by passing broadcasting index tensors (``b: (B, 1, 1, 1)``, ``q_idx: (1, 1, n, 1)``, ...), which is
the same thing only when every operation the function applies to the indices (and to the score) is
elementwise: ``(q >= kv) | torch.any(kv == G)`` reduces over the whole tile and means something
else on a tile than on a pair. :func:`recording` runs the function once under a
``TorchFunctionMode`` that follows every tensor computed from the inputs and proves that each
operation on them is one of:

- an elementwise operation (comparisons, arithmetic, logic, ``where``, ``clamp``, casts, unary
  functions): its result at a pair depends only on its inputs at that pair;
- indexing a tensor that does not depend on the inputs (a captured table) with one index per
  dimension, each an input-derived integer tensor or a Python int: ``docs[q_idx]``,
  ``rel[h, q_idx - kv_idx + L]``.

Anything else reached from the inputs (a reduction, a shape read, a host read such as ``bool()``
or ``.item()``, a view, indexing an index tensor, an in-place write) leaves the function unproved,
and it is evaluated one pair at a time under ``torch.vmap`` instead, as FlexAttention does.
Operations on tensors that do not depend on the inputs are free (they are the same either way).
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from attnkit._cache import PER_PAIR
from attnkit._validate import compiling, traced_as_constant

__all__ = ["Recording", "broadcast_proved", "indexing_per_pair", "recording"]

#: Operations whose result at a position depends only on their inputs at that position
#: (their names; a Tensor method, a ``torch`` function or a ``torch.nn.functional`` one).
ELEMENTWISE = frozenset(
    """
    add sub subtract rsub mul multiply div divide true_divide floor_divide remainder fmod pow
    float_power neg negative abs absolute sign sgn signbit copysign reciprocal square sqrt rsqrt
    exp exp2 expm1 log log2 log10 log1p sin cos tan asin acos atan atan2 arctan2 sinh cosh tanh
    asinh acosh atanh sigmoid logit erf erfc erfinv floor ceil round trunc fix frac clamp clip
    clamp_min clamp_max minimum maximum fmin fmax hypot logaddexp logaddexp2 xlogy lerp addcmul
    addcdiv nan_to_num isnan isinf isposinf isneginf isfinite isreal where
    eq ne lt le gt ge greater less greater_equal less_equal not_equal
    logical_and logical_or logical_xor logical_not
    bitwise_and bitwise_or bitwise_xor bitwise_not bitwise_left_shift bitwise_right_shift
    relu relu6 leaky_relu elu selu celu gelu silu mish softplus softsign hardtanh hardsigmoid
    hardswish tanhshrink threshold
    to type type_as float double half bfloat16 long int short bool byte char clone detach
    contiguous masked_fill zeros_like ones_like full_like empty_like
    __add__ __radd__ __sub__ __rsub__ __mul__ __rmul__ __truediv__ __rtruediv__ __floordiv__
    __rfloordiv__ __mod__ __rmod__ __pow__ __rpow__ __neg__ __pos__ __abs__ __invert__
    __and__ __rand__ __or__ __ror__ __xor__ __rxor__ __lshift__ __rlshift__ __rshift__
    __rrshift__ __eq__ __ne__ __lt__ __le__ __gt__ __ge__ __div__ __rdiv__
    """.split()
)

#: Attributes whose value does not depend on a tensor's shape or contents.
HARMLESS_ATTRIBUTES = frozenset(
    {"dtype", "device", "layout", "requires_grad", "is_cuda", "is_cpu", "is_meta", "is_leaf", "grad_fn"}
)
HARMLESS_METHODS = frozenset(
    # new_zeros(size) and the like: a constant of the given size (reading a shape is refused on its own)
    {"is_floating_point", "is_complex", "element_size", "get_device", "new_zeros", "new_ones", "new_full"}
)


def _name(func) -> str:
    name = getattr(func, "__name__", "")
    if name == "__get__":  # a property of the tensor: its descriptor's name
        return "." + str(getattr(getattr(func, "__self__", None), "__name__", "?"))
    return str(name)


class Recording(TorchFunctionMode):
    """Follows every tensor computed from ``inputs`` while active; :attr:`why` is None while each
    operation on them is elementwise or an index into a tensor that does not depend on them, else
    the first operation that is not, in words."""

    def __init__(self, inputs: tuple[torch.Tensor, ...]):
        super().__init__()
        self._computed = {id(t) for t in inputs}
        self._alive: list[torch.Tensor] = list(inputs)  # keeps ids unique while recording
        self.why: str | None = None

    def _is_derived(self, x) -> bool:
        return isinstance(x, torch.Tensor) and id(x) in self._computed

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.why is None:
            leaves = tree_leaves((args, kwargs))
            if any(self._is_derived(x) for x in leaves):
                self.why = self._refusal(func, args, kwargs)
                if self.why is None:
                    for t in tree_leaves(out):
                        if isinstance(t, torch.Tensor):
                            self._computed.add(id(t))
                            self._alive.append(t)
        return out

    def _refusal(self, func, args, kwargs) -> str | None:
        name = _name(func)
        if name.startswith("."):
            return None if name[1:] in HARMLESS_ATTRIBUTES else f"reads the {name[1:]} of an index tensor"
        if name in HARMLESS_METHODS:
            return None
        if name == "__getitem__":
            return self._indexing(args[0], args[1])
        if name == "where" and len(args) + len(kwargs) != 3:
            return "torch.where with one argument (the indices where it holds)"
        if name.endswith("_") and not name.endswith("__"):
            return f"{name} writes into a tensor in place"
        if name in ELEMENTWISE:
            return None
        return f"{name} is not elementwise"

    def _indexing(self, table, index) -> str | None:
        if self._is_derived(table):
            return "indexes a tensor computed from the indices"
        parts = index if isinstance(index, tuple) else (index,)
        for part in parts:
            if isinstance(part, torch.Tensor):
                if part.dtype == torch.bool:
                    return "indexes with a bool tensor"
            elif isinstance(part, bool) or not isinstance(part, int):
                return f"indexes with {type(part).__name__} (not one index per dimension)"
        if len(parts) != table.dim():
            return f"indexes {len(parts)} of the {table.dim()} dimensions of a captured tensor"
        return None


def recording(*inputs: torch.Tensor) -> Recording:
    """``with recording(b, h, q_idx, kv_idx) as rec: out = fn(b, h, q_idx, kv_idx)``; then
    ``rec.why`` is None where broadcasting ``fn`` equals evaluating it one pair at a time."""
    return Recording(inputs)


def _per_pair(fn) -> bool:
    try:
        return fn in PER_PAIR
    except TypeError:  # not weak-referenceable, or unhashable
        return False


@traced_as_constant
def _proved_on_zeros(fn, arity: int) -> bool:
    """The proof for torch.compile: ``fn`` recorded eagerly (while dynamo traces, its answer is a
    constant of the graph) on broadcasting zero indices (``(2, 1, 1, 1)``, ..., ``(1, 1, 1, 3)``) and,
    for a score_mod (5 arguments), a zero score; unproved where it is known to need one pair at a
    time or raises on them."""
    if _per_pair(fn):
        return False
    shapes = [(2, 1, 1, 1), (1, 2, 1, 1), (1, 1, 3, 1), (1, 1, 1, 3)]
    inputs = [torch.zeros(shape, dtype=torch.int64) for shape in shapes]
    if arity == 5:
        inputs.insert(0, torch.zeros(2, 2, 3, 3))
    try:
        with recording(*inputs) as rec:
            fn(*inputs)
    except Exception:  # noqa: BLE001 - unproved: evaluated one pair at a time
        return False
    return rec.why is None


def broadcast_proved(fn, *inputs: torch.Tensor) -> tuple[object, str]:
    """``(fn(*inputs), "")`` on broadcasting tensors where that is proved to equal evaluating ``fn``
    one pair at a time; else ``(None, why)``: the recording found an operation that is not
    elementwise, ``fn`` raised on the tensors, it is known from before to need one pair at a time
    (:data:`attnkit._cache.PER_PAIR`). While torch.compile traces, the proof is made eagerly on
    zero indices (:func:`_proved_on_zeros`), a constant of the graph."""
    if compiling():
        if not _proved_on_zeros(fn, len(inputs)):
            return None, "under torch.compile, not proved elementwise"
        return fn(*inputs), ""
    if _per_pair(fn):
        return None, "it needed one pair at a time before"
    try:
        with recording(*inputs) as rec:
            out = fn(*inputs)
        why = rec.why
    except Exception as err:  # noqa: BLE001 - a function of one pair fails on tensors in many ways
        out, why = None, f"{type(err).__name__}: {err}"
    if why is None:
        return out, ""
    try:
        PER_PAIR[fn] = True
    except TypeError:
        pass
    return None, why


class _IndexingPerPair(TorchFunctionMode):
    """``t[i]``, ``t[i, j]``, ``t[i][j]`` with index tensors (0-d under vmap) or ints, as
    ``aten.index``: an indexing operation that vmap batches and autograd differentiates, not a
    Python int read from a 0-d tensor (which vmap, and a traced graph, cannot do). Indices with
    slices, ``None`` or ``...`` keep ``Tensor.__getitem__``."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.__getitem__:
            table, where = args[0], args[1]
            leaves = tree_leaves(where)
            if isinstance(table, torch.Tensor) and all(
                isinstance(i, (torch.Tensor, int)) and not isinstance(i, bool) for i in leaves
            ):
                indices = [
                    i if isinstance(i, torch.Tensor) else torch.tensor(i, dtype=torch.int64, device=table.device)
                    for i in leaves
                ]
                return torch.ops.aten.index.Tensor(table, indices)
        return func(*args, **(kwargs or {}))


def indexing_per_pair() -> TorchFunctionMode:
    """The context a function of one pair runs in under ``torch.vmap``, eager or traced by
    torch.compile: ``table[q_idx]`` with a 0-d index tensor is an indexing operation
    (``aten.index``), as torch's ``TransformGetItemToIndex`` makes it for FlexAttention's
    ``mask_mod`` and ``score_mod``; unlike torch's (an autograd.Function), dynamo traces it under
    vmap with tensors that require a gradient."""
    return _IndexingPerPair()
