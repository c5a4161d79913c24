"""Ring attention on this machine: 2 processes x 1 thread against 1 process x 2 threads.

    python benchmarks/distributed.py [--lengths 8192 32768] [--repeats 3] [--out benchmarks/results/distributed.json]

B=1, H=8, D=64, fp32, causal and document & causal masks (documents of random lengths,
~1/8 of the sequence each). For each length and mask:

- ``1 proc``: ``attnkit.attention`` and PyTorch's SDPA (``is_causal=True``, or the dense
  bool mask where it fits) in one process with 2 threads;
- ``ring``: ``attnkit.distributed.ring_attention`` (zigzag) on 2 gloo processes with
  1 thread each; time is the slowest rank's median.

Forward and forward+backward times (medians over ``--repeats``), the per-rank peak
memory during the call: the bytes of tensors made by the call and alive at once
(counted exactly in one more, untimed run; see ``core.PeakTensors``) and the rise of
resident memory (sampled every 2 ms, from a baseline holding the inputs; the allocator
keeps freed memory, so it is noisy), the bytes each rank sends (forward), and the work balance of zigzag against
contiguous from :func:`attnkit.distributed.explain`. A second table gives the error of
ring attention against the float64 reference by world size (1-4), fp32, L=1024.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import core
import torch
import torch.nn.functional as F
from core import PeakRSS, PeakTensors

import attnkit
from attnkit import distributed as D
from attnkit import masks
from attnkit.distributed.local import run_local

RESULTS = Path(__file__).parent / "results"
B, H, DH = 1, 8, 64


def make_mask(kind: str, length: int):
    return masks.causal() if kind == "causal" else core.packed_documents(length)


def inputs(length: int):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(B, H, length, DH, generator=g) for _ in range(4)]  # q, k, v, dout


def _timed(fn, repeats: int, backward: bool):
    """(median ms, largest resident-memory rise in MB, peak MB of live tensors made in the call)."""
    times, peaks = [], []
    for _ in range(repeats + 1):  # the first run warms up
        with PeakRSS() as mem:
            start = time.perf_counter()
            fn(backward)
            times.append(time.perf_counter() - start)
        peaks.append(mem.rise_mb)
    with PeakTensors() as live:  # one more run, untimed: the tracking costs time
        fn(backward)
    return 1e3 * statistics.median(times[1:]), max(peaks[1:]), live.peak_mb


def single(rank, world, length, kind, repeats):
    q, k, v, dout = inputs(length)
    mask = make_mask(kind, length)

    def ours(backward):
        qq, kk, vv = (t.requires_grad_(backward) for t in (q, k, v))
        with torch.set_grad_enabled(backward):
            out = attnkit.attention(qq, kk, vv, mask)
            if backward:
                out.backward(dout)
                for t in (qq, kk, vv):
                    t.grad = None

    dense = None if kind == "causal" or length > 8192 else mask.materialize(length, length)

    def sdpa(backward):
        qq, kk, vv = (t.requires_grad_(backward) for t in (q, k, v))
        with torch.set_grad_enabled(backward):
            out = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=dense, is_causal=dense is None)
            if backward:
                out.backward(dout)
                for t in (qq, kk, vv):
                    t.grad = None

    row = {}
    for name, fn in (("attnkit", ours), ("sdpa", sdpa)):
        if name == "sdpa" and kind != "causal" and dense is None:
            continue
        for backward in (False, True):
            row[f"{name}_{'fwdbwd' if backward else 'fwd'}"] = _timed(fn, repeats, backward)
    return row


def ring(rank, world, length, kind, repeats, layout):
    q, k, v, dout = inputs(length)
    mask = make_mask(kind, length)
    q, k, v, dout = (D.shard(t, 2, layout)[0].clone() for t in (q, k, v, dout))

    def run(backward):
        qq, kk, vv = (t.requires_grad_(backward) for t in (q, k, v))
        with torch.set_grad_enabled(backward):
            out = D.ring_attention(qq, kk, vv, mask, layout=layout)
            if backward:
                out.backward(dout)
                for t in (qq, kk, vv):
                    t.grad = None

    return {f"ring_{'fwdbwd' if b else 'fwd'}": _timed(run, repeats, b) for b in (False, True)}


def accuracy(rank, world, length):
    """Max |ring - float64 reference| of the output and gradients, fp32 inputs."""
    out = {}
    for kind in ("causal", "document"):
        q, k, v, dout = inputs(length)
        mask = make_mask(kind, length)
        parts = [D.shard(t, 2)[0].clone().requires_grad_() for t in (q, k, v)]
        o = D.ring_attention(*parts, mask)
        o.backward(D.shard(dout, 2)[0])
        got = [D.unshard(t, 2) for t in (o.detach(), *(p.grad for p in parts))]
        out[kind] = got
    return out


def accuracy_rows(length: int) -> list[dict]:
    rows = []
    refs = {}
    for kind in ("causal", "document"):
        q, k, v, dout = (t.double() for t in inputs(length))
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        o = attnkit.attention(q, k, v, make_mask(kind, length), kernel="reference")
        o.backward(dout)
        refs[kind] = [o.detach(), q.grad, k.grad, v.grad]
    for world in (1, 2, 3, 4):
        got = run_local(accuracy, world, (length,), timeout=600)[0]
        for kind in ("causal", "document"):
            errs = [(a.double() - b).abs().max().item() for a, b in zip(got[kind], refs[kind])]
            rows.append({"world": world, "mask": kind, "out": errs[0], "dq": errs[1], "dk": errs[2], "dv": errs[3]})
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=RESULTS / "distributed.json")
    args = p.parse_args()
    rows = []
    for length in args.lengths:
        for kind in ("causal", "document"):
            print(f"L={length} {kind}...", file=sys.stderr, flush=True)
            one = run_local(single, 1, (length, kind, args.repeats), threads=2, timeout=3600)[0]
            two = run_local(ring, 2, (length, kind, args.repeats, "zigzag"), threads=1, timeout=3600)
            mask = make_mask(kind, length)
            plans = {lay: D.explain(mask, length, world_size=2, layout=lay) for lay in ("zigzag", "contiguous")}
            row = {"L": length, "mask": kind, **{k: v[0] for k, v in one.items()}}
            row.update({f"{k}_mem_mb": v[1] for k, v in one.items()})
            row.update({f"{k}_tensors_mb": v[2] for k, v in one.items()})
            for name in ("ring_fwd", "ring_fwdbwd"):
                row[name] = max(r[name][0] for r in two)
                row[f"{name}_mem_mb"] = [r[name][1] for r in two]
                row[f"{name}_tensors_mb"] = [r[name][2] for r in two]
            row["sent_mb"] = [plans["zigzag"].bytes_sent(r, B, H, DH) / 2**20 for r in range(2)]
            row["balance_zigzag"] = plans["zigzag"].balance
            row["balance_contiguous"] = plans["contiguous"].balance
            row["work_share"] = [w / plans["zigzag"].dense_work for w in plans["zigzag"].work]
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    acc = accuracy_rows(1024)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "machine": platform.processor() or platform.machine(),
                "torch": torch.__version__,
                "rows": rows,
                "accuracy": acc,
            },
            indent=1,
        )
    )
    print(table(rows))
    print()
    print(accuracy_table(acc))


def table(rows) -> str:
    def ms(x):
        return "-" if x is None else f"{x:,.0f}"

    lines = [
        "| L | mask | attnkit 1x2 fwd / fwd+bwd (ms) | SDPA 1x2 fwd / fwd+bwd | ring 2x1 fwd / fwd+bwd "
        "| ring / attnkit fwd+bwd "
        "| peak tensors MB 1 proc (fwd+bwd) | per rank | RSS rise MB 1 proc | per rank | MB sent per rank (fwd) "
        "| balance zigzag / contiguous |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        sdpa = f"{ms(r.get('sdpa_fwd'))} / {ms(r.get('sdpa_fwdbwd'))}" if "sdpa_fwd" in r else "does not fit"
        lines.append(
            f"| {r['L']} | {r['mask']} | {ms(r['attnkit_fwd'])} / {ms(r['attnkit_fwdbwd'])} | {sdpa} "
            f"| {ms(r['ring_fwd'])} / {ms(r['ring_fwdbwd'])} | {r['ring_fwdbwd'] / r['attnkit_fwdbwd']:.2f} "
            f"| {r['attnkit_fwdbwd_tensors_mb']:.0f} | {' / '.join(f'{m:.0f}' for m in r['ring_fwdbwd_tensors_mb'])} "
            f"| {r['attnkit_fwdbwd_mem_mb']:.0f} | {' / '.join(f'{m:.0f}' for m in r['ring_fwdbwd_mem_mb'])} "
            f"| {' / '.join(f'{m:.1f}' for m in r['sent_mb'])} "
            f"| {r['balance_zigzag']:.2f} / {r['balance_contiguous']:.2f} |"
        )
    return "\n".join(lines)


def accuracy_table(rows) -> str:
    lines = ["| world size | mask | max err out | dq | dk | dv |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['world']} | {r['mask']} | {r['out']:.1e} | {r['dq']:.1e} | {r['dk']:.1e} | {r['dv']:.1e} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
