"""Masks written as predicates, the way FlexAttention users bring them, on the CPU beside SDPA.

    python benchmarks/gym.py [--length 4096] [--modes fwd fwd+bwd] [--repeats 3]
                             [--cases natten ...] [--flex]

The masks of FlexAttention's companion collection (attention-gym), written here from their
published definitions as ``fn(b, h, q_idx, kv_idx) -> bool`` predicates and passed to
``attnkit.masks.from_fn`` (the same function is a FlexAttention ``mask_mod``):

- ``natten``: 2-D neighbourhood attention on a square canvas of ``sqrt(L)`` pixels a side,
  a 13 x 13 kernel whose centre is clamped inside the canvas; tokens in raster order;
- ``natten_tiled``: the same with tokens ordered tile by tile (8 x 8 tiles);
- ``natten_morton``: the same with tokens in Morton (Z-curve) order;
- ``sliding_tile_2d``: sliding tile attention: the canvas cut into 8 x 8 tiles, every
  query of a tile attends the 3 x 3 tiles around its own (the window clamped inside);
- ``sliding_tile_3d``: the same for video: 16 frames of ``sqrt(L)/4`` pixels a side, tiles of
  4 x 4 x 4 (frames x rows x columns), a 3 x 3 x 3 window of tiles;
- ``block_diffusion``: a block-diffusion language model's mask over ``[x_t, x_0]`` (each half
  L/2 tokens, blocks of 64): noisy tokens see their own noisy block and the clean blocks
  before it, clean tokens see clean blocks up to their own;
- ``shared_prefix``: one shared prefix (L/4 tokens) and 6 continuations of it; each
  continuation sees the prefix and itself causally;
- ``topk_blocks``: a block map keeping, per row of 128 x 128 blocks, the diagonal block and
  the 3 other earlier blocks with the largest scores of a random draw, one map for all heads;
- ``topk_blocks_per_head``: the same with a different map per head (8 heads);
- ``per_head_windows``: causal sliding windows of 64, 128, 256, ... keys, one per head.

For each case, interleaved, the median of ``--repeats`` runs of ``attnkit.attention`` with
the mask object, SDPA with the equivalent dense bool mask, and the block ideal (dense SDPA
without a mask x the fraction of 128 x 128 blocks the mask keeps, the mask's own heads
averaged); the time to prepare the mask once (block map and plan: ``attnkit.prepare`` on a
fresh mask object) is reported apart. ``--flex`` adds FlexAttention compiled for the CPU
(forward; compile time apart). Writes ``benchmarks/results/gym.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from cpu import flex_cell, interleaved_medians, make_step, timed  # noqa: E402

import attnkit  # noqa: E402
from attnkit import masks  # noqa: E402

B, H, D = 1, 8, 64
RESULTS = Path(__file__).parent / "results"
Predicate = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _morton_decode(idx: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x, y)`` of Morton codes: x from the even bits, y from the odd bits."""
    x = torch.zeros_like(idx)
    y = torch.zeros_like(idx)
    for bit in range(bits):
        x |= ((idx >> (2 * bit)) & 1) << bit
        y |= ((idx >> (2 * bit + 1)) & 1) << bit
    return x, y


