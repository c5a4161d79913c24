"""The fused kernel (PyTorch's flash CPU op per run of the plan): one call where the plan is SDPA's
causal square or hides nothing, causal squares, the plan its benchmark counts, O(L) memory."""

from __future__ import annotations

import pytest
import torch
import torch.utils._python_dispatch
from _oracle import ENGINES, FusedCalls, MaxNumel, assert_oracle, gold_and_naive, naive_attention, pin_engine, randn

import attnkit
from attnkit import masks
from attnkit.kernels import blocks, sparsity
from attnkit.kernels.runs import fused_engine as fused
from attnkit.kernels.runs import tiles


@pytest.mark.parametrize("offsets", [(0, 0), (37, 37)])
def test_tiled_causal_square_with_equal_offsets_is_one_fused_call_forward_and_backward(offsets, monkeypatch, request):
    from attnkit.kernels.runs import aten as _aten

    pin_engine(request, "fused")
    calls = {"forward": 0, "backward": 0}
    for name in calls:
        real = getattr(_aten, f"flash_{name}")

        def counted(*a, _real=real, _name=name, **kw):
            calls[_name] += 1
            return _real(*a, **kw)

        monkeypatch.setattr(_aten, f"flash_{name}", counted)
    mask = masks.causal(q_offset=offsets[0], kv_offset=offsets[1])
    q, k, v = (randn(2, 3, 300, 16, requires_grad=True) for _ in range(3))
    out, lse = attnkit.attention(q, k, v, mask, kernel="fused", return_lse=True)
    dout = randn(2, 3, 300, 16)
    out.backward(dout)
    assert calls == {"forward": 1, "backward": 1}, calls  # not one call per row block
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    dense = torch.ones(300, 300, dtype=torch.bool).tril()
    gold, _ = naive_attention(q64, k64, v64, dense)
    gold.backward(dout.double())
    for got, want in ((out, gold), (q.grad, q64.grad), (k.grad, k64.grad), (v.grad, v64.grad)):
        torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=1e-4)


