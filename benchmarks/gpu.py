"""attnkit's Triton kernel beside SDPA's backends and compiled FlexAttention, on one GPU.

    python benchmarks/gpu.py [--out benchmarks/results/gpu.json]            # CUDA, under 8 minutes on an H200
    TRITON_INTERPRET=1 python benchmarks/gpu.py --interpret                   # toy sizes on the CPU (tested)

B=1, H=16, D=128 (toy: B=1, H=2, D=16, L=128, fp32), for fp16 and bf16, L in {4k, 16k, 64k},
forward and forward+backward, masks: dense (none), causal, document (documents of
random lengths, L/16 on average) & causal, sliding window (1024 left), prefix-LM (L/4)
& causal, ALiBi + causal, softcap (30) + window. For each: milliseconds, TFLOP/s of the
work the mask keeps (4 * B * H * kept pairs * D, x3.5 with the backward pass), the ratio
to the best of the others, and peak memory. Competitors: SDPA with the flash, cuDNN and
memory-efficient backends (is_causal where the mask is causal, a dense bool mask where
the backend takes one) and compiled FlexAttention (``create_block_mask`` and compile time
reported apart, per mask and shape).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import attnkit
from attnkit import bias, masks

RESULTS = Path(__file__).parent / "results"


def make_cases(length: int, heads: int):
    g = torch.Generator().manual_seed(length)
    sizes = torch.randint(length // 32, length // 32 * 3, (64,), generator=g)
    ids = torch.repeat_interleave(torch.arange(64), sizes)[:length]
    ids = torch.cat([ids, torch.full((length - len(ids),), 64)]) if len(ids) < length else ids
    window = min(1024, length // 4)
    slopes = bias.alibi_slopes(heads)
    return {
        "dense": (None, {}),
        "causal": (masks.causal(), {}),
        "document": (masks.document(ids) & masks.causal(), {}),
        "window": (masks.sliding_window(window), {}),
        "prefix": (masks.prefix_lm(length // 4), {}),
        "alibi+causal": (masks.causal(), {"attn_bias": bias.alibi(slopes, causal=True)}),
        "softcap+window": (masks.sliding_window(window), {"softcap": 30.0}),
    }


def timer(device):
    if device.type == "cuda":

        def run(fn, repeats):
            fn()
            torch.cuda.synchronize()
            times = []
            for _ in range(repeats):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
            return statistics.median(times)
    else:

        def run(fn, repeats):
            fn()
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                fn()
                times.append(1e3 * (time.perf_counter() - start))
            return statistics.median(times)

    return run


def kept_pairs(mask, length, batch) -> int:
    if mask is None:
        return batch * length * length
    prepared = attnkit.prepare(mask, length, length, block_size=(64, 64))
    return int(prepared.kept * batch * length * length)  # pairs in kept blocks (an upper bound on the work)


def candidates(q, k, v, mask, mods, device):
    """name -> callable(backward) for every competitor that can run this case."""
    out = {}

    def ours(backward):
        o = attnkit.attention(q, k, v, mask, kernel="triton", **mods)
        if backward:
            o.backward(torch.ones_like(o))

    out["attnkit triton"] = ours
    plain = not mods
    dense = None
    if mask is not None and not isinstance(mask, masks._kinds.Causal):
        dense = mask.materialize(q.shape[2], k.shape[2], device=device) if q.shape[2] <= 16384 else "too big"
    bias_dense = None
    if "attn_bias" in mods and q.shape[2] <= 16384:
        bias_dense = mods["attn_bias"].dense(1, q.shape[1], q.shape[2], k.shape[2], device).to(q.dtype)
    if device.type == "cuda":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backends = {
            "flash": SDPBackend.FLASH_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION,
        }
    else:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backends = {"math": SDPBackend.MATH}
    for name, backend in backends.items():
        if (not plain and "attn_bias" not in mods) or isinstance(dense, str):
            continue  # softcap: SDPA has none
        if mods.get("attn_bias") is not None and bias_dense is None:
            continue
        causal = isinstance(mask, masks._kinds.Causal)
        attn_mask = dense
        if bias_dense is not None:
            causal_mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=device).tril()
            attn_mask = bias_dense.masked_fill(~causal_mask, float("-inf"))
            causal = False

        def sdpa(backward, backend=backend, attn_mask=attn_mask, causal=causal):
            with sdpa_kernel(backend):
                o = F.scaled_dot_product_attention(
                    q, k, v, attn_mask=attn_mask, is_causal=causal and attn_mask is None, enable_gqa=True
                )
            if backward:
                o.backward(torch.ones_like(o))

        out[f"sdpa {name}"] = sdpa
    return out


def flex_candidate(q, k, v, mask, mods, length):
    """Compiled FlexAttention (CUDA only): the callable and its set-up seconds, or None."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if mask is not None and not isinstance(
        mask, (masks._kinds.Causal, masks._kinds.SlidingWindow, masks._kinds.PrefixLM, masks._base.Combine)
    ):
        return None
    device = q.device
    start = time.perf_counter()
    if mask is None:
        block = None
    else:
        m = mask
        ids = getattr(getattr(m, "left", None), "ids", None)
        if ids is not None:
            ids = ids.to(device)[0]

            def mask_mod(b, h, qi, ki):  # document & causal
                return (ids[qi] == ids[ki]) & (ki <= qi)
        elif isinstance(m, masks._kinds.Causal):

            def mask_mod(b, h, qi, ki):
                return ki <= qi
        elif isinstance(m, masks._kinds.SlidingWindow):
            left = m.left

            def mask_mod(b, h, qi, ki):
                return (ki <= qi) & (ki >= qi - left)
        elif isinstance(m, masks._kinds.PrefixLM):
            prefix = m.prefix_len

            def mask_mod(b, h, qi, ki):
                return (ki < prefix) | (ki <= qi)
        else:
            return None  # no FlexAttention twin of this mask here
        block = create_block_mask(mask_mod, None, None, length, length, device=device)
    score_mod = None
    if "softcap" in mods:
        cap = mods["softcap"]

        def score_mod(score, b, h, qi, ki):
            return cap * torch.tanh(score / cap)

    if "attn_bias" in mods:
        slopes = mods["attn_bias"].slopes.to(device)

        def score_mod(score, b, h, qi, ki):
            return score + slopes[h] * (ki - qi)

    compiled = torch.compile(flex_attention)

    def flex(backward):
        o = compiled(q, k, v, score_mod=score_mod, block_mask=block, enable_gqa=True)
        if backward:
            o.backward(torch.ones_like(o))

    flex(False)
    flex(True)
    torch.cuda.synchronize()
    return flex, time.perf_counter() - start


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--interpret", action="store_true", help="toy sizes on the CPU under TRITON_INTERPRET=1")
    p.add_argument("--lengths", type=int, nargs="+", default=None)
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--out", type=Path, default=RESULTS / "gpu.json")
    args = p.parse_args()
    if args.interpret:
        device, dtypes, lengths, heads, dim, repeats = torch.device("cpu"), [torch.float32], [128], 2, 16, 1
    else:
        if not torch.cuda.is_available():
            sys.exit("benchmarks/gpu.py needs a CUDA GPU (or --interpret for the CPU smoke run).")
        device, dtypes, lengths, heads, dim, repeats = (
            torch.device("cuda"),
            [torch.bfloat16, torch.float16],
            [4096, 16384, 65536],
            16,
            128,
            5,
        )
    lengths = args.lengths or lengths
    repeats = args.repeats or repeats
    measure = timer(device)
    rows = []
    for dtype in dtypes:
        for length in lengths:
            g = torch.Generator(device="cpu").manual_seed(0)
            q, k, v = (
                torch.randn(1, heads, length, dim, generator=g).to(device, dtype).requires_grad_() for _ in range(3)
            )
            for name, (mask, mods) in make_cases(length, heads).items():
                mods = {key: (val.to(device) if isinstance(val, torch.Tensor) else val) for key, val in mods.items()}
                if "attn_bias" in mods:
                    b = mods["attn_bias"]
                    mods["attn_bias"] = bias.alibi(b.slopes.to(device), causal=b.causal)
                work = 4 * heads * kept_pairs(mask, length, 1) * dim
                fns = candidates(q, k, v, mask, mods, device)
                setup = {}
                if device.type == "cuda":
                    try:
                        found = flex_candidate(q, k, v, mask, mods, length)
                    except Exception as e:  # a compile failure is a result too
                        print(f"flex failed for {name} L={length}: {type(e).__name__}: {str(e)[:200]}", file=sys.stderr)
                        found = None
                    if found is not None:
                        fns["flex (compiled)"], setup["flex (compiled)"] = found
                for backward in (False, True):
                    times = {}
                    for who, fn in fns.items():
                        try:
                            if device.type == "cuda":
                                torch.cuda.reset_peak_memory_stats()
                            times[who] = measure(lambda fn=fn: fn(backward), repeats)
                            mem = torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else None
                        except Exception as e:
                            print(
                                f"{who} failed for {name} L={length}: {type(e).__name__}: {str(e)[:200]}",
                                file=sys.stderr,
                            )
                            continue
                        flops = work * (3.5 if backward else 1.0)
                        rows.append(
                            {
                                "dtype": str(dtype).split(".")[-1],
                                "L": length,
                                "mask": name,
                                "pass": "fwd+bwd" if backward else "fwd",
                                "kernel": who,
                                "ms": times[who],
                                "tflops": flops / times[who] / 1e9,
                                "peak_mb": mem,
                                "setup_s": setup.get(who),
                            }
                        )
                    best_other = min((t for w, t in times.items() if w != "attnkit triton"), default=None)
                    for r in rows[-len(times) :]:
                        r["vs_best_other"] = (
                            None if best_other is None or r["kernel"] != "attnkit triton" else best_other / r["ms"]
                        )
                    print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
                for t in (q, k, v):
                    t.grad = None
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.machine(),
                "torch": torch.__version__,
                "interpret": args.interpret,
                "rows": rows,
            },
            indent=1,
        )
    )
    print(table(rows))


def table(rows) -> str:
    lines = [
        "| dtype | L | mask | pass | kernel | ms | TFLOP/s | triton speed / best other | peak MB | set-up s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = "" if r.get("vs_best_other") is None else f"{r['vs_best_other']:.2f}"
        mem = "" if r["peak_mb"] is None else f"{r['peak_mb']:,.0f}"
        setup = "" if r["setup_s"] is None else f"{r['setup_s']:.1f}"
        lines.append(
            f"| {r['dtype']} | {r['L']} | {r['mask']} | {r['pass']} | {r['kernel']} | {r['ms']:.2f} "
            f"| {r['tflops']:.3f} | {ratio} | {mem} | {setup} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
