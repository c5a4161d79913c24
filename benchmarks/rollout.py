"""Rollout and gradient attribution against one forward of the model, and their memory per token.

    python benchmarks/rollout.py [--lengths 8192 32768] [--repeats 3] [--grad-max 8192] [--out FILE]

The model: 4 attnkit layers (d_model 256, 8 heads of 32) with residuals, a causal mask and a
vocabulary head, fp32, batch 1. For each length: the median time of one forward, of
``rollout(method="rollout")`` and of ``rollout(method="grad")`` for the last row, and the peak
bytes of the tensors each makes and holds at once (one more run under ``core.PeakTensors``,
exact, not timed), divided by the length. Targets: rollout within 3x a forward, grad within 5x;
memory per token flat from 8k to 32k (linear in L).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import machine  # benchmarks/machine.py
import torch
from core import PeakTensors  # benchmarks/core.py
from torch import nn

import attnkit
from attnkit import masks
from attnkit.inspect import rollout

RESULTS = Path(__file__).parent / "results"
D, H, LAYERS, VOCAB = 256, 8, 4, 512


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList(attnkit.MultiHeadAttention(D, H) for _ in range(LAYERS))
        self.mlps = nn.ModuleList(
            nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D)) for _ in range(LAYERS)
        )
        self.head = nn.Linear(D, VOCAB)

    def forward(self, ids):
        x = self.embed(ids)
        for attention, mlp in zip(self.blocks, self.mlps):
            x = x + attention(x, mask=masks.causal())[0]
            x = x + mlp(x)
        return self.head(x)


def timed(fn, repeats: int) -> tuple[float, float]:
    """(median seconds over ``repeats`` runs after one warm-up, peak MiB of live tensors in one more run)."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    with PeakTensors() as peak:
        fn()
    return statistics.median(times), peak.peak_mb


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--grad-max", type=int, default=8192, help="longest L to time method='grad' at")
    parser.add_argument("--out", type=Path, default=RESULTS / "rollout.json")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = Model().eval()
    rows = []
    for length in args.lengths:
        ids = torch.randint(0, VOCAB, (1, length))

        def forward():
            with torch.no_grad():
                model(ids)

        fwd, fwd_mb = timed(forward, args.repeats)
        roll, roll_mb = timed(lambda: rollout(model, ids, rows=[-1]), args.repeats)
        if length <= args.grad_max:
            grad, grad_mb = timed(lambda: rollout(model, ids, rows=[-1], method="grad"), max(1, args.repeats - 1))
        else:
            grad, grad_mb = float("nan"), float("nan")
        row = {
            "L": length,
            "forward_s": round(fwd, 3),
            "rollout_s": round(roll, 3),
            "grad_s": round(grad, 3),
            "rollout_vs_forward": round(roll / fwd, 2),
            "grad_vs_forward": round(grad / fwd, 2),
            "forward_kb_per_token": round(1024 * fwd_mb / length, 1),
            "rollout_kb_per_token": round(1024 * roll_mb / length, 1),
            "grad_kb_per_token": round(1024 * grad_mb / length, 1),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    result = {"machine": machine.describe(), "model": {"d_model": D, "heads": H, "layers": LAYERS}, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
