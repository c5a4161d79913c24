"""DigitCaptioner on the test split: exact captions, word accuracy, alignment.

    python benchmarks/captioner.py [--strips 1000] [--seed 0]

Strips of 2-6 digits drawn from the test split (indices divisible by 5, never used
in training). Alignment: for each correctly named digit, whether the patch with the
largest cross-attention weight (last layer, mean of heads) lies inside that digit's
8 columns. Writes benchmarks/results/captioner.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from attnkit.models import DigitCaptioner
from attnkit.models.captioner import evaluate

RESULTS = Path(__file__).parent / "results"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strips", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS / "captioner.json")
    args = parser.parse_args()
    model = DigitCaptioner.from_package()
    start = time.perf_counter()
    result = evaluate(model, args.strips, seed=args.seed, aligned_strips=args.strips)
    result["seconds"] = round(time.perf_counter() - start, 1)
    result["training"] = getattr(model, "training_info", {})
    print("| measure (test split, strips of 2-6 digits) | value | target |")
    print("|---|---|---|")
    print(f"| exact captions ({args.strips} strips) | {result['exact']:.1%} | >= 95% |")
    print(f"| word accuracy | {result['word_accuracy']:.1%} | >= 98% |")
    print(f"| words whose strongest patch is inside their digit | {result['alignment']:.1%} | >= 90% |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
