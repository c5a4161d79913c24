"""Seeing attention at long context: attention_stats beside eager weights, and RecallLM by length.

    python benchmarks/long_context.py [--lengths 16384 32768] [--repeats 3] [--out benchmarks/results/long_context.json]

(Not named ``inspect.py``: a script folder is first on ``sys.path``, and a file named like
the standard library's ``inspect`` would be imported by torch in place of it, breaking
every benchmark here.)

- ``stats``: :func:`attnkit.inspect.attention_stats` (B=1, H=8, D=64, fp32, causal and
  document & causal masks; without and with the top-8 keys of every row) against one
  ``attnkit.attention`` forward on the same inputs, the three run in turn in each round: the
  median of the rounds' time ratios (target <= 1.5 at 16k-64k) and peak memory rise (target
  <= 512 MB at 32k).
- ``eager``: ``attnkit.attention_weights`` + the same reductions done densely, where the
  ``(B, H, L, L)`` matrix fits (L <= 8192), and the memory it would need beyond that.
- ``recall``: the shipped RecallLM's first-query accuracy on fresh texts of 1k, 4k, 16k
  and 32k tokens, the pair asked about anywhere in the text.

Medians over ``--repeats`` runs; writes JSON and prints the tables.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import core
import machine  # benchmarks/machine.py
import torch

import attnkit
from attnkit import masks
from attnkit.inspect import attention_stats

RESULTS = Path(__file__).parent / "results"
B, H, D = 1, 8, 64


def make_mask(kind: str, length: int):
    return masks.causal() if kind == "causal" else core.packed_documents(length)


def dense_reductions(q, k, v, mask):
    """What a user does without attention_stats: the whole weight matrix, then reductions."""
    w = attnkit.attention_weights(q, k, v, mask)
    entropy = -torch.special.xlogy(w, w).sum(-1)
    top = w.max(-1)
    received = w.sum(-2)
    topk = w.topk(8, -1)
    return entropy, top, received, topk


def timed(fn, repeats):
    times, peak = [], 0.0
    for i in range(repeats + 1):
        with core.PeakRSS() as mem:
            start = time.perf_counter()
            fn()
            elapsed = time.perf_counter() - start
        if i:  # the first run warms up
            times.append(elapsed)
            peak = max(peak, mem.rise_mb)
    return 1e3 * statistics.median(times), peak


def in_turn(fns: dict, repeats: int) -> tuple[dict, dict, dict]:
    """Each function once per round, in turn (after one warm-up round that also measures the
    peak memory rise): median ms, peak MB, and the median of each round's ratio to the first."""
    peaks, times = {}, {name: [] for name in fns}
    for name, fn in fns.items():
        with core.PeakRSS() as mem:
            fn()
        peaks[name] = mem.rise_mb
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    first = next(iter(fns))
    ratios = {name: statistics.median(a / b for a, b in zip(t, times[first])) for name, t in times.items()}
    return {name: 1e3 * statistics.median(t) for name, t in times.items()}, peaks, ratios


def stats_rows(lengths, repeats) -> list[dict]:
    rows = []
    for length in lengths:
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(B, H, length, D, generator=g) for _ in range(3))
        for kind in ("causal", "document"):
            mask = make_mask(kind, length)
            attnkit.prepare(mask, length, length)  # both calls reuse the prepared plan
            fns = {
                "forward": lambda: attnkit.attention(q, k, v, mask),
                "stats": lambda: attention_stats(q, k, v, mask),
                "topk": lambda: attention_stats(q, k, v, mask, topk=8),
            }
            with torch.no_grad():
                ms, mb, ratio = in_turn(fns, repeats)
            row = {
                "L": length,
                "mask": kind,
                "forward_ms": ms["forward"],
                "stats_ms": ms["stats"],
                "ratio": ratio["stats"],
                "forward_mb": mb["forward"],
                "stats_mb": mb["stats"],
                "topk_ms": ms["topk"],
                "topk_ratio": ratio["topk"],
                "topk_mb": mb["topk"],
            }
            dense_bytes = 4 * B * H * length * length
            row["eager_needs_gb"] = 3 * dense_bytes / 2**30  # weights, their log terms, the masked scores
            if length <= 8192:
                with torch.no_grad():
                    row["eager_ms"], row["eager_mb"] = timed(lambda: dense_reductions(q, k, v, mask), 1)
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    return rows


def recall_rows(samples: dict) -> list[dict]:
    from attnkit.models.recall import RecallLM, accuracy

    model = RecallLM.from_package()
    rows = []
    for length, n in samples.items():
        start = time.perf_counter()
        acc = accuracy(model, length, n=n, seed=12345, batch_size=1 if length > 4096 else 8)
        rows.append({"L": length, "n": n, "accuracy": acc, "seconds": time.perf_counter() - start})
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


def table(rows) -> str:
    lines = [
        "| L | mask | attnkit forward (ms) | attention_stats (ms) | stats / forward | with top-8 keys (ms) "
        "| top-8 / forward "
        "| peak rise: forward / stats / top-8 (MB) | eager weights + reductions (ms, MB) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        eager = (
            f"{r['eager_ms']:,.0f} ms, {r['eager_mb']:,.0f} MB"
            if "eager_ms" in r
            else f"needs ~{r['eager_needs_gb']:.0f} GB: does not fit in 24 GB"
            if r["eager_needs_gb"] >= 24
            else f"needs ~{r['eager_needs_gb']:.0f} GB"
        )
        lines.append(
            f"| {r['L']:,} | {r['mask']} | {r['forward_ms']:,.0f} | {r['stats_ms']:,.0f} | {r['ratio']:.2f} "
            f"| {r['topk_ms']:,.0f} | {r['topk_ratio']:.2f} "
            f"| {r['forward_mb']:,.0f} / {r['stats_mb']:,.0f} / {r['topk_mb']:,.0f} | {eager} |"
        )
    return "\n".join(lines)


def recall_table(rows) -> str:
    lines = ["| text length (tokens) | texts | first-query accuracy |", "|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['L']:,} | {r['n']} | {r['accuracy']:.1%} |")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--recall",
        default="1024:200,4096:100,16384:32,32768:16",
        help="length:texts pairs for RecallLM's accuracy ('' to skip)",
    )
    p.add_argument("--out", type=Path, default=RESULTS / "long_context.json")
    args = p.parse_args()
    rows = stats_rows(args.lengths, args.repeats)
    samples = {int(a): int(b) for a, b in (x.split(":") for x in args.recall.split(",") if x)}
    recall = recall_rows(samples) if samples else []
    if not samples and args.out.exists():  # --recall '': the file's earlier recall rows stay
        recall = json.loads(args.out.read_text()).get("recall", [])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "machine": machine.describe(),
                "stats": rows,
                "recall": recall,
            },
            indent=1,
        )
    )
    print(table(rows))
    if recall:
        print()
        print(recall_table(recall))


if __name__ == "__main__":
    main()
