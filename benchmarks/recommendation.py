"""Recommendation on MovieLens-100K (test split, full ranking): SASRec on attnkit beside baselines.

    python benchmarks/recommendation.py [--epochs 120] [--seed 0]

In one run, with the protocol of attnkit.models.movielens (leave-one-out by time, every
unseen item ranked, all 943 users):

- most popular (training counts);
- first-order Markov: counts of the next item after the user's last item (popularity breaks ties);
- SASRec built from attnkit parts, trained here (and the shipped weights);
- the same SASRec with torch.nn.MultiheadAttention layers instead of attnkit's, trained
  with the same seed, epochs and settings: attnkit should change nothing about quality.

Writes benchmarks/results/recommendation.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from torch import nn

from attnkit.models import movielens, recommender
from attnkit.models.recommender import SASRec, evaluate

RESULTS = Path(__file__).parent / "results"


class TorchAttention(nn.Module):
    """torch.nn.MultiheadAttention with the call signature of attnkit's, for the comparison."""

    def __init__(self, d_model, num_heads):
        super().__init__()
        self.inner = nn.MultiheadAttention(d_model, num_heads, batch_first=True)

    def forward(self, x, mask=None):
        lengths = self.lengths
        length = x.shape[1]
        future = torch.ones(length, length, dtype=torch.bool).triu(1)  # torch: True = hidden
        padding = torch.arange(length)[None] >= lengths[:, None]
        return self.inner(x, x, x, attn_mask=future, key_padding_mask=padding, need_weights=False)[0], None


class TorchSASRec(SASRec):
    def __init__(self, config=recommender.Config()):
        super().__init__(config)
        for block in self.blocks:
            block.attention = TorchAttention(config.d_model, config.num_heads)

    def forward(self, ids, lengths):
        for block in self.blocks:
            block.attention.lengths = lengths
        return super().forward(ids, lengths)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=120)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS / "recommendation.json")
    args = parser.parse_args()
    rows = {}
    popular = movielens.popularity_scores()
    rows["most popular"] = movielens.evaluate(lambda user, history: popular)
    markov = movielens.markov_counts()
    rows["first-order Markov"] = movielens.evaluate(lambda user, history: markov[history[-1]] + 1e-6 * popular)
    shipped = SASRec.from_package()
    rows["SASRec on attnkit (shipped weights)"] = evaluate(shipped)
    for name, cls in (("SASRec on attnkit", SASRec), ("SASRec on torch.nn.MultiheadAttention", TorchSASRec)):
        original = recommender.SASRec
        recommender.SASRec = cls  # train() builds recommender.SASRec
        try:
            _, record = recommender.train(args.epochs, seed=args.seed, progress=False, log=None)
        finally:
            recommender.SASRec = original
        rows[f"{name} (trained here)"] = {
            "HR@10": record["test_HR@10"],
            "NDCG@10": record["test_NDCG@10"],
            "train_seconds": record["seconds"],
        }
        print(name, rows[f"{name} (trained here)"], flush=True)
    best_hr = max(rows["most popular"]["HR@10"], rows["first-order Markov"]["HR@10"])
    best_ndcg = max(rows["most popular"]["NDCG@10"], rows["first-order Markov"]["NDCG@10"])
    print("| model (test split, 943 users, full ranking) | HR@10 | NDCG@10 | vs best baseline | training |")
    print("|---|---|---|---|---|")
    for name, r in rows.items():
        rel = f"{r['HR@10'] / best_hr - 1:+.0%} / {r['NDCG@10'] / best_ndcg - 1:+.0%}"
        train_s = f"{r['train_seconds']:.0f} s" if "train_seconds" in r else "-"
        print(f"| {name} | {r['HR@10']:.3f} | {r['NDCG@10']:.3f} | {rel} | {train_s} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
