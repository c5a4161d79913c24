"""The one log-sum-exp merge: partial attention over disjoint key sets combines exactly.

If ``out_i`` and ``lse_i`` are attention over key set i, then over their union
``lse = logsumexp_i(lse_i)`` and ``out = sum_i exp(lse_i - lse) * out_i``. Runs within a
row block, tiles, ring-attention ranks and attention sinks (an extra key of value 0)
all combine this way, in float32 (float64 for float64 inputs). A row that sees no key
has ``out = 0`` and ``lse = -inf`` and stays so.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["NEG_INF", "accumulator_dtype", "add_sinks", "merge", "merge_into", "sink_factor"]

NEG_INF = float("-inf")


def accumulator_dtype(x: torch.Tensor) -> torch.dtype:
    """float32 accumulation (float64 for float64 inputs), the dtype of every lse."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def merge(parts: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact merge of attention over disjoint key sets by their log-sum-exp.

    Each part's output is 0 on the rows it hides entirely, and its lse -inf.
    """
    if len(parts) == 1:
        return parts[0]
    total = torch.logsumexp(torch.stack([lse_r for _, lse_r in parts]), dim=0)
    safe = torch.where(total == NEG_INF, 0.0, total)
    out = torch.exp(parts[0][1] - safe)[..., None] * parts[0][0].to(parts[0][1].dtype)
    for o, lse_r in parts[1:]:
        out = out + torch.exp(lse_r - safe)[..., None] * o.to(lse_r.dtype)
    return out, total


def merge_into(
    acc_out: torch.Tensor, acc_lse: torch.Tensor, out: torch.Tensor, lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge a partial ``(out, lse)`` into the accumulators ``(acc_out, acc_lse)``; returns them
    (``acc_out`` updated in place; ``acc_lse`` is a new tensor)."""
    lse = lse.to(acc_lse.dtype)
    new = torch.logaddexp(acc_lse, lse)
    safe = torch.where(torch.isinf(new), torch.zeros_like(new), new)  # rows nothing reached: -inf
    w_acc = torch.exp(acc_lse - safe)
    w_new = torch.exp(lse - safe)
    acc_out.mul_(w_acc[..., None]).add_(out.to(acc_out.dtype) * w_new[..., None])
    return acc_out, new


def sink_factor(lse: torch.Tensor, sinks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(factor, lse')`` of each head's sink logit in the softmax denominator.

    A sink is an extra key per head with value 0 (gpt-oss): every weight of a row is
    multiplied by ``factor = exp(lse) / (exp(lse) + exp(sink)) = sigmoid(lse - sink)``,
    and the row's log-sum-exp becomes ``lse' = logaddexp(lse, sink)``. A fully masked
    row (``lse = -inf``) gets factor 0 (its output stays 0, with zero gradients) and
    ``lse' = sink``, also for a sink of ``-inf``. ``sinks: (Hq,)``; ``lse: (..., Hq, Lq)``.
    """
    sink = sinks.to(lse.dtype)
    sink = sink.view(-1, 1) if lse.dim() >= 2 else sink.view(-1)  # (Hq, 1): broadcasts over Lq
    dead = lse == float("-inf")  # rows with no key: only the sink is left (-inf - -inf would be NaN)
    live = lse.masked_fill(dead, 0.0)
    factor = torch.sigmoid(live - sink).masked_fill(dead, 0.0)  # (..., Hq, Lq)
    return factor, torch.where(dead, sink.expand_as(lse), torch.logaddexp(live, sink))


def add_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` with each head's sink in the softmax denominator (see :func:`sink_factor`)."""
    factor, lse = sink_factor(lse, sinks)
    return (out.to(factor.dtype) * factor[..., None]).to(out.dtype), lse
