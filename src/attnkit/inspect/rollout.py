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
gradient rule is elementwise in ``A``: its weights are recomputed one chunk of query rows at a
time (:func:`attnkit.attention_weights` with ``rows=``), in memory proportional to the chunk.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from attnkit import functional
from attnkit._validate import AttnkitTypeError, AttnkitValueError
from attnkit.inspect.capture import attention_layers

__all__ = ["METHODS", "rollout"]

METHODS = ("rollout", "grad")

#: Weights ``(B x H x rows x Lk)`` the gradient rule holds at once (a chunk of query rows).
CHUNK_ELEMENTS = 2**23


@dataclass
class _Layer:
    name: str
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    mask: Any
    mods: dict
    out: torch.Tensor | None = None  # the heads' outputs (grad method), in the graph
    lse: torch.Tensor | None = None  # the call's row lse (grad method), made once for every chosen row


class _Recorder:
    """Every attention call of ``model`` in this thread while the block is open, in call order."""

    def __init__(self, model: nn.Module, keep_outputs: bool):
        self.model, self.keep_outputs = model, keep_outputs
        self.layers: list[_Layer] = []
        self._handles: list = []
        self._thread = threading.get_ident()
        self._names = {id(m): name for name, m in model.named_modules()}
        self._pending: dict[int, _Layer] = {}

    def _attention(self, module, q, k, v, mask, mods):
        if threading.get_ident() != self._thread or id(module) not in self._names:
            return
        keep = {key: mods.get(key) for key in ("attn_bias", "softcap", "sinks", "scale") if mods.get(key) is not None}
        if keep.get("sinks") is not None:
            keep["sinks"] = keep["sinks"].detach()
        layer = _Layer(self._names[id(module)] or type(module).__name__, q.detach(), k.detach(), v.detach(), mask, keep)
        self.layers.append(layer)
        self._pending[id(module)] = layer

    def _output(self, module, out):
        layer = self._pending.pop(id(module), None)
        if layer is not None and threading.get_ident() == self._thread:
            layer.out = out
        return None

    def __enter__(self) -> _Recorder:
        layers = attention_layers(self.model, "roll out")
        if layers is not None:
            for m in layers:
                self._handles.append(
                    m.register_attention_hook(
                        lambda mod, q, k, v, mask, kw: self._attention(mod, q, k, v, mask, kw), with_kwargs=True
                    )
                )
                if self.keep_outputs:
                    self._handles.append(m.register_head_output_hook(self._output))
        else:
            from attnkit.integrations.transformers import register_attention_hook, register_head_output_hook

            self._handles.append(register_attention_hook(self._attention))
            if self.keep_outputs:
                self._handles.append(register_head_output_hook(self._output))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


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


