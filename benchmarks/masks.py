"""What a new mask costs to make, against one forward and against torch's ``create_block_mask``.

    python benchmarks/masks.py [--lengths 1024 4096 16384 65536] [--repeats 7]
                               [--torch-max 16384] [--no-compile] [--out benchmarks/results/masks.json]

Every sample makes the mask **new** (new document ids, new lengths, a new predicate object) and
prepares it with :func:`attnkit.prepare` (no cache can answer), then times one forward (and one
forward+backward) of ``B x 8 heads x L x 64`` fp32 with the prepared mask. Rows:

- structured kinds (``causal``, ``sliding_window``, ``prefix_lm``, ``document & causal``,
  ``padding & causal``, ``per-row documents`` of a packed batch, ``sliding | prefix``), B=1 and B=4;
- ``from_fn``: a document & causal predicate written as a FlexAttention ``mask_mod``, beside
  torch's ``create_block_mask`` of the same ``mask_mod`` (eager, and ``_compile=True`` warm; its
  compile time is printed once);
- attention-gym's ``natten`` (2-D neighbourhood) and ``vsa`` (a top-k block map per head), through
  :func:`attnkit.flex.create_block_mask`, beside torch's.

Targets (issue "masks made in milliseconds"): structured kinds at L=4096 <= 5% of a forward
(B=1 and B=4); ``from_fn`` no slower than torch's compiled ``create_block_mask`` and never more
than one forward at L=4096. Medians over ``--repeats`` interleaved samples; writes JSON with the
machine (``lscpu``) and prints the table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import machine  # benchmarks/machine.py
import torch
from core import median_ms  # benchmarks/core.py: interleaved medians

import attnkit
from attnkit import _cache, masks
from attnkit.flex import create_block_mask as attnkit_block_mask

RESULTS = Path(__file__).parent / "results"
H, D = 8, 64


class Fresh:
    """A source of new random parameters: every call a different layout."""

    def __init__(self, seed: int = 0):
        self.g = torch.Generator().manual_seed(seed)

    def documents(self, batch: int, length: int, count: int = 8) -> torch.Tensor:
        """(batch, length) document ids, ``count`` documents of random lengths per row."""
        rows = []
        for _ in range(batch):
            cuts = torch.randperm(length - 1, generator=self.g)[: count - 1].add(1).sort().values
            sizes = torch.diff(torch.cat([torch.tensor([0]), cuts, torch.tensor([length])]))
            rows.append(torch.repeat_interleave(torch.arange(count), sizes))
        return torch.stack(rows)

    def lengths(self, batch: int, length: int) -> torch.Tensor:
        return torch.randint(length // 2, length + 1, (batch,), generator=self.g)

    def integer(self, low: int, high: int) -> int:
        return int(torch.randint(low, high, (1,), generator=self.g))


def structured(fresh: Fresh, batch: int, length: int, count: int) -> dict:
    """Each kind's maker: a new mask object with new parameters every call (the parameters drawn
    beforehand, ``count`` sets a kind, so that drawing them is not timed)."""

    def cycle(draw):
        pool = [draw() for _ in range(count)]
        state = {"i": 0}

        def next_one():
            state["i"] = (state["i"] + 1) % count
            return pool[state["i"]]

        return next_one

    window, prefix = cycle(lambda: fresh.integer(200, 300)), cycle(lambda: fresh.integer(length // 8, length // 4))
    one_row, rows = cycle(lambda: fresh.documents(1, length)[0]), cycle(lambda: fresh.documents(batch, length))
    lengths, short = cycle(lambda: fresh.lengths(batch, length)), cycle(lambda: fresh.integer(64, 512))
    return {
        "causal": lambda: masks.causal(),
        "sliding_window": lambda: masks.sliding_window(window(), 0),
        "prefix_lm": lambda: masks.prefix_lm(prefix()),
        "document & causal": lambda: masks.document(one_row()) & masks.causal(),
        "per-row documents & causal": lambda: masks.document(rows()) & masks.causal(),
        "padding & causal": lambda: masks.padding(lengths()) & masks.causal(),
        "sliding | prefix": lambda: masks.sliding_window(window(), 0) | masks.prefix_lm(short()),
    }


def doc_mask_mod(ids: torch.Tensor):
    """A document & causal ``mask_mod`` as FlexAttention users write it."""

    def document_causal(b, h, q_idx, kv_idx):
        return (ids[q_idx] == ids[kv_idx]) & (q_idx >= kv_idx)

    return document_causal


def _tensors(batch: int, length: int, grad: bool):
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(batch, H, length, D, generator=g, requires_grad=grad) for _ in range(3))
    return q, k, v


def forward_times(batch: int, length: int, prepared, repeats: int) -> tuple[float, float]:
    """(forward ms, forward+backward ms) with a prepared mask."""
    q, k, v = _tensors(batch, length, False)
    qg, kg, vg = _tensors(batch, length, True)

    def fwd():
        with torch.no_grad():
            attnkit.attention(q, k, v, prepared)

    def both():
        attnkit.attention(qg, kg, vg, prepared).sum().backward()

    t = median_ms({"fwd": fwd, "both": both}, max(3, repeats // 2))
    return t["fwd"], t["both"]


def run(args) -> dict:
    fresh = Fresh()
    rows: list[dict] = []
    torch_flex = _torch_flex()
    compiled_once: dict = {}
    for length in args.lengths:
        repeats = args.repeats if length <= 16384 else max(3, args.repeats // 2)
        for batch in (1, 4):
            makers = structured(fresh, batch, length, repeats + 2)
            prepare_ms = median_ms(
                {k: (lambda m=m: attnkit.prepare(m(), length, length)) for k, m in makers.items()}, repeats
            )
            for kind, ms in prepare_ms.items():  # against a forward with a mask of the same kind
                one = attnkit.prepare(makers[kind](), length, length)
                fwd, both = forward_times(batch, length, one, repeats) if length <= args.forward_max else (None, None)
                rows.append(_row("structured", kind, batch, length, ms, fwd, both))
            _flush(rows[-len(prepare_ms) :])
        # from_fn and torch's create_block_mask, B=1, the same predicate
        ids = fresh.documents(1, length)[0]
        cases = {
            "from_fn (attnkit.prepare)": lambda: attnkit.prepare(masks.from_fn(doc_mask_mod(ids)), length, length),
            "from_fn (attnkit.flex.create_block_mask)": lambda: attnkit_block_mask(
                doc_mask_mod(ids), None, None, length, length
            ),
        }
        if torch_flex is not None and length <= args.torch_max:
            cases["torch create_block_mask"] = lambda: torch_flex(
                doc_mask_mod(ids), None, None, length, length, device="cpu"
            )
            if not args.no_compile:
                key = ("compile", length)
                start = time.perf_counter()
                torch_flex(doc_mask_mod(ids), None, None, length, length, device="cpu", _compile=True)
                compiled_once[key] = time.perf_counter() - start
                cases["torch create_block_mask _compile=True"] = lambda: torch_flex(
                    doc_mask_mod(ids), None, None, length, length, device="cpu", _compile=True
                )
        times = median_ms(cases, max(3, repeats // 2))
        rep = attnkit.prepare(masks.from_fn(doc_mask_mod(ids)), length, length)
        fwd, both = forward_times(1, length, rep, repeats) if length <= args.forward_max else (None, None)
        for kind, ms in times.items():
            row = _row("from_fn", kind, 1, length, ms, fwd, both)
            if ("compile", length) in compiled_once and "_compile" in kind:
                row["first_call_s"] = round(compiled_once[("compile", length)], 1)
            rows.append(row)
        _flush(rows[-len(times) :])
        if length <= args.gym_max:
            rows.extend(_gym(length, torch_flex, repeats, args))
    for length in args.gym_lengths:
        rows.extend(_catalogue(length, torch_flex, args))
    return {"machine": machine.describe(), "shape": {"H": H, "D": D, "dtype": "float32"}, "rows": rows}


def _gym(length: int, torch_flex, repeats: int, args) -> list[dict]:
    """attention-gym's natten and VSA, new every call, through attnkit's and torch's create_block_mask."""
    try:
        import attn_gym.masks as gym
    except ImportError:
        print("attention-gym is not installed (pip install attn-gym --no-deps): its rows are skipped", file=sys.stderr)
        return []
    side = int(length**0.5)
    if side * side != length:
        return []
    g = torch.Generator().manual_seed(length)

    def vsa_mod():
        qq, kk = (torch.randn(1, H, length, 16, generator=g) for _ in range(2))
        topk = gym.compute_vsa_topk_indices(qq, kk, tile_numel=64, top_k=max(1, length // 64 // 8))
        return gym.generate_vsa_mask_mod(topk, tile_numel=64)

    out = []
    for name, make, heads in (
        (f"attention-gym natten 2-D (7x7 of {side}x{side})", lambda: gym.generate_natten(side, side, 7, 7), None),
        ("attention-gym vsa (per head, top 1/8 tiles)", vsa_mod, H),
    ):
        made = make()  # the mask_mod; VSA's top-k scoring is the model's, not the mask's cost
        cases = {"attnkit": lambda: attnkit_block_mask(made, 1 if heads else None, heads, length, length)}
        if torch_flex is not None and length <= args.torch_max:
            cases["torch"] = lambda: torch_flex(made, 1 if heads else None, heads, length, length, device="cpu")
        times = median_ms(cases, max(3, repeats // 2))
        bm = attnkit_block_mask(made, 1 if heads else None, heads, length, length)
        prepared = masks.from_block_mask(bm)
        fwd, both = (
            forward_times(1, length, attnkit.prepare(prepared, length, length), repeats)
            if length <= args.forward_max
            else (None, None)
        )
        for who, ms in times.items():
            out.append(_row("attention-gym", f"{name}: {who}", 1, length, ms, fwd, both))
        _flush(out[-len(times) :])
    return out


def _median_after_own(fns: dict, repeats: int) -> dict:
    """Median time of each function in ms, interleaved, each timed call right after an untimed one of
    its own: no case pays for what the one before it left (torch's eager mask frees L x L tensors,
    and the next call meets the allocator's and the caches' state after them)."""
    times = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            fn()
            start = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - start)
    return {k: 1e3 * statistics.median(v) for k, v in times.items()}


def _catalogue(length: int, torch_flex, args) -> list[dict]:
    """Every mask of attention-gym's catalogue (tests/_gym.py) at ``length``: attnkit's
    ``create_block_mask`` with its caches cleared before each call but the predicate's traced program
    (and, in ``attnkit_traced_ms``, that one too: nothing answers from a cache),
    ``torch.compile(create_block_mask)`` (warm: its compile time is recorded)
    and eager (up to ``--gym-eager-max``). Medians of ``--gym-repeats`` interleaved calls, each after
    an untimed call of its own."""
    try:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        from _gym import catalogue  # the catalogue the tests check, at any length
    except ImportError:
        print("attention-gym is not installed (pip install attn-gym): the catalogue is skipped", file=sys.stderr)
        return []
    out = []
    for name, make in catalogue(length).items():
        if args.gym_only and name not in args.gym_only:
            continue
        fn, lq, lk, *lead = make()
        b, h = lead or (None, None)

        def ours(fn=fn, b=b, h=h, lq=lq, lk=lk):
            # every cache attnkit keeps but the predicate's traced program (as torch's compiled code
            # is kept): the mask is made from nothing else
            _cache.clear(keep=(_cache.PROGRAMS,))
            return attnkit_block_mask(fn, b, h, lq, lk)

        def traced(fn=fn, b=b, h=h, lq=lq, lk=lk):
            _cache.clear()  # every cache: the predicate traced again too
            return attnkit_block_mask(fn, b, h, lq, lk)

        cases = {"attnkit": ours, "attnkit traced anew": traced}
        row = {"group": "attention-gym catalogue", "kind": name, "B": b or 1, "H": h or 1, "L": length}
        if torch_flex is not None and not args.no_compile:
            compiled = torch.compile(torch_flex)  # as torch's docs advise (the _compile flag is deprecated)
            start = time.perf_counter()
            try:
                for _ in range(2):  # the second call: a recompile on its guards fails here too, not in the timing
                    compiled(fn, b, h, lq, lk, device="cpu")
            except Exception as err:  # noqa: BLE001 - torch's compiler fails on some masks: said in the row
                row["torch_compiled_error"] = f"{type(err).__name__}: {str(err).strip().splitlines()[0][:120]}"
            else:
                row["torch_compile_s"] = round(time.perf_counter() - start, 1)
                cases["torch compiled"] = lambda fn=fn, b=b, h=h, lq=lq, lk=lk, c=compiled: c(
                    fn, b, h, lq, lk, device="cpu"
                )
        if torch_flex is not None and length <= args.gym_eager_max:
            cases["torch eager"] = lambda fn=fn, b=b, h=h, lq=lq, lk=lk: torch_flex(fn, b, h, lq, lk, device="cpu")
        try:
            times = _median_after_own(cases, args.gym_repeats)
        except Exception as err:  # noqa: BLE001 - torch's compiled function failing late: timed without it
            row["torch_compiled_error"] = f"{type(err).__name__}: {str(err).strip().splitlines()[0][:120]}"
            cases.pop("torch compiled", None)
            times = _median_after_own(cases, args.gym_repeats)
        row["attnkit_ms"] = round(times["attnkit"], 2)
        row["attnkit_traced_ms"] = round(times["attnkit traced anew"], 2)
        for who, key in (("torch compiled", "torch_compiled_ms"), ("torch eager", "torch_eager_ms")):
            if who in times:
                row[key] = round(times[who], 2)
                row[key.replace("_ms", "_over_attnkit")] = round(times[who] / times["attnkit"], 2)
        torch._dynamo.reset()  # each mask's compiled graph is its own: none kept for the next
        out.append(row)
        compiled = eager = "-"
        if "torch_compiled_error" in row:
            compiled = "fails to compile"
        if "torch_compiled_ms" in row:
            compiled = f"{row['torch_compiled_ms']:9.2f} ms ({row['torch_compiled_ms'] / row['attnkit_ms']:5.2f}x)"
        if "torch_eager_ms" in row:
            eager = f"{row['torch_eager_ms']:9.2f} ms"
        ours_ms = row["attnkit_ms"]
        print(
            f"L={length:6d} {name:24s} attnkit {ours_ms:9.2f} ms (traced anew {row['attnkit_traced_ms']:.2f})  "
            f"torch compiled {compiled}  eager {eager}",
            flush=True,
        )
    return out


def _torch_flex():
    try:
        from torch.nn.attention.flex_attention import create_block_mask
    except ImportError:
        return None
    return create_block_mask


def _row(group, kind, batch, length, ms, fwd, both) -> dict:
    row = {"group": group, "kind": kind, "B": batch, "L": length, "prepare_ms": round(ms, 3)}
    if fwd is not None:
        row.update(forward_ms=round(fwd, 2), fwd_bwd_ms=round(both, 2))
        row["share_of_forward"] = round(ms / fwd, 4)
        row["share_of_fwd_bwd"] = round(ms / both, 4)
    return row


def _flush(rows) -> None:
    for r in rows:
        share = f"{100 * r['share_of_forward']:6.1f}%" if "share_of_forward" in r else "     - "
        share2 = f"{100 * r['share_of_fwd_bwd']:6.1f}%" if "share_of_fwd_bwd" in r else "     - "
        print(
            f"L={r['L']:6d} B={r['B']} {r['kind']:48s} {r['prepare_ms']:10.2f} ms  {share} of fwd {share2} of fwd+bwd",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="*", default=[1024, 4096, 16384, 65536])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--torch-max", type=int, default=16384, help="longest L to time torch's create_block_mask at")
    parser.add_argument("--forward-max", type=int, default=16384, help="longest L to time a forward at")
    parser.add_argument("--gym-max", type=int, default=16384)
    parser.add_argument("--gym-lengths", type=int, nargs="*", default=[4096, 16384],
                        help="lengths to time attention-gym's whole catalogue at")  # fmt: skip
    parser.add_argument("--gym-only", nargs="*", default=[], help="only these masks of the catalogue")
    parser.add_argument("--gym-repeats", type=int, default=5)
    parser.add_argument("--gym-eager-max", type=int, default=4096, help="longest L to time torch's eager at")
    parser.add_argument("--no-compile", action="store_true", help="skip torch's _compile=True (minutes to compile)")
    parser.add_argument("--out", type=Path, default=RESULTS / "masks.json")
    args = parser.parse_args()
    print(f"lscpu: {machine.describe()['model']}, threads {torch.get_num_threads()}", flush=True)
    result = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
