"""SpeechRecognizer on held-out voices: exact strings, character error rate, monotonic alignments.

    python benchmarks/speech.py [--n 500] [--out benchmarks/results/speech.json]

500 utterances (seed 10,000) of digit strings in the accents en-gb-scotland, en-gb-x-rp,
en-gb-x-gbclan and en-gb-x-gbcwmd with voices m5-m7, f3-f4, none of which were used for
training or model selection; also 300 utterances of the training voices (new texts) for
comparison. The held-out set is decoded twice: greedily, and over the test-time
vocal-tract warps (``TEST_WARPS``, the model's default). Needs espeak-ng. Prints a table
and writes JSON.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from attnkit.models.speech import TEST_VOICES, TEST_WARPS, TRAIN_VOICES, SpeechRecognizer, dataset, evaluate

RESULTS = Path(__file__).parent / "results"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=500)
    p.add_argument("--out", type=Path, default=RESULTS / "speech.json")
    args = p.parse_args()
    model = SpeechRecognizer.from_package()
    rows = []
    held_out = dataset(args.n, TEST_VOICES, 10_000, progress=True)
    for name, items, warps in (
        ("held-out voices, greedy", held_out, (1.0,)),
        (f"held-out voices, warps {TEST_WARPS}", held_out, TEST_WARPS),
        ("training voices, new texts", dataset(300, TRAIN_VOICES, 20_000, progress=True), TEST_WARPS),
    ):
        result = evaluate(model, items, warps)
        rows.append({"set": name, **result})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"rows": rows, "training": model.training_info.get("command")}, indent=1))
    print("| utterances | n | exact strings | character error rate | monotonic alignments |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['set']} | {r['n']} | {r['exact']:.1%} | {r['cer']:.2%} | {r['monotonic']:.1%} |")


if __name__ == "__main__":
    main()
