"""``attnkit.capture``: record the attention weights of every attnkit layer in a model."""

from __future__ import annotations

import threading

import torch
from torch import nn

from attnkit import functional
from attnkit._types import Index
from attnkit._validate import AttnkitTypeError, AttnkitValueError
from attnkit.nn import MultiHeadAttention

#: Elements of ``(B, H, Lq, Lk)`` above which ``mode="weights"`` refuses to record a layer
#: whole (256 MB of float32); ``mode="stats"`` and ``rows=`` have no such limit.
FULL_WEIGHTS_BUDGET = 2**26

MODES = ("weights", "stats", "heads")


def attention_layers(model: nn.Module, what: str) -> list[MultiHeadAttention] | None:
    """The :class:`attnkit.MultiHeadAttention` layers of ``model``, or None for a transformers model
    run with ``attn_implementation="attnkit"`` (checked: its attention goes through the integration's
    hooks); any other model is refused, naming ``what`` was asked of it."""
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


class Capture:
    """Attention recorded while the ``with`` block runs, in call order.

    ``mode="weights"``: ``weights[i]`` is ``(B, H, Lq, Lk)`` (detached) from the layer
    ``names[i]``, or ``(B, len(heads), len(rows), Lk)`` with ``rows=``/``heads=``.
    ``mode="stats"``: ``stats[i]`` is an :class:`~attnkit.inspect.AttentionStats`
    (entropy, sink mass, mean distance, key mass received, top-k keys; O(L) memory at
    any length), and ``weights[i]`` the chosen rows' weights when ``rows=`` is given.
    ``mode="heads"``: ``outputs[i]`` is the layer's per-head output ``(B, H, Lq, head_dim)``
    before its output projection (detached): what :func:`attnkit.inspect.intervene` patches in.
    The model keeps its own kernel and its outputs do not change: everything is
    recomputed from the layer's projected queries and keys with the same mask.

    >>> import torch, attnkit
    >>> model = torch.nn.Sequential(attnkit.MultiHeadAttention(16, 4))
    >>> layer, x = model[0], torch.randn(1, 5, 16)
    >>> with attnkit.capture(model) as cap:
    ...     _ = layer(x)
    >>> cap.names, cap.weights[0].shape
    (['0'], torch.Size([1, 4, 5, 5]))
    """

    def __init__(
        self,
        model: nn.Module,
        mode: str = "weights",
        *,
        rows: Index = None,
        heads: Index = None,
        topk: int = 0,
        sink_tokens: int = 1,
    ):
        if mode not in MODES:
            raise AttnkitValueError(f"mode must be 'weights', 'stats' or 'heads', but got {mode!r}.")
        self.mode, self.rows, self.heads, self.topk, self.sink_tokens = mode, rows, heads, topk, sink_tokens
        self.tokens: list[str] | None = None  # labels for the notebook view (set it: cap.tokens = [...])
        if not isinstance(model, nn.Module):
            raise AttnkitTypeError(f"capture expects a torch.nn.Module, but got {type(model).__name__}.")
        self.layers = [(name, m) for name, m in model.named_modules() if isinstance(m, MultiHeadAttention)]
        self._hf_names = None
        config = getattr(model, "config", None)
        if not self.layers and getattr(config, "_attn_implementation", None) == "attnkit":
            # a HuggingFace model run through attnkit.integrations.transformers
            self._hf_names = {id(m): name for name, m in model.named_modules()}
        elif not self.layers:
            raise AttnkitValueError(
                f"{type(model).__name__} has no attnkit.MultiHeadAttention layer to capture (a HuggingFace "
                "model must be loaded with attn_implementation='attnkit' after "
                "`import attnkit.integrations.transformers`)."
            )
        self._model = model
        self._thread: int | None = None  # the thread that opened the block: only its calls are recorded
        self.weights: list[torch.Tensor] = []
        self.stats: list = []
        self.outputs: list[torch.Tensor] = []
        self.names: list[str] = []
        self._handles: list = []

    def _record(self, name: str, q, k, v, mask, mods: dict) -> None:
        from attnkit.inspect.stats import attention_stats

        selected = self.rows is not None or self.heads is not None
        with torch.no_grad():
            if self.mode == "stats":
                self.stats.append(attention_stats(q, k, v, mask, sink_tokens=self.sink_tokens, topk=self.topk, **mods))
            elif not selected:
                elements = q.shape[:-1].numel() * k.shape[-2]
                if elements > FULL_WEIGHTS_BUDGET:
                    raise AttnkitValueError(
                        f"capturing the full weights of layer {name!r} would hold {tuple(q.shape[:-1])} x "
                        f"{k.shape[-2]} = {elements:,} values ({4 * elements / 2**30:.1f} GiB). At this length "
                        "use attnkit.capture(model, mode='stats') (exact statistics in O(L) memory) and/or "
                        "rows=[-1] (the last token's weights), heads=[...]."
                    )
            if self.mode == "weights" or selected:
                w = functional.attention_weights(q, k, v, mask, rows=self.rows, heads=self.heads, **mods)
                self.weights.append(w.detach())
        self.names.append(name)

    def _hook(self, name: str):
        def hook(module, q, k, v, mask, kwargs):
            if threading.get_ident() != self._thread:  # another thread's call of the same model
                return
            if getattr(module, "holds_a_shard", lambda: False)():
                raise AttnkitValueError(
                    f"layer {name!r} is a RingMultiHeadAttention over several ranks: each rank holds a shard of the "
                    "sequence, so its weights are not this rank's to capture. Load its state dict into "
                    "attnkit.MultiHeadAttention and capture that on the whole sequence."
                )
            mods = {key: kwargs.get(key) for key in ("attn_bias", "softcap", "sinks")}
            if mods["sinks"] is not None:
                mods["sinks"] = mods["sinks"].detach()
            self._record(name, q, k, v, mask, mods)

        return hook

    def _hf_hook(self, module, q, k, v, mask, mods):
        name = self._hf_names.get(id(module))
        if name is None or threading.get_ident() != self._thread:  # another model's, or another thread's
            return
        self._record(name, q, k, v, mask, {key: mods[key] for key in ("attn_bias", "softcap", "sinks", "scale")})

    def _heads_hook(self, name: str | None):
        def hook(module, out):
            if threading.get_ident() != self._thread:
                return None
            found = name if name is not None else self._hf_names.get(id(module))
            if found is not None:  # (None: another model's attention)
                self.outputs.append(out.detach())
                self.names.append(found)
            return None

        return hook

    def __enter__(self) -> Capture:
        self._thread = threading.get_ident()
        if self._hf_names is not None:
            from attnkit.integrations.transformers import (
                check_model,
                register_attention_hook,
                register_head_output_hook,
            )

            check_model(self._model)  # a model that bypasses the interface would record nothing
            if self.mode == "heads":
                self._handles.append(register_head_output_hook(self._heads_hook(None)))
            else:
                self._handles.append(register_attention_hook(self._hf_hook))
            return self
        for name, layer in self.layers:
            if self.mode == "heads":
                self._handles.append(layer.register_head_output_hook(self._heads_hook(name or type(layer).__name__)))
            else:
                self._handles.append(
                    layer.register_attention_hook(self._hook(name or type(layer).__name__), with_kwargs=True)
                )
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _row_list(self, length: int) -> list[int]:
        if self.rows is None:
            return []
        if isinstance(self.rows, slice):
            return list(range(length))[self.rows]
        items = [self.rows] if isinstance(self.rows, int) else list(self.rows)
        return [int(r) % length for r in items]

    def _repr_html_(self) -> str:
        """The capture as a view in a notebook cell: the weights page (``mode="weights"``), the
        long-context page (``mode="stats"``), or a table of what was recorded (``mode="heads"``).
        Tokens are ``tokens`` when set (``cap.tokens = [...]``), else positions."""
        from attnkit.viz import notebook

        tokens = getattr(self, "tokens", None)
        if self.mode == "stats" and self.stats:
            from attnkit.viz.long import long_html

            length = self.stats[0].received.shape[-1]
            labels = [str(t) for t in tokens] if tokens is not None else [str(i) for i in range(length)]
            rows = self._row_list(self.stats[0].entropy.shape[-1])
            try:
                page = long_html(self.stats, labels, rows, self.weights if rows else [], names=self.names)
            except AttnkitValueError as error:
                return notebook.too_big("long-context", notebook.LONG_BUDGET + 1, notebook.LONG_BUDGET, str(error))
            budget = notebook.LONG_BUDGET if length > 1024 else notebook.INLINE_BUDGET
            size = len(page.encode("utf-8"))
            if size > budget:
                return notebook.too_big("statistics", size, budget, "Capture fewer rows (rows=) or a shorter input.")
            return notebook.iframe(page, 720, "attnkit: attention statistics")
        if self.mode == "weights" and self.weights and self.rows is None and self.heads is None:
            from attnkit.viz.html import attention_html

            shapes = {tuple(w.shape[1:]) for w in self.weights}
            if len(shapes) == 1:
                lq, lk = next(iter(shapes))[-2:]
                named = [str(t) for t in tokens] if tokens is not None and len(tokens) == lq else None
                try:
                    page = attention_html(
                        self.stack(0),
                        named or [str(i) for i in range(lq)],
                        key_tokens=None if lq == lk and named else [str(j) for j in range(lk)],
                        layer_names=self.names,
                    )
                except AttnkitValueError as error:
                    return notebook.too_big("weights", notebook.INLINE_BUDGET + 1, notebook.INLINE_BUDGET, str(error))
                size = len(page.encode("utf-8"))
                if size <= notebook.INLINE_BUDGET:
                    return notebook.iframe(page, 640, "attnkit: attention weights")
                return notebook.too_big(
                    "weights", size, notebook.INLINE_BUDGET, "Use attnkit.capture(model, mode='stats') at this length."
                )
        recorded = self.outputs if self.mode == "heads" else self.weights
        listed = "".join(
            f"<tr><td>{i}</td><td>{name}</td><td>{tuple(t.shape)}</td></tr>"
            for i, (name, t) in enumerate(zip(self.names, recorded))
        )
        what = {"heads": "head outputs (B, H, Lq, head_dim)", "weights": "weights", "stats": "statistics"}[self.mode]
        if not listed:
            return f"<div><b>attnkit capture</b> ({self.mode}): nothing recorded yet.</div>"
        return (
            f"<div><b>attnkit capture</b>: {what} of {len(self.names)} calls"
            f"<table><tr><th>#</th><th>layer</th><th>shape</th></tr>{listed}</table></div>"
        )

    def stack_stats(self, name: str, batch: int = 0) -> torch.Tensor:
        """One statistic of one sequence over the captured layers, e.g. ``"entropy"``:
        ``(layers, H, Lq)`` (``(layers, H, Lk)`` for ``received``)."""
        if not self.stats:
            raise AttnkitValueError("no statistics were captured: use attnkit.capture(model, mode='stats').")
        values = [getattr(s, name) for s in self.stats]
        if any(v is None for v in values):
            raise AttnkitValueError(f"{name} was not recorded (topk= was 0).")
        return torch.stack([v[batch] for v in values])

    def stack(self, batch: int = 0) -> torch.Tensor:
        """The weights of one sequence as ``(layers, H, Lq, Lk)`` (every call must agree in shape)."""
        if not self.weights:
            raise AttnkitValueError("nothing was captured: run the model inside the with block.")
        shapes = {tuple(w.shape[1:]) for w in self.weights}
        if len(shapes) != 1:
            raise AttnkitValueError(f"captured weights differ in shape {sorted(shapes)}; index cap.weights instead.")
        return torch.stack([w[batch] for w in self.weights])


