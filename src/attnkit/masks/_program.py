"""A ``from_fn`` predicate as a program the native engine evaluates over many pairs at once.

The predicate is run once on one pair's index tensors under a ``TorchFunctionMode`` that writes
down every operation applied to values computed from the indices: straight-line code over integers
and bools (arithmetic that wraps as torch's does, floor and truncating division and remainder,
comparisons, bit and logical operations, shifts, ``minimum``/``maximum``/``clamp``, ``where``, integer
casts, and reads of captured integer or bool tensors indexed by such values). Each instruction keeps
the dtype torch computed it in (read from the traced result itself), so the engine wraps every
value as torch would, and constants are converted to the dtype of the operation that uses them
(a Python scalar does not widen a tensor's dtype). The engine (``native_predicate`` in
``kernels/native/csrc/predicate.h``) then runs the program over a tile's pairs in vectorised loops,
threaded, writing bools, packed bits or a tile's all/any, with no ``(tq, Lk)`` intermediates.

What the program language does not hold (floats, reductions, reading a shape, a host read, a
table read with a bool index) leaves :func:`trace` with None, and the caller evaluates with torch
as before. While ``torch.compile`` traces, nothing here runs (the callers check).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["Program", "evaluate", "trace"]

# opcodes: the order of PredOp in predicate.h
(INPUT, CONST, ADD, SUB, MUL, NEG, ABS, FLOORDIV, TRUNCDIV, REMAINDER, FMOD, EQ, NE, LT, LE, GT, GE, AND, OR, XOR,
 NOT, LNOT, SHL, SHR, MIN, MAX, WHERE, CAST, LOAD, LAND, LOR, LXOR, SIGN) = range(33)  # fmt: skip

DTYPES = {torch.bool: 0, torch.uint8: 1, torch.int8: 2, torch.int16: 3, torch.int32: 4, torch.int64: 5}

_BINARY = {
    "add": ADD, "sub": SUB, "subtract": SUB, "mul": MUL, "multiply": MUL,
    "floor_divide": FLOORDIV, "floordiv": FLOORDIV, "remainder": REMAINDER, "mod": REMAINDER, "fmod": FMOD,
    "eq": EQ, "ne": NE, "not_equal": NE, "lt": LT, "less": LT, "le": LE, "less_equal": LE,
    "gt": GT, "greater": GT, "ge": GE, "greater_equal": GE,
    "bitwise_and": AND, "and": AND, "bitwise_or": OR, "or": OR, "bitwise_xor": XOR, "xor": XOR,
    "logical_and": LAND, "logical_or": LOR, "logical_xor": LXOR,
    "bitwise_left_shift": SHL, "lshift": SHL, "bitwise_right_shift": SHR, "rshift": SHR,
    "minimum": MIN, "maximum": MAX,
}  # fmt: skip
_UNARY = {"neg": NEG, "negative": NEG, "abs": ABS, "absolute": ABS, "sign": SIGN, "sgn": SIGN}
_CASTS = frozenset({"to", "type", "type_as", "long", "int", "short", "bool", "byte", "char"})
_SAME = frozenset({"clone", "detach", "contiguous", "pos", "positive"})
_CONSTANTS = frozenset({"zeros_like", "ones_like", "full_like", "new_zeros", "new_ones", "new_full", "new_tensor"})
_ATTRIBUTES = frozenset({"dtype", "device", "layout", "is_cuda", "is_cpu", "requires_grad"})


class _Outside(Exception):
    """An operation the program language does not hold."""


@dataclass(frozen=True)
class Program:
    """A traced predicate: ``code`` (n, 6) int64 (op, dtype, operands; see predicate.h) and the captured
    ``tables`` it reads (the predicate's own tensors: their contents are read at each evaluation)."""

    code: torch.Tensor
    tables: tuple[torch.Tensor, ...]

    def on_grid(self, q_len: int, kv_len: int, clamp: bool, inside: bool) -> Program:
        """The program over parts of a grid, its indices made inside it from eight inputs: ``b``,
        ``h``, then ``q_start``, ``q_local``, ``q_offset`` and the same for the keys; a part's query
        index is ``min(q_start + q_local, q_len - 1) + q_offset`` (``clamp``: a short last part
        repeats its last index), its key index likewise. ``inside``: pairs whose unclamped index is
        at or past the length are False (a ragged last block). The inputs are per part or per
        position, so what they add is computed once per part, not per pair."""
        pro: list[list[int]] = []

        def emit(op, *operands, dtype=5):
            pro.append([op, dtype, *operands, *(-1,) * (4 - len(operands))])
            return len(pro) - 1

        b, h = emit(INPUT, 0), emit(INPUT, 1)

        def index(first: int, length: int) -> tuple[int, int]:
            raw = emit(ADD, emit(INPUT, first), emit(INPUT, first + 1))
            at = emit(MIN, raw, emit(CONST, length - 1)) if clamp else raw
            return raw, emit(ADD, at, emit(INPUT, first + 2))

        q_raw, q = index(2, q_len)
        kv_raw, kv = index(5, kv_len)
        sources = (b, h, q, kv)
        moved: dict[int, int] = {}
        for i, (op, dtype, *operands) in enumerate(self.code.tolist()):
            if op == INPUT:
                moved[i] = sources[operands[0]]
                continue
            first = 1 if op == LOAD else 4 if op == CONST else 0  # operands that are not slots
            pro.append([op, dtype, *operands[:first], *(moved[x] if x >= 0 else x for x in operands[first:])])
            moved[i] = len(pro) - 1
        result = moved[self.code.shape[0] - 1]
        if inside:
            in_q = emit(LT, q_raw, emit(CONST, q_len), dtype=0)
            in_kv = emit(LT, kv_raw, emit(CONST, kv_len), dtype=0)
            result = emit(LAND, result, emit(LAND, in_q, in_kv, dtype=0), dtype=0)
        elif result != len(pro) - 1:
            result = emit(CAST, result, dtype=0)
        return Program(torch.tensor(pro, dtype=torch.int64), self.tables)


def _wrap(value: int, dtype: torch.dtype) -> int:
    """``value`` as torch converts a Python int to ``dtype`` (two's complement, as the engine wraps)."""
    if dtype == torch.bool:
        return int(value != 0)
    bits = torch.iinfo(dtype).bits
    value &= (1 << bits) - 1
    signed = dtype != torch.uint8
    return value - (1 << bits) if signed and value >= 1 << (bits - 1) else value


def _name(func) -> str:
    name = getattr(func, "__name__", "")
    if name == "__get__":
        return "." + str(getattr(getattr(func, "__self__", None), "__name__", "?"))
    return str(name)


def _tensors(args, kwargs):
    """The tensors among an operation's arguments (in tuples and lists too)."""
    for x in (*args, *kwargs.values()):
        if isinstance(x, torch.Tensor):
            yield x
        elif isinstance(x, tuple | list):
            yield from (y for y in x if isinstance(y, torch.Tensor))


class _Tracer(TorchFunctionMode):
    def __init__(self, inputs):
        super().__init__()
        self.slots: dict[int, int] = {}
        self.alive: list = list(inputs)  # ids stay unique while tracing
        self.code: list[list[int]] = []
        self.tables: list[torch.Tensor] = []
        self.table_ids: dict[int, int] = {}
        self.consts: dict[tuple[int, int], int] = {}
        #: a table read with fewer indices than its dims: one pair's row, read on when indexed again
        self.rows: dict[int, tuple[torch.Tensor, list[int]]] = {}
        self.why: str | None = None
        for i, x in enumerate(inputs):
            self.slots[id(x)] = self._emit(INPUT, x.dtype, i)

    def _emit(self, op: int, dtype: torch.dtype, *operands: int) -> int:
        if dtype not in DTYPES:
            raise _Outside(f"a {dtype} value")
        self.code.append([op, DTYPES[dtype], *operands, *(-1,) * (4 - len(operands))])
        return len(self.code) - 1

    def _const(self, value: int, dtype: torch.dtype) -> int:
        key = (_wrap(value, dtype), DTYPES[dtype])
        if key not in self.consts:
            self.consts[key] = self._emit(CONST, torch.int64, key[0])
        return self.consts[key]

    def _operand(self, x, dtype: torch.dtype) -> int:
        """The slot of ``x`` in an operation computed in ``dtype``: a traced value, or a constant."""
        if isinstance(x, torch.Tensor) and id(x) in self.slots:
            return self.slots[id(x)]
        if isinstance(x, torch.Tensor):
            if x.dim() or x.dtype not in DTYPES:
                raise _Outside(f"a captured {x.dtype} tensor of shape {tuple(x.shape)} used per pair")
            x = int(x.item())
        if isinstance(x, bool | int):
            if dtype not in DTYPES:
                raise _Outside(f"a {dtype} operation")
            return self._const(int(x), dtype)
        raise _Outside(f"an operand of type {type(x).__name__}")

    def _track(self, out, slot: int):
        self.slots[id(out)] = slot
        self.alive.append(out)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.why is None and any(id(x) in self.slots or id(x) in self.rows for x in _tensors(args, kwargs)):
            try:
                self._record(_name(func), args, kwargs, out)
            except _Outside as err:
                self.why = str(err)
        return out

    def _record(self, name: str, args, kwargs, out):
        if name.startswith("."):
            if name[1:] not in _ATTRIBUTES:
                raise _Outside(f"reads the {name[1:]} of an index tensor")
            return
        if name in ("is_floating_point", "is_complex"):
            return
        if name == "__getitem__":
            return self._load(args[0], args[1], out)
        if any(id(x) in self.rows for x in _tensors(args, kwargs)):
            raise _Outside(f"{name} of a row of a captured tensor")
        if name in _CONSTANTS:  # a constant: not computed from the indices
            if isinstance(out, torch.Tensor) and out.dim() == 0 and out.dtype in DTYPES:
                self._track(out, self._const(int(out.reshape(-1)[0].item()), out.dtype))
            return
        if not isinstance(out, torch.Tensor) or out.dtype not in DTYPES or out.dim() != 0:
            raise _Outside(f"{name} gives {type(out).__name__} {getattr(out, 'dtype', '')}")
        reflected = name.startswith("__r") and name.endswith("__") and name[3:-2] in _BINARY
        name = name[3:-2] if reflected else name.strip("_") if name.startswith("__") else name
        if name in ("div", "divide", "true_divide", "truediv"):
            mode = kwargs.get("rounding_mode", args[2] if len(args) > 2 else None)
            name = {"floor": "floor_divide", "trunc": "trunc"}.get(mode, "true")
            if name == "true":
                raise _Outside("true division")
            if name == "trunc":
                return self._binary(TRUNCDIV, args[0], args[1], out)
        if name in ("add", "sub", "subtract") and kwargs.get("alpha", 1) != 1 or len(args) > 2 and name in _BINARY:
            raise _Outside(f"{name} with more arguments")
        if name in _BINARY:
            a, b = (args[1], args[0]) if reflected else (args[0], args[1] if len(args) > 1 else kwargs.get("other"))
            return self._binary(_BINARY[name], a, b, out)
        if name in _UNARY:
            return self._track(out, self._emit(_UNARY[name], out.dtype, self._operand(args[0], out.dtype)))
        if name in ("invert", "bitwise_not", "logical_not"):
            op = LNOT if name == "logical_not" or args[0].dtype == torch.bool else NOT
            return self._track(out, self._emit(op, out.dtype, self._operand(args[0], out.dtype)))
        if name in _CASTS or name in _SAME:
            x = self._operand(args[0], args[0].dtype)
            same = args[0].dtype == out.dtype
            return self._track(out, x if same else self._emit(CAST, out.dtype, x))
        if name == "where" and len(args) + len(kwargs) == 3:
            cond, a, b = (list(args) + [kwargs.get(k) for k in ("input", "other")])[:3]
            if not (isinstance(cond, torch.Tensor) and cond.dtype == torch.bool):
                raise _Outside("where with a condition that is not bool")
            slots = (self._operand(cond, torch.bool), self._operand(a, out.dtype), self._operand(b, out.dtype))
            return self._track(out, self._emit(WHERE, out.dtype, *slots))
        if name in ("clamp", "clip", "clamp_min", "clamp_max"):
            lo = kwargs.get("min", args[1] if len(args) > 1 and name != "clamp_max" else None)
            hi = kwargs.get(
                "max", args[2] if len(args) > 2 else args[1] if len(args) > 1 and name == "clamp_max" else None
            )
            slot = self._operand(args[0], out.dtype)
            if args[0].dtype != out.dtype:
                slot = self._emit(CAST, out.dtype, slot)
            if lo is not None:
                slot = self._emit(MAX, out.dtype, slot, self._operand(lo, out.dtype))
            if hi is not None:
                slot = self._emit(MIN, out.dtype, slot, self._operand(hi, out.dtype))
            return self._track(out, slot)
        raise _Outside(f"{name} is outside the program language")

    def _binary(self, op: int, a, b, out):
        compute = torch.result_type(a, b)
        if compute not in DTYPES:
            raise _Outside(f"a {compute} operation")
        if op in (SHL, SHR) and compute == torch.bool:
            raise _Outside("a shift of bools")
        same = self._identity(op, a, b, out) if out.dtype == torch.bool else None
        if same is not None:  # x | False, x & True (or_masks / and_masks start from a constant): x itself
            return self._track(out, same)
        self._track(out, self._emit(op, out.dtype, self._operand(a, compute), self._operand(b, compute)))

    def _identity(self, op: int, a, b, out) -> int | None:
        """The slot of the bool operand that ``op`` returns unchanged (its other operand a constant
        False for ``|``/``^``, True for ``&``), else None."""
        for x, c in ((a, b), (b, a)):
            if not (isinstance(x, torch.Tensor) and id(x) in self.slots and x.dtype == torch.bool):
                continue
            value = self._constant(c)
            if value is None:
                continue
            if (op in (OR, XOR, LOR, LXOR) and value == 0) or (op in (AND, LAND) and value != 0):
                return self.slots[id(x)]
        return None

    def _constant(self, x) -> int | None:
        """``x``'s value where it is the same for every pair (a number, a 0-d captured tensor, a traced
        constant), else None."""
        if isinstance(x, torch.Tensor) and id(x) in self.slots:
            op, _, value, *_ = self.code[self.slots[id(x)]]
            return value if op == CONST else None
        if isinstance(x, torch.Tensor):
            return int(x.item()) if x.dim() == 0 and x.dtype in DTYPES else None
        return int(x) if isinstance(x, bool | int) else None

    def _load(self, table, index, out) -> None:
        """``table[index]``: a captured tensor read at indices computed per pair (or ints); with fewer
        indices than its dims, a row kept until it is indexed again (``intervals[i][0]``)."""
        slots: list[int] = []
        if isinstance(table, torch.Tensor) and id(table) in self.rows:
            table, slots = self.rows[id(table)]
            slots = list(slots)
        elif not isinstance(table, torch.Tensor) or id(table) in self.slots:
            raise _Outside("indexing a tensor computed from the indices")
        parts = index if isinstance(index, tuple) else (index,)
        if table.dtype not in DTYPES or not 1 <= table.dim() <= 3 or len(slots) + len(parts) > table.dim():
            raise _Outside(f"indexing a {table.dtype} tensor of {table.dim()} dims with {len(parts)} indices")
        for part in parts:
            if isinstance(part, torch.Tensor) and part.dtype in (torch.bool, torch.uint8):
                raise _Outside("indexing with a bool or uint8 tensor")
            if isinstance(part, bool) or not isinstance(part, int | torch.Tensor):
                raise _Outside(f"indexing with {type(part).__name__}")
            slots.append(self._operand(part, torch.int64))
        if not isinstance(out, torch.Tensor) or out.dtype != table.dtype:
            raise _Outside("a table read that is not one value per pair")
        if len(slots) < table.dim():
            self.rows[id(out)] = (table, slots)
            self.alive.append(out)
            return
        if id(table) not in self.table_ids:
            self.table_ids[id(table)] = len(self.tables)
            self.tables.append(table.detach())
            self.alive.append(table)
        self._track(out, self._emit(LOAD, out.dtype, self.table_ids[id(table)], *slots))


def trace(fn, b, h, q_idx, kv_idx) -> Program | None:
    """``fn`` as a program, traced on the first pair of the index tensors it would be given, each a
    0-d tensor of its dtype (one pair, as ``torch.vmap`` hands FlexAttention's mask_mod one: the
    type promotion recorded is the one it computes); None where it leaves the program language or
    fails on that pair (the caller evaluates it with torch, which says why)."""
    if any(x.numel() == 0 or x.dtype not in DTYPES or x.dtype == torch.bool for x in (b, h, q_idx, kv_idx)):
        return None
    inputs = [x.reshape(-1)[0].clone() for x in (b, h, q_idx, kv_idx)]
    tracer = _Tracer(inputs)
    try:
        with tracer:
            out = fn(*inputs)
    except Exception:  # noqa: BLE001 - the torch path evaluates it again and reports what it raises
        return None
    if tracer.why is not None or not isinstance(out, torch.Tensor) or out.dtype != torch.bool:
        return None
    slot = tracer.slots.get(id(out))
    if slot is None or out.dim() != 0:
        return None
    return Program(torch.tensor(_used(tracer.code, slot), dtype=torch.int64), tuple(tracer.tables))


def _used(code: list[list[int]], result: int) -> list[list[int]]:
    """The instructions ``result`` depends on, renumbered, ``result`` last (the engine's output)."""
    needed, stack = set(), [result]
    while stack:
        i = stack.pop()
        if i in needed:
            continue
        needed.add(i)
        op, _, *operands = code[i]
        if op == LOAD:
            operands = operands[1:]  # the first is the table
        if op not in (INPUT, CONST):
            stack.extend(x for x in operands if x >= 0)
    order = sorted(needed)
    new = {old: i for i, old in enumerate(order)}
    out = []
    for i in order:
        op, dtype, *operands = code[i]
        first = 1 if op == LOAD else 4 if op in (INPUT, CONST) else 0  # operands that are not slots
        out.append([op, dtype, *operands[:first], *(new.get(x, x) if x >= 0 else x for x in operands[first:])])
    return out


def available() -> bool:
    """Whether the native engine (and so this evaluator) runs in this process."""
    from attnkit.kernels.native import build

    return build.available()


def evaluate(program: Program, inputs, shape: tuple[int, int, int], mode: int) -> torch.Tensor | None:
    """The program over every pair of ``shape`` ``(T, X, Y)``; ``inputs`` broadcast to it. ``mode``: 0 bool
    (T, X, Y); 1 packed along Y, uint8 (T, X, ceil(Y / 8)); 2 uint8 (T,), bit 0 where some pair is
    True, bit 1 where some is False. None where a pair leaves a table, divides by zero or shifts by a
    negative amount (the torch path raises or answers there)."""
    values = [torch.as_tensor(x, dtype=torch.int64) for x in inputs]
    try:
        tables = [t.to(torch.int64).contiguous() for t in program.tables]
        return torch.ops.attnkit.native_predicate(program.code, values, tables, list(shape), mode)
    except RuntimeError:
        return None