def _received(layer: _Layer, r: torch.Tensor, heads: list[int] | None) -> torch.Tensor:
    """``r @ A``: ``(B, R, Lk)``, the weights each key receives with query ``i`` weighted by ``r[:, :, i]``,
    ``A`` averaged over ``heads`` (all when None), from the backward of the layer's attention call."""
    q, k = layer.q, layer.k
    b, h, lq, _ = q.shape
    if k.shape[1] != h:  # GQA: one value head per query head, so each head's share stays apart
        k = k.repeat_interleave(h // k.shape[1], dim=1)
    chosen = list(range(h)) if heads is None else heads
    grad = torch.zeros(b, h, lq, r.shape[1], dtype=q.dtype, device=q.device)
    grad[:, chosen] = r.transpose(1, 2).to(q.dtype).unsqueeze(1) / len(chosen)
    values = torch.zeros(b, h, k.shape[2], r.shape[1], dtype=q.dtype, device=q.device, requires_grad=True)
    with torch.enable_grad():
        out = functional.attention(q, k, values, layer.mask, **layer.mods)
        (got,) = torch.autograd.grad(out, values, grad)
    return got.sum(dim=1).transpose(1, 2).to(r.dtype)  # (B, R, Lk)


def _rows_allowed(mask, lq: int, lk: int):
    """``allowed(start, stop) -> (.., rows, Lk) bool``: the mask's pairs for a run of query rows, or
    None where the mask cannot be read as pairs (none, or an additive float tensor)."""
    from attnkit.masks import Mask
    from attnkit.plan import PreparedMask, prepare

    if isinstance(mask, Mask):
        mask = prepare(mask, lq, lk)
    if isinstance(mask, PreparedMask):
        keys = torch.arange(lk, device=mask.device)
        return lambda start, stop: mask.allowed_at(torch.arange(start, stop, device=mask.device), keys)
    if isinstance(mask, torch.Tensor) and mask.dtype == torch.bool:
        return lambda start, stop: mask[..., start:stop, :] if mask.shape[-2] == lq else mask
    return None


def _received_grad(layer: _Layer, r: torch.Tensor, d_out: torch.Tensor, heads: list[int] | None) -> torch.Tensor:
    """``r @ mean_h((dA * A)^+)`` with ``dA = dO V^T``, a chunk of query rows at a time, each over
    the keys its rows may see (the mask's reach: half the pairs for a causal mask)."""
    q, k, v = layer.q, layer.k, layer.v
    b, h, lq, _ = q.shape
    lk = k.shape[2]
    v_all = v.repeat_interleave(h // v.shape[1], dim=1) if v.shape[1] != h else v
    chosen = list(range(h)) if heads is None else heads
    step = max(1, CHUNK_ELEMENTS // max(1, b * len(chosen) * lk))
    total = torch.zeros(b, r.shape[1], lk, dtype=torch.float64 if q.dtype == torch.float64 else torch.float32)
    allowed = _rows_allowed(layer.mask, lq, lk)
    bias = layer.mods.get("attn_bias")
    direct = allowed is not None and layer.mods.get("sinks") is None and (bias is None or hasattr(bias, "part"))
    if direct:  # the weights as exp(s - lse), the lse from the layer's own kernel: one pass less than a softmax
        if layer.lse is None:
            _, layer.lse = functional.attention(q, k, v, layer.mask, return_lse=True, **layer.mods)
        lse = layer.lse[:, chosen].masked_fill(~torch.isfinite(layer.lse[:, chosen]), float("inf"))  # no key: weights 0
        k_all = k.repeat_interleave(h // k.shape[1], dim=1) if k.shape[1] != h else k
        scale = layer.mods.get("scale") or q.shape[-1] ** -0.5
        softcap = layer.mods.get("softcap")
    for start in range(0, lq, step):
        stop = min(lq, start + step)
        lo, hi, mask, mods = 0, lk, layer.mask, dict(layer.mods)
        if direct:
            pairs = allowed(start, stop)  # (Bm, Hm, c, Lk)
            seen = pairs.reshape(-1, lk).any(dim=0).nonzero()
            if seen.numel() == 0:
                continue  # no row of the chunk sees a key
            lo, hi = int(seen[0]), int(seen[-1]) + 1
            pairs = pairs[..., lo:hi]
            if pairs.shape[1] == h and len(chosen) != h:
                pairs = pairs[:, chosen]
            s = (q[:, chosen, start:stop] @ k_all[:, chosen, lo:hi].transpose(-2, -1)) * scale
            if softcap is not None:
                s = torch.tanh(s / softcap) * softcap
            if bias is not None:
                dense = bias.part(lq, lk, q=slice(start, stop), kv=slice(lo, hi)).dense(
                    b, h, stop - start, hi - lo, q.device
                )
                s = s + (dense[:, chosen] if dense.shape[1] == h else dense).to(s.dtype)
            w = torch.where(pairs, torch.exp(s - lse[:, :, start:stop, None]), 0.0)  # (B, h', c, hi - lo)
        elif allowed is not None and (bias is None or hasattr(bias, "part")):
            pairs = allowed(start, stop)
            seen = pairs.reshape(-1, lk).any(dim=0).nonzero()
            if seen.numel() == 0:
                continue  # no row of the chunk sees a key
            lo, hi = int(seen[0]), int(seen[-1]) + 1
            mask = pairs[..., lo:hi]
            if bias is not None:
                mods["attn_bias"] = bias.part(lq, lk, q=slice(start, stop), kv=slice(lo, hi))
            w = functional.attention_weights(
                q[:, :, start:stop], k[:, :, lo:hi], v[:, :, lo:hi], mask, heads=chosen, **mods
            )  # (B, h', c, hi - lo)
        else:
            w = functional.attention_weights(q, k, v, mask, rows=list(range(start, stop)), heads=chosen, **mods)
        d_w = d_out[:, chosen, start:stop].to(w.dtype) @ v_all[:, chosen, lo:hi].transpose(-2, -1).to(w.dtype)
        m = d_w.mul_(w).clamp_min_(0).mean(dim=1)  # (B, c, keys), in place on the chunk's own tensors
        total[..., lo:hi] += (r[:, :, start:stop].to(m.dtype) @ m).to(total.dtype)
    return total.to(r.dtype)


def rollout(
    model: nn.Module,
    *args: Any,
    rows: Any,
    method: str = "rollout",
    residual: float = 0.5,
    heads: Any = "mean",
    target: Callable[[Any], torch.Tensor] | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    """Relevance ``(B, len(rows), L)`` of every input token for each chosen query row.

    Runs ``model(*args, **kwargs)`` once (plus, for ``method="grad"``, one backward pass per row)
    and carries each row's vector down the attention layers (see the module's docstring for the
    two rules). ``rows``: query indices (negative from the end). ``heads``: ``"mean"`` (every head
    of each layer) or a list with one entry per layer: a head index or a list of heads averaged.
    ``residual`` (rollout only): the identity's share, 0.5 in Abnar & Zuidema. ``target`` (grad
    only): ``target(output) -> (B, len(rows))`` scalars whose gradients weight the heads; default
    each row's top logit. Works on models built from :class:`attnkit.MultiHeadAttention` and on
    transformers models run with ``attn_implementation="attnkit"`` whose attention layers are
    self-attention over the whole input (encoders, decoders without a cache); other calls are
    refused. Exact (float32 for float32 models); no ``L x L`` tensor is made.

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
    grad_method = method == "grad"
    with _Recorder(model, keep_outputs=grad_method) as rec:
        with torch.set_grad_enabled(grad_method):
            output = model(*args, **kwargs)
    layers = rec.layers
    if not layers:
        raise AttnkitValueError("the model ran no attention layer attnkit could see: nothing to roll out.")
    length = layers[0].q.shape[2]
    for layer in layers:
        if layer.q.shape[2] != layer.k.shape[2] or layer.q.shape[2] != length:
            raise AttnkitValueError(
                f"rollout follows self-attention over the whole input, but layer {layer.name!r} attends from "
                f"{layer.q.shape[2]} queries to {layer.k.shape[2]} keys (cross-attention or a KV cache): run the "
                "model on the whole input without a cache."
            )
    bad = [i for i in row_list if not -length <= i < length]
    if bad:
        raise AttnkitValueError(f"rows {bad} are out of range for an input of {length} tokens.")
    rows_pos = [i % length for i in row_list]
    per_layer = _heads_per_layer(heads, layers)
    b = layers[0].q.shape[0]
    dtype = torch.float64 if layers[0].q.dtype == torch.float64 else torch.float32
    start = torch.zeros(b, len(rows_pos), length, dtype=dtype, device=layers[0].q.device)
    start[:, torch.arange(len(rows_pos)), torch.tensor(rows_pos)] = 1.0
    if not grad_method:
        r = start
        for layer, chosen in zip(reversed(layers), reversed(per_layer)):
            r = residual * r + (1 - residual) * _received(layer, r, chosen)
        return r
    if any(layer.out is None for layer in layers):
        raise AttnkitValueError(
            "a layer's head outputs were not seen: method='grad' needs attnkit's head output hooks."
        )
    scores = (target or _top_logit(rows_pos))(output)
    if not isinstance(scores, torch.Tensor) or scores.shape != (b, len(rows_pos)):
        got = tuple(scores.shape) if isinstance(scores, torch.Tensor) else type(scores).__name__
        raise AttnkitValueError(f"target must return a (B, len(rows)) = {(b, len(rows_pos))} tensor, but gave {got}.")
    result = []
    outs = [layer.out for layer in layers if layer.out is not None]
    for j in range(len(rows_pos)):
        d_outs = torch.autograd.grad(scores[:, j].sum(), outs, retain_graph=j + 1 < len(rows_pos), allow_unused=True)
        r = start[:, j : j + 1]
        for layer, chosen, d_out in zip(reversed(layers), reversed(per_layer), reversed(d_outs)):
            if d_out is not None:
                r = r + _received_grad(layer, r, d_out.detach(), chosen)
        result.append(r)
    return torch.cat(result, dim=1)


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
