"""Which PyTorch operations one attnkit call runs: the work a kernel does, without a clock.

    python benchmarks/opstream.py [--cases window prefix document] [--length 4096]
                                  [--dtype float32] [--modes fwd fwd+bwd] [--out FILE]

Times on a shared 2-core machine move by 10-40% between processes; the operations a
call dispatches do not. It runs the tiled kernel's PyTorch engines (the native engine is
turned off: its work is one opaque call, whose operations this cannot see). For each case
this records every ATen operation of one call (after a warm-up call, so plans and mask
tiles are cached) with its input shapes, and counts them. Two trees that dispatch the same
operations on the same shapes do the same arithmetic: run it with ``PYTHONPATH`` on each
tree and compare the JSON files (the summary line counts the fused attention calls and
all operations). Writes ``benchmarks/results/opstream.json``.
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import attnkit
from attnkit import masks

#: Every kernel but the native engine, in the registry's order and with its preferences: the
#: PyTorch engines' operations are what this counts.
WITHOUT_NATIVE = tuple(k for k in attnkit.kernels.PRIORITY if k.name != "native")

B, H, D = 1, 8, 64
RESULTS = Path(__file__).parent / "results"
FUSED = ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward")


def cases(length: int) -> dict[str, masks.Mask]:
    """The masked cases of ``benchmarks/cpu.py``, by name."""
    return {
        "window": masks.sliding_window(256),
        "prefix": masks.prefix_lm(length // 4),
        "document": masks.document(torch.arange(length) // (length // 8)),
        "causal": masks.causal(),
    }


class OpLog(TorchDispatchMode):
    """Counts (operation, input shapes) of everything dispatched inside it."""

    def __init__(self):
        super().__init__()
        self.counts: collections.Counter[tuple[str, str]] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        shapes = [tuple(a.shape) for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        self.counts[(str(func), str(shapes))] += 1
        return func(*args, **kwargs)


def record(mask: masks.Mask, length: int, dtype: torch.dtype, backward: bool) -> OpLog:
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, length, D, dtype=dtype, requires_grad=backward) for _ in range(3))

    def step():
        if backward:
            out = attnkit.attention(q, k, v, mask)
            out.backward(torch.ones_like(out))
        else:
            with torch.no_grad():
                attnkit.attention(q, k, v, mask)

    with attnkit.use_kernels(*WITHOUT_NATIVE, prefer=True):
        step()  # plans and mask tiles are cached from here on
        with OpLog() as log:
            step()
    return log


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=["window", "prefix", "document"])
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--modes", nargs="+", default=["fwd", "fwd+bwd"], choices=["fwd", "fwd+bwd"])
    parser.add_argument("--out", type=Path, default=RESULTS / "opstream.json")
    args = parser.parse_args()
    known = cases(args.length)
    unknown = sorted(set(args.cases) - set(known))
    if unknown:
        parser.error(f"unknown cases {unknown}; choose from {sorted(known)}")
    rows = []
    for name in args.cases:
        for mode in args.modes:
            log = record(known[name], args.length, getattr(torch, args.dtype), mode == "fwd+bwd")
            fused = sum(n for (op, _), n in log.counts.items() if op.split(".")[1] in FUSED)
            total = sum(log.counts.values())
            print(f"{name} {mode}: {fused} fused attention calls, {total} operations, {len(log.counts)} distinct")
            ops = [{"op": op, "shapes": shapes, "count": n} for (op, shapes), n in sorted(log.counts.items())]
            rows.append({"case": name, "mode": mode, "fused_calls": fused, "operations": total, "ops": ops})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"torch": torch.__version__, "length": args.length, "dtype": args.dtype, "shape": {"B": B, "H": H, "D": D}}
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
