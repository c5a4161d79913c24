"""What the heads of each layer do, in numbers."""

from __future__ import annotations

import torch


def layer_statistics(weights: torch.Tensor, tokens: list[str], special: tuple[str, ...] = ()) -> list[dict]:
    """Per layer of ``weights: (layers, heads, L, L)``: the mean share of attention on
    the ``special`` tokens (a model's markers, such as BERT's ``[CLS]``/``[SEP]``), on the
    previous token and on the token itself, and the mean entropy of a row in bits."""
    weights = weights.double()
    length = weights.shape[-1]
    is_special = torch.tensor([t in special for t in tokens], dtype=torch.bool)
    rows = []
    for layer, w in enumerate(weights):  # (heads, L, L)
        entropy = -(w * torch.log2(w.clamp_min(1e-30))).sum(-1)  # (heads, L)
        previous = w.diagonal(offset=-1, dim1=-2, dim2=-1).mean().item() if length > 1 else 0.0
        rows.append(
            {
                "layer": layer,
                "special": w[..., is_special].sum(-1).mean().item(),
                "previous": previous,
                "self": w.diagonal(dim1=-2, dim2=-1).mean().item(),
                "entropy_bits": entropy.mean().item(),
                "max_entropy_bits": float(torch.log2(torch.tensor(float(length)))),
            }
        )
    return rows


def summarize(weights: torch.Tensor, tokens: list[str], special: tuple[str, ...] = ()) -> str:
    """A short table of :func:`layer_statistics`."""
    name = f"on {'/'.join(special)}" if special else "on special"
    lines = [f"layer  {name:>13}  on previous  on itself  entropy (bits)"]
    for r in layer_statistics(weights, tokens, special):
        lines.append(
            f"{r['layer']:>5}  {r['special']:>13.0%}  {r['previous']:>11.0%}  {r['self']:>9.0%}  "
            f"{r['entropy_bits']:>5.2f} of {r['max_entropy_bits']:.2f}"
        )
    return "\n".join(lines)


def notable_heads(
    weights: torch.Tensor, tokens: list[str], special: tuple[str, ...] = ()
) -> list[tuple[int, int, str]]:
    """Three heads of ``weights: (layers, heads, L, L)`` that each do one recognisable thing, as
    ``(layer, head, what)``: the one that most reads the previous token, the one that most rests on the
    ``special`` tokens (else the one most on itself), and the one that spreads its weights most evenly
    (the highest mean entropy); each a different head."""
    weights = weights.double()
    layers, heads, length = weights.shape[0], weights.shape[1], weights.shape[-1]
    is_special = torch.tensor([t in special for t in tokens], dtype=torch.bool)
    previous = weights.diagonal(offset=-1, dim1=-2, dim2=-1).mean(-1) if length > 1 else torch.zeros(layers, heads)
    resting = weights[..., is_special].sum(-1).mean(-1) if bool(is_special.any()) else None
    itself = weights.diagonal(dim1=-2, dim2=-1).mean(-1)
    entropy = -(weights * torch.log2(weights.clamp_min(1e-30))).sum(-1).mean(-1)
    wanted = [
        (previous, "reads the previous token"),
        (resting, f"rests on {'/'.join(special)}") if resting is not None else (itself, "looks at itself"),
        (entropy, "spreads over the whole text"),
    ]
    chosen: list[tuple[int, int, str]] = []
    for score, what in wanted:
        order = torch.argsort(score.reshape(-1), descending=True, stable=True).tolist()
        pick = next(i for i in order if (i // heads, i % heads) not in [(c[0], c[1]) for c in chosen])
        chosen.append((pick // heads, pick % heads, what))
    return chosen
