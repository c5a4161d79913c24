"""attnkit against PyTorch's own kernels on the CPU, in one process.

    python benchmarks/cpu.py [--lengths 1024 4096 16384] [--dtypes float32 bfloat16]
                             [--modes fwd fwd+bwd] [--repeats 5] [--flex-max-len 4096]
                             [--threads N] [--sdpa-max-len 16384] [--live]

For every case (mask kind x length x dtype x mode) the implementations run
interleaved, ``--repeats`` times each, and the median time is reported:

- ``attnkit``: ``attnkit.attention`` with the mask object (auto dispatch);
- ``sdpa``: ``F.scaled_dot_product_attention`` with no mask (dense), ``is_causal``
  (causal) or the equivalent dense bool mask (every other case);
- ``flex``: ``flex_attention`` compiled with ``torch.compile``, its block mask built
  once; its compile time is reported apart, and a failure is recorded with its error;
- ``ideal``: dense SDPA time x the fraction of 128 x 128 blocks the mask keeps, the dense SDPA
  call timed interleaved with the case's own (``dense_ms``): a ratio of one run, not of two runs
  minutes apart (the dense time alone moved 15.8-19.4 ms over three runs at L=4096 on one machine).
  attnkit/ideal is the median over rounds of the ratio of the two calls of one round, with the
  half-width of the rounds' middle half beside it (``±``): a long dense call slowed by a busy
  neighbour for a whole run moves a ratio of medians, not a ratio of neighbouring calls.
  Every sample is written (``*_samples_ms``).

Peak memory is the largest rise of the process's resident memory during one call,
sampled every 0.5 ms; with ``--live``, also the exact peak bytes of the tensors one attnkit
call makes and holds at once (``core.PeakTensors``: O(L) is what the kernel promises).
Above ``--sdpa-max-len`` SDPA is not run (its dense mask alone is L x L): the ideal is then
the dense SDPA time of the longest length measured in the same run, scaled by (L / L0)^2.
"GFLOP/s kept" is the work of the kept 128 x 128 blocks (4 L^2 D per head forward, 14 with
the backward) over attnkit's time, beside dense SDPA's GFLOP/s. ``--threads`` sets
``torch.set_num_threads``. Writes ``benchmarks/results/cpu.json`` and prints a table of
ratios (attnkit / sdpa, attnkit / ideal, attnkit / flex).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time
from pathlib import Path

import machine  # benchmarks/machine.py
import torch
import torch.nn.functional as F

import attnkit
from attnkit import masks

B, H, D = 1, 8, 64
RESULTS = Path(__file__).parent / "results"


def cases(length: int):
    """name -> (attnkit mask, flex mask_mod or None, what SDPA gets)."""
    doc = length // 8
    ids = torch.arange(length) // doc
    half = length // 2
    return {
        "dense": (None, None, {}),
        "causal": (masks.causal(), lambda b, h, i, j: j <= i, {"is_causal": True}),
        "document": (masks.document(ids), lambda b, h, i, j: (i // doc) == (j // doc), "mask"),
        "document_causal": (
            masks.document(ids) & masks.causal(),  # 8 documents of L/8 tokens, each causal
            lambda b, h, i, j: ((i // doc) == (j // doc)) & (j <= i),
            "mask",
        ),
        "window": (masks.sliding_window(256), lambda b, h, i, j: (j <= i) & (i - j <= 256), "mask"),
        "prefix": (
            masks.prefix_lm(length // 4),  # a bidirectional prefix, causal after it
            lambda b, h, i, j: (j < length // 4) | (j <= i),
            "mask",
        ),
        "padding": (masks.padding(torch.tensor([half] * B)), lambda b, h, i, j: j < half, "mask"),
    }


class PeakRSS:
    """Largest rise of resident memory while the block runs, sampled in a thread."""

    def __init__(self):
        self.page = os.sysconf("SC_PAGE_SIZE")

    def _rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self.page

    def __enter__(self):
        self.base = self.peak = self._rss()
        self.running = True
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self):
        while self.running:
            self.peak = max(self.peak, self._rss())
            time.sleep(0.0005)

    def __exit__(self, *exc):
        self.running = False
        self.thread.join()
        self.peak = max(self.peak, self._rss())

    @property
    def mib(self) -> float:
        return (self.peak - self.base) / 2**20


def make_step(fn, inputs, backward: bool):
    def step():
        if backward:
            for t in inputs:
                t.grad = None
            out = fn(*inputs)
            out.backward(torch.ones_like(out))
        else:
            with torch.no_grad():
                fn(*inputs)

    return step


def timed(step) -> float:
    start = time.perf_counter()
    step()
    return time.perf_counter() - start


def interleaved_times(steps: dict, repeats: int) -> dict[str, list[float]]:
    """``name -> [ms, ...]``: the steps run in turn, one round after another, ``repeats`` rounds,
    after one warm-up call each (plans, caches, one-time costs). Sample ``i`` of every step comes
    from round ``i``: calls seconds apart, not minutes."""
    for step in steps.values():
        step()
    times: dict[str, list[float]] = {key: [] for key in steps}
    for _ in range(repeats):
        for key, step in steps.items():
            times[key].append(1e3 * timed(step))
    return times


def record_times(row: dict, samples: dict[str, list[float]]) -> None:
    """``row["<name>_ms"]``, each step's median, and ``row["<name>_samples_ms"]``, its samples."""
    for key, ms in samples.items():
        row[f"{key}_ms"] = statistics.median(ms)
        row[f"{key}_samples_ms"] = [round(t, 3) for t in ms]


