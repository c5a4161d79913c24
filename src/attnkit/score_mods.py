"""General score modifications: ``score_mod(score, b, h, q_idx, kv_idx) -> score``.

FlexAttention's escape hatch, for what a mask (which pairs) and a bias (an added value)
cannot say: any function of a score and its indices, additive or not (soft-capping,
activations, gates). It runs after scaling, soft-capping and the bias, before the mask::

    s = q . k * scale
    s = softcap * tanh(s / softcap)       if softcap
    s = s + attn_bias(b, h, i, j)         if attn_bias
    s = score_mod(s, b, h, i, j)          if score_mod
    s = -inf where the mask hides (i, j)

The function gets the scores of one tile ``(Bs, Hs, n, S)`` and broadcasting int64 index
tensors ``b: (Bs, 1, 1, 1)``, ``h: (1, Hs, 1, 1)``, ``q_idx: (1, 1, n, 1)``,
``kv_idx: (1, 1, 1, S)`` (query and key indices, 0-based), and returns scores of the same
shape, where that is proved to equal evaluating it one pair at a time (every operation on the score
and the indices elementwise, or an index into a captured tensor: :mod:`attnkit._pointwise`); any
other function (one that reduces over the tile, reads a shape, fails on tiles) runs one pair at a
time under ``torch.vmap``, as FlexAttention's ``score_mod`` does. Gradients flow
through it to q, k and v, and to the tensors it captures that require a gradient (a learnable
bias in its closure, a module's parameters, a global: :func:`captured_tensors` finds them, as
FlexAttention lifts captured buffers); ``ScoreMod(fn, *params)`` names them explicitly.

>>> import torch, attnkit
>>> q = k = v = torch.randn(1, 2, 6, 8)
>>> relu = lambda score, b, h, q_idx, kv_idx: torch.relu(score)
>>> attnkit.attention(q, k, v, attnkit.masks.causal(), score_mod=relu).shape
torch.Size([1, 2, 6, 8])
"""

from __future__ import annotations

import functools
import inspect
import types
from collections.abc import Callable

import torch

from attnkit._cache import global_reads
from attnkit._pointwise import broadcast_proved, indexing_per_pair
from attnkit._validate import AttnkitTypeError, AttnkitValueError, compiling

__all__ = ["ScoreMod", "ScoreModLike", "as_score_mod", "captured_tensors"]


class ScoreMod:
    """A score modification ``fn(score, b, h, q_idx, kv_idx) -> score`` and the tensors it closes
    over (``params``: they get gradients)."""

    def __init__(self, fn: Callable[..., torch.Tensor] | ScoreMod, *params: torch.Tensor):
        if isinstance(fn, ScoreMod):
            params = fn.params + params
            fn = fn.fn
        self.fn: Callable[..., torch.Tensor]
        self.params: tuple[torch.Tensor, ...]
        if not callable(fn):
            raise AttnkitTypeError(
                f"score_mod must be callable as fn(score, b, h, q_idx, kv_idx), but got {type(fn).__name__}."
            )
        for i, t in enumerate(params):
            if not isinstance(t, torch.Tensor):
                raise AttnkitTypeError(
                    f"ScoreMod params must be tensors (those fn closes over), but params[{i}] is {type(t).__name__}."
                )
        self.fn, self.params = fn, tuple(params)

    @property
    def __name__(self) -> str:
        return str(getattr(self.fn, "__name__", type(self.fn).__name__))

    def __repr__(self) -> str:
        return f"ScoreMod({self.__name__}, {len(self.params)} params)"

    def __call__(self, score, b, h, q_idx, kv_idx) -> torch.Tensor:
        """The modified scores of one tile: by broadcasting where that is proved to equal one pair at
        a time (:mod:`attnkit._pointwise`), else under torch.vmap (FlexAttention's semantics)."""
        out, why = broadcast_proved(self.fn, score, b, h, q_idx, kv_idx)
        if isinstance(out, torch.Tensor) and out.shape == score.shape and out.is_floating_point():
            return out
        first = why or self._wrong(out)
        try:
            with indexing_per_pair():
                if _along_axes(score, b, h, q_idx, kv_idx):
                    out = _vmapped(self.fn)(score, b.reshape(-1), h.reshape(-1), q_idx.reshape(-1), kv_idx.reshape(-1))
                else:  # indices chosen per pair (the reference kernel's kept coordinates): one flat vmap
                    flat = [t.expand(score.shape).reshape(-1) for t in (b, h, q_idx, kv_idx)]
                    out = torch.vmap(self.fn)(score.reshape(-1), *flat).reshape(score.shape)
        except Exception as err:  # noqa: BLE001
            self._refuse(f"{first}; one pair at a time under torch.vmap: {type(err).__name__}: {err}", score)
        if not isinstance(out, torch.Tensor) or out.shape != score.shape or not out.is_floating_point():
            self._refuse(self._wrong(out), score)
        assert isinstance(out, torch.Tensor)  # _refuse raised otherwise
        return out

    @staticmethod
    def _wrong(out) -> str:
        return f"{out.dtype} of shape {tuple(out.shape)}" if isinstance(out, torch.Tensor) else type(out).__name__

    def _refuse(self, what: str, score):
        raise AttnkitValueError(
            f"score_mod {self.__name__} must return float scores of the tile's shape {tuple(score.shape)} for "
            "broadcasting index tensors (b, h, q_idx, kv_idx), or work on one pair at a time under torch.vmap; "
            f"it returned or raised: {str(what)[:300]}."
        )


