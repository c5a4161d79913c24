"""Head interventions on the fast path: ablate, scale or patch attention heads' outputs.

A head's output is its ``(B, Lq, head_dim)`` slice of the attention output, before the layer's
output projection mixes the heads. :func:`intervene` changes chosen heads' outputs for the
calls of a ``with`` block (through :meth:`attnkit.MultiHeadAttention.register_head_output_hook`
or, for transformers models run with ``attn_implementation="attnkit"``,
:func:`attnkit.integrations.transformers.register_head_output_hook`); the attention itself runs
on whatever kernel it would have, and nothing remains after the block. :func:`head_effects`
sweeps every head with activation patching.

Layers are numbered in call order (the order :func:`attnkit.capture` records them), or named
as ``capture`` names them (the module's name in the model).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from attnkit._validate import AttnkitTypeError, AttnkitValueError
from attnkit.inspect.capture import Capture, attention_layers, capture

__all__ = ["HeadEffects", "Intervention", "head_effects", "intervene"]

Layer = int | str
MODES = ("zero", "mean")


def _check_layer(layer: Any, what: str) -> Layer:
    if isinstance(layer, bool) or not isinstance(layer, (int, str)) or (isinstance(layer, int) and layer < 0):
        raise AttnkitTypeError(
            f"{what} keys are layers: a call-order index (int >= 0) or a module name as capture gives it, "
            f"but got {layer!r}."
        )
    return layer


def _check_heads(heads: Any, what: str) -> tuple[int, ...]:
    items = [heads] if isinstance(heads, int) else heads
    try:
        items = list(items)
    except TypeError:
        items = [None]
    if not items or any(isinstance(h, bool) or not isinstance(h, int) or h < 0 for h in items):
        raise AttnkitTypeError(f"{what} takes heads as an int or a list of ints >= 0, but got {heads!r}.")
    return tuple(items)


class Intervention:
    """The context manager :func:`intervene` returns; ``seen`` lists the layers it met, in call order."""

    def __init__(
        self,
        model: nn.Module,
        ablate: dict | None = None,
        scale: dict | None = None,
        patch: Capture | None = None,
        mode: str = "zero",
        *,
        heads: dict | None = None,
        positions: Any = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise AttnkitTypeError(f"intervene expects a torch.nn.Module, but got {type(model).__name__}.")
        if mode not in MODES:
            raise AttnkitValueError(f"mode must be 'zero' or 'mean', but got {mode!r}.")
        self.model, self.mode = model, mode
        self.ablate = {_check_layer(k, "ablate"): _check_heads(v, "ablate") for k, v in (ablate or {}).items()}
        self.scale: dict[tuple[Layer, int], float] = {}
        for key, factor in (scale or {}).items():
            if not (isinstance(key, tuple) and len(key) == 2):
                raise AttnkitTypeError(f"scale keys are (layer, head) pairs, but got {key!r}.")
            layer, head = _check_layer(key[0], "scale"), _check_heads(key[1], "scale")[0]
            if isinstance(factor, bool) or not isinstance(factor, (int, float)):
                raise AttnkitTypeError(f"scale factors are numbers, but got {factor!r} for {key!r}.")
            self.scale[(layer, head)] = float(factor)
        if patch is not None and not (isinstance(patch, Capture) and patch.mode == "heads"):
            raise AttnkitTypeError(
                "patch takes the Capture of a clean run taken with attnkit.capture(model, mode='heads'), "
                f"but got {type(patch).__name__}{'' if not isinstance(patch, Capture) else ' of mode ' + patch.mode}."
            )
        if patch is not None and not patch.outputs:
            raise AttnkitValueError("the patch Capture holds no head outputs: run the clean input inside its block.")
        self.patch = patch
        self.patch_heads = (
            None if heads is None else {_check_layer(k, "heads"): _check_heads(v, "heads") for k, v in heads.items()}
        )
        if heads is not None and patch is None:
            raise AttnkitValueError("heads= chooses the heads to patch: give patch= (a Capture of mode='heads') too.")
        self.positions = positions
        self.seen: list[str] = []
        self._order: dict[int, int] = {}
        self._names = {id(m): name for name, m in model.named_modules()}
        self._thread: int | None = None
        self._handles: list = []

    @property
    def empty(self) -> bool:
        return not self.ablate and not self.scale and self.patch is None

    def _wanted(self) -> set[Layer]:
        layers = set(self.ablate) | {layer for layer, _ in self.scale}
        if self.patch is not None:
            layers |= set(self.patch_heads) if self.patch_heads is not None else set(range(len(self.patch.outputs)))
        return layers

    def _hook(self, module, out: torch.Tensor) -> torch.Tensor | None:
        if threading.get_ident() != self._thread or id(module) not in self._names:
            return None  # another thread's call, or another model's attention
        if id(module) not in self._order:
            self._order[id(module)] = len(self._order)
            self.seen.append(self._names[id(module)])
        index, name = self._order[id(module)], self._names[id(module)]
        heads = out.shape[1]

        def chosen(table: dict, what: str) -> tuple[int, ...]:
            found = table.get(index, ()) + table.get(name, ())
            bad = [h for h in found if h >= heads]
            if bad:
                raise AttnkitValueError(f"{what} asks for head(s) {bad} of layer {index} ({name!r}): it has {heads}.")
            return found

        def select(hs) -> torch.Tensor:
            sel = torch.zeros(heads, dtype=torch.bool, device=out.device)
            sel[list(hs)] = True
            return sel.view(heads, 1, 1)

        if self.patch is not None:
            patched = tuple(range(heads)) if self.patch_heads is None else chosen(self.patch_heads, "patch heads")
            if patched and index >= len(self.patch.outputs):
                raise AttnkitValueError(
                    f"patch holds {len(self.patch.outputs)} layers' head outputs, but this run called layer {index}."
                )
            if patched:
                clean = self.patch.outputs[index].to(out.device, out.dtype)
                if clean.shape != out.shape:
                    raise AttnkitValueError(
                        f"the clean run's heads of layer {index} have shape {tuple(clean.shape)}, this run's "
                        f"{tuple(out.shape)}: patch between inputs of the same batch size and length."
                    )
                where = select(patched)
                if self.positions is not None:
                    rows = torch.zeros(out.shape[2], dtype=torch.bool, device=out.device)
                    rows[self.positions] = True
                    where = where & rows.view(1, -1, 1)
                out = torch.where(where, clean, out)
        ablated = chosen(self.ablate, "ablate")
        if ablated:
            where = select(ablated)
            off = torch.zeros((), dtype=out.dtype, device=out.device)
            out = torch.where(where, out.mean(dim=2, keepdim=True) if self.mode == "mean" else off, out)
        factors = [(h, f) for (layer, h), f in self.scale.items() if layer in (index, name)]
        if factors:
            bad = [h for h, _ in factors if h >= heads]
            if bad:
                raise AttnkitValueError(f"scale asks for head(s) {bad} of layer {index} ({name!r}), which has {heads}.")
            scale = torch.ones(heads, dtype=out.dtype, device=out.device)
            for h, f in factors:
                scale[h] = f
            out = out * scale.view(heads, 1, 1)
        return out

    def __enter__(self) -> Intervention:
        self._thread = threading.get_ident()
        if self.empty:
            return self  # nothing to change: no hook at all, outputs bit-identical
        layers = attention_layers(self.model, "intervene on")
        # eager code between the kernels: torch.compile runs it as it is on every call (call order,
        # the opening thread) instead of tracing one call's decisions into a graph
        hook = torch.compiler.disable(self._hook)
        if layers is not None:
            self._handles = [m.register_head_output_hook(hook) for m in layers]
        else:
            from attnkit.integrations.transformers import register_head_output_hook

            self._handles = [register_head_output_hook(hook)]
        return self

    def __exit__(self, kind, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if kind is None and not self.empty:
            named = set(self.seen)
            called = len(self.seen)
            missing = sorted(
                str(layer)
                for layer in self._wanted()
                if (layer >= called if isinstance(layer, int) else layer not in named)
            )
            if missing:
                raise AttnkitValueError(
                    f"intervene was asked for layer(s) {', '.join(missing)}, but the block called "
                    f"{len(self.seen)} attention layer(s): {self.seen} (indices 0..{len(self.seen) - 1})."
                )


def intervene(
    model: nn.Module,
    ablate: dict | None = None,
    scale: dict | None = None,
    patch: Capture | None = None,
    mode: str = "zero",
    *,
    heads: dict | None = None,
    positions: Any = None,
) -> Intervention:
    """Change attention heads' outputs inside a ``with`` block; every kernel keeps running.

    - ``ablate={layer: [heads]}``: those heads' outputs become 0 (``mode="zero"``) or their mean
      over the call's query positions (``mode="mean"``, padding positions included);
    - ``scale={(layer, head): factor}``: a head's output multiplied by ``factor``;
    - ``patch=clean``: a :func:`attnkit.capture` of ``mode="heads"`` taken on a clean input; its
      head outputs replace this run's at ``heads={layer: [heads]}`` (default: every head of every
      layer it holds) and at the query ``positions`` (an index; default: all).

    Patching is applied first, then ablation, then scaling. Layers are call-order indices or the
    module names :func:`attnkit.capture` reports. Only the calls of the thread that opened the block
    change; with nothing asked, no hook is installed (outputs bit-identical); after the block the
    model and transformers are as before. A layer or head the run does not have is an error that
    lists the layers called.

    >>> import torch, attnkit
    >>> from attnkit.inspect import intervene
    >>> model = torch.nn.Sequential(attnkit.MultiHeadAttention(16, 4))
    >>> layer, x = model[0], torch.randn(1, 5, 16)
    >>> with intervene(model, ablate={0: [1, 2]}):
    ...     y, _ = layer(x)
    """
    return Intervention(model, ablate, scale, patch, mode, heads=heads, positions=positions)


@dataclass(frozen=True)
class HeadEffects:
    """Activation patching of every head: ``values[layer, head]`` is ``metric`` of the corrupt run
    with that head's output patched in from the clean run (all positions, or ``positions``);
    ``clean`` and ``corrupt`` are the metric of the two runs unpatched."""

    values: torch.Tensor
    names: list[str]
    clean: float
    corrupt: float

    def normalized(self) -> torch.Tensor:
        """``(values - corrupt) / (clean - corrupt)``: 1 where a head alone restores the clean metric."""
        span = self.clean - self.corrupt
        if span == 0:
            raise AttnkitValueError("the clean and corrupt runs give the same metric: nothing to normalise by.")
        return (self.values - self.corrupt) / span

    def figure(self, title: str = "activation patching: metric with the head patched in") -> Any:
        """A matplotlib heatmap, layers down and heads across (diverging around the corrupt metric)."""
        import matplotlib.pyplot as plt

        values = self.values.double()
        reach = float((values - self.corrupt).abs().max()) or 1.0
        fig, ax = plt.subplots(figsize=(1.2 + 0.45 * values.shape[1], 1.0 + 0.4 * values.shape[0]))
        image = ax.imshow(values.numpy(), cmap="RdBu_r", vmin=self.corrupt - reach, vmax=self.corrupt + reach)
        ax.set_xlabel("head")
        ax.set_ylabel("layer")
        ax.set_yticks(range(len(self.names)), [f"{i}: {n}" for i, n in enumerate(self.names)], fontsize=7)
        ax.set_xticks(range(values.shape[1]))
        ax.set_title(f"{title}\nclean {self.clean:.3g}, corrupt {self.corrupt:.3g}", fontsize=9)
        fig.colorbar(image, ax=ax, shrink=0.8)
        fig.tight_layout()
        return fig

    def save(self, path: str | Path) -> Path:
        """Write the heatmap: ``.png`` (matplotlib) or ``.html`` (a self-contained table)."""
        path = Path(path)
        if path.suffix == ".png":
            import matplotlib.pyplot as plt

            fig = self.figure()
            fig.savefig(path, dpi=120)
            plt.close(fig)
        elif path.suffix in (".html", ".htm"):
            path.write_text(self._html(), encoding="utf-8")
        else:
            raise AttnkitValueError(f"save writes .png or .html files, but got {path.name!r}.")
        return path

    def _repr_html_(self) -> str:
        return self._html()

    def _html(self) -> str:
        values = self.values.double()
        reach = float((values - self.corrupt).abs().max()) or 1.0
        rows = []
        for i, name in enumerate(self.names):
            cells = []
            for h, value in enumerate(values[i].tolist()):
                t = max(-1.0, min(1.0, (value - self.corrupt) / reach))
                color = f"rgba(178,24,43,{t:.2f})" if t > 0 else f"rgba(33,102,172,{-t:.2f})"
                tip = f"layer {i}, head {h}: {value:.4g}"
                cells.append(f'<td title="{tip}" style="background:{color}">{value:.3g}</td>')
            rows.append(f"<tr><th>{i}: {name}</th>{''.join(cells)}</tr>")
        header = "".join(f"<th>{h}</th>" for h in range(values.shape[1]))
        return (
            '<div class="attnkit-head-effects"><table style="border-collapse:collapse;font:11px sans-serif">'
            f"<caption>metric with each head patched in (clean {self.clean:.4g}, corrupt {self.corrupt:.4g})"
            f"</caption><tr><th>layer \\ head</th>{header}</tr>{''.join(rows)}</table></div>"
        )


def _run(model: nn.Module, inputs: Any):
    if isinstance(inputs, dict):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


def head_effects(
    model: nn.Module,
    clean: Any,
    corrupt: Any,
    metric: Callable[[Any], Any],
    *,
    positions: Any = None,
) -> HeadEffects:
    """Activation patching of every (layer, head), as TransformerLens's
    ``get_act_patch_attn_head_out_all_pos``: run ``clean`` once recording every head's output,
    then ``corrupt`` once per head with that head's clean output patched in, and ``metric(output)``
    (a scalar) of each run. ``clean`` / ``corrupt``: the model's input (a tensor, a tuple of
    arguments or a dict of keyword arguments), of the same batch size and length. Costs
    ``layers x heads + 2`` forwards on the model's own kernels."""
    with torch.no_grad():
        with capture(model, mode="heads") as cap:
            clean_value = float(metric(_run(model, clean)))
        corrupt_value = float(metric(_run(model, corrupt)))
        table = torch.empty(len(cap.outputs), max((o.shape[1] for o in cap.outputs), default=0))
        table.fill_(float("nan"))
        for layer, out in enumerate(cap.outputs):
            for head in range(out.shape[1]):
                with intervene(model, patch=cap, heads={layer: [head]}, positions=positions):
                    table[layer, head] = float(metric(_run(model, corrupt)))
    return HeadEffects(table, list(cap.names), clean_value, corrupt_value)
