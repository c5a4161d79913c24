"""``attnkit recommend``: SASRec's top movies for a MovieLens-100K user, and what the next-item
query attended to in the history (a figure and an interactive page)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from attnkit.apps.report import say


def check(args: Any) -> None:
    """The arguments alone, before torch is imported or the data read."""
    from attnkit.apps.shipped import MOVIELENS_USERS
    from attnkit.errors import AttnkitValueError

    if not 1 <= args.user <= MOVIELENS_USERS:
        raise AttnkitValueError(
            f"--user must be a MovieLens-100K user id (1 to {MOVIELENS_USERS}), but got {args.user}."
        )


def run(args: Any, out: Path) -> int:
    """Recommend to ``args.user``; prints the history and the titles, writes the figure and page into ``out``."""
    from attnkit._validate import AttnkitValueError
    from attnkit.models import movielens
    from attnkit.models.recommender import SASRec
    from attnkit.viz import save_html, visualize_attention
    from attnkit.viz.html import bars_overview, cut_labels

    users = movielens.split().test
    if args.user not in users:
        raise AttnkitValueError(f"--user must be a MovieLens-100K user id (1 to {max(users)}), but got {args.user}.")
    history = movielens.history(args.user, "test")  # everything but the held-out last item
    names = movielens.titles()
    model = SASRec.from_package()
    top = model.recommend([history], k=args.k)[0]
    print(f"user {args.user}: the last {min(5, len(history))} of {len(history)} movies")
    for item in history[-5:]:
        print(f"  {names.get(item, item)}")
    print(f"top {args.k}:")
    for rank, item in enumerate(top, 1):
        print(f"  {rank:2d}. {names.get(item, item)}")
    explained = model.explain(history)
    shown = min(args.last, len(explained["items"]))
    weights = explained["weights"][..., -shown:]  # (layers, heads, shown)
    labels, _ = cut_labels(explained["titles"][-shown:], 40)
    drew_on = model.attribute(history, top)  # (k, n): each history item's part of each score
    items = []
    for item, row in zip(top, drew_on):
        best = row.topk(min(3, len(row)))
        items.append(
            (
                names.get(item, str(item)),
                [(explained["titles"][j], v) for v, j in zip(best.values.tolist(), best.indices.tolist()) if v > 0],
            )
        )
    overview = bars_overview(
        f"Top {len(top)} for user {args.user}, and the past movies each one drew on most",
        items,
        note=f"{len(history)} movies in the history. Each bar: how much that past movie raises the title's score "
        "through the last layer's attention (its weight times its value, read along the title's embedding). "
        "The heatmap and model views show the weights themselves.",
        captions=[
            "drew on most:" if bars else "no past movie raises it: the score comes from elsewhere" for _, bars in items
        ],
    )
    written = [out / "recommend.png", out / "recommend.html"]
    visualize_attention(
        weights.mean(1),
        [f"layer {i}" for i in range(len(weights))],
        written[0],
        key_tokens=labels,
        xlabel="history (oldest to newest)",
        ylabel="",
        title=f"user {args.user}: the next-item query's attention (mean of heads)",
    )
    save_html(
        written[1],
        weights[:, :, None, :],
        ["next item"],
        key_tokens=labels,
        layer_names=[f"layer {i}" for i in range(len(weights))],
        title=f"user {args.user}: attention over the history",
        axes=("query (the next item)", f"past movie (the last {shown}, oldest first)"),
        overview=overview,
        focus=(len(weights) - 1, None),
    )
    for path in written:
        say(f"wrote {path}")
    return 0
