"""Attribution patching (AtP) against activation patching on the shipped RecallLM.

    python benchmarks/atp.py [--lengths 256 4096] [--texts 8]

RecallLM answers ``? k`` with the value stored after ``k`` earlier in the text. For each text,
the clean input asks about a stored pair; the corrupt input is the same text with that pair's
value replaced; the metric is the clean answer's logit minus the corrupt answer's at the last
position. ``head_effects(method="patch")`` measures every head's effect (a forward per head);
``method="atp"`` estimates it from one clean forward, one corrupt forward and one backward.
Per length: the effects of both summed over the texts, their rank correlation, whether the
heads each ranks first agree, and the time of each. Writes ``benchmarks/results/atp.json``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import machine  # benchmarks/machine.py
import torch

from attnkit.inspect import head_effects
from attnkit.models.recall import RecallLM, make_batch

RESULTS = Path(__file__).parent / "results"


def pair_texts(model: RecallLM, length: int, count: int, seed: int = 0):
    """``count`` (clean, corrupt, right, wrong) texts ending with ``? key``: the corrupt text stores
    another value for that key."""
    g = torch.Generator().manual_seed(seed + length)
    tokens, targets = make_batch(count, length, pairs=8, queries=1, task=model.task, generator=g, depth=0.3)
    asked = (targets != -100).nonzero()  # (row, position of the key after "?")
    out = []
    for row, at in asked.tolist():
        clean = tokens[row, : at + 1].clone()
        key, right = int(clean[at]), int(targets[row, at])
        stored = (clean[: at - 1] == key).nonzero().flatten()[0]  # the pair's key
        wrong = model.task.first_value + (right - model.task.first_value + 1 + row) % model.task.num_values
        corrupt = clean.clone()
        corrupt[stored + 1] = wrong
        out.append((clean[None], corrupt[None], right, wrong))
    return out


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    ra, rb = a.flatten().argsort().argsort().double(), b.flatten().argsort().argsort().double()
    return float(torch.corrcoef(torch.stack([ra, rb]))[0, 1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 4096])
    parser.add_argument("--texts", type=int, default=8)
    parser.add_argument("--out", type=Path, default=RESULTS / "atp.json")
    args = parser.parse_args()
    model = RecallLM.from_package().eval()
    rows = []
    for length in args.lengths:
        patch = atp = None
        seconds = {"patch": 0.0, "atp": 0.0}
        for clean, corrupt, right, wrong in pair_texts(model, length, args.texts):

            def metric(logits, right=right, wrong=wrong):
                return logits[0, -1, right] - logits[0, -1, wrong]

            got = {}
            for method in ("patch", "atp"):
                start = time.perf_counter()
                effects = head_effects(model, clean, corrupt, metric, method=method)
                seconds[method] += time.perf_counter() - start
                got[method] = effects.values - effects.corrupt
            patch = got["patch"] if patch is None else patch + got["patch"]
            atp = got["atp"] if atp is None else atp + got["atp"]
        assert patch is not None and atp is not None
        top = 3
        first_patch = set(patch.abs().flatten().topk(top).indices.tolist())
        first_atp = set(atp.abs().flatten().topk(top).indices.tolist())
        heads = patch.shape[1]
        rows.append(
            {
                "length": length,
                "texts": args.texts,
                "patch": patch.tolist(),
                "atp": atp.tolist(),
                "spearman": spearman(patch, atp),
                "top3_shared": len(first_patch & first_atp),
                "top3_patch": [f"L{i // heads}H{i % heads}" for i in sorted(first_patch)],
                "top3_atp": [f"L{i // heads}H{i % heads}" for i in sorted(first_atp)],
                "seconds_patch": seconds["patch"],
                "seconds_atp": seconds["atp"],
            }
        )
        r = rows[-1]
        print(
            f"L={length}: spearman {r['spearman']:.3f}, top-3 shared {r['top3_shared']}/3 "
            f"(patch {r['top3_patch']}, atp {r['top3_atp']}), patch {r['seconds_patch']:.1f} s, "
            f"atp {r['seconds_atp']:.1f} s"
        )
        for name in ("patch", "atp"):
            table = torch.tensor(r[name])
            print(f"  {name:5s}", "  ".join(" ".join(f"{v:+7.2f}" for v in layer) for layer in table.tolist()))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": machine.describe(), "rows": rows}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
