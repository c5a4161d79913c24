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

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from attnkit._validate import AttnkitTypeError, AttnkitValueError
from attnkit.inspect.capturing import Capture, capture
from attnkit.inspect.sites import Site, Sites

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


def _check_attention_mask(mask: Any, mode: str) -> torch.Tensor | None:
    if mask is None:
        return None
    if mode != "mean":
        raise AttnkitValueError("attention_mask= chooses the positions mode='mean' averages: pass mode='mean' too.")
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        raise AttnkitTypeError(
            "attention_mask must be a (batch, length) tensor, 1 (or True) at real tokens and 0 at padding, as "
            f"transformers takes it, but got {type(mask).__name__}"
            f"{' of shape ' + str(tuple(mask.shape)) if isinstance(mask, torch.Tensor) else ''}."
        )
    return mask.bool()


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
        attention_mask: torch.Tensor | None = None,
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
        self.real = _check_attention_mask(attention_mask, mode)
        self.seen: list[str] = []
        self._sites: Sites | None = None

    @property
    def empty(self) -> bool:
        return not self.ablate and not self.scale and self.patch is None

    def _wanted(self) -> set[Layer]:
        layers = set(self.ablate) | {layer for layer, _ in self.scale}
        if self.patch is not None:
            layers |= set(self.patch_heads) if self.patch_heads is not None else set(range(len(self.patch.outputs)))
        return layers

    def _hook(self, site: Site, out: torch.Tensor) -> torch.Tensor | None:
        if site.index == len(self.seen):
            self.seen.append(site.name)
        index, name = site.index, site.name
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
            out = torch.where(where, self._mean(out, index) if self.mode == "mean" else off, out)
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

    def _mean(self, out: torch.Tensor, index: int) -> torch.Tensor:
        """Each sequence's head outputs averaged over its query positions (``(B, H, 1, hd)``): the real
        ones where an attention mask was given, every position otherwise."""
        if self.real is None:
            return out.mean(dim=2, keepdim=True)
        real = self.real.to(out.device)
        if real.shape != (out.shape[0], out.shape[2]):
            raise AttnkitValueError(
                f"attention_mask has shape {tuple(real.shape)}, but layer {index} was called on {out.shape[0]} "
                f"sequence(s) of {out.shape[2]} queries: give the (batch, length) mask of this input."
            )
        weights = real.to(out.dtype).view(out.shape[0], 1, -1, 1)
        count = weights.sum(dim=2, keepdim=True).clamp(min=1)
        return (out * weights).sum(dim=2, keepdim=True) / count

    def __enter__(self) -> Intervention:
        if self.empty:
            return self  # nothing to change: no hook at all, outputs bit-identical
        self._sites = Sites(self.model, "intervene on")
        self._sites.on("head_output", self._hook)
        self._sites.__enter__()
        return self

    def __exit__(self, kind, *exc) -> None:
        if self._sites is not None:
            self._sites.__exit__(kind, *exc)
            self._sites = None
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
    attention_mask: torch.Tensor | None = None,
) -> Intervention:
    """Change attention heads' outputs inside a ``with`` block; every kernel keeps running.

    - ``ablate={layer: [heads]}``: those heads' outputs become 0 (``mode="zero"``) or their mean
      over each sequence's query positions (``mode="mean"``): its real positions where
      ``attention_mask`` (``(batch, length)``, 1 at real tokens, as transformers takes it) is given,
      every position (padding included) otherwise;
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
    return Intervention(
        model, ablate, scale, patch, mode, heads=heads, positions=positions, attention_mask=attention_mask
    )


@dataclass(frozen=True)
class HeadEffects:
    """Every head's effect on ``metric``: ``values[layer, head]`` is the metric of the corrupt run
    with that head's output patched in from the clean run (all positions, or ``positions``):
    measured (``method="patch"``) or estimated to first order (``method="atp"``); ``clean`` and
    ``corrupt`` are the metric of the two runs unpatched."""

    values: torch.Tensor
    names: list[str]
    clean: float
    corrupt: float
    method: str = "patch"

    def normalized(self) -> torch.Tensor:
        """``(values - corrupt) / (clean - corrupt)``: 1 where a head alone restores the clean metric."""
        span = self.clean - self.corrupt
        if span == 0:
            raise AttnkitValueError("the clean and corrupt runs give the same metric: nothing to normalise by.")
        return (self.values - self.corrupt) / span

    def figure(self, title: str | None = None) -> Any:
        """A matplotlib heatmap, layers down and heads across (diverging around the corrupt metric)."""
        import matplotlib.pyplot as plt

        if title is None:
            title = {
                "patch": "activation patching: metric with the head patched in",
                "atp": "attribution patching (first order): metric with the head patched in",
            }[self.method]
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
        from attnkit.viz.html import effects_table

        estimate = " (first-order estimate)" if self.method == "atp" else ""
        caption = f"metric with each head patched in{estimate} (clean {self.clean:.4g}, corrupt {self.corrupt:.4g})"
        return effects_table(self.values.double().tolist(), self.names, self.corrupt, caption)


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
    method: str = "patch",
) -> HeadEffects:
    """Every (layer, head)'s effect on ``metric`` when its output is patched from ``clean`` into
    ``corrupt``. ``clean`` / ``corrupt``: the model's input (a tensor, a tuple of arguments or a
    dict of keyword arguments), of the same batch size and length; ``metric(output)`` a scalar.

    - ``method="patch"``: activation patching, as TransformerLens's
      ``get_act_patch_attn_head_out_all_pos``: ``clean`` once recording every head's output, then
      ``corrupt`` once per head with that head's clean output patched in (``layers x heads + 2``
      forwards on the model's own kernels). Exact.
    - ``method="atp"``: attribution patching (Nanda; Kramár et al.'s AtP): the first-order estimate
      ``metric(corrupt) + sum((z_clean - z_corrupt) * d metric / d z_corrupt)`` over the head's
      output ``z`` (its positions, or ``positions``), from one clean forward, one corrupt forward and
      one backward, whatever the number of heads. Where patching a head changes the run a lot
      (attention saturating, a head that switches what it attends to), the estimate can be far
      from the measured value: check the heads it ranks first with ``method="patch"``.
    """
    if method not in ("patch", "atp"):
        raise AttnkitValueError(
            f"method must be 'patch' (activation patching) or 'atp' (attribution patching), not {method!r}."
        )
    if method == "atp":
        return _attribution_patching(model, clean, corrupt, metric, positions)
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


class _Tape:
    """The head outputs of one run, in call order, kept in the autograd graph (the first made a
    leaf that requires a gradient where nothing before it does), for ``d metric / d z``."""

    def __init__(self, model: nn.Module) -> None:
        self.outputs: list[torch.Tensor] = []
        self._sites = Sites(model, "attribute")
        self._sites.on("head_output", self._hook)

    def _hook(self, site: Site, out: torch.Tensor) -> torch.Tensor:
        if not out.requires_grad:
            out = out.detach().requires_grad_()
        self.outputs.append(out)
        return out

    def __enter__(self) -> _Tape:
        self._sites.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._sites.__exit__(*exc)


def _attribution_patching(model, clean, corrupt, metric, positions) -> HeadEffects:
    with torch.no_grad(), capture(model, mode="heads") as cap:
        clean_value = float(metric(_run(model, clean)))
    with torch.enable_grad(), _Tape(model) as tape:
        value = metric(_run(model, corrupt))
    if len(tape.outputs) != len(cap.outputs):
        raise AttnkitValueError(
            f"the clean run called {len(cap.outputs)} attention layers and the corrupt run {len(tape.outputs)}: "
            "attribution patching compares runs of the same model over inputs of the same shape."
        )
    if not isinstance(value, torch.Tensor) or value.numel() != 1 or not value.requires_grad:
        raise AttnkitValueError(
            "metric must return a scalar tensor computed from the model's output (differentiable), "
            f"but got {type(value).__name__} {tuple(value.shape) if isinstance(value, torch.Tensor) else ''}."
        )
    grads = torch.autograd.grad(value.reshape(()), tape.outputs, allow_unused=True)
    table = torch.full((len(cap.outputs), max((o.shape[1] for o in cap.outputs), default=0)), float("nan"))
    for layer, (z_clean, z_corrupt, grad) in enumerate(zip(cap.outputs, tape.outputs, grads)):
        if z_clean.shape != z_corrupt.shape:
            raise AttnkitValueError(
                f"the clean run's heads of layer {layer} have shape {tuple(z_clean.shape)}, the corrupt run's "
                f"{tuple(z_corrupt.shape)}: patch between inputs of the same batch size and length."
            )
        if grad is None:  # the metric does not depend on this layer
            table[layer, : z_clean.shape[1]] = 0.0
            continue
        change = (z_clean.to(grad.dtype) - z_corrupt.detach()) * grad  # (B, H, Lq, hd)
        if positions is not None:
            rows = torch.zeros(change.shape[2], dtype=torch.bool, device=change.device)
            rows[positions] = True
            change = change * rows.view(1, 1, -1, 1)
        table[layer, : change.shape[1]] = change.double().sum(dim=(0, 2, 3)).float()
    corrupt_value = float(value.detach())
    return HeadEffects(table + corrupt_value, list(cap.names), clean_value, corrupt_value, method="atp")