def natten(side: int, kernel: int, order: str = "raster", tile: int = 8) -> Predicate:
    """Neighbourhood attention on a ``side x side`` canvas with a ``kernel x kernel`` window."""
    half = kernel // 2

    def xy(idx):
        if order == "raster":
            return idx % side, idx // side
        if order == "tiled":  # tiles of tile x tile pixels, in raster order, raster inside
            per_row = side // tile
            t, inside = idx // (tile * tile), idx % (tile * tile)
            return (t % per_row) * tile + inside % tile, (t // per_row) * tile + inside // tile
        return _morton_decode(idx, int(math.log2(side)))

    def fn(b, h, q_idx, kv_idx):
        qx, qy = xy(q_idx)
        kx, ky = xy(kv_idx)
        cx = qx.clamp(half, side - 1 - half)  # the window's centre stays inside the canvas
        cy = qy.clamp(half, side - 1 - half)
        return ((cx - kx).abs() <= half) & ((cy - ky).abs() <= half)

    return fn


def sliding_tiles(shape: tuple[int, ...], tile: tuple[int, ...], window: tuple[int, ...]) -> Predicate:
    """Sliding tile attention: tokens in tile order over a canvas of ``shape``; a query's tile
    attends the ``window`` tiles around it (centre clamped so the window stays inside)."""
    grid = [s // t for s, t in zip(shape, tile)]
    per_tile = math.prod(tile)

    def tile_coords(idx):
        t = idx // per_tile
        coords = []
        for g in reversed(grid):
            coords.append(t % g)
            t = t // g
        return coords[::-1]

    def fn(b, h, q_idx, kv_idx):
        keep = None
        for qc, kc, g, w in zip(tile_coords(q_idx), tile_coords(kv_idx), grid, window):
            centre = qc.clamp(w // 2, g - 1 - w // 2)
            near = (centre - kc).abs() <= w // 2
            keep = near if keep is None else keep & near
        return keep

    return fn


def block_diffusion(length: int, block: int) -> Predicate:
    """Over ``[x_t, x_0]`` (``length // 2`` tokens each): block diagonal among the noisy tokens,
    offset block causal from noisy to clean, block causal among the clean tokens."""
    n = length // 2

    def fn(b, h, q_idx, kv_idx):
        q_clean, kv_clean = q_idx >= n, kv_idx >= n
        qb, kb = (q_idx % n) // block, (kv_idx % n) // block
        diagonal = ~q_clean & ~kv_clean & (qb == kb)
        offset_causal = ~q_clean & kv_clean & (kb < qb)
        causal = q_clean & kv_clean & (kb <= qb)
        return diagonal | offset_causal | causal

    return fn


def shared_prefix(length: int, prefix: int, parts: int) -> Predicate:
    """A shared prefix and ``parts`` continuations; each sees the prefix and itself causally."""
    size = -(-(length - prefix) // parts)

    def fn(b, h, q_idx, kv_idx):
        part_q = (q_idx - prefix).clamp(min=0) // size
        part_kv = (kv_idx - prefix).clamp(min=0) // size
        own = (q_idx >= prefix) & (kv_idx >= prefix) & (part_q == part_kv) & (kv_idx <= q_idx)
        return ((kv_idx < prefix) & (kv_idx <= q_idx)) | own  # the prefix: causal, and seen by all

    return fn


def topk_blocks(length: int, heads: int, block: int, k: int, seed: int = 0) -> Predicate:
    """Per head and row of blocks: the diagonal block and the ``k`` earlier blocks of largest
    random score (a learned block selection stands in), causal inside the diagonal block."""
    n = length // block
    g = torch.Generator().manual_seed(seed)
    score = torch.rand(heads, n, n, generator=g)
    earlier = torch.ones(n, n, dtype=torch.bool).tril(-1)
    score = score.masked_fill(~earlier, -1.0)
    chosen = torch.zeros(heads, n, n, dtype=torch.bool)
    top = score.topk(min(k, n - 1), dim=-1).indices
    chosen.scatter_(-1, top, True)
    chosen &= earlier
    chosen |= torch.eye(n, dtype=torch.bool)
    table = chosen  # (heads, n, n)

    def fn(b, h, q_idx, kv_idx):
        return table[h, q_idx // block, kv_idx // block] & (kv_idx <= q_idx)

    return fn


def per_head_windows(heads: int, base: int) -> Predicate:
    sizes = torch.tensor([base * 2 ** (i % 4) for i in range(heads)])

    def fn(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx < sizes[h])

    return fn


def cases(length: int) -> dict[str, tuple[Predicate, int | None]]:
    """name -> (predicate, number of heads it differs by or None)."""
    side = math.isqrt(length)
    if side * side != length or side & (side - 1):
        raise SystemExit(f"--length must be the square of a power of two (4096, 16384), not {length}")
    return {
        "natten": (natten(side, 13), None),
        "natten_tiled": (natten(side, 13, "tiled"), None),
        "natten_morton": (natten(side, 13, "morton"), None),
        "sliding_tile_2d": (sliding_tiles((side, side), (8, 8), (3, 3)), None),
        "sliding_tile_3d": (sliding_tiles((16, side // 4, side // 4), (4, 4, 4), (3, 3, 3)), None),
        "block_diffusion": (block_diffusion(length, 64), None),
        "shared_prefix": (shared_prefix(length, length // 4, 6), None),
        "topk_blocks": (topk_blocks(length, 1, 128, 3), None),
        "topk_blocks_per_head": (topk_blocks(length, H, 128, 3), H),
        "per_head_windows": (per_head_windows(H, 64), H),
    }


def run_case(name, fn, heads, length, mode, repeats, with_flex, dense_ms):
    backward = mode == "fwd+bwd"
    torch.manual_seed(0)
    inputs = [torch.randn(B, H, length, D, requires_grad=backward) for _ in range(3)]
    row = {"case": name, "L": length, "mode": mode}
    start = time.perf_counter()
    mask = masks.from_fn(fn, num_heads=heads)
    prepared = attnkit.prepare(mask, length, length)  # what the first call does, timed alone
    row["prepare_ms"] = 1e3 * (time.perf_counter() - start)
    row["kept_128"] = attnkit.prepare(mask, length, length, block_size=(128, 128)).kept
    dense = mask.materialize(length, length)
    impls = {
        "attnkit": lambda q, k, v: attnkit.attention(q, k, v, prepared),
        "sdpa": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=dense),
    }
    if with_flex and not backward:
        try:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention

            torch._dynamo.reset()
            compiled = torch.compile(flex_attention)
            block_mask = create_block_mask(fn, None, heads, length, length, device="cpu")
            flex = lambda q, k, v: compiled(q, k, v, block_mask=block_mask)  # noqa: E731
            start = time.perf_counter()
            make_step(flex, inputs, backward)()
            row["flex_compile_s"] = time.perf_counter() - start
            impls["flex"] = flex
        except Exception as err:  # a failure is a result
            row["flex_error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
    steps = {key: make_step(impl, inputs, backward) for key, impl in impls.items()}
    for key, ms in interleaved_medians(steps, repeats).items():
        row[f"{key}_ms"] = ms
    row["ideal_ms"] = dense_ms * row["kept_128"]
    row["kernel"] = str(attnkit.explain(inputs[0], inputs[1], inputs[2], prepared))
    return row


def dense_time(length: int, mode: str, repeats: int) -> float:
    backward = mode == "fwd+bwd"
    torch.manual_seed(0)
    inputs = [torch.randn(B, H, length, D, requires_grad=backward) for _ in range(3)]
    step = make_step(F.scaled_dot_product_attention, inputs, backward)
    step()
    return 1e3 * statistics.median(timed(step) for _ in range(repeats))


def table(rows) -> str:
    head = (
        "| case | mode | kept | attnkit ms | sdpa (dense mask) ms | attnkit/sdpa | ideal ms | attnkit/ideal "
        "| prepare ms | prepare / attnkit | flex ms | kernel |"
    )
    lines = [head, "|" + "---|" * 12]
    for r in rows:
        flex = flex_cell(r)
        lines.append(
            f"| {r['case']} | {r['mode']} | {r['kept_128']:.1%} | {r['attnkit_ms']:.1f} | {r['sdpa_ms']:.1f} | "
            f"{r['attnkit_ms'] / r['sdpa_ms']:.2f} | {r['ideal_ms']:.1f} | {r['attnkit_ms'] / r['ideal_ms']:.2f} | "
            f"{r['prepare_ms']:.0f} | {r['prepare_ms'] / r['attnkit_ms']:.0%} | {flex} | {r['kernel']} |"
        )
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--modes", nargs="+", default=["fwd", "fwd+bwd"], choices=["fwd", "fwd+bwd"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cases", nargs="+", default=None, help="a subset of the cases (default: all)")
    parser.add_argument("--flex", action="store_true", help="also FlexAttention compiled for the CPU (forward)")
    parser.add_argument("--out", type=Path, default=RESULTS / "gym.json")
    args = parser.parse_args()
    known = cases(args.length)
    names = args.cases or list(known)
    unknown = sorted(set(names) - set(known))
    if unknown:
        parser.error(f"unknown cases {unknown}; choose from {sorted(known)}")
    for fn, heads in known.values():  # PyTorch's first calls of each operation, not attributed to a case
        attnkit.prepare(masks.from_fn(fn, num_heads=heads), 256, 256)
    rows = []
    for mode in args.modes:
        dense_ms = dense_time(args.length, mode, args.repeats)
        for i, name in enumerate(names, 1):
            print(f"[{mode} {i}/{len(names)}] {name}", flush=True)
            fn, heads = known[name]
            rows.append(run_case(name, fn, heads, args.length, mode, args.repeats, args.flex, dense_ms))
    meta = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(),
        "shape": {"B": B, "H": H, "D": D},
        "repeats": args.repeats,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    print()
    print(table(rows))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