def interleaved_medians(steps: dict, repeats: int) -> dict[str, float]:
    """``name -> median ms`` of :func:`interleaved_times`."""
    return {key: statistics.median(ts) for key, ts in interleaved_times(steps, repeats).items()}


def ideal_ratio(row: dict, samples: dict) -> None:
    """Set ``row["attnkit_ideal"]``, the median over rounds of attnkit's time over the ideal's
    (dense SDPA x the blocks kept) in the same round, and ``row["attnkit_ideal_spread"]``, the
    half-width of the rounds' middle half over that median. A ratio of neighbouring calls
    cancels a slow phase of a shared machine that a ratio of two medians carries into one of
    them; the spread says how far one run can be trusted."""
    row["attnkit_ideal"], row["attnkit_ideal_spread"] = round_ratios(
        samples["attnkit"], [d * row["kept_128"] for d in samples["dense"]]
    )


def round_ratios(times: list[float], others: list[float]) -> tuple[float, float]:
    """The median over rounds of ``times[i] / others[i]`` (two calls of one round) and the half-width
    of the rounds' middle half over it."""
    ratios = sorted(a / b for a, b in zip(times, others))
    q1, mid, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
    return mid, (q3 - q1) / 2 / mid


def flex_cell(row: dict) -> str:
    """The table's FlexAttention column: its time, "failed" or "-"."""
    return f"{row['flex_ms']:.1f}" if "flex_ms" in row else ("failed" if "flex_error" in row else "-")


def flops(length: int, mode: str) -> float:
    """Floating-point operations of dense attention: 4 L^2 D per head forward, 10 more backward."""
    return (4 if mode == "fwd" else 14) * B * H * length * length * D


