"""Attention rollout and gradient-weighted attribution, exact, without an ``L x L`` matrix.

Both carry a row vector ``r`` (one per chosen query row, one-hot at that row) from the last
attention layer down to the first:

- ``method="rollout"`` (Abnar & Zuidema 2020): ``r <- residual * r + (1 - residual) * r @ A_l``,
  ``A_l`` the layer's weights averaged over its heads (or over the heads chosen for it);
- ``method="grad"`` (Chefer et al. 2021): ``r <- r + r @ mean_h((dA_h * A_h)^+)``, ``dA`` the
  gradient of a scalar target with respect to the weights, ``dA_h = dO_h V_h^T``.

``r @ A`` is the weight each key receives from the queries, each query weighted by ``r``: it is
the gradient of the attention's output with respect to a value tensor whose rows are ``r``'s
(``dV = A^T dO``), so one backward pass of the layer's own attention call gives it, on the
kernel that call would use, for every mask, bias, softcap and sinks, in O(L) memory. The
gradient rule is elementwise in ``A``: it is a reduction of the weights ``exp(s - lse)`` (with the
lse of the layer's own kernel) that the kernels compute, as they compute statistics: the registry
chooses one (:func:`attnkit.kernels.registry.relevance`), which walks the tiles the mask keeps and
skips the rows whose ``r`` is 0 (in the last layer, all but the chosen row).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn

from attnkit._validate import AttnkitTypeError, AttnkitValueError
from attnkit.call import make_call
from attnkit.inspect.sites import Site, Sites
from attnkit.kernels import registry
from attnkit.kernels.contract import RelevanceRequest

__all__ = ["METHODS", "Relevance", "rollout"]

METHODS = ("rollout", "grad")


@dataclass
class _Layer:
    name: str
    module: nn.Module
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    mask: Any
    mods: dict
    cross: bool | None  # keys from another sequence (None: the call site cannot tell)
    out: torch.Tensor | None = None  # the heads' outputs (grad method), in the graph
    lse: torch.Tensor | None = None  # the call's row lse (grad method), made once for every chosen row


class _Recorder:
    """Every attention call of ``model`` in this thread while the block is open, in call order."""

    def __init__(self, model: nn.Module, keep_outputs: bool):
        self.layers: list[_Layer] = []
        self._pending: dict[int, _Layer] = {}
        self._sites = Sites(model, "roll out")
        self._sites.on("attention", self._attention)
        self._sites.on("lse", self._lse)  # each layer's kernel's lse: its weights are exp(s - lse)
        if keep_outputs:  # the grad rule: each layer's head outputs
            self._sites.on("head_output", self._output)

    def _attention(self, site: Site, q, k, v, mask, mods):
        keep = {key: mods.get(key) for key in ("attn_bias", "softcap", "sinks", "scale") if mods.get(key) is not None}
        if keep.get("sinks") is not None:
            keep["sinks"] = keep["sinks"].detach()
        layer = _Layer(site.name, site.module, q.detach(), k.detach(), v.detach(), mask, keep, mods.get("cross"))
        self.layers.append(layer)
        self._pending[site.index] = layer

    def _lse(self, site: Site, lse):
        layer = self._pending.get(site.index)
        if layer is not None:
            layer.lse = lse.detach()

    def _output(self, site: Site, out):
        layer = self._pending.pop(site.index, None)
        if layer is not None:
            layer.out = out
        return None

    def __enter__(self) -> _Recorder:
        self._sites.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._sites.__exit__(*exc)


def _logits(output) -> torch.Tensor:
    found = getattr(output, "logits", None)
    if found is None:
        found = output[0] if isinstance(output, (tuple, list)) else output
    if not isinstance(found, torch.Tensor):
        raise AttnkitTypeError(f"the model returned {type(output).__name__}: give target=, a function of it.")
    return found


def _top_logit(rows: list[int]) -> Callable[[Any], torch.Tensor]:
    def target(output):
        logits = _logits(output)
        if logits.dim() != 3:
            raise AttnkitValueError(
                f"the default target is each chosen row's top logit, which needs logits (B, L, vocab); the model "
                f"returned shape {tuple(logits.shape)}: give target=, a function of the output returning (B, rows)."
            )
        return logits[:, rows].max(dim=-1).values  # (B, R)

    return target


def _received(
    layer: _Layer, r: torch.Tensor, heads: list[int] | None, d_out: torch.Tensor | None = None
) -> torch.Tensor:
    """``(B, R, Lk)``: ``r @ mean_h(A_h)``, the weights each key receives with query ``i`` weighted by
    ``r[:, :, i]`` (rollout), or with ``d_out`` the gradient rule's ``r @ mean_h((dA_h * A_h)^+)``,
    ``dA = dO V^T``; ``heads``: the heads averaged (all when None). A reduction of the layer's
    weights ``exp(s - lse)`` that the registry's kernel computes tile by tile over the keys the mask
    keeps (:func:`attnkit.kernels.registry.relevance`), with the lse the layer's kernel returned in
    the model's forward; rows whose ``r`` is 0 are skipped."""
    q, k, v = layer.q, layer.k, layer.v
    h = q.shape[1]
    chosen = list(range(h)) if heads is None else heads
    head_weights = torch.zeros(h, dtype=torch.float64)
    head_weights[chosen] = 1.0 / len(chosen)
    if layer.lse is None:
        raise AttnkitValueError(
            f"layer {layer.name!r} gave no lse to its hooks, so its weights exp(s - lse) cannot be reduced: roll out "
            "a model whose attention runs attnkit.MultiHeadAttention or the transformers integration."
        )
    call = make_call(q, k, v, mask=layer.mask, return_lse=True, **layer.mods)
    found = registry.relevance(call, RelevanceRequest(layer.lse, r, d_out, head_weights))
    return found.to(r.dtype)


