"""Compiled training keeps block sparsity: attnkit under torch.compile(fullgraph=True).

    python benchmarks/compile.py [--length 4096] [--repeats 7] [--out benchmarks/results/compile.json]

One training step (forward + backward of ``out.square().sum()``), B=1, H=8, D=64, fp32, a
document & causal mask of 8 documents, 2 threads:

- ``eager tiled``: ``attnkit.attention(q, k, v, prepared)`` without compiling;
- ``compiled tiled``: the same inside ``torch.compile(fullgraph=True)``: the tiled kernel
  runs as custom ops over the PreparedMask (made outside the compiled function);
- ``compiled mask object``: a mask object built inside the compiled function: it becomes
  a dense mask in the graph (SDPA with an Lq x Lk mask);
- ``SDPA dense``: ``scaled_dot_product_attention`` with the dense bool mask, eager.

Reports the median step time, its ratio to eager tiled, the compile time (first call)
and the largest single allocation during a step (profiler, bytes of one tensor).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import attnkit
from attnkit import masks

RESULTS = Path(__file__).parent / "results"


def largest_allocation_mb(fn) -> float:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return max((e.self_cpu_memory_usage for e in prof.events() if e.name != "[memory]"), default=0) / 2**20


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS / "compile.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    length = args.length
    ids = torch.repeat_interleave(torch.arange(8), length // 8)
    mask = masks.document(ids) & masks.causal()
    prepared = attnkit.prepare(mask, length, length)
    dense = prepared.materialize()
    q, k, v = (torch.randn(1, 8, length, 64, requires_grad=True) for _ in range(3))

    def tiled_step(q, k, v, prepared):
        return attnkit.attention(q, k, v, prepared).square().sum()

    def object_step(q, k, v, ids):
        return attnkit.attention(q, k, v, masks.document(ids) & masks.causal()).square().sum()

    compiled_tiled = torch.compile(tiled_step, fullgraph=True)
    compiled_object = torch.compile(object_step, fullgraph=True)
    steps = {
        "eager tiled": lambda: tiled_step(q, k, v, prepared).backward(),
        "compiled tiled": lambda: compiled_tiled(q, k, v, prepared).backward(),
        "compiled mask object": lambda: compiled_object(q, k, v, ids).backward(),
        "SDPA dense": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=dense).square().sum().backward(),
    }
    compile_s = {}
    for name, step in steps.items():
        start = time.perf_counter()
        step()
        compile_s[name] = time.perf_counter() - start
        step()
    times = {name: [] for name in steps}
    for _ in range(args.repeats):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    ms = {name: 1e3 * statistics.median(t) for name, t in times.items()}
    rows = []
    for name, step in steps.items():
        rows.append(
            {
                "case": name,
                "ms": round(ms[name], 2),
                "vs_eager_tiled": round(ms[name] / ms["eager tiled"], 3),
                "first_call_s": round(compile_s[name], 2),
                "largest_allocation_mb": round(largest_allocation_mb(step), 2),
            }
        )
    print(
        f"L={length}, B=1, H=8, D=64, fp32, document & causal (8 documents, {prepared.kept:.0%} of blocks kept), "
        f"{args.threads} threads, medians of {args.repeats}"
    )
    print(f"{'case':<22} {'fwd+bwd ms':>11} {'vs eager tiled':>15} {'first call s':>13} {'largest alloc MB':>17}")
    for r in rows:
        print(
            f"{r['case']:<22} {r['ms']:>11.1f} {r['vs_eager_tiled']:>14.2f}x {r['first_call_s']:>13.1f} "
            f"{r['largest_allocation_mb']:>17.1f}"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "machine": platform.processor() or platform.machine(),
                "torch": torch.__version__,
                "threads": args.threads,
                "length": length,
                "kept": prepared.kept,
                "rows": rows,
            },
            indent=1,
        )
        + "\n"
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
