"""RecallLM's recall with its KV cache compressed by each scoring method, against the full cache.

    python benchmarks/kv_compress.py [--lengths 1024 4096 16384] [--texts 128] [--keep 0.5 0.25] [--out FILE]
    python benchmarks/kv_compress.py --budgets uniform pyramid --methods observed snapkv knorm \
        --out benchmarks/results/kv_budgets.json
    python benchmarks/kv_compress.py --budgets uniform pyramid --allocate heads --methods observed snapkv random \
        --out benchmarks/results/kv_heads.json

For each length: ``texts`` fresh recall texts (8 key-value pairs in filler, one question), read up
to the question into per-layer :class:`attnkit.KVCache`; every layer's keys are scored during that
prefill by :func:`attnkit.inspect.kv_scores` (SnapKV with a 64-query window, TOVA, observed
attention; KNorm, the keys' norms alone) or a baseline (random entries, the most recent entries),
each cache is compressed to each share of ``--keep`` (:meth:`KVCache.compress`; with ``--budgets
pyramid`` that share spread over the layers as PyramidKV does, :func:`attnkit.nn.layer_budgets`;
with ``--allocate heads`` each layer's budget spread over its heads as AdaKV does) and the question
is decoded over it
(:func:`attnkit.models.recall.compressed_recall`). The question is not seen when scoring
(question-agnostic compression). Writes the accuracies and a markdown table.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import machine  # benchmarks/machine.py
import torch

from attnkit.models.recall import RecallLM, compressed_recall

RESULTS = Path(__file__).parent / "results"
METHODS = ("snapkv", "tova", "observed", "random", "recent")


def table(rows: list[dict], keep: list[float], methods: tuple[str, ...] = METHODS) -> str:
    head = (
        "| text length | budgets | texts | full cache | "
        + " | ".join(f"{m} {share:.0%}" for m in methods for share in keep)
        + " |"
    )
    lines = [head, "|" + "---|" * (4 + len(methods) * len(keep))]
    for r in rows:
        budgets = r.get("budgets", "uniform") + (", per head" if r.get("allocate") == "heads" else "")
        cells = [f"{r['L']:,}", budgets, str(r["texts"]), f"{r['full']:.1%}"]
        cells += [f"{r[m][str(share)]:.1%}" for m in methods for share in keep]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--texts", type=int, default=128)
    parser.add_argument("--keep", type=float, nargs="+", default=[0.5, 0.25])
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), help=f"among {METHODS + ('knorm',)}")
    parser.add_argument("--budgets", nargs="+", default=["uniform"], choices=["uniform", "pyramid"])
    parser.add_argument("--allocate", nargs="+", default=["sequence"], choices=["sequence", "heads"])
    parser.add_argument("--out", type=Path, default=RESULTS / "kv_compress.json")
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    model = RecallLM.from_package().eval()
    rows = []
    methods = tuple(args.methods)
    for length in args.lengths:
        for budgets, allocate in [(b, a) for b in args.budgets for a in args.allocate]:
            start = time.perf_counter()
            batch = max(1, min(16, 65536 // length))
            print(
                f"L={length}, {budgets} budgets ({allocate}): {args.texts} texts in batches of {batch}, "
                f"{len(methods)} methods x {len(args.keep)} shares ...",
                flush=True,
            )
            found = compressed_recall(
                model, length, keep=args.keep, methods=methods, n=args.texts, seed=args.seed, batch_size=batch,
                budgets=budgets, allocate=allocate,
            )  # fmt: skip
            row = {"L": length, "budgets": budgets, "allocate": allocate, "texts": args.texts, "full": found["full"]}
            row.update({m: {str(share): acc for share, acc in found[m].items()} for m in methods})
            row["seconds"] = round(time.perf_counter() - start, 1)
            rows.append(row)
            print(json.dumps(row), flush=True)
    result = {
        "machine": machine.describe(),
        "command": "python benchmarks/kv_compress.py "
        + " ".join(["--lengths", *map(str, args.lengths), "--texts", str(args.texts), "--keep", *map(str, args.keep)])
        + (" --methods " + " ".join(methods) if methods != METHODS else "")
        + (" --budgets " + " ".join(args.budgets) if args.budgets != ["uniform"] else "")
        + (" --allocate " + " ".join(args.allocate) if args.allocate != ["sequence"] else ""),
        "methods": list(methods),
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(table(rows, args.keep, methods))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