class Relevance(NamedTuple):
    """What :func:`rollout` gives for a model with cross-attention: ``target (B, R, Lt)``, each
    chosen row's relevance over the tokens of its own sequence (the decoder's input, or the
    entries of its KV cache), and ``source (B, R, Ls)``, over the tokens of the sequence its
    cross-attention reads (the encoder's input; the memory's positions when no encoder ran)."""

    target: torch.Tensor
    source: torch.Tensor


def _query_slots(layer: _Layer) -> torch.Tensor:
    """``(B or 1, Lq)``: the token slot (key index) of each query of a self-attention call: the
    queries themselves over the whole input; a KV cache's entries of the latest append (each
    sequence's own, read from the cached mask); the last ``Lq`` keys of a cache that keeps every
    sequence at one length (transformers' caches)."""
    from attnkit import masks

    lq, lk = layer.q.shape[2], layer.k.shape[2]
    steps = torch.arange(lq, device=layer.q.device)
    if isinstance(layer.mask, masks.Cached):
        return layer.mask.start.to(layer.q.device)[:, None] + steps
    if lq == lk:
        return steps[None]
    if lq < lk and layer.cross is None:
        return (lk - lq + steps)[None]
    raise AttnkitValueError(
        f"layer {layer.name!r} attends from {lq} queries to {lk} keys of its own sequence without a cached mask, "
        "so where its queries sit among the keys is unknown: decode with a KVCache and a mask object (or none), "
        "or run the model on the whole input."
    )


