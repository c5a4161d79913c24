"""The hook points of one attention call site, and the one order they run in.

An attention call site is an :class:`attnkit.MultiHeadAttention` layer, or the transformers
integration (every attention module of a model loaded with ``attn_implementation="attnkit"``
calls it). Each holds a :class:`HookPoints` and runs its attention through :meth:`HookPoints.run`,
so both call their hooks the same way:

1. attention hooks, ``hook(module, q, k, v, mask, mods)``, before attention (``mods``: the call's
   keyword arguments: ``attn_bias``, ``softcap``, ``sinks``, ``scale``, ``dropout_p``); a hook
   registered ``with_cross=True`` is called ``hook(module, q, k, v, mask, mods, cross)``, ``cross``
   whether the keys come from another sequence than the queries (cross-attention) rather than from
   the queries' own tokens or a cache of them (None where the call site cannot tell);
2. the attention, with ``return_lse=True`` when an lse hook is registered, then lse hooks,
   ``hook(module, lse)``;
3. head output hooks, ``hook(module, out)`` on ``out: (B, H, Lq, head_dim)``: a tensor returned
   (same shape) replaces it.

:mod:`attnkit.inspect` reads a model's call sites through these hooks (``attnkit.inspect.sites``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from attnkit import functional
from attnkit._validate import AttnkitTypeError, AttnkitValueError

__all__ = ["KINDS", "HookPoints"]

#: The kinds of hook a call site takes, in the order they run.
KINDS = ("attention", "lse", "head_output")


class HookPoints:
    """The hooks of one call site, by kind (:data:`KINDS`); :meth:`run` is the call with them."""

    def __init__(self) -> None:
        self.hooks: dict[str, OrderedDict] = {kind: OrderedDict() for kind in KINDS}
        self._with_cross: set[int] = set()  # handle ids of attention hooks that take ``cross``

    def register(self, kind: str, hook: Callable[..., Any], *, with_cross: bool = False) -> RemovableHandle:
        """Add ``hook`` to the ``kind`` hooks; ``handle.remove()`` takes it out. ``with_cross``
        (attention hooks): also pass whether the call is cross-attention."""
        if kind not in KINDS:
            raise AttnkitValueError(f"hook kinds are {KINDS}, not {kind!r}.")
        if not callable(hook):
            raise AttnkitTypeError(f"a {kind} hook must be callable, but got {type(hook).__name__}.")
        table = self.hooks[kind]
        handle = RemovableHandle(table)
        table[handle.id] = hook
        if with_cross:
            self._with_cross.add(handle.id)
        return handle

    def __bool__(self) -> bool:
        return any(self.hooks.values())

    def before(
        self, module: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any, mods: dict,
        *, cross: bool | None = None,
    ) -> None:  # fmt: skip
        """Step 1: the attention hooks, on the call's inputs (and ``cross`` for those that take it)."""
        for key, hook in tuple(self.hooks["attention"].items()):
            if key in self._with_cross:
                hook(module, q, k, v, mask, dict(mods), cross)
            else:
                hook(module, q, k, v, mask, dict(mods))

    def after(self, module: nn.Module, out: torch.Tensor) -> torch.Tensor:
        """Step 3: the head output hooks on ``out (B, H, Lq, head_dim)``; the heads they leave."""
        for hook in tuple(self.hooks["head_output"].values()):
            new = hook(module, out)
            if new is not None:
                if not isinstance(new, torch.Tensor) or new.shape != out.shape:
                    got = tuple(new.shape) if isinstance(new, torch.Tensor) else type(new).__name__
                    raise AttnkitValueError(
                        f"a head output hook returned {got}; it must return None or a tensor of the heads' "
                        f"shape {tuple(out.shape)}."
                    )
                out = new
        return out

    def run(
        self, module: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any, mods: dict,
        *, need_weights: bool = False, cross: bool | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
        """``(out (B, H, Lq, head_dim), weights or None)`` of :func:`attnkit.attention` on the call,
        with this site's hooks around it (see the module docstring); ``cross``: whether the keys come
        from another sequence (None: the call site cannot tell)."""
        self.before(module, q, k, v, mask, mods, cross=cross)
        if need_weights:
            out, weights = functional.attention_with_weights(q, k, v, mask, **mods)
        elif self.hooks["lse"]:
            (out, lse), weights = functional.attention(q, k, v, mask, return_lse=True, **mods), None
            for hook in tuple(self.hooks["lse"].values()):
                hook(module, lse)
        else:
            out, weights = functional.attention(q, k, v, mask, **mods), None
        return self.after(module, out), weights
