"""``attnkit.capture``: record the attention weights of every attnkit layer in a model."""

from __future__ import annotations

import torch
from torch import nn

from attnkit import functional
from attnkit._types import Index
from attnkit._validate import AttnkitValueError
from attnkit.inspect.sites import Site, Sites

#: Elements of ``(B, H, Lq, Lk)`` above which ``mode="weights"`` refuses to record a layer
#: whole (256 MB of float32); ``mode="stats"`` and ``rows=`` have no such limit.
FULL_WEIGHTS_BUDGET = 2**26

MODES = ("weights", "stats", "heads")


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
        self._sites = Sites(model, "capture")
        if mode == "heads":
            self._sites.on("head_output", self._on_heads)
        else:
            self._sites.on("attention", self._on_call)
        self.weights: list[torch.Tensor] = []
        self.stats: list = []
        self.outputs: list[torch.Tensor] = []
        self.names: list[str] = []

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

    def _on_call(self, site: Site, q, k, v, mask, mods: dict) -> None:
        if getattr(site.module, "holds_a_shard", lambda: False)():
            raise AttnkitValueError(
                f"layer {site.name!r} is a RingMultiHeadAttention over several ranks: each rank holds a shard of the "
                "sequence, so its weights are not this rank's to capture. Load its state dict into "
                "attnkit.MultiHeadAttention and capture that on the whole sequence."
            )
        kept = {key: mods[key] for key in ("attn_bias", "softcap", "sinks", "scale") if mods.get(key) is not None}
        if "sinks" in kept:
            kept["sinks"] = kept["sinks"].detach()
        self._record(site.name, q, k, v, mask, kept)

    def _on_heads(self, site: Site, out: torch.Tensor) -> None:
        self.outputs.append(out.detach())
        self.names.append(site.name)

    def __enter__(self) -> Capture:
        self._sites.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._sites.__exit__(*exc)

    def rows_of(self, length: int) -> list[int]:
        """The chosen query rows (``rows=``) as indices into ``length`` rows (none: ``[]``)."""
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
            rows = self.rows_of(self.stats[0].entropy.shape[-1])
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
