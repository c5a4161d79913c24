"""Exact attention statistics at any length, without the ``Lq x Lk`` matrix.

Every weight is ``exp(s - lse)`` with its row's log-sum-exp; so a pass over the tiles the
prepared mask keeps for each row's largest score and sum, and one more that forms the weights
from them (a large float32 lse's rounding kept out), can reduce them (entropy, largest weight,
mass on the first keys, mean distance, mass each key receives, top-k keys) in O(L) memory.
This is how :func:`attnkit.capture` records long inputs. The kernel that computes them is the
registry's choice among the kernels that compute statistics (:func:`attnkit.kernels.registry.stats`:
the native engine's two passes, or the math kernel's walk); :func:`attnkit.explain` with
``stats=True`` names it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

import torch

from attnkit import functional
from attnkit._validate import AttnkitTypeError, AttnkitValueError, check_nonnegative_int
from attnkit.bias import BiasLike
from attnkit.kernels import registry
from attnkit.kernels.contract import StatsRequest
from attnkit.plan import MaskLike
from attnkit.score_mods import ScoreModLike

__all__ = ["AttentionStats", "attention_stats"]


@dataclass(frozen=True)
class AttentionStats:
    """Statistics of the attention weights of one call; shapes ``(B, H, Lq)`` unless noted.

    - ``lse``: row log-sum-exp of the scores (``-inf`` for a row with every key masked);
    - ``entropy``: of each row's weights, in nats (with ``sinks``, the sink's weight counts
      as one more outcome); :attr:`entropy_bits` gives it in bits, the unit the views print;
    - ``max_weight`` and ``argmax``: the largest weight and its key (``-1`` for a fully
      masked row);
    - ``sink_mass``: weight on the first ``sink_tokens`` keys;
    - ``mean_distance``: ``sum_j w_ij |p(i) - k(j)|`` with the mask's positions
      (:meth:`attnkit.masks.Mask.positions`: each sequence's own inside a KV cache);
    - ``received (B, H, Lk)``: each key's total weight over all queries;
    - ``topk_keys`` / ``topk_weights (B, H, Lq, min(topk, Lk))``: the largest weights of each row,
      largest first (keys ``-1`` / weights 0 where a row has fewer allowed keys); None
      when ``topk=0``.

    A fully masked row has lse ``-inf`` and 0 everywhere else. All values are float32
    (float64 for float64 inputs) and exact to that precision. ``topk`` and ``sink_tokens`` past Lk
    count every key (``topk_keys`` is then ``(B, H, Lq, Lk)``).
    """

    lse: torch.Tensor
    entropy: torch.Tensor
    max_weight: torch.Tensor
    argmax: torch.Tensor
    sink_mass: torch.Tensor
    mean_distance: torch.Tensor
    received: torch.Tensor
    topk_keys: torch.Tensor | None = None
    topk_weights: torch.Tensor | None = None

    @property
    def valid(self) -> torch.Tensor:
        """``(B, H, Lq)`` bool: rows that attend to at least one key."""
        return torch.isfinite(self.lse)

    @property
    def entropy_bits(self) -> torch.Tensor:
        """``entropy`` in bits (``entropy / ln 2``): the unit every attnkit view, figure and
        summary prints (a row spread evenly over n keys has log2(n) bits)."""
        return self.entropy / math.log(2.0)

    def head_summary(self) -> dict[str, torch.Tensor]:
        """Per-head means over the batch and the rows that attend: ``{name: (H,)}``.

        Names: ``entropy``, ``max_weight``, ``sink_mass``, ``mean_distance``.
        """
        valid = self.valid.to(self.entropy.dtype)
        count = valid.sum(dim=(0, 2)).clamp_min(1)
        return {
            name: (getattr(self, name) * valid).sum(dim=(0, 2)) / count
            for name in ("entropy", "max_weight", "sink_mass", "mean_distance")
        }

    def _repr_html_(self) -> str:
        """A table for a notebook cell: per head, the means over the batch and the rows that attend
        (entropy in bits, largest weight, mass on the first keys, mean distance), shaded by entropy."""
        import html as _html

        summary = self.head_summary()
        entropy = summary["entropy"] / math.log(2.0)
        top = float(entropy.max()) if entropy.numel() else 1.0
        cells = []
        for h in range(entropy.shape[0]):
            shade = 0.15 + 0.6 * float(entropy[h]) / (top or 1.0)
            cells.append(
                f"<tr><td>{h}</td><td style='background:rgba(70,110,190,{shade:.2f})'>{float(entropy[h]):.2f}</td>"
                f"<td>{float(summary['max_weight'][h]):.3f}</td><td>{float(summary['sink_mass'][h]):.3f}</td>"
                f"<td>{float(summary['mean_distance'][h]):.1f}</td></tr>"
            )
        shape = _html.escape(str(tuple(self.lse.shape)))
        return (
            f"<div class='attnkit-stats'><b>AttentionStats</b> (B, H, Lq) = {shape}, Lk = {self.received.shape[-1]}"
            "<table><tr><th>head</th><th>entropy (bits)</th><th>max weight</th><th>first-token mass</th>"
            f"<th>mean distance</th></tr>{''.join(cells)}</table></div>"
        )

    def to(self, *args: Any, **kwargs: Any) -> AttentionStats:
        """Every tensor moved/cast with ``Tensor.to`` (``argmax`` and ``topk_keys`` keep int64)."""
        out: dict[str, Any] = {}
        for f in fields(self):
            t = getattr(self, f.name)
            if t is None:
                out[f.name] = None
            elif t.is_floating_point():
                out[f.name] = t.to(*args, **kwargs)
            else:
                device = kwargs.get("device", next((a for a in args if isinstance(a, (str, torch.device))), None))
                out[f.name] = t if device is None else t.to(device)
        return AttentionStats(**out)


def _positions(mask, q_len: int, kv_len: int, device, dtype):
    """Key-axis positions ``(B or 1, Lq)`` and ``(B or 1, Lk)`` of the queries and keys
    (:meth:`attnkit.masks.Mask.positions`; bottom-right alignment for masks without any)."""
    found = None if mask is None else mask.positions(q_len, kv_len, device)
    if found is None:
        found = (torch.arange(q_len, device=device)[None] + (kv_len - q_len), torch.arange(kv_len, device=device)[None])
    return found[0].to(device, dtype), found[1].to(device, dtype)


def attention_stats(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: MaskLike = None,
    *,
    scale: float | None = None,
    attn_bias: BiasLike = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    score_mod: ScoreModLike = None,
    sink_tokens: int = 1,
    topk: int = 0,
) -> AttentionStats:
    """Exact statistics of the attention weights, in O(L) memory (see :class:`AttentionStats`).

    The arguments are :func:`attnkit.attention`'s (inputs of rank 2 to 4). A first pass
    over the tiles the mask keeps gives each row's largest score and sum (its lse), a second
    reduces the weights ``exp(s - lse)``; no tensor of ``Lq x Lk`` elements is made (a tile holds
    ``128 x 2048`` pairs per head at most). ``v`` is checked, not used.

    >>> import torch, attnkit
    >>> from attnkit.inspect import attention_stats
    >>> q = k = v = torch.randn(1, 2, 6, 8)
    >>> st = attention_stats(q, k, v, attnkit.masks.causal(), topk=2)
    >>> st.entropy.shape, st.received.shape, st.topk_keys.shape
    (torch.Size([1, 2, 6]), torch.Size([1, 2, 6]), torch.Size([1, 2, 6, 2]))
    >>> st.argmax[0, 0, 0].item()  # the first query sees only the first key
    0
    """
    sink_tokens = check_nonnegative_int(sink_tokens, "sink_tokens")
    topk = check_nonnegative_int(topk, "topk")
    if isinstance(mask, torch.Tensor) and mask.is_floating_point():
        raise AttnkitTypeError(
            "attention_stats takes bool masks or mask objects; pass an additive float mask as "
            "attn_bias=attnkit.bias.dense(tensor) (and -inf entries as a bool mask)."
        )
    squeeze = q.dim() - 4 if isinstance(q, torch.Tensor) else 0
    if squeeze > 0:
        raise AttnkitValueError(f"attention_stats takes inputs of rank 2 to 4, but q has shape {tuple(q.shape)}.")
    call = functional.stats_call(
        q, k, v, mask, scale=scale, attn_bias=attn_bias, softcap=softcap, sinks=sinks, score_mod=score_mod
    )
    lq, lk = call.q.shape[2], call.k.shape[2]
    topk, sink_tokens = min(topk, lk), min(sink_tokens, lk)  # a row has at most Lk keys to rank or count
    ct = torch.float64 if call.q.dtype == torch.float64 else torch.float32
    qpos, kpos = _positions(call.mask_object(), lq, lk, call.q.device, ct)
    request = StatsRequest(qpos, kpos, sink_tokens, topk)
    with torch.no_grad():
        found = registry.stats(call, request)
    stats = AttentionStats(**_with_sink_entropy(call, found))
    if q.dim() < 4:
        lifted: dict[str, Any] = {}
        for f in fields(stats):
            t = getattr(stats, f.name)
            lifted[f.name] = None if t is None else t.reshape(t.shape[4 - q.dim() :])
        stats = AttentionStats(**lifted)
    return stats


def _with_sink_entropy(call, out: dict) -> dict:
    """``out`` with the sink's own term in each row's entropy (the sink is one more outcome)."""
    if call.sinks is not None:
        lse = out["lse"]
        w_sink = torch.exp(call.sinks.to(lse.dtype).view(-1, 1) - lse)
        w_sink = torch.where(torch.isfinite(lse), w_sink, torch.zeros_like(w_sink))
        out = {**out, "entropy": out["entropy"] + torch.special.xlogy(w_sink, w_sink).neg()}
    return out
