"""The block-sparse kernel: block maps, the oracle around block boundaries, gradients,
dropout, dispatch choices and O(L) memory."""

import pytest
import torch
from conftest import (
    ENGINES,
    FusedCalls,
    assert_oracle,
    gold_and_naive,
    naive_attention,
    pin_engine,
    randn,
    rounding_atol,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

import attnkit
from attnkit import masks
from attnkit.kernels import tiled, tiles

# --- block maps --------------------------------------------------------------------------


def check_block_map(mask, lq, lk, bq, bk, exact):
    codes = mask.block_map(lq, lk, bq, bk)
    dense = mask.materialize(lq, lk)
    nq, nk = -(-lq // bq), -(-lk // bk)
    assert codes.shape[-2:] == (nq, nk)
    codes = codes.expand(*torch.broadcast_shapes(codes.shape[:2], dense.shape[:2]), nq, nk)
    dense = dense.expand(*codes.shape[:2], lq, lk)
    for i in range(nq):
        for j in range(nk):
            block = dense[..., i * bq : (i + 1) * bq, j * bk : (j + 1) * bk]
            c = codes[..., i, j]
            empty, full = ~block.flatten(-2).any(-1), block.flatten(-2).all(-1)
            assert not (c == masks.EMPTY)[~empty].any(), f"block ({i}, {j}) called empty"
            assert not (c == masks.FULL)[~full].any(), f"block ({i}, {j}) called full"
            if exact:
                assert torch.equal(c == masks.EMPTY, empty) and torch.equal(c == masks.FULL, full)


def primitive_masks(draw, lq, lk, batch):
    align = draw(st.sampled_from(["bottom_right", "top_left"]))
    kind = draw(st.sampled_from(["causal", "window", "prefix", "padding", "document", "dense", "from_fn"]))
    if kind == "causal":
        return masks.causal(align)
    if kind == "window":
        return masks.sliding_window(draw(st.integers(0, 9)), draw(st.integers(0, 5)), align)
    if kind == "prefix":
        return masks.prefix_lm(draw(st.integers(0, lk)), align)
    if kind == "padding":
        return masks.padding(torch.tensor(draw(st.lists(st.integers(0, lk), min_size=batch, max_size=batch))))
    if kind == "document" and lq == lk:
        ids = draw(st.lists(st.integers(0, 3), min_size=lq, max_size=lq))
        return masks.document(torch.tensor(sorted(ids)))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    if kind == "from_fn":  # a predicate over a random table, per sequence and head (its blocks: all, none, some)
        table = torch.rand(batch, 3, lq, lk, generator=g) > draw(st.sampled_from([0.0, 0.5, 1.0]))
        return masks.from_fn(lambda b, h, q, kv: table[b, h, q, kv], batch_size=batch, num_heads=3)
    return masks.dense(torch.rand(batch, 1, lq, lk, generator=g) > draw(st.sampled_from([0.0, 0.5, 1.0])))


@settings(max_examples=80, deadline=None)
@given(st.data())
def test_block_maps_match_materialized_masks(data):
    lq, lk = data.draw(st.integers(1, 40)), data.draw(st.integers(1, 40))
    bq, bk = data.draw(st.sampled_from([1, 3, 4, 8])), data.draw(st.sampled_from([1, 2, 5, 8]))
    a = primitive_masks(data.draw, lq, lk, 2)
    check_block_map(a, lq, lk, bq, bk, exact=not repr(a).startswith("document("))  # unsorted ids: PARTIAL may be loose
    b = primitive_masks(data.draw, lq, lk, 2)
    check_block_map(a & b, lq, lk, bq, bk, exact=False)
    check_block_map(a | b, lq, lk, bq, bk, exact=False)


def test_document_block_map_is_exact_for_packed_ids():
    ids = torch.tensor([0] * 10 + [1] * 6 + [2] * 16)
    check_block_map(masks.document(ids), 32, 32, 8, 8, exact=True)


def test_block_map_never_materializes_a_matrix():
    with MaxNumel() as seen:
        masks.causal().block_map(100_000, 100_000, 256, 64)
        (masks.document(torch.arange(100_000) // 5000) & masks.sliding_window(300)).block_map(100_000, 100_000, 256, 64)
    assert seen.largest < 1_000_000


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
            out, lse = tiled.attention(q, k, v, prepared, scale=d**-0.5)
            assert_oracle(out, gold, naive, what=f"{mask!r} blocks={blocks}")


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
    prepared = attnkit.prepare(mask, 100, 100, block_size=(16, 8))
    out, lse = tiled.attention(q, k, v, prepared, scale=0.3)
    dense = mask.materialize(100, 100)
    scores = (q @ k.transpose(-1, -2) * 0.3).masked_fill(~dense, float("-inf"))
    assert torch.allclose(lse, torch.logsumexp(scores, -1), atol=1e-12)
    assert (lse[..., 50:] == float("-inf")).all() and (out[..., 50:, :] == 0).all()
    assert any(not row.runs for row in prepared.groups[0].rows)  # whole row blocks are skipped


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
        got = grads(lambda q, k, v: tiled.attention(q, k, v, prepared, scale=0.25)[0], dtype)
        for name, g, n, o in zip("qkv", gold, naive, got):
            assert torch.isfinite(o).all()
            err = (o.double() - g).abs().max().item()
            bound = (
                1e-12 if dtype == torch.float64 else 3 * (n.double() - g).abs().max().item() + rounding_atol(g, dtype)
            )
            assert err <= bound, f"d{name} {mask!r}: {err:.3e} > {bound:.3e}"


def test_tiled_gradcheck():
    q, k, v = (randn(1, 2, 21, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    mask = masks.prefix_lm(3) | masks.sliding_window(2)
    prepared = attnkit.prepare(mask, 21, 21, block_size=(4, 4))
    assert torch.autograd.gradcheck(lambda q, k, v: tiled.attention(q, k, v, prepared, scale=0.5)[0], (q, k, v))


def test_poison_in_skipped_and_partial_blocks_does_not_leak():
    q, k, v = randn(2, 2, 150, 16), randn(2, 2, 150, 16), randn(2, 2, 150, 16)
    mask = masks.padding(torch.tensor([70, 150]))
    clean = attnkit.attention(q, k, v, mask, kernel="tiled")
    k[0, :, 70:] = float("nan")
    v[0, :, 70:] = float("inf")
    assert torch.equal(attnkit.attention(q, k, v, mask, kernel="tiled"), clean)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("engine", ENGINES)
def test_poison_in_keys_and_queries_no_pair_uses_inside_partial_tiles_does_not_leak(engine, bias, monkeypatch):
    """Keys no query attends and queries that attend no key, inside partial tiles: junk (NaN,
    inf) there never reaches the output or the gradients, on every engine, with and without a bias."""
    pin_engine(monkeypatch, engine)
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
    import importlib

    pin_engine(monkeypatch, "fused")  # the cache of evaluated tiles is the PyTorch engines'
    prepare_module = importlib.import_module("attnkit.prepare")  # the module (attnkit.prepare is the function)
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
        monkeypatch.setattr(prepare_module, "TILE_CACHE_BYTES", limit)  # room for all; for the bool forms of most
        q, k, v = (randn(1, h, 700, 16, dtype=dtype, requires_grad=True) for h in (4, hkv, hkv))
        prepared = attnkit.prepare(masks.from_fn(fn, num_heads=4), 700, 700)
        first = tiled.attention(q, k, v, prepared, scale=0.25)[0]
        evaluated = calls["n"]
        second = tiled.attention(q, k, v, prepared, scale=0.25)[0]
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
        held = [t for t in prepared.tiles.tiles.values() if isinstance(t, tiles.Tile)]
        assert held and all(t.allowed.shape[1] == 1 for t in held), "equal heads kept once"
        compact = [t.cached_additive is None for t in held]
        assert any(compact) == (limit < 2**20)


# --- dropout ---------------------------------------------------------------------------------


def test_tiled_dropout_kept_fraction_and_reproducibility():
    p = 0.2
    q, k = randn(2, 4, 300, 8), randn(2, 4, 300, 8)
    v = torch.eye(300).expand(2, 4, 300, 300)
    mask = masks.sliding_window(40)
    torch.manual_seed(5)
    out = attnkit.attention(q, k, v, mask, dropout_p=p, kernel="tiled")
    torch.manual_seed(5)
    assert torch.equal(out, attnkit.attention(q, k, v, mask, dropout_p=p, kernel="tiled"))
    inside = mask.materialize(300, 300).expand_as(out)
    kept = (out[inside] != 0).double().mean().item()
    n = inside.sum().item()
    assert abs(kept - (1 - p)) < 6 * (p * (1 - p) / n) ** 0.5
    assert (out[~inside] == 0).all()


# --- dispatch ----------------------------------------------------------------------------


def test_dispatch_choices(monkeypatch):
    """Where the native engine does not run (no compiler, ATTNKIT_NATIVE=0): SDPA where PyTorch's
    fused kernel beats the per-run tiled engines."""
    pin_engine(monkeypatch, "fused")

    def plan(mask, length=2048, dropout_p=0.0, dtype=torch.float32):
        q = torch.empty(1, 2, length, 16, dtype=dtype)
        return attnkit.explain(q, q, q, mask, dropout_p=dropout_p)

    assert str(plan(None)) == "sdpa: no mask"
    assert str(plan(masks.causal())) == "sdpa: is_causal"
    doc = plan(masks.document(torch.arange(2048) // 256))
    assert doc.kernel == "tiled" and str(doc) == (
        "tiled: 12% of blocks kept, all full; fused engine (native engine turned off by ATTNKIT_NATIVE=0)"
    )
    assert plan(masks.sliding_window(128)).kernel == "tiled"
    one_length = plan(masks.padding(torch.tensor([1024])))  # every sequence's keys end at 1024: a cut, no mask
    assert one_length.reason == "sdpa: every sequence's keys end at 1024: no mask over the first 1024 keys"
    q2 = torch.empty(2, 2, 2048, 16)
    assert attnkit.explain(q2, q2, q2, masks.padding(torch.tensor([1024, 2000]))).kernel == "tiled"
    assert plan(torch.ones(2048, 2048, dtype=torch.bool)).reason == "sdpa: the mask hides nothing here"
    assert plan(torch.rand(2048, 2048) > 0.1).reason == "sdpa: dense mask: 100% of blocks kept"
    assert plan(masks.causal(), length=64).reason == "sdpa: is_causal"
    assert "is small" in plan(masks.sliding_window(4), length=64).reason
    assert plan(torch.zeros(2048, 2048)).reason == "sdpa: dense mask (additive float mask)"
    assert plan(None, dropout_p=0.1).kernel == "tiled"
    assert plan(torch.zeros(64, 64), length=64, dropout_p=0.1).kernel == "reference"
    q = torch.empty(1, 2, 0, 16)
    assert attnkit.explain(q, q, q).kernel == "reference"


def test_dispatch_with_the_native_engine(monkeypatch):
    """With the native engine: the tiled kernel takes unmasked, causal and masked calls of at least
    NATIVE_MIN_QUERIES query rows (it beats SDPA there) whatever their key length; decoding steps,
    small calls, tensor masks and float64 keep the rules of the PyTorch engines; explain says
    which engine runs."""
    pin_engine(monkeypatch, "native")

    def plan(mask, b=1, h=2, lq=2048, lk=2048, dtype=torch.float32):
        q, k = torch.empty(b, h, lq, 16, dtype=dtype), torch.empty(b, h, lk, 16, dtype=dtype)
        return attnkit.explain(q, k, k, mask)

    rows = tiled.NATIVE_MIN_QUERIES
    for mask in (None, masks.causal(), masks.sliding_window(128), masks.padding(torch.tensor([1000]))):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            got = plan(mask, dtype=dtype)
            assert got.kernel == "tiled" and str(got).endswith("native engine (C++)"), got
    assert str(plan(None)) == "tiled: no mask, 4096 query rows; native engine (C++)"
    for lk in (1, 16, 5000):  # the choice for an unmasked call does not depend on Lk
        assert plan(None, h=1, lq=rows, lk=lk).kernel == "tiled"
        assert plan(None, h=1, lq=rows - 1, lk=lk).kernel == "sdpa"
    assert plan(None, b=rows // 16, h=1, lq=16).kernel == "tiled"
    assert plan(None, b=rows, h=1, lq=tiled.NATIVE_MIN_ROWS - 1).kernel == "sdpa"  # decoding steps
    assert plan(masks.causal(), h=8, lq=1, lk=4096).kernel == "sdpa"
    assert plan(None, dtype=torch.float64).kernel == "sdpa"
    grad = torch.empty(1, 2, 2048, 16, dtype=torch.bfloat16, requires_grad=True)
    assert attnkit.explain(grad, grad, grad).kernel == "sdpa"  # unmasked bf16 training: SDPA's bf16 backward
    assert attnkit.explain(grad, grad, grad, masks.causal()).kernel == "tiled"
    assert plan(torch.rand(2048, 2048) > 0.1).reason == "sdpa: dense mask: 100% of blocks kept"
    window = plan(masks.sliding_window(128), dtype=torch.float64)
    assert window.kernel == "tiled" and "fused engine (torch.float64 on cpu" in str(window), window


def test_dispatch_weighs_dtype_and_backward(monkeypatch):
    pin_engine(monkeypatch, "fused")

    def kernel(mask, dtype, grad, batch=1):
        q = torch.empty(batch, 2, 2048, 16, dtype=dtype, requires_grad=grad)
        return attnkit.explain(q, q, q, mask).kernel

    window = masks.sliding_window(1024)  # 42% of the blocks, masked diagonal tiles, no causal square
    assert kernel(window, torch.float32, False) == "tiled"
    assert kernel(window, torch.float32, True) == "tiled"
    assert kernel(window, torch.bfloat16, True) == "sdpa"  # masked tiles are slow in bf16 backward
    square = masks.prefix_lm(512) & masks.causal()  # causal: one causal square of 2048 rows
    assert kernel(square, torch.bfloat16, True) == "tiled"
    padding = masks.padding(torch.tensor([1024, 1500]))  # full blocks only
    assert kernel(padding, torch.bfloat16, True, batch=2) == "tiled"
    with torch.no_grad():
        q = torch.empty(1, 2, 2048, 16, dtype=torch.bfloat16, requires_grad=True)
        assert attnkit.explain(q, q, q, window).kernel == "tiled"  # no backward under no_grad


# --- memory --------------------------------------------------------------------------------


class MaxNumel(TorchDispatchMode):
    """Records the largest tensor any op creates."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_long_document_mask_never_allocates_lq_by_lk():
    length = 16384
    q, k, v = (randn(1, 1, length, 16, requires_grad=True) for _ in range(3))
    mask = masks.document(torch.arange(length) // (length // 8))
    assert attnkit.explain(q, k, v, mask).kernel == "tiled"
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


def test_lse_gradient_through_merged_row_blocks():
    """Row blocks with equal runs are merged for the fused engine; the math engine (taken
    when the lse has a gradient) walks them 128 rows at a time and must not reuse the
    merged block's mask tile."""
    torch.manual_seed(0)
    ids = torch.cat([torch.zeros(100, dtype=torch.long), torch.ones(1000, dtype=torch.long)])
    # 640 queries inside document 1, 256 keys across its start: every row block sees the same partial run
    mask = masks.document(ids, q_offset=300)
    prepared = attnkit.prepare(mask, 640, 256)
    assert any(r.q1 - r.q0 > 128 and not all(run.full for run in r.runs) for g in prepared.groups for r in g.rows)
    q = torch.randn(1, 2, 640, 16, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(1, 2, 256, 16, dtype=torch.float64, requires_grad=True) for _ in range(2))
    grads = []
    for kernel in ("tiled", "reference"):
        out, lse = attnkit.attention(q, k, v, mask, kernel=kernel, return_lse=True)
        grads.append(torch.autograd.grad((out.sum() + lse.sin().sum()), (q, k, v)))
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want)


def planned_fused_calls(mask, length: int, heads: int = 8) -> int:
    """Fused calls of one forward: one per run, and one or two per causal square."""
    plan = attnkit.prepare(mask, length, length, block_size=tiled.BLOCK_SIZE)
    q = torch.zeros(1, heads, length, 64)
    call = tiles.TileCall(plan, 0.125, 0.0, 0, True)
    calls = 0
    for group in plan.groups:
        sel = tiles.select(group, plan, 1, heads, heads, q.device)
        for step in tiled._steps(call, 0, group, sel, q, q):
            calls += 1 + (step.c < step.a) if isinstance(step, tiled.Square) else len(step.runs)
    return calls


def test_opstream_benchmark_counts_one_fused_call_per_run(tmp_path):
    """benchmarks/opstream.py (the clock-free comparison of two trees) sees the kernel's plan:
    one fused call per run (or per causal square and its rectangle) forward, as many backward."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
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


@pytest.mark.parametrize("lq", [1, 300])
@pytest.mark.parametrize("engine", ["native", "fused"])
def test_padding_of_one_length_runs_sdpa_over_the_kept_keys_exactly(lq, engine, monkeypatch):
    """Every sequence's keys ending at the same n: SDPA over the first n keys with no mask (a
    decoding step over a cache with room left; the native engine's key limit where it runs),
    forward and backward against the float64 oracle; junk past n is never read; GQA and
    bfloat16 too."""
    pin_engine(monkeypatch, engine)
    expected = "tiled" if engine == "native" and lq >= tiled.NATIVE_MIN_ROWS else "sdpa"
    for dtype, hq, hkv in ((torch.float32, 4, 4), (torch.float32, 4, 2), (torch.bfloat16, 4, 1)):
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
        assert_oracle(out, gold, naive, what=f"{dtype} Hq={hq} Hkv={hkv}")
        grad = randn(*out.shape, dtype=dtype)
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad)
        q64, k64, v64 = (t.double().requires_grad_() for t in (q.detach(), kk, vv))
        want = torch.autograd.grad(naive_attention(q64, k64, v64)[0], (q64, k64, v64), grad.double())
        tol = 3e-2 if dtype == torch.bfloat16 else 1e-5
        for got, w in zip((dq, dk[:, :, :509], dv[:, :, :509]), want):
            torch.testing.assert_close(got.double(), w, atol=tol * w.abs().max().item(), rtol=0)
        assert dk[:, :, 509:].eq(0).all() and dv[:, :, 509:].eq(0).all()


# --- causal squares: row blocks that form a causal square run as one is_causal call ---------

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
def test_causal_squares_are_exact_forward_and_backward(name, monkeypatch):
    from attnkit.kernels import _aten

    length, make, squares = SQUARE_CASES[name]
    mask = make()
    q, k, v = (randn(2, 2, length, 16, dtype=torch.float64, requires_grad=True) for _ in range(3))
    calls = FusedCalls(monkeypatch)
    prepared = attnkit.prepare(mask, length, length)
    out = attnkit.attention(q, k, v, prepared, kernel="tiled")
    dense = prepared.materialize()
    want = naive_attention(q, k, v, dense)[0]
    assert (out - want).abs().max() < 1e-12
    upstream = torch.randn_like(want)
    for got, exp in zip(torch.autograd.grad(out, (q, k, v), upstream), torch.autograd.grad(want, (q, k, v), upstream)):
        assert (got - exp).abs().max() < 1e-10
    if _aten.AVAILABLE:
        found = calls.causal(tiled.SQUARE_MIN_ROWS)
        assert found == 2 * squares, found  # forward and backward


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_causal_squares_within_the_oracle_rule_and_gqa(dtype, engine, monkeypatch):
    """A prefix-LM long enough for causal squares (the fused engine), on every engine."""
    pin_engine(monkeypatch, engine)
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


def test_squares_and_full_blocks_choose_the_tiled_kernel_like_a_plan_of_full_blocks(monkeypatch):
    """A prefix-LM in bf16 with a backward keeps 54% of blocks, past the masked-plan limit (30%),
    but runs as causal squares plus full blocks: auto takes the tiled kernel, says why, and is
    exact. A prefix ending mid-block leaves a partial row block outside the square: the limit holds."""
    pin_engine(monkeypatch, "fused")  # the limits of the per-run engines (the native one takes every plan)
    n = 2048
    q, k, v = (randn(1, 2, n, 32, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    square = attnkit.explain(q, k, v, masks.prefix_lm(n // 4))
    assert square.kernel == "tiled" and "causal squares and full blocks" in str(square), square
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


def test_causal_squares_with_strided_inputs_sinks_and_the_lse(monkeypatch):
    """Squares beside the other features: (B, L, H, D) tensors viewed as (B, H, L, D), sinks added
    from the merged lse, return_lse; forward and gradients equal the float64 formula."""
    n, prefix = 1000, 100  # rows [128, 1000): one square of 872 rows
    q, k, v = (randn(2, n, 2, 16, dtype=torch.float64).transpose(1, 2).requires_grad_() for _ in range(3))
    sinks = torch.tensor([0.5, -1.0], dtype=torch.float64)
    calls = FusedCalls(monkeypatch)
    out, lse = attnkit.attention(q, k, v, masks.prefix_lm(prefix), kernel="tiled", sinks=sinks, return_lse=True)
    allowed = masks.prefix_lm(prefix).materialize(n, n)
    s = (q @ k.transpose(-2, -1) * 16**-0.5).masked_fill(~allowed, float("-inf"))
    s = torch.cat([s, sinks.view(1, 2, 1, 1).expand(2, 2, n, 1)], dim=-1)
    want, want_lse = torch.softmax(s, dim=-1)[..., :n] @ v, torch.logsumexp(s, dim=-1)
    assert (out - want).abs().max() < 1e-12 and (lse - want_lse).abs().max() < 1e-12
    upstream = torch.randn_like(want)
    for got, exp in zip(torch.autograd.grad(out, (q, k, v), upstream), torch.autograd.grad(want, (q, k, v), upstream)):
        assert (got - exp).abs().max() < 1e-10
    from attnkit.kernels import _aten

    if _aten.AVAILABLE:
        # the forward ran the square; the backward of a call with sinks gets the lse's gradient,
        # which the fused engine's backward does not take: the math engine runs it
        assert calls.causal(tiled.SQUARE_MIN_ROWS) == 1
