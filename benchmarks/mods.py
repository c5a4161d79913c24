"""Score modifications (ALiBi, T5 relative bias, soft-capping, sinks) on the CPU, beside PyTorch.

    python benchmarks/mods.py [--length 4096] [--modes fwd fwd+bwd] [--repeats 5] [--no-flex]

Five cases at B=1, H=8, D=64, fp32: ALiBi + causal, relative bias + document (8
documents), softcap + sliding window (256), softcap 50 + causal (Gemma 2's attention
logits), sinks + sliding window (256). For each, interleaved, the median of ``--repeats``
runs of (the baseline's median of at most 3, timed apart):

- ``attnkit``: ``attnkit.attention(q, k, v, mask, attn_bias=..., softcap=..., sinks=...)``;
- ``baseline``: what PyTorch offers eagerly. For the two biases, SDPA given the bias
  as a dense ``(H, L, L)`` float mask (-inf where the mask hides); SDPA has no
  soft-capping and no sinks, so for those the plain formula (matmul, tanh or the
  sink column, softmax, matmul: Gemma 2's and gpt-oss's eager code);
- ``flex``: FlexAttention compiled with ``torch.compile`` for the CPU (score_mod and
  block mask; sinks from its returned log-sum-exp), forward only, compile time apart;
- ``ideal``: dense SDPA (no mask) time x the fraction of 128 x 128 blocks kept, the dense
  SDPA call timed interleaved with the case's own calls (one process's median of the same call
  moves by up to 20% between runs on a shared machine; a ratio of one run does not). attnkit/ideal
  is the median over rounds of the two calls' ratio in each round, ``±`` the half-width of the
  rounds' middle half; every sample is written (``*_samples_ms``).

Writes ``benchmarks/results/mods.json`` (with ``lscpu``'s model and flags) and prints a table
of ratios.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
import machine  # noqa: E402  (benchmarks/machine.py)
from cpu import (  # noqa: E402
    PeakRSS,
    flex_cell,
    ideal_cell,
    ideal_ratio,
    interleaved_medians,
    interleaved_times,
    make_step,
    record_times,
)

import attnkit  # noqa: E402
from attnkit import bias, masks  # noqa: E402

B, H, D = 1, 8, 64
RESULTS = Path(__file__).parent / "results"


def cases(length: int):
    """name -> (mask, attnkit kwargs, dense additive bias or None, softcap, sinks, flex score_mod, flex mask_mod)."""
    doc = length // 8
    slopes = bias.alibi_slopes(H)
    table = 0.5 * torch.randn(32, H)
    sinks = torch.randn(H)
    i = torch.arange(length)[:, None]
    j = torch.arange(length)[None, :]
    buckets = bias.relative_buckets(j - i, 32, 128, True)  # (L, L), for the baselines
    table_t = table.t().contiguous()

    def window(b, h, qi, kj):
        return (kj <= qi) & (qi - kj <= 256)

    return {
        "alibi+causal": (
            masks.causal(),
            {"attn_bias": bias.alibi(slopes, causal=True)},
            (-slopes.view(-1, 1, 1) * (i - j)).masked_fill(j > i, float("-inf")),
            None,
            None,
            lambda s, b, h, qi, kj: s - slopes[h] * (qi - kj),
            lambda b, h, qi, kj: kj <= qi,
        ),
        "relative+document": (
            masks.document(torch.arange(length) // doc),
            {"attn_bias": bias.relative(table)},
            table_t[:, buckets].masked_fill((i // doc) != (j // doc), float("-inf")),
            None,
            None,
            lambda s, b, h, qi, kj: s + table_t[h, buckets[qi, kj]],
            lambda b, h, qi, kj: (qi // doc) == (kj // doc),
        ),
        "softcap+window": (
            masks.sliding_window(256),
            {"softcap": 30.0},
            None,
            30.0,
            None,
            lambda s, b, h, qi, kj: 30.0 * torch.tanh(s / 30.0),
            window,
        ),
        "softcap+causal": (
            masks.causal(),
            {"softcap": 50.0},
            None,
            50.0,
            None,
            lambda s, b, h, qi, kj: 50.0 * torch.tanh(s / 50.0),
            lambda b, h, qi, kj: kj <= qi,
        ),
        "sinks+window": (
            masks.sliding_window(256),
            {"sinks": sinks},
            None,
            None,
            sinks,
            None,
            window,
        ),
    }


def eager_formula(q, k, v, allowed, softcap, sinks):
    """The plain PyTorch formula a model's eager code runs: O(L^2) scores."""
    s = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.view(1, -1, 1, 1).expand(*s.shape[:-1], 1)], dim=-1)
        return torch.softmax(s, dim=-1)[..., :-1] @ v
    return torch.softmax(s, dim=-1) @ v


