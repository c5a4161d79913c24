"""The block-sparse kernels (native, fused, math: the "tiled" group) on one plan: the oracle around
block boundaries and at any block size, gradients, poison that must not leak, when each of them is
chosen over SDPA, and O(L) memory. Each engine's own tests: test_native.py, test_fused.py,
test_math.py."""

import pytest
import torch
from _oracle import (
    ENGINES,
    assert_oracle,
    gold_and_naive,
    naive_attention,
    pin_engine,
    randn,
    rounding_atol,
    run_engine,
    run_engines,
)

import attnkit
from attnkit import _cache, masks
from attnkit.kernels import blocks as plan_blocks
from attnkit.kernels.native import build as native_build
from attnkit.kernels.native import kernel as native
from attnkit.kernels.runs import tiles

# --- block maps --------------------------------------------------------------------------


# --- the kernel against the oracle ----------------------------------------------------------


def mask_zoo(b, lq, lk):
    ids = torch.sort(torch.randint(0, 4, (b, lq)), dim=-1).values
    cases = [
        None,
        masks.causal(),
        masks.causal(align="top_left"),
        masks.sliding_window(5, 2),
        masks.prefix_lm(max(1, lk // 3)) & masks.causal(),
        masks.prefix_lm(3) | masks.sliding_window(2),  # rows with two runs
        masks.padding(torch.randint(0, lk + 1, (b,))),
        torch.rand(b, 1, lq, lk) > 0.6,
    ]
    if lq == lk:
        cases.append(masks.document(ids) & masks.causal())
        cases.append(masks.document(ids[0]))
    return cases


def dense_of(mask, lq, lk):
    if mask is None or isinstance(mask, torch.Tensor):
        return mask
    return mask.materialize(lq, lk)


SMALL_BLOCKS = [(16, 8), (64, 64), None]  # None: the default sizes


@pytest.mark.parametrize("length", [1, 63, 64, 65, 127, 1025])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_tiled_against_the_oracle_around_block_boundaries(length, dtype):
    b, h = 2, 2
    d = 8 if length > 500 else 16
    q, k, v = (
        randn(b, h, length, d, dtype=dtype),
        randn(b, 1, length, d, dtype=dtype),
        randn(b, 1, length, d, dtype=dtype),
    )
    for mask in mask_zoo(b, length, length):
        dense = dense_of(mask, length, length)
        gold, naive = gold_and_naive(q, k, v, dense)
        for blocks in SMALL_BLOCKS if length <= 127 else [None]:
            prepared = attnkit.prepare(mask, length, length, block_size=blocks)
            for engine, (out, _) in run_engines(q, k, v, prepared, d**-0.5).items():
                assert_oracle(out, gold, naive, what=f"{engine} {mask!r} blocks={blocks}")


@pytest.mark.parametrize("lq,lk", [(1, 130), (130, 1), (70, 200), (200, 70)])
def test_tiled_with_lq_not_lk(lq, lk):
    q, k, v = randn(2, 4, lq, 16), randn(2, 2, lk, 16), randn(2, 2, lk, 24)  # GQA and Dv != D
    for mask in mask_zoo(2, lq, lk):
        gold, naive = gold_and_naive(q, k, v, dense_of(mask, lq, lk))
        assert_oracle(attnkit.attention(q, k, v, mask, kernel="tiled"), gold, naive, what=repr(mask))


def test_log_sum_exp_and_fully_masked_rows_and_blocks():
    q, k, v = (
        randn(1, 2, 100, 8, dtype=torch.float64),
        randn(1, 2, 100, 8, dtype=torch.float64),
        randn(1, 2, 100, 8, dtype=torch.float64),
    )
    ids = torch.tensor([0] * 50 + [1] * 50)
    mask = masks.document(ids) & masks.padding(torch.tensor([40]))  # queries 50.. see nothing
    dense = mask.materialize(100, 100)
    scores = (q @ k.transpose(-1, -2) * 0.3).masked_fill(~dense, float("-inf"))
    for blocks, dtype in (((16, 8), torch.float64), ((32, 8), torch.float32)):
        prepared = attnkit.prepare(mask, 100, 100, block_size=blocks)
        found = run_engines(q.to(dtype), k.to(dtype), v.to(dtype), prepared, 0.3)
        assert len(found) == (
            2 if dtype == torch.float64 else len(run_engines(q.float(), k.float(), v.float(), prepared, 0.3))
        )
        for engine, (out, lse) in found.items():
            atol = 1e-12 if dtype == torch.float64 else 1e-5
            assert torch.allclose(lse.double(), torch.logsumexp(scores, -1), atol=atol), engine
            assert (lse[..., 50:] == float("-inf")).all() and (out[..., 50:, :] == 0).all(), engine
    assert any(not row.runs for row in plan_blocks.groups(prepared)[0].rows)  # whole row blocks are skipped


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("blocks", [(16, 8), None])
def test_tiled_gradients_against_the_oracle(dtype, blocks):
    lq = lk = 97
    q64, k64, v64 = (
        randn(2, 4, lq, 16, dtype=torch.float64),
        randn(2, 2, lk, 16, dtype=torch.float64),
        randn(2, 2, lk, 16, dtype=torch.float64),
    )
    grad = randn(2, 4, lq, 16, dtype=torch.float64)
    ids = torch.sort(torch.randint(0, 3, (2, lq)), -1).values
    for mask in [
        masks.document(ids) & masks.causal(),
        masks.prefix_lm(7) | masks.sliding_window(4),
        masks.padding(torch.tensor([50, 0])),
    ]:
        dense = mask.materialize(lq, lk)
        prepared = attnkit.prepare(mask, lq, lk, block_size=blocks)

        def grads(fn, dt):
            ts = [t.to(dt).detach().requires_grad_(True) for t in (q64, k64, v64)]
            fn(*ts).backward(grad.to(dt))
            return [t.grad for t in ts]

        gold = grads(lambda q, k, v: naive_attention(q, k, v, dense)[0], torch.float64)
        naive = grads(lambda q, k, v: naive_attention(q, k, v, dense)[0], dtype)
        for engine in ENGINES:
            if run_engine(engine, *(t.to(dtype) for t in (q64, k64, v64)), prepared, 0.25) is None:
                continue
            got = grads(lambda q, k, v: run_engine(engine, q, k, v, prepared, 0.25)[0], dtype)
            for name, g, n, o in zip("qkv", gold, naive, got):
                assert torch.isfinite(o).all()
                err = (o.double() - g).abs().max().item()
                bound = (
                    1e-12
                    if dtype == torch.float64
                    else 3 * (n.double() - g).abs().max().item() + rounding_atol(g, dtype)
                )
                assert err <= bound, f"{engine} d{name} {mask!r}: {err:.3e} > {bound:.3e}"


def test_tiled_gradcheck():
    q, k, v = (randn(1, 2, 21, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    mask = masks.prefix_lm(3) | masks.sliding_window(2)
    prepared = attnkit.prepare(mask, 21, 21, block_size=(4, 4))
    for engine in ("fused", "math"):
        assert torch.autograd.gradcheck(lambda q, k, v: run_engine(engine, q, k, v, prepared, 0.5)[0], (q, k, v))


def test_poison_in_skipped_and_partial_blocks_does_not_leak():
    q, k, v = randn(2, 2, 150, 16), randn(2, 2, 150, 16), randn(2, 2, 150, 16)
    mask = masks.padding(torch.tensor([70, 150]))
    clean = attnkit.attention(q, k, v, mask, kernel="tiled")
    k[0, :, 70:] = float("nan")
    v[0, :, 70:] = float("inf")
    assert torch.equal(attnkit.attention(q, k, v, mask, kernel="tiled"), clean)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("engine", ENGINES)
def test_poison_in_keys_and_queries_no_pair_uses_inside_partial_tiles_does_not_leak(engine, bias, monkeypatch, request):
    """Keys no query attends and queries that attend no key, inside partial tiles: junk (NaN,
    inf) there never reaches the output or the gradients, on every engine, with and without a bias."""
    pin_engine(request, engine)
    mask = masks.from_fn(lambda b, h, q, kv: (kv % 3 != 0) & (q % 5 != 0) & (kv <= q + 40))
    extra = {"attn_bias": attnkit.bias.alibi(attnkit.bias.alibi_slopes(2))} if bias else {}
    q, k, v = (randn(1, 2, 300, 16, requires_grad=True) for _ in range(3))
    clean = attnkit.attention(q, k, v, mask, kernel="tiled", **extra)
    (dq, dk, dv) = torch.autograd.grad(clean.sum(), (q, k, v))
    poisoned = [t.detach().clone() for t in (q, k, v)]
    poisoned[1][:, :, ::3] = float("nan")
    poisoned[2][:, :, ::3] = float("inf")
    poisoned[0][:, :, ::5] = float("nan")
    pq, pk, pv = (t.requires_grad_() for t in poisoned)
    out = attnkit.attention(pq, pk, pv, mask, kernel="tiled", **extra)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, clean, atol=1e-6, rtol=1e-5)
    grads = torch.autograd.grad(out.sum(), (pq, pk, pv))
    for got, want in zip(grads, (dq, dk, dv)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_mask_tiles_past_the_cache_bound_are_kept_as_bool_and_never_evaluated_again(monkeypatch):
    """Past the prepared mask's tile budget a tile is kept as its bool form alone (its additive
    form made per call); either way the mask's elements are evaluated once per tile, and heads
    of a group whose tiles agree are kept once."""
    calls = {"n": 0}

    def fn(b, h, q, kv):
        calls["n"] += 1
        return (kv <= q) & (q - kv < 64 + 64 * (h % 2))  # heads 0, 2 agree; heads 1, 3 agree

    dense = masks.from_fn(fn, num_heads=4).materialize(700, 700)
    for limit, dtype, hkv in (
        (64 * 2**20, torch.float32, 4),
        (600_000, torch.float32, 2),
        (600_000, torch.bfloat16, 4),
    ):
        monkeypatch.setattr(_cache, "PLAN_STORE_BYTES", limit)  # room for all; for the bool forms of most
        q, k, v = (randn(1, h, 700, 16, dtype=dtype, requires_grad=True) for h in (4, hkv, hkv))
        prepared = attnkit.prepare(masks.from_fn(fn, num_heads=4), 700, 700)
        first = run_engine("fused", q, k, v, prepared, 0.25)[0]  # the store of evaluated tiles is the walk's
        evaluated = calls["n"]
        second = run_engine("fused", q, k, v, prepared, 0.25)[0]
        assert calls["n"] == evaluated, "a second call evaluated the mask again"
        assert torch.equal(first, second)
        gold, naive = gold_and_naive(q.detach(), k.detach(), v.detach(), dense, scale=0.25)
        assert_oracle(first, gold, naive, what=f"limit {limit}")
        grad = randn(*first.shape, dtype=dtype)
        got = torch.autograd.grad(second, (q, k, v), grad)
        q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
        want = torch.autograd.grad(naive_attention(q64, k64, v64, dense, 0.25)[0], (q64, k64, v64), grad.double())
        for g, w, name in zip(got, want, "qkv"):
            tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
            torch.testing.assert_close(g.double(), w, atol=tol * w.abs().max().item(), rtol=0, msg=f"d{name}")
        held = [t for t in _cache.plan_store(prepared).values() if isinstance(t, tiles.Tile)]
        assert held and all(t.allowed.shape[1] == 1 for t in held), "equal heads kept once"
        compact = [t.cached_additive is None for t in held]
        assert any(compact) == (limit < 2**20)


# --- dropout ---------------------------------------------------------------------------------


# --- dispatch ----------------------------------------------------------------------------


def test_dispatch_choices(monkeypatch, request):
    """Where the native engine does not run (no compiler, ATTNKIT_NATIVE=0): SDPA where PyTorch's
    fused kernel beats the per-run tiled engines."""
    pin_engine(request, "fused")

    def plan(mask, length=2048, dropout_p=0.0, dtype=torch.float32):
        q = torch.empty(1, 2, length, 16, dtype=dtype)
        return attnkit.explain(q, q, q, mask, dropout_p=dropout_p)

    assert str(plan(None)) == "sdpa: no mask"
    assert str(plan(masks.causal())) == "sdpa: is_causal"
    doc = plan(masks.document(torch.arange(2048) // 256))
    assert doc.kernel == "fused" and str(doc) == "fused: 12% of blocks kept, all full"
    assert doc.rejected["native"][0].startswith("not among the kernels of use_kernels(")  # pinned away
    assert plan(masks.sliding_window(128)).kernel == "fused"
    one_length = plan(masks.padding(torch.tensor([1024])))  # every sequence's keys end at 1024: a cut, no mask
    assert one_length.reason == "sdpa: every sequence's keys end at 1024: no mask over the first 1024 keys"
    q2 = torch.empty(2, 2, 2048, 16)
    two_lengths = attnkit.explain(q2, q2, q2, masks.padding(torch.tensor([1024, 2000])))
    by_limit = "sdpa: each sequence's keys end at its own limit: one call per limit over those keys, no mask"
    assert two_lengths.reason == by_limit
    assert plan(torch.ones(2048, 2048, dtype=torch.bool)).reason == "sdpa: the mask hides nothing here"
    dense = plan(torch.rand(2048, 2048) > 0.1)
    assert dense.reason == "sdpa: dense mask" and "100% of blocks kept" in dense.rejected["fused"][0]
    assert plan(masks.causal(), length=64).reason == "sdpa: is_causal"
    assert "is small" in plan(masks.sliding_window(4), length=64).reason
    assert plan(torch.zeros(2048, 2048)).reason == "sdpa: dense mask (additive float mask)"
    assert plan(None, dropout_p=0.1).kernel == "math"
    assert plan(torch.zeros(64, 64), length=64, dropout_p=0.1).kernel == "reference"
    q = torch.empty(1, 2, 0, 16)
    assert attnkit.explain(q, q, q).kernel == "reference"


def test_dispatch_with_the_native_engine(monkeypatch, request):
    """With the native engine: the tiled kernel takes unmasked, causal and masked calls of at least
    NATIVE_MIN_QUERIES query rows (it beats SDPA there) whatever their key length; decoding steps,
    small calls, tensor masks and float64 keep the rules of the PyTorch engines; explain says
    which engine runs."""
    pin_engine(request, "native")

    def plan(mask, b=1, h=2, lq=2048, lk=2048, dtype=torch.float32):
        q, k = torch.empty(b, h, lq, 16, dtype=dtype), torch.empty(b, h, lk, 16, dtype=dtype)
        return attnkit.explain(q, k, k, mask)

    rows = native.MIN_QUERIES
    for mask in (None, masks.causal(), masks.sliding_window(128), masks.padding(torch.tensor([1000]))):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            got = plan(mask, dtype=dtype)
            half = dtype != torch.float32  # bfloat16's products named only for half inputs
            assert got.kernel == "native" and str(got).endswith(native_build.describe(half)), got
            assert ("bfloat16:" in str(got)) == half, got
    assert str(plan(None)) == f"native: no mask, 4096 query rows; {native_build.describe(False)}"
    assert native_build.build_name() in str(plan(None))  # which build runs: the wheel's, or built here
    for lk in (1, 16, 5000):  # the choice for an unmasked call does not depend on Lk
        assert plan(None, h=1, lq=rows, lk=lk).kernel == "native"
        assert plan(None, h=1, lq=rows - 1, lk=lk).kernel == "sdpa"
    assert plan(None, b=rows // 16, h=1, lq=16).kernel == "native"
    assert plan(None, b=rows, h=1, lq=native.MIN_ROWS - 1).kernel == "sdpa"  # decoding steps
    # a decoding step whose causal mask hides nothing: the row path over every key (one run of K/V
    # rows, faster than SDPA's kernel), in float32 and in half precision (its rows widened as read)
    assert "row path" in str(plan(masks.causal(), h=8, lq=1, lk=4096))
    bf16 = str(plan(masks.causal(), h=8, lq=1, lk=4096, dtype=torch.bfloat16))
    assert "row path" in bf16 and "bfloat16 rows widened to float32" in bf16, bf16
    assert plan(None, dtype=torch.float64).kernel == "sdpa"
    # half-precision training: where the engine's bf16 runs on AMX tiles (forward and backward) it
    # takes bf16 unmasked and causal (0.7-0.85x SDPA's time, docs/benchmarks.md); elsewhere unmasked
    # training goes to SDPA, whose backward multiplies in half precision, and causal bf16 to the engine
    # (as it goes where AMX tiles are not); fp16 (no product path of its own) as before
    tiles = "AMX tiles" in native_build.info()
    grad = torch.empty(1, 2, 2048, 16, dtype=torch.bfloat16, requires_grad=True)
    assert attnkit.explain(grad, grad, grad).kernel == ("native" if tiles else "sdpa")
    causal = attnkit.explain(grad, grad, grad, masks.causal())
    assert causal.kernel == "native", causal
    half = grad.detach().half().requires_grad_()
    assert attnkit.explain(half, half, half).kernel == "sdpa"
    assert attnkit.explain(half, half, half, masks.causal()).kernel == ("sdpa" if tiles else "native")
    assert plan(torch.rand(2048, 2048) > 0.1).reason == "sdpa: dense mask"
    window = plan(masks.sliding_window(128), dtype=torch.float64)
    assert window.kernel == "fused" and window.rejected["native"] == ("does not take torch.float64",), window


def test_dispatch_weighs_dtype_and_backward(monkeypatch, request):
    pin_engine(request, "fused")

    def kernel(mask, dtype, grad, batch=1):
        q = torch.empty(batch, 2, 2048, 16, dtype=dtype, requires_grad=grad)
        return attnkit.explain(q, q, q, mask).kernel

    window = masks.sliding_window(1024)  # 42% of the blocks, masked diagonal tiles, no causal square
    assert kernel(window, torch.float32, False) == "fused"
    assert kernel(window, torch.float32, True) == "fused"
    assert kernel(window, torch.bfloat16, True) == "sdpa"  # masked tiles are slow in bf16 backward
    square = masks.prefix_lm(512) & masks.causal()  # causal: one causal square of 2048 rows
    assert kernel(square, torch.bfloat16, True) == "fused"
    padding = masks.padding(torch.tensor([1024, 1500]))  # each sequence's own keys: SDPA over them
    assert kernel(padding, torch.bfloat16, True, batch=2) == "sdpa"
    with torch.no_grad():
        q = torch.empty(1, 2, 2048, 16, dtype=torch.bfloat16, requires_grad=True)
        assert attnkit.explain(q, q, q, window).kernel == "fused"  # no backward under no_grad


# --- memory --------------------------------------------------------------------------------


def test_lse_gradient_through_merged_row_blocks():
    """Row blocks with equal runs are merged for the fused engine; the math engine (taken
    when the lse has a gradient) walks them 128 rows at a time and must not reuse the
    merged block's mask tile."""
    torch.manual_seed(0)
    ids = torch.cat([torch.zeros(100, dtype=torch.long), torch.ones(1000, dtype=torch.long)])
    # 640 queries inside document 1, 256 keys across its start: every row block sees the same partial run
    mask = masks.document(ids, q_offset=300)
    prepared = attnkit.prepare(mask, 640, 256)
    assert any(
        r.q1 - r.q0 > 128 and not all(run.full for run in r.runs) for g in plan_blocks.groups(prepared) for r in g.rows
    )
    q = torch.randn(1, 2, 640, 16, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(1, 2, 256, 16, dtype=torch.float64, requires_grad=True) for _ in range(2))
    grads = []
    for kernel in ("tiled", "reference"):
        out, lse = attnkit.attention(q, k, v, mask, kernel=kernel, return_lse=True)
        grads.append(torch.autograd.grad((out.sum() + lse.sin().sum()), (q, k, v)))
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("lq", [1, 300])
@pytest.mark.parametrize("engine", ["native", "fused"])
def test_padding_of_one_length_runs_sdpa_over_the_kept_keys_exactly(lq, engine, monkeypatch, request):
    """Every sequence's keys ending at the same n: SDPA over the first n keys with no mask (a
    decoding step over a cache with room left; the native engine's key limit where it runs),
    forward and backward against the float64 oracle; junk past n is never read; GQA and
    bfloat16 too."""
    pin_engine(request, engine)
    few = native.few_rows() if engine == "native" else 8  # the row path's size (read from the loaded engine)
    for dtype, hq, hkv in ((torch.float32, 4, 4), (torch.float32, 4, 2), (torch.bfloat16, 4, 1)):
        # the row path takes decoding steps (float32 and bfloat16); SDPA runs them without the engine
        row_path = lq <= few
        expected = "native" if engine == "native" and (lq >= native.MIN_ROWS or row_path) else "sdpa"
        q = randn(2, hq, lq, 16, dtype=dtype, requires_grad=True)
        k, v = (randn(2, hkv, 700, 16, dtype=dtype, requires_grad=True) for _ in range(2))
        mask = masks.padding(torch.tensor([509, 509]))
        assert attnkit.explain(q, k, v, mask).kernel == expected
        with torch.no_grad():
            k[:, :, 509:] = float("nan")  # never read
            v[:, :, 509:] = float("inf")
        out = attnkit.attention(q, k, v, mask)
        kk, vv = (t.detach()[:, :, :509].double() for t in (k, v))
        gold, naive = gold_and_naive(q.detach(), k.detach()[:, :, :509], v.detach()[:, :, :509])
        # lq = 1: eight rows, whose naive error can be a lucky rounding (seen on an Intel Xeon: the
        # row path 1.6e-7, naive 7.5e-8): TESTING.md's floor for small problems
        assert_oracle(out, gold, naive, what=f"{dtype} Hq={hq} Hkv={hkv}", small=lq <= few)
        grad = randn(*out.shape, dtype=dtype)
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad)
        q64, k64, v64 = (t.double().requires_grad_() for t in (q.detach(), kk, vv))
        want = torch.autograd.grad(naive_attention(q64, k64, v64)[0], (q64, k64, v64), grad.double())
        tol = 3e-2 if dtype == torch.bfloat16 else 1e-5
        for got, w in zip((dq, dk[:, :, :509], dv[:, :, :509]), want):
            torch.testing.assert_close(got.double(), w, atol=tol * w.abs().max().item(), rtol=0)
        assert dk[:, :, 509:].eq(0).all() and dv[:, :, 509:].eq(0).all()


# --- causal squares: row blocks that form a causal square run as one is_causal call ---------