def _along_axes(score, *indices) -> bool:
    """Whether each index tensor varies along its own axis only (b along the first of the score's
    last four, ..., kv_idx along the last): the nested vmap of :func:`_vmapped` reads them so."""
    if score.dim() != 4:
        return False
    return all(t.dim() == 4 and t.numel() == t.shape[axis] for axis, t in enumerate(indices))


def _vmapped(fn):
    """``fn`` of one (score, b, h, q, kv) over a tile ``(B, H, n, S)`` with 1-D index tensors."""
    f = torch.vmap(fn, in_dims=(0, None, None, None, 0))  # keys
    f = torch.vmap(f, in_dims=(0, None, None, 0, None))  # queries
    f = torch.vmap(f, in_dims=(0, None, 0, None, None))  # heads
    return torch.vmap(f, in_dims=(0, 0, None, None, None))  # batch rows


#: What ``score_mod=`` takes: ``fn(score, b, h, q_idx, kv_idx) -> score``, a ScoreMod, or None.
ScoreModLike = ScoreMod | Callable[..., torch.Tensor] | None


def as_score_mod(value: Callable[..., torch.Tensor] | ScoreMod | None) -> ScoreMod | None:
    """``score_mod=`` as a :class:`ScoreMod` (None stays None); a bare function's captured tensors
    that require a gradient become its params (:func:`captured_tensors`)."""
    if value is None or isinstance(value, ScoreMod):
        return value
    if compiling():  # traced: the score_mod's reads are the graph's inputs, and autograd follows them there
        return ScoreMod(value)
    return ScoreMod(value, *captured_tensors(value))


def captured_tensors(fn: Callable, *, requires_grad: bool = True) -> list[torch.Tensor]:
    """The tensors ``fn`` can read without being passed them: its closure's cells, its defaults,
    the globals its code names (nested functions' too) and the attributes it reads from them
    (``cfg.slope`` of a module or class), a bound method's object and class, a classmethod's
    class, a ``functools.partial``'s arguments, an ``nn.Module``'s parameters and buffers, a
    class's attributes, and, a few levels deep, the lists, tuples, dicts and plain objects among
    those. With ``requires_grad``
    (the default) only those that require a gradient: what a score_mod's gradient must reach.

    >>> import torch
    >>> bias = torch.zeros(4, requires_grad=True)
    >>> captured_tensors(lambda score, b, h, q, kv: score + bias[h]) == [bias]
    True
    """
    found: dict[int, torch.Tensor] = {}
    seen: set[int] = set()

    def visit(obj, depth: int) -> None:
        if (
            depth > 6
            or id(obj) in seen
            or isinstance(obj, (str, bytes, int, float, bool, type(None), types.ModuleType))
        ):
            return
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if obj.requires_grad or not requires_grad:
                found.setdefault(id(obj), obj)
        elif isinstance(obj, torch.nn.Module):
            for t in (*obj.parameters(), *obj.buffers()):
                visit(t, depth + 1)
        elif isinstance(obj, (list, tuple, set, frozenset)):
            for x in list(obj)[:1000]:
                visit(x, depth + 1)
        elif isinstance(obj, dict):
            for x in list(obj.values())[:1000]:
                visit(x, depth + 1)
        elif isinstance(obj, functools.partial):
            visit(obj.func, depth + 1)
            visit(obj.args, depth + 1)
            visit(obj.keywords, depth + 1)
        elif inspect.ismethod(obj):
            visit(obj.__self__, depth + 1)
            visit(obj.__func__, depth + 1)
        elif isinstance(obj, types.FunctionType):
            for cell in obj.__closure__ or ():
                try:
                    visit(cell.cell_contents, depth + 1)
                except ValueError:  # an empty cell
                    pass
            visit(obj.__defaults__, depth + 1)
            visit(obj.__kwdefaults__, depth + 1)
            for chain in global_reads(obj.__code__):  # cfg.slope: through modules and classes
                if chain[0] in obj.__globals__:
                    value = obj.__globals__[chain[0]]
                    visit(value, depth + 1)
                    for attr in chain[1:]:
                        value = getattr(value, attr, None)
                        visit(value, depth + 1)
        elif isinstance(obj, ScoreMod):
            visit(obj.fn, depth + 1)
        elif isinstance(obj, (staticmethod, classmethod)):
            visit(obj.__func__, depth + 1)
        elif isinstance(obj, type):  # a class of the user's: its class attributes (torch's own: none)
            if not str(getattr(obj, "__module__", "")).startswith(("torch", "builtins", "numpy")):
                visit(dict(vars(obj)), depth + 1)
        elif hasattr(obj, "__dict__"):  # a callable object, a config
            visit(type(obj), depth + 1)
            visit(vars(obj), depth + 1)

    visit(fn, 0)
    return list(found.values())