def run_case(name, length, mode, repeats, use_flex):
    mask, kwargs, dense_bias, softcap, sinks, score_mod, mask_mod = cases(length)[name]
    backward = mode == "fwd+bwd"
    torch.manual_seed(0)
    inputs = [torch.randn(B, H, length, D, requires_grad=backward) for _ in range(3)]
    row = {"case": name, "L": length, "mode": mode}
    impls = {"attnkit": lambda q, k, v: attnkit.attention(q, k, v, mask, **kwargs)}
    if dense_bias is not None:
        row["baseline"] = "sdpa + dense float bias"
        impls["baseline"] = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=dense_bias)
    else:
        allowed = mask.materialize(length, length)
        row["baseline"] = "eager formula"
        impls["baseline"] = lambda q, k, v: eager_formula(q, k, v, allowed, softcap, sinks)
    if use_flex and not backward:
        try:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention

            torch._dynamo.reset()
            compiled = torch.compile(flex_attention)
            block_mask = create_block_mask(mask_mod, None, None, length, length, device="cpu")

            def flex(q, k, v):
                if sinks is None:
                    return compiled(q, k, v, score_mod=score_mod, block_mask=block_mask)
                out, lse = compiled(q, k, v, block_mask=block_mask, return_lse=True)
                return out * torch.sigmoid(lse - sinks.view(-1, 1))[..., None]

            start = time.perf_counter()
            make_step(flex, inputs, backward)()
            row["flex_compile_s"] = time.perf_counter() - start
            impls["flex"] = flex
        except Exception as err:  # a failure is a result: record it
            row["flex_error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
    impls["dense"] = lambda q, k, v: F.scaled_dot_product_attention(q, k, v)  # for the ideal
    steps = {key: make_step(fn, inputs, backward) for key, fn in impls.items()}
    # attnkit, dense SDPA (the ideal) and FlexAttention interleaved; the O(L^2) baseline apart, after
    # them, so that no timed call follows the L x L tensors it allocates and frees
    quick = {key: step for key, step in steps.items() if key != "baseline"}
    samples = interleaved_times(quick, repeats)
    record_times(row, samples)
    row["baseline_ms"] = interleaved_medians({"baseline": steps["baseline"]}, min(repeats, 3))["baseline"]
    for key in ("attnkit", "baseline"):
        with PeakRSS() as peak:
            steps[key]()
        row[f"{key}_peak_mib"] = peak.mib
    q = inputs[0]
    row["kernel"] = str(attnkit.explain(q, q, q, mask, **kwargs))
    row["kept_128"] = attnkit.prepare(mask, length, length, block_size=(128, 128)).kept
    row["ideal_ms"] = row["dense_ms"] * row["kept_128"]
    ideal_ratio(row, samples)
    return row


def ratio(a, b):
    return f"{a / b:.2f}" if a is not None and b else "-"


def table(rows) -> str:
    lines = [
        "| case | mode | attnkit ms | ideal ms | attnkit/ideal | baseline | baseline ms | baseline/attnkit "
        "| flex ms | attnkit/flex | peak MiB attnkit / baseline |",
        "|" + "---|" * 11,
    ]
    for r in rows:
        flex = flex_cell(r)
        lines.append(
            f"| {r['case']} | {r['mode']} | {r['attnkit_ms']:.1f} | {r['ideal_ms']:.1f} | "
            f"{ideal_cell(r)} | {r['baseline']} | {r['baseline_ms']:.1f} | "
            f"{ratio(r['baseline_ms'], r['attnkit_ms'])} | {flex} | {ratio(r['attnkit_ms'], r.get('flex_ms'))} | "
            f"{r['attnkit_peak_mib']:.0f} / {r['baseline_peak_mib']:.0f} |"
        )
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--modes", nargs="+", default=["fwd", "fwd+bwd"], choices=["fwd", "fwd+bwd"])
    parser.add_argument("--cases", nargs="+", default=list(cases(256)), choices=list(cases(256)))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-flex", action="store_true", help="skip compiled FlexAttention")
    parser.add_argument("--out", type=Path, default=RESULTS / "mods.json")
    args = parser.parse_args()
    rows = []
    for mode in args.modes:
        for name in args.cases:
            row = run_case(name, args.length, mode, args.repeats, not args.no_flex)
            rows.append(row)
            print(
                f"{name} {mode}: attnkit {row['attnkit_ms']:.1f} ms, ideal {row['ideal_ms']:.1f} ms "
                f"({ideal_cell(row)}), "
                f"{row['baseline']} {row['baseline_ms']:.1f} ms",
                flush=True,
            )
    print(table(rows))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {**machine.describe(), "shape": {"B": B, "H": H, "D": D}, "repeats": args.repeats}
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