def test_long_document_mask_never_allocates_lq_by_lk():
    length = 16384
    q, k, v = (randn(1, 1, length, 16, requires_grad=True) for _ in range(3))
    mask = masks.document(torch.arange(length) // (length // 8))
    assert attnkit.explain(q, k, v, mask).kernel in ("native", "fused")
    with MaxNumel() as seen:
        out = attnkit.attention(q, k, v, mask)
        out.sum().backward()
    assert seen.largest <= length * 256, seen.largest  # one row block of 256 queries
    assert torch.isfinite(q.grad).all()
    # spot check one document against the oracle
    sl = slice(2048, 4096)
    want = naive_attention(
        q[..., sl, :].detach().double(), k[..., sl, :].detach().double(), v[..., sl, :].detach().double()
    )[0]
    assert (out[..., sl, :].detach().double() - want).abs().max() < 1e-5


def planned_fused_calls(mask, length: int, heads: int = 8) -> int:
    """Fused calls of one forward: one per run, and one or two per causal square."""
    plan = attnkit.prepare(mask, length, length, block_size=sparsity.BLOCK_SIZE)
    q = torch.zeros(1, heads, length, 64)
    call = tiles.TileCall(plan, 0.125, 0.0, 0, "fused")
    calls = 0
    for group in blocks.groups(plan):
        sel = tiles.select(group, plan, 1, heads, heads, q.device)
        for step in fused.ENGINE.steps(call, 0, group, sel, q, q):
            calls += 1 + (step.c < step.a) if isinstance(step, blocks.Square) else len(step.runs)
    return calls


def test_opstream_benchmark_counts_one_fused_call_per_run(tmp_path):
    """benchmarks/opstream.py (the clock-free comparison of two trees) sees the kernel's plan:
    one fused call per run (or per causal square and its rectangle) forward, as many backward."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "opstream.json"
    done = subprocess.run(
        [sys.executable, str(root / "benchmarks" / "opstream.py"), "--cases", "window", "prefix", "--length", "1024"]
        + ["--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {(r["case"], r["mode"]): r for r in json.loads(out.read_text())["rows"]}
    for name, mask in (("window", masks.sliding_window(256)), ("prefix", masks.prefix_lm(256))):
        runs = planned_fused_calls(mask, 1024)
        assert runs > 1
        assert rows[(name, "fwd")]["fused_calls"] == runs
        assert rows[(name, "fwd+bwd")]["fused_calls"] == 2 * runs
        assert rows[(name, "fwd+bwd")]["operations"] > rows[(name, "fwd")]["operations"]


SQUARE_CASES = {
    # rows [384, 1200) (the first whole block after a prefix of 300) see keys [0, 384) entirely
    # and themselves causally: a square of 816 + a rectangle
    "prefix_lm": (1200, lambda: masks.prefix_lm(300), 1),
    "prefix_and_causal": (1100, lambda: masks.prefix_lm(256) & masks.causal(), 1),
    # documents of 128 and 896 tokens: the long one is a square of its own (no rectangle)
    "document_causal": (1024, lambda: masks.document(torch.tensor([0] * 128 + [1] * 896)) & masks.causal(), 1),
    # per-sequence prefixes: one square per sequence's group
    "prefix_per_sequence": (1024, lambda: masks.prefix_lm(torch.tensor([128, 256])), 2),
    # a document starting mid-block: its row blocks are not a square (per-run path), still exact
    "unaligned_document": (1000, lambda: masks.document(torch.tensor([0] * 100 + [1] * 900)) & masks.causal(), 0),
}


@pytest.mark.parametrize("name", list(SQUARE_CASES))
def test_causal_squares_are_exact_forward_and_backward(name, monkeypatch, request):
    from attnkit.kernels.runs import aten as _aten

    length, make, squares = SQUARE_CASES[name]
    mask = make()
    q, k, v = (randn(2, 2, length, 16, dtype=torch.float64, requires_grad=True) for _ in range(3))
    calls = FusedCalls(monkeypatch, request)
    prepared = attnkit.prepare(mask, length, length)
    out = attnkit.attention(q, k, v, prepared, kernel="fused")
    dense = prepared.materialize()
    want = naive_attention(q, k, v, dense)[0]
    assert (out - want).abs().max() < 1e-12
    upstream = torch.randn_like(want)
    for got, exp in zip(torch.autograd.grad(out, (q, k, v), upstream), torch.autograd.grad(want, (q, k, v), upstream)):
        assert (got - exp).abs().max() < 1e-10
    if _aten.AVAILABLE:
        found = calls.causal(blocks.SQUARE_MIN_ROWS)
        assert found == 2 * squares, found  # forward and backward


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_causal_squares_within_the_oracle_rule_and_gqa(dtype, engine, monkeypatch, request):
    """A prefix-LM long enough for causal squares (the fused engine), on every engine."""
    pin_engine(request, engine)
    mask = masks.prefix_lm(300)
    for hq, hkv in ((4, 4), (4, 2)):  # grouped heads keep the per-run path
        q = randn(1, hq, 1200, 32, dtype=dtype, requires_grad=True)
        k, v = (randn(1, hkv, 1200, 32, dtype=dtype, requires_grad=True) for _ in range(2))
        dense = mask.materialize(1200, 1200)
        out = attnkit.attention(q, k, v, mask, kernel="tiled")
        gold, naive = gold_and_naive(q, k, v, dense)
        assert_oracle(out, gold, naive, what=f"{dtype} {hq}/{hkv}")
        upstream = torch.randn(out.shape, dtype=torch.float64)
        grads = [torch.autograd.grad(o, (q, k, v), upstream.to(o.dtype)) for o in (out, gold, naive)]
        for name, o, g, n in zip("qkv", *grads):
            assert_oracle(o, g, n, factor=3.0, what=f"d{name} {dtype} {hq}/{hkv}")


def test_squares_and_full_blocks_choose_the_tiled_kernel_like_a_plan_of_full_blocks(monkeypatch, request):
    """A prefix-LM in bf16 with a backward keeps 54% of blocks, past the masked-plan limit (30%),
    but runs as causal squares plus full blocks: auto takes the tiled kernel, says why, and is
    exact. A prefix ending mid-block leaves a partial row block outside the square: the limit holds."""
    pin_engine(request, "fused")  # the limits of the per-run engines (the native one takes every plan)
    n = 2048
    q, k, v = (randn(1, 2, n, 32, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    square = attnkit.explain(q, k, v, masks.prefix_lm(n // 4))
    assert square.kernel == "fused" and "causal squares and full blocks" in str(square), square
    assert attnkit.explain(q, k, v, masks.prefix_lm(n // 4 + 40)).kernel == "sdpa"
    assert attnkit.explain(q, k, v, masks.sliding_window(n // 2, n // 2)).kernel == "sdpa"  # no square
    kv = randn(1, 1, n, 32, dtype=torch.bfloat16, requires_grad=True)
    assert attnkit.explain(q, kv, kv, masks.prefix_lm(n // 4)).kernel == "sdpa"  # GQA: no squares
    out = attnkit.attention(q, k, v, masks.prefix_lm(n // 4))
    dense = masks.prefix_lm(n // 4).materialize(n, n)
    gold, naive = gold_and_naive(q, k, v, dense)
    assert_oracle(out, gold, naive)
    upstream = torch.randn(out.shape, dtype=torch.float64)
    grads = [torch.autograd.grad(o, (q, k, v), upstream.to(o.dtype)) for o in (out, gold, naive)]
    for name, o, g, n_ in zip("qkv", *grads):
        assert_oracle(o, g, n_, factor=3.0, what=f"d{name}")


def test_causal_squares_with_strided_inputs_sinks_and_the_lse(monkeypatch, request):
    """Squares beside the other features: (B, L, H, D) tensors viewed as (B, H, L, D), sinks added
    from the merged lse, return_lse; forward and gradients equal the float64 formula."""
    n, prefix = 1000, 100  # rows [128, 1000): one square of 872 rows
    q, k, v = (randn(2, n, 2, 16, dtype=torch.float64).transpose(1, 2).requires_grad_() for _ in range(3))
    sinks = torch.tensor([0.5, -1.0], dtype=torch.float64)
    calls = FusedCalls(monkeypatch, request)
    out, lse = attnkit.attention(q, k, v, masks.prefix_lm(prefix), kernel="fused", sinks=sinks, return_lse=True)
    allowed = masks.prefix_lm(prefix).materialize(n, n)
    s = (q @ k.transpose(-2, -1) * 16**-0.5).masked_fill(~allowed, float("-inf"))
    s = torch.cat([s, sinks.view(1, 2, 1, 1).expand(2, 2, n, 1)], dim=-1)
    want, want_lse = torch.softmax(s, dim=-1)[..., :n] @ v, torch.logsumexp(s, dim=-1)
    assert (out - want).abs().max() < 1e-12 and (lse - want_lse).abs().max() < 1e-12
    upstream = torch.randn_like(want)
    for got, exp in zip(torch.autograd.grad(out, (q, k, v), upstream), torch.autograd.grad(want, (q, k, v), upstream)):
        assert (got - exp).abs().max() < 1e-10
    from attnkit.kernels.runs import aten as _aten

    if _aten.AVAILABLE:
        # the forward ran the square; the backward of a call with sinks gets the lse's gradient,
        # which the fused engine's backward does not take: the math engine runs it
        assert calls.causal(blocks.SQUARE_MIN_ROWS) == 1