def run_case(name, length, dtype, mode, repeats, flex_max_len, dense_times, sdpa_max_len=None, live=False):
    mask, mask_mod, sdpa_arg = cases(length)[name]
    backward = mode == "fwd+bwd"
    torch.manual_seed(0)
    inputs = [torch.randn(B, H, length, D, dtype=dtype, requires_grad=backward) for _ in range(3)]
    row = {"case": name, "L": length, "dtype": str(dtype).removeprefix("torch."), "mode": mode}

    impls = {"attnkit": lambda q, k, v: attnkit.attention(q, k, v, mask)}
    too_long = sdpa_max_len is not None and length > sdpa_max_len  # no dense mask: the ideal is extrapolated
    if not too_long and name != "dense":  # the ideal's denominator, interleaved with this case's own calls
        impls["dense"] = lambda q, k, v: F.scaled_dot_product_attention(q, k, v)
    if too_long:
        pass
    elif sdpa_arg == "mask":
        dense_mask = mask.materialize(length, length)
        impls["sdpa"] = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=dense_mask)
    else:
        impls["sdpa"] = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, **sdpa_arg)

    if length <= flex_max_len:
        try:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention

            torch._dynamo.reset()  # a fresh compile per case: past the recompile limit it would run eagerly
            compiled = torch.compile(flex_attention)
            block_mask = None
            if mask_mod is not None:
                block_mask = create_block_mask(mask_mod, None, None, length, length, device="cpu")
            flex = lambda q, k, v: compiled(q, k, v, block_mask=block_mask)  # noqa: E731
            start = time.perf_counter()
            make_step(flex, inputs, backward)()
            row["flex_compile_s"] = time.perf_counter() - start
            impls["flex"] = flex
        except Exception as err:  # a failure is a result: record it, keep going
            row["flex_error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"

    steps = {key: make_step(fn, inputs, backward) for key, fn in impls.items()}
    samples = interleaved_times(steps, repeats)
    record_times(row, samples)
    for key in ("attnkit", "sdpa"):
        if key in steps:
            with PeakRSS() as peak:
                steps[key]()
            row[f"{key}_peak_mib"] = peak.mib
    if live:  # one more call, untimed: tracking every tensor costs time
        from core import PeakTensors

        with PeakTensors() as tensors:
            steps["attnkit"]()
        row["attnkit_live_mib"] = tensors.peak_mb

    q = inputs[0]
    plan = attnkit.explain(q, q, q, mask)
    row["kernel"] = str(plan)
    row["kept_128"] = 1.0 if mask is None else attnkit.prepare(mask, length, length, block_size=(128, 128)).kept
    key = (row["dtype"], mode)
    if name == "dense" and "sdpa_ms" in row:
        dense_times[(length, *key)] = row["sdpa_ms"]
    dense = row.get("dense_ms", dense_times.get((length, *key)))  # this case's own run first
    if dense is None:  # not measured at this length: the longest measured, scaled by (L / L0)^2
        measured = [n for (n, *k) in dense_times if tuple(k) == key]
        if measured:
            base = max(measured)
            dense = dense_times[(base, *key)] * (length / base) ** 2
            row["ideal_from_L"] = base
    if dense is not None:
        row["ideal_ms"] = dense * row["kept_128"]
        if "dense" in samples:
            ideal_ratio(row, samples)
        row["sdpa_dense_gflops"] = flops(length, mode) / dense / 1e6
    row["attnkit_gflops_kept"] = flops(length, mode) * row["kept_128"] / row["attnkit_ms"] / 1e6
    return row


def fmt_ratio(a, b):
    return f"{a / b:.2f}" if a is not None and b else "-"


def ideal_cell(row: dict) -> str:
    """The table's attnkit/ideal column: the median ratio of rounds with its spread, or the ratio
    of the medians where the ideal was not timed beside the case (extrapolated from another L)."""
    if "attnkit_ideal" in row:
        return f"{row['attnkit_ideal']:.2f} ±{100 * row['attnkit_ideal_spread']:.0f}%"
    return fmt_ratio(row["attnkit_ms"], row.get("ideal_ms"))


def table(rows) -> str:
    head = (
        "| case | L | dtype | mode | attnkit ms | sdpa ms | attnkit/sdpa | ideal ms | attnkit/ideal "
        "| GFLOP/s kept / dense SDPA | flex ms | attnkit/flex | peak MiB attnkit / sdpa | live MiB | kernel |"
    )
    lines = [head, "|" + "---|" * 15]
    for r in rows:
        flex = flex_cell(r)
        sdpa = f"{r['sdpa_ms']:.1f}" if "sdpa_ms" in r else "-"
        ideal = f"{r['ideal_ms']:.1f}" + (f" (from L={r['ideal_from_L']})" if "ideal_from_L" in r else "")
        peak = f"{r['attnkit_peak_mib']:.0f} / " + (f"{r['sdpa_peak_mib']:.0f}" if "sdpa_peak_mib" in r else "-")
        live = f"{r['attnkit_live_mib']:.0f}" if "attnkit_live_mib" in r else "-"
        gflops = f"{r['attnkit_gflops_kept']:.0f} / " + (
            f"{r['sdpa_dense_gflops']:.0f}" if "sdpa_dense_gflops" in r else "-"
        )
        lines.append(
            f"| {r['case']} | {r['L']} | {r['dtype']} | {r['mode']} | {r['attnkit_ms']:.1f} | "
            f"{sdpa} | {fmt_ratio(r['attnkit_ms'], r.get('sdpa_ms'))} | "
            f"{ideal if 'ideal_ms' in r else '-'} | {ideal_cell(r)} | {gflops} | "
            f"{flex} | {fmt_ratio(r['attnkit_ms'], r.get('flex_ms'))} | {peak} | {live} | {r['kernel']} |"
        )
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--modes", nargs="+", default=["fwd", "fwd+bwd"], choices=["fwd", "fwd+bwd"])
    parser.add_argument("--cases", nargs="+", default=list(cases(1024)), choices=list(cases(1024)))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--flex-max-len", type=int, default=4096, help="skip FlexAttention above this L")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: PyTorch's)")
    parser.add_argument("--sdpa-max-len", type=int, default=16384, help="skip SDPA (and dense) above this L")
    parser.add_argument("--live", action="store_true", help="also the exact peak bytes of attnkit's live tensors")
    parser.add_argument("--out", type=Path, default=RESULTS / "cpu.json")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    rows, dense_times = [], {}
    names = ["dense"] + [c for c in args.cases if c != "dense"]  # dense first: the ideal needs it
    total = len(args.lengths) * len(args.dtypes) * len(args.modes) * len(names)
    done = 0
    for length in args.lengths:
        for dtype in args.dtypes:
            for mode in args.modes:
                for name in names:
                    done += 1
                    if name == "dense" and length > args.sdpa_max_len and name not in args.cases:
                        continue  # no dense measurement this long: the ideal is extrapolated
                    print(f"[{done}/{total}] {name} L={length} {dtype} {mode}", flush=True)
                    row = run_case(
                        name,
                        length,
                        getattr(torch, dtype),
                        mode,
                        args.repeats,
                        args.flex_max_len,
                        dense_times,
                        args.sdpa_max_len,
                        args.live,
                    )
                    if name in args.cases:
                        rows.append(row)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {**machine.describe(), "shape": {"B": B, "H": H, "D": D}, "repeats": args.repeats}
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print()
    print(table(rows))
    for r in rows:
        if "flex_error" in r:
            print(f"flex failed on {r['case']} L={r['L']} {r['dtype']} {r['mode']}: {r['flex_error']}")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