def capture(
    model: nn.Module,
    mode: str = "weights",
    *,
    rows: Index = None,
    heads: Index = None,
    topk: int = 0,
    sink_tokens: int = 1,
) -> Capture:
    """Record attention from every attnkit attention layer inside ``model``.

    ``with attnkit.capture(model) as cap: model(...)``; then ``cap.weights`` (or
    ``cap.stats`` with ``mode="stats"``) and ``cap.names``. Outside the block nothing is
    recorded and no hook remains; inside it, only the calls of the thread that opened the block
    (another thread serving the same model is not recorded). Works on models built from
    :class:`attnkit.MultiHeadAttention` and on transformers models loaded with
    ``attn_implementation="attnkit"``.

    - ``mode="weights"`` (default): full weights, for inputs that fit
      (:data:`FULL_WEIGHTS_BUDGET`); longer inputs raise an error pointing here.
    - ``mode="stats"``: :func:`attnkit.inspect.attention_stats` per layer, any length.
    - ``mode="heads"``: each layer's per-head outputs before its output projection
      (``cap.outputs``), for :func:`attnkit.inspect.intervene`'s ``patch=``.
    - ``rows=`` / ``heads=``: also (or only) the weights of these query rows and heads,
      e.g. ``rows=[-1]`` for the last token, exact, in memory proportional to them.
    - ``topk`` / ``sink_tokens``: passed to ``attention_stats``.
    """
    return Capture(model, mode, rows=rows, heads=heads, topk=topk, sink_tokens=sink_tokens)