def _gather(r: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``r (B, R, L)`` at the queries' slots: ``(B, R, Lq)``, 0 for a query past the stored entries."""
    b, n, length = r.shape
    idx = slots.expand(b, -1)
    got = r.gather(2, idx.clamp(max=length - 1)[:, None].expand(b, n, -1))
    return got * (idx < length)[:, None].to(got.dtype)


def _scatter(r_q: torch.Tensor, slots: torch.Tensor, length: int) -> torch.Tensor:
    """The inverse of :func:`_gather`: ``(B, R, L)``, ``r_q (B, R, Lq)`` at the queries' slots."""
    b, n, _ = r_q.shape
    idx = slots.expand(b, -1)
    kept = r_q * (idx < length)[:, None].to(r_q.dtype)
    out = r_q.new_zeros(b, n, length)
    return out.scatter_add_(2, idx.clamp(max=length - 1)[:, None].expand(b, n, -1), kept)


def _encoder_of(model: nn.Module, encoder: Any) -> nn.Module | None:
    if encoder is None or isinstance(encoder, nn.Module):
        return encoder
    if encoder != "auto":
        raise AttnkitTypeError(f"encoder must be 'auto', None or a module of the model, but got {encoder!r}.")
    getter = getattr(model, "get_encoder", None)
    found = getter() if callable(getter) else getattr(model, "encoder", None)
    return found if isinstance(found, nn.Module) else None


@dataclass
class _Streams:
    """Which sequence each recorded call reads and writes: ``kinds[i]`` is ``"target"`` (self-attention
    of the chosen rows' sequence), ``"source"`` (the encoder's self-attention) or ``"cross"`` (target
    queries over source keys); ``slots``: the target queries' slots among ``length`` tokens."""

    kinds: list[str]
    length: int
    slots: torch.Tensor
    queries: int
    source_length: int | None


def _streams(model: nn.Module, layers: list[_Layer], encoder: Any) -> _Streams:
    if any(layer.cross is None and layer.q.shape[2] != layer.k.shape[2] for layer in layers) and getattr(
        getattr(model, "config", None), "is_encoder_decoder", False
    ):
        raise AttnkitValueError(
            f"{type(model).__name__} is a transformers encoder-decoder, whose cross-attention calls the integration "
            "cannot tell from cached self-attention: roll out its encoder alone, or build the model from "
            "attnkit.MultiHeadAttention (rollout follows attnkit's cross-attention into the encoder)."
        )
    kinds = ["cross" if layer.cross else "target" for layer in layers]
    source_length = None
    if "cross" in kinds:
        found = _encoder_of(model, encoder)
        inside = {id(m) for m in found.modules()} if found is not None else set()
        kinds = [
            kind if kind == "cross" or id(layer.module) not in inside else "source"
            for kind, layer in zip(kinds, layers)
        ]
        if encoder == "auto" and found is None and "target" in kinds:
            raise AttnkitValueError(
                f"{type(model).__name__} ran cross-attention and self-attention, and has no `encoder` attribute or "
                "get_encoder(): say which module's attention layers read the source sequence with encoder=<module> "
                "(encoder=None: no encoder ran in this call, its memory was given)."
            )
        crossing = [layer for layer, kind in zip(layers, kinds) if kind == "cross"]
        source_length = crossing[0].k.shape[2]
        for layer, kind in zip(layers, kinds):
            if (
                kind == "source"
                and layer.q.shape[2] != source_length
                or kind != "target"
                and layer.k.shape[2] != source_length
            ):
                raise AttnkitValueError(
                    f"the cross-attention of {crossing[0].name!r} reads {source_length} source tokens, but layer "
                    f"{layer.name!r} attends from {layer.q.shape[2]} queries to {layer.k.shape[2]} keys: rollout "
                    "follows one encoder's self-attention over the whole source."
                )
    own = [layer for layer, kind in zip(layers, kinds) if kind == "target"]
    ref = own[0] if own else next(layer for layer, kind in zip(layers, kinds) if kind == "cross")
    slots = _query_slots(own[0]) if own else torch.arange(ref.q.shape[2], device=ref.q.device)[None]
    length, queries = (ref.k.shape[2] if own else ref.q.shape[2]), ref.q.shape[2]
    for layer, kind in zip(layers, kinds):
        if kind == "source":
            continue
        mismatch = layer.q.shape[2] != queries or (kind == "target" and layer.k.shape[2] != length)
        if not mismatch and kind == "target" and layer is not ref:
            other = _query_slots(layer)
            mismatch = other.shape != slots.shape or not torch.equal(other, slots)
        if mismatch:
            raise AttnkitValueError(
                f"rollout carries relevance over one sequence's tokens, but layer {layer.name!r} attends from "
                f"{layer.q.shape[2]} queries to {layer.k.shape[2]} keys where layer {ref.name!r} attends from "
                f"{queries} to {length if kind == 'target' else ref.k.shape[2]} (another sequence, or caches of other "
                "fills): roll out one decoder's calls, with its cross-attention made by attnkit.MultiHeadAttention."
            )
    return _Streams(kinds, length, slots, queries, source_length)


def rollout(
    model: nn.Module,
    *args: Any,
    rows: Any,
    method: str = "rollout",
    residual: float = 0.5,
    heads: Any = "mean",
    target: Callable[[Any], torch.Tensor] | None = None,
    encoder: Any = "auto",
    **kwargs: Any,
) -> torch.Tensor | Relevance:
    """Relevance ``(B, len(rows), L)`` of every input token for each chosen query row.

    Runs ``model(*args, **kwargs)`` once (plus, for ``method="grad"``, one backward pass per row)
    and carries each row's vector down the attention layers (see the module's docstring for the
    two rules). ``rows``: indices of the last attention call's queries (negative from the end).
    ``heads``: ``"mean"`` (every head of each layer) or a list with one entry per attention call:
    a head index or a list of heads averaged. ``residual`` (rollout only): the identity's share,
    0.5 in Abnar & Zuidema. ``target`` (grad only): ``target(output) -> (B, len(rows))`` scalars
    whose gradients weight the heads; default each row's top logit.

    Works on models built from :class:`attnkit.MultiHeadAttention` and on transformers models run
    with ``attn_implementation="attnkit"``:

    - self-attention over the whole input (encoders, decoders without a cache): ``L`` tokens;
    - a decoding step over KV caches: ``L`` is the caches' entries; the step's queries are rows of
      their own entries, the entries stored before the step are inputs (relevance stops there);
    - cross-attention (attnkit layers): a :class:`Relevance` ``(target, source)``; a cross call
      moves relevance from its queries to the source tokens, which then goes down the encoder's
      self-attention (the layers inside ``encoder``: ``"auto"`` takes ``model.get_encoder()`` or
      ``model.encoder``; None where no encoder runs in the call). Rollout keeps each row's mass
      over both; the gradient rule is Chefer et al.'s encoder-decoder rule (``R_ts += A_ts R_ss``,
      without its normalisation of ``R_ss``).

    Exact (float32 for float32 models); no ``L x L`` tensor is made.

    >>> import torch, attnkit
    >>> from attnkit.inspect import rollout
    >>> layer = attnkit.MultiHeadAttention(16, 4)
    >>> r = rollout(layer, torch.randn(2, 9, 16), rows=[-1], mask=attnkit.masks.causal())
    >>> r.shape, round(r[0, 0].sum().item(), 4)  # each row's relevance sums to 1 (rollout keeps mass)
    (torch.Size([2, 1, 9]), 1.0)
    """
    if method not in METHODS:
        raise AttnkitValueError(f"method must be 'rollout' or 'grad', but got {method!r}.")
    if isinstance(residual, bool) or not isinstance(residual, (int, float)) or not 0 <= residual <= 1:
        raise AttnkitValueError(f"residual must be a number in [0, 1], but got {residual!r}.")
    if not isinstance(model, nn.Module):
        raise AttnkitTypeError(f"rollout expects a torch.nn.Module, but got {type(model).__name__}.")
    row_list = [rows] if isinstance(rows, int) else list(rows) if not isinstance(rows, torch.Tensor) else rows.tolist()
    if not row_list or any(isinstance(i, bool) or not isinstance(i, int) for i in row_list):
        raise AttnkitTypeError(f"rows must be an int or a list of ints (negative from the end), but got {rows!r}.")
    if not (encoder is None or encoder == "auto" or isinstance(encoder, nn.Module)):
        raise AttnkitTypeError(f"encoder must be 'auto', None or a module of the model, but got {encoder!r}.")
    grad_method = method == "grad"
    with _Recorder(model, keep_outputs=grad_method) as rec:
        with torch.set_grad_enabled(grad_method):
            output = model(*args, **kwargs)
    layers = rec.layers
    if not layers:
        raise AttnkitValueError("the model ran no attention layer attnkit could see: nothing to roll out.")
    streams = _streams(model, layers, encoder)
    queries = streams.queries
    bad = [i for i in row_list if not -queries <= i < queries]
    if bad:
        raise AttnkitValueError(
            f"rows {bad} are out of range for the {queries} queries of the last attention call (its input tokens)."
        )
    rows_pos = [i % queries for i in row_list]
    per_layer = _heads_per_layer(heads, layers)
    b = layers[0].q.shape[0]
    dtype = torch.float64 if layers[0].q.dtype == torch.float64 else torch.float32
    device = layers[0].q.device
    one_hot = torch.zeros(b, len(rows_pos), queries, dtype=dtype, device=device)
    one_hot[:, torch.arange(len(rows_pos)), torch.tensor(rows_pos)] = 1.0
    start = _scatter(one_hot, streams.slots.to(device), streams.length)
    cross = streams.source_length is not None  # the result: a Relevance (target, source)
    source = torch.zeros(b, len(rows_pos), streams.source_length or 0, dtype=dtype, device=device)
    order = list(zip(reversed(layers), reversed(per_layer), reversed(streams.kinds)))
    if not grad_method:
        r, r_s = start, source
        for layer, chosen, kind in order:
            if kind == "source":
                r_s = residual * r_s + (1 - residual) * _received(layer, r_s, chosen)
                continue
            r_q = _gather(r, streams.slots)
            moved = _received(layer, r_q, chosen)
            r = r - (1 - residual) * _scatter(r_q, streams.slots, streams.length)
            if kind == "cross":
                r_s = r_s + (1 - residual) * moved
            else:
                r = r + (1 - residual) * moved
        return Relevance(r, r_s) if cross else r
    if any(layer.out is None for layer in layers):
        raise AttnkitValueError(
            "a layer's head outputs were not seen: method='grad' needs attnkit's head output hooks."
        )
    scores = (target or _top_logit(rows_pos))(output)
    if not isinstance(scores, torch.Tensor) or scores.shape != (b, len(rows_pos)):
        got = tuple(scores.shape) if isinstance(scores, torch.Tensor) else type(scores).__name__
        raise AttnkitValueError(f"target must return a (B, len(rows)) = {(b, len(rows_pos))} tensor, but gave {got}.")
    result, result_s = [], []
    outs = [layer.out for layer in layers if layer.out is not None]
    for j in range(len(rows_pos)):
        d_outs = torch.autograd.grad(scores[:, j].sum(), outs, retain_graph=j + 1 < len(rows_pos), allow_unused=True)
        r = start[:, j : j + 1]
        r_s = source[:, j : j + 1]
        for (layer, chosen, kind), d_out in zip(order, reversed(d_outs)):
            if d_out is None:
                continue
            if kind == "source":
                r_s = r_s + _received(layer, r_s, chosen, d_out.detach())
                continue
            moved = _received(layer, _gather(r, streams.slots), chosen, d_out.detach())
            if kind == "cross":
                r_s = r_s + moved
            else:
                r = r + moved
        result.append(r)
        result_s.append(r_s)
    r = torch.cat(result, dim=1)
    return Relevance(r, torch.cat(result_s, dim=1)) if cross else r


def _heads_per_layer(heads: Any, layers: list[_Layer]) -> list[list[int] | None]:
    if isinstance(heads, str):
        if heads != "mean":
            raise AttnkitValueError(f"heads must be 'mean' or a list with one entry per layer, but got {heads!r}.")
        return [None] * len(layers)
    entries = list(heads)
    if len(entries) != len(layers):
        raise AttnkitValueError(
            f"heads has {len(entries)} entries but the model ran {len(layers)} attention layers "
            f"({[layer.name for layer in layers]}): give one head (or list of heads) per layer, or 'mean'."
        )
    out: list[list[int] | None] = []
    for entry, layer in zip(entries, layers):
        chosen = [entry] if isinstance(entry, int) else list(entry)
        count = layer.q.shape[1]
        if not chosen or any(isinstance(x, bool) or not isinstance(x, int) or not 0 <= x < count for x in chosen):
            raise AttnkitValueError(f"heads for layer {layer.name!r} must be indices in 0..{count - 1}, got {entry!r}.")
        out.append(chosen)
    return out
