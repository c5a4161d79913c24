"""MovieLens-100K, read from the ``recbole`` wheel without importing recbole, and its protocol.

943 users, 1,682 movies, 100,000 timestamped ratings. The files come with
``pip install --no-deps recbole==1.2.1`` (they are not copied into attnkit: their
licence does not allow redistribution).

Protocol (leave-one-out, full ranking): each user's interactions sorted by timestamp
(ties by item id); the last item is the test target, the one before it the validation
target, the rest is training. A recommender ranks **every** item the user has not
interacted with before the target; HR@10 and NDCG@10 are averaged over users.
"""

from __future__ import annotations

import functools
import importlib.util
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

from attnkit._validate import AttnkitValueError

NUM_ITEMS = 1682  # item ids are 1..1682; 0 is padding


def data_folder() -> Path:
    """The folder of ``ml-100k.inter`` inside the installed recbole wheel."""
    spec = importlib.util.find_spec("recbole")
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError("MovieLens-100K comes with the recbole wheel: pip install --no-deps recbole==1.2.1")
    folder = Path(spec.origin).parent / "dataset_example" / "ml-100k"
    if not (folder / "ml-100k.inter").is_file():
        raise ModuleNotFoundError(f"recbole is installed but {folder / 'ml-100k.inter'} is missing.")
    return folder


@functools.lru_cache(maxsize=1)
def interactions() -> dict[int, list[int]]:
    """Each user's item ids in time order (ties by item id)."""
    rows: dict[int, list[tuple[float, int]]] = {}
    with open(data_folder() / "ml-100k.inter", encoding="utf-8") as f:
        next(f)
        for line in f:
            user, item, _, stamp = line.rstrip("\n").split("\t")
            rows.setdefault(int(user), []).append((float(stamp), int(item)))
    return {user: [item for _, item in sorted(events)] for user, events in sorted(rows.items())}


@functools.lru_cache(maxsize=1)
def titles() -> dict[int, str]:
    """Item id -> "Title (year)"."""
    out = {}
    with open(data_folder() / "ml-100k.item", encoding="latin-1") as f:
        next(f)
        for line in f:
            fields = line.rstrip("\n").split("\t")
            out[int(fields[0])] = f"{fields[1]} ({fields[2]})" if len(fields) > 2 and fields[2] else fields[1]
    return out


@dataclass(frozen=True)
class Split:
    """Per user: ``train`` items (time order), the ``valid`` and the ``test`` target."""

    train: dict[int, list[int]]
    valid: dict[int, int]
    test: dict[int, int]


@functools.lru_cache(maxsize=1)
def split() -> Split:
    train, valid, test = {}, {}, {}
    for user, items in interactions().items():
        train[user], valid[user], test[user] = items[:-2], items[-2], items[-1]
    return Split(train, valid, test)


def history(user: int, target: str) -> list[int]:
    """What a user has done before the ``"valid"`` or ``"test"`` target."""
    s = split()
    if target == "valid":
        return list(s.train[user])
    if target == "test":
        return [*s.train[user], s.valid[user]]
    raise AttnkitValueError(f"target must be 'valid' or 'test', but got {target!r}.")


def rank_metrics(ranks: list[int], k: int = 10) -> dict[str, float]:
    """HR@k and NDCG@k from the 0-based rank of each user's target among the candidates."""
    if not ranks:
        return {f"HR@{k}": 0.0, f"NDCG@{k}": 0.0}
    hits = [r < k for r in ranks]
    ndcg = [1.0 / math.log2(r + 2) if r < k else 0.0 for r in ranks]
    return {f"HR@{k}": sum(hits) / len(ranks), f"NDCG@{k}": sum(ndcg) / len(ranks)}


def rank_of(scores: torch.Tensor | Sequence[float], target: int, seen: Iterable[int]) -> int:
    """0-based rank of ``target`` by ``scores`` (indexed by item id) among items not in ``seen``.

    Ties count against the target (a score equal to the target's ranks above it), so a
    constant scorer gets no credit.
    """
    import torch

    scores = torch.as_tensor(scores, dtype=torch.float64).clone()
    scores[0] = float("-inf")
    excluded = torch.tensor(sorted(set(seen) - {target}), dtype=torch.long)
    if len(excluded):
        scores[excluded] = float("-inf")
    return int((scores >= scores[target]).sum()) - 1


def evaluate(score_fn: Callable[[int, list[int]], torch.Tensor], target: str = "test", k: int = 10) -> dict[str, float]:
    """HR@k and NDCG@k of ``score_fn(user, history) -> scores (NUM_ITEMS + 1,)`` over all users."""
    s = split()
    goal = s.test if target == "test" else s.valid
    ranks = [rank_of(score_fn(user, history(user, target)), goal[user], history(user, target)) for user in goal]
    return rank_metrics(ranks, k)


def popularity_scores() -> torch.Tensor:
    """Counts of each item in the training interactions."""
    import torch

    counts = torch.zeros(NUM_ITEMS + 1)
    for items in split().train.values():
        counts.index_add_(0, torch.tensor(items, dtype=torch.long), torch.ones(len(items)))
    return counts


def markov_counts() -> torch.Tensor:
    """``(NUM_ITEMS + 1, NUM_ITEMS + 1)`` counts of item j right after item i in training sequences."""
    import torch

    counts = torch.zeros(NUM_ITEMS + 1, NUM_ITEMS + 1)
    for items in split().train.values():
        for a, b in zip(items, items[1:]):
            counts[a, b] += 1
    return counts
