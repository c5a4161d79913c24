"""A model's attention call sites, named in call order: the one mechanism every inspection tool uses.

Each attention call site of a model (an :class:`attnkit.MultiHeadAttention` layer, or a
transformers attention module run with ``attn_implementation="attnkit"``) has hook points
(:mod:`attnkit.nn.hooks`). :class:`Sites` opens them for one model and one thread: while its
``with`` block runs, the hooks added to it hear only this thread's calls of this model's
attention, each with the :class:`Site` it came from (its call-order ``index`` and module
``name``). :func:`attnkit.capture`, :func:`attnkit.inspect.rollout`,
:func:`attnkit.inspect.intervene` and :func:`attnkit.inspect.head_effects` are its clients.

Hooks by name, as TransformerLens's hook points and nnsight's envoys give them: site
``layers.{i}.attn`` is the ``i``-th attention called; a hook on ``layers.{i}.attn.{what}``
(``i`` may be ``*``) sees:

- ``weights``: the attention weights ``(B, H, Lq, Lk)`` (computed for the hook: O(L^2) memory);
- ``stats``: the call's :class:`~attnkit.inspect.AttentionStats` (O(L) memory at any length);
- ``lse``: the kernel's row log-sum-exp ``(B, H, Lq)``;
- ``z``: the heads' outputs ``(B, H, Lq, head_dim)`` before the output projection; a tensor the
  hook returns (same shape) replaces them.

>>> import torch, attnkit
>>> from attnkit.inspect import Sites
>>> model = torch.nn.Sequential(attnkit.MultiHeadAttention(16, 4), attnkit.MultiHeadAttention(16, 4))
>>> seen = []
>>> with Sites(model) as s:
...     s.add_hook("layers.*.attn.weights", lambda site, w: seen.append((site.index, tuple(w.shape))))
...     s.add_hook("layers.1.attn.z", lambda site, z: z * 0)   # head outputs of the second layer off
...     y, _ = model[1](model[0](torch.randn(2, 5, 16))[0])
>>> seen
[(0, (2, 4, 5, 5)), (1, (2, 4, 5, 5))]
>>> bool((y == model[1].out_proj.bias).all())
True
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from attnkit import functional
from attnkit._validate import AttnkitTypeError, AttnkitValueError
from attnkit.nn import MultiHeadAttention

__all__ = ["NAMED", "Site", "Sites", "attention_layers"]

#: What a hook by name sees at a site (see the module docstring).
NAMED = ("weights", "stats", "lse", "z")
_NAME = re.compile(r"^layers\.(\d+|\*)\.attn\.(" + "|".join(NAMED) + r")$")


def attention_layers(model: nn.Module, what: str) -> list[MultiHeadAttention] | None:
    """The :class:`attnkit.MultiHeadAttention` layers of ``model``, or None for a transformers model
    run with ``attn_implementation="attnkit"`` (checked: its attention goes through the integration's
    hooks); any other model is refused, naming ``what`` was asked of it."""
    if not isinstance(model, nn.Module):
        raise AttnkitTypeError(f"{what} expects a torch.nn.Module, but got {type(model).__name__}.")
    layers = [m for m in model.modules() if isinstance(m, MultiHeadAttention)]
    if layers:
        return layers
    if getattr(getattr(model, "config", None), "_attn_implementation", None) == "attnkit":
        from attnkit.integrations.transformers import check_model

        check_model(model)
        return None
    raise AttnkitValueError(
        f"{type(model).__name__} has no attnkit.MultiHeadAttention layer to {what} (a transformers model must "
        "be loaded with attn_implementation='attnkit' after `import attnkit.integrations.transformers`)."
    )


@dataclass(frozen=True)
class Site:
    """One attention call site: ``index`` in call order (the order of first calls in the block),
    ``name`` the module's name in the model (its class name for the model itself), ``module``."""

    index: int
    name: str
    module: nn.Module

    @property
    def path(self) -> str:
        """``layers.{index}.attn``: the name hooks are added by."""
        return f"layers.{self.index}.attn"


