"""The core's own speed targets, attnkit beside PyTorch in one process.

    python benchmarks/core.py [--repeats 30] [--out benchmarks/results/core.json]

- ``decode``: one query (B=1, H=8, D=64, fp32) against Lk in {512, 4096} cached keys,
  with a padding mask (3 keys of padding), a causal mask and no mask; SDPA gets the
  equivalent bool mask (none for causal at Lq=1, where it hides nothing). Each sample times
  50 calls in a row.
- ``packed``: B=4, L=4096, H=8, D=64, fp32 forward, each row 8 documents of random
  lengths (its own layout), document & causal; ideal = dense SDPA time x the mean
  fraction of 128 x 64 blocks each row needs.
- ``prepare``: building the block map and plans of a document & causal mask at
  L=16384, against one forward with it.
- ``translator``: greedy decoding of the DateTranslator with its KV cache, tokens/s.

Medians over ``--repeats`` interleaved runs; writes JSON and prints a table of ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
import weakref
from pathlib import Path

import machine  # benchmarks/machine.py
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import attnkit
from attnkit import masks

RESULTS = Path(__file__).parent / "results"


def median_ms(fns: dict, repeats: int) -> dict:
    """Median time of each function in ms, the functions interleaved."""
    for fn in fns.values():
        fn()
        fn()
    times = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - start)
    return {k: 1e3 * statistics.median(v) for k, v in times.items()}


PAGE = 4096


def packed_documents(length: int, count: int = 64, seed: int | None = None):
    """A document & causal mask: ``count`` documents of random lengths (L/16 to 3L/16) packed into ``length``."""
    g = torch.Generator().manual_seed(length if seed is None else seed)
    sizes = torch.randint(length // 16, length // 16 * 3, (count,), generator=g)
    ids = torch.repeat_interleave(torch.arange(count), sizes)[:length]
    return masks.document(ids) & masks.causal()


class PeakRSS:
    """Peak resident memory above the level at entry, sampled by a thread (Linux)."""

    def __enter__(self):
        self.base = self.peak = self._rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    @staticmethod
    def _rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * PAGE

    def _sample(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self._rss())
            time.sleep(0.002)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._rss())

    @property
    def rise_mb(self) -> float:
        return (self.peak - self.base) / 2**20


class PeakTensors(TorchDispatchMode):
    """Peak bytes of the tensors made inside the block and alive at once (exact, unlike
    resident memory, which the allocator keeps after tensors are freed). Views and
    in-place results count with the storage they share; inputs made before it, never."""

    def __enter__(self):
        self.refs: dict[int, int] = {}  # storage address -> live tensors on it
        self.sizes: dict[int, int] = {}
        self.outside: set[int] = set()
        self.now = self.peak = 0
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            key = t.untyped_storage().data_ptr()
            if key in self.outside or (key in given and key not in self.refs):
                self.outside.add(key)  # a view or in-place result of a tensor from outside
                continue
            if key not in self.refs:
                self.refs[key], self.sizes[key] = 0, t.untyped_storage().nbytes()
                self.now += self.sizes[key]
                self.peak = max(self.peak, self.now)
            self.refs[key] += 1
            weakref.finalize(t, self._release, key)
        return out

    def _release(self, key: int) -> None:
        self.refs[key] -= 1
        if self.refs[key] == 0:
            del self.refs[key]
            self.now -= self.sizes.pop(key)

    @property
    def peak_mb(self) -> float:
        return self.peak / 2**20


#: Decoding steps are timed DECODE_BATCH calls at a time (a step takes 50-800 us: one call's
#: time is mostly the timer's and the switch between the two implementations' noise).
DECODE_BATCH = 50


def batched(fn):
    def run():
        for _ in range(DECODE_BATCH):
            fn()

    return run


def decode_rows(repeats: int) -> list[dict]:
    rows = []
    for lk in (512, 4096):
        q, k, v = torch.randn(1, 8, 1, 64), torch.randn(1, 8, lk, 64), torch.randn(1, 8, lk, 64)
        padding = masks.padding(torch.tensor([lk - 3]))
        bool_padding = padding.materialize(1, lk)
        for name, mask, sdpa_mask in (
            ("padding", padding, bool_padding),
            ("causal", masks.causal(), None),
            ("none", None, None),
        ):
            with torch.no_grad():
                t = median_ms(
                    {
                        "attnkit": batched(lambda: attnkit.attention(q, k, v, mask)),
                        "sdpa": batched(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=sdpa_mask)),
                    },
                    repeats,
                )
            t = {key: ms / DECODE_BATCH for key, ms in t.items()}  # per call
            rows.append(
                {
                    "case": f"decode {name}",
                    "L": lk,
                    "attnkit_ms": t["attnkit"],
                    "ref_ms": t["sdpa"],
                    "ref": "sdpa",
                    "kernel": str(attnkit.explain(q, k, v, mask)),
                }
            )
    return rows


def fresh_padding_rows(repeats: int) -> list[dict]:
    """A decoding step as a user writes it: B=4 sequences whose lengths differ, a new
    ``masks.padding(lengths)`` each step (the lengths move every step: no two calls alike); SDPA
    gets the bool mask built from the same lengths each step."""
    rows = []
    for lk in (512, 4096):
        g = torch.Generator().manual_seed(lk)
        q, k, v = (torch.randn(4, 8, n, 64, generator=g) for n in (1, lk, lk))
        base = torch.tensor([lk - 37, lk - 200, lk // 2, lk - 1])
        step = [0]

        def lengths():
            step[0] += 1
            out = base.clone()
            out[0] -= step[0] % 400
            return out

        def ours():
            attnkit.attention(q, k, v, masks.padding(lengths()))

        def theirs():
            mask = torch.arange(lk)[None, None, None, :] < lengths()[:, None, None, None]
            F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

        with torch.no_grad():
            t = median_ms({"attnkit": batched(ours), "sdpa": batched(theirs)}, repeats)
            kernel = str(attnkit.explain(q, k, v, masks.padding(lengths())))
        t = {key: ms / DECODE_BATCH for key, ms in t.items()}
        rows.append(
            {
                "case": "decode B=4, new padding mask each step",
                "L": lk,
                "attnkit_ms": t["attnkit"],
                "ref_ms": t["sdpa"],
                "ref": "sdpa (bool mask from the lengths)",
                "kernel": kernel,
            }
        )
    return rows


def packed_row(repeats: int) -> dict:
    g = torch.Generator().manual_seed(0)
    b, length = 4, 4096
    ids = []
    for _ in range(b):
        cuts = torch.sort(torch.randperm(length - 1, generator=g)[:7] + 1).values
        row = torch.zeros(length, dtype=torch.long)
        row[cuts] = 1
        ids.append(row.cumsum(0))
    mask = masks.document(torch.stack(ids)) & masks.causal()
    q, k, v = (torch.randn(b, 8, length, 64, generator=g) for _ in range(3))
    prepared = attnkit.prepare(mask, length, length)
    with torch.no_grad():
        t = median_ms(
            {
                "attnkit": lambda: attnkit.attention(q, k, v, prepared),
                "dense": lambda: F.scaled_dot_product_attention(q, k, v),
            },
            max(3, repeats // 6),
        )
    ideal = t["dense"] * prepared.kept
    return {
        "case": "packed B=4 (doc & causal)",
        "L": length,
        "attnkit_ms": t["attnkit"],
        "ref_ms": ideal,
        "ref": f"ideal ({prepared.kept:.0%} of blocks)",
        "kernel": str(attnkit.explain(q, k, v, prepared)),
    }


def prepare_row(repeats: int) -> dict:
    length = 16384
    ids = torch.arange(length) // (length // 8)
    q = torch.randn(1, 8, length, 64)
    with torch.no_grad():
        prepare_ms = median_ms({"p": lambda: attnkit.prepare(masks.document(ids) & masks.causal(), length, length)}, 5)[
            "p"
        ]
        prepared = attnkit.prepare(masks.document(ids) & masks.causal(), length, length)
        forward_ms = median_ms({"f": lambda: attnkit.attention(q, q, q, prepared)}, 3)["f"]
    return {
        "case": "prepare doc&causal",
        "L": length,
        "attnkit_ms": prepare_ms,
        "ref_ms": forward_ms,
        "ref": "one forward",
        "kernel": "-",
    }


def translator_row() -> dict:
    from attnkit.models import DateTranslator

    model = DateTranslator.from_package().eval()
    texts = ["25th of March 2019", "2019年3月25日", "Monday, March 25, 2019", "25 MAR 2019"] * 16
    with torch.no_grad():
        source, lengths = model.encode_source(texts)
        model.generate(source, lengths)
        times = []
        for _ in range(5):
            start = time.perf_counter()
            out = model.generate(source, lengths)
            times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    tokens = out.shape[0] * out.shape[1]
    return {
        "case": "DateTranslator greedy decode",
        "L": out.shape[1],
        "attnkit_ms": 1e3 * seconds,
        "ref_ms": None,
        "ref": f"{tokens / seconds:,.0f} tokens/s (batch of {len(texts)})",
        "kernel": "-",
    }


def table(rows) -> str:
    lines = ["| case | L | attnkit ms | compared with | its ms | ratio | kernel |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        ref = f"{r['ref_ms']:.3f}" if r["ref_ms"] else "-"
        ratio = f"{r['attnkit_ms'] / r['ref_ms']:.2f}" if r["ref_ms"] else "-"
        lines.append(
            f"| {r['case']} | {r['L']} | {r['attnkit_ms']:.3f} | {r['ref']} | {ref} | {ratio} | {r['kernel']} |"
        )
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--out", type=Path, default=RESULTS / "core.json")
    args = parser.parse_args()
    rows = decode_rows(args.repeats) + fresh_padding_rows(args.repeats)
    print(table(rows), flush=True)
    rows.append(packed_row(args.repeats))
    rows.append(prepare_row(args.repeats))
    rows.append(translator_row())
    meta = machine.describe()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print()
    print(table(rows))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