class Sites:
    """The attention call sites of ``model`` for one ``with`` block (see the module docstring).

    Tools add hooks with :meth:`on` (``"attention"``: ``fn(site, q, k, v, mask, mods)``, ``mods`` the
    call's keyword arguments and ``cross``: whether its keys come from another sequence, None where
    the call site cannot tell; ``"lse"``:
    ``fn(site, lse)``; ``"head_output"``: ``fn(site, out)``, which may return new outputs); users
    with :meth:`add_hook` by name. ``called`` lists the sites met, in call order."""

    def __init__(self, model: nn.Module, what: str = "inspect") -> None:
        self.model = model
        self.layers = attention_layers(model, what)
        self._names = {id(m): name for name, m in model.named_modules()}
        self._order: dict[int, Site] = {}
        self.called: list[Site] = []
        self._thread: int | None = None
        self._wanted: dict[str, list[Callable[..., Any]]] = {"attention": [], "lse": [], "head_output": []}
        self._handles: list = []

    def site(self, module: nn.Module) -> Site | None:
        """The site of ``module``'s call in this thread and block (None: another thread's call, or
        another model's attention); a module met for the first time gets the next index."""
        if threading.get_ident() != self._thread or id(module) not in self._names:
            return None
        found = self._order.get(id(module))
        if found is None:
            found = Site(len(self._order), self._names[id(module)] or type(module).__name__, module)
            self._order[id(module)] = found
            self.called.append(found)
        return found

    def on(self, kind: str, fn: Callable[..., Any]) -> None:
        """Call ``fn(site, ...)`` at every site's ``kind`` hook point (``attention``, ``lse`` or
        ``head_output``) while the block is open."""
        if kind not in self._wanted:
            raise AttnkitValueError(f"hook points are {tuple(self._wanted)}, not {kind!r}.")
        self._wanted[kind].append(fn)
        if self._thread is not None:  # added inside the block: hooked at once
            self._attach(kind, fn)

    def add_hook(self, name: str, fn: Callable[..., Any]) -> None:
        """``fn(site, value)`` at the sites named ``layers.{i}.attn.{what}`` (``i`` an index or ``*``;
        ``what`` one of :data:`NAMED`); for ``z`` a tensor it returns replaces the heads' outputs."""
        found = _NAME.match(name) if isinstance(name, str) else None
        if found is None:
            raise AttnkitValueError(
                f"hook names are 'layers.<i>.attn.<what>' with <i> a call-order index or '*' and <what> one of "
                f"{NAMED}, but got {name!r}."
            )
        index = None if found.group(1) == "*" else int(found.group(1))
        what = found.group(2)

        def chosen(site: Site) -> bool:
            return index is None or site.index == index

        if what == "z":
            self.on("head_output", lambda site, out: fn(site, out) if chosen(site) else None)
            return
        if what == "lse":
            self.on("lse", lambda site, lse: fn(site, lse) if chosen(site) else None)
            return

        def at_call(site, q, k, v, mask, mods):
            if not chosen(site):
                return
            kept = {key: mods[key] for key in ("attn_bias", "softcap", "sinks", "scale") if mods.get(key) is not None}
            with torch.no_grad():
                if what == "weights":
                    fn(site, functional.attention_weights(q, k, v, mask, **kept))
                else:
                    from attnkit.inspect.stats import attention_stats

                    fn(site, attention_stats(q, k, v, mask, **kept))

        self.on("attention", at_call)

    def _attach(self, kind: str, fn: Callable[..., Any]) -> None:
        def hook(module, *payload):
            site = self.site(module)
            if site is None:
                return None
            if kind == "attention":  # (q, k, v, mask, mods, cross): cross into the tools' mods
                *call, mods, cross = payload
                return fn(site, *call, {**mods, "cross": cross})
            return fn(site, *payload)

        # eager code between the kernels: torch.compile runs it as it is on every call (call order, the
        # opening thread) instead of tracing one call's decisions into a graph
        hook = torch.compiler.disable(hook)
        if self.layers is not None:
            for layer in self.layers:
                self._handles.append(layer.hook_points.register(kind, hook, with_cross=kind == "attention"))
        else:
            from attnkit.integrations.transformers import HOOK_POINTS

            self._handles.append(HOOK_POINTS.register(kind, hook, with_cross=kind == "attention"))

    def __enter__(self) -> Sites:
        if self._thread is not None:
            raise AttnkitValueError("these sites are open already: open them once per with block.")
        self._thread = threading.get_ident()
        self._order.clear()
        self.called.clear()
        if self.layers is None:
            from attnkit.integrations.transformers import check_model

            check_model(self.model)  # a model that bypasses the interface would call no hook
        for kind, fns in self._wanted.items():
            for fn in fns:
                self._attach(kind, fn)
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._thread = None
