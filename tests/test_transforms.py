"""attnkit under PyTorch's own machinery: forward-mode AD, torch.func, torch.compile (fullgraph,
dynamic shapes, export, masks built inside), autocast and threads. Each answer is exact against
the float64 formula, or a clear refusal; never a silent zero (docs/transforms.md)."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from _oracle import assert_oracle, gold_and_naive, naive_attention, randn

import attnkit
from attnkit import masks
from attnkit.kernels.native import build as native_build

FORCED = ["native", "fused", "math", "sdpa"]


def _problem():
    """The issue's repro: a decoding-like call with padding and GQA (auto's native row path)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 4, 16, generator=g, dtype=torch.float64)
    k, v = (
        torch.randn(2, 2, 40, 16, generator=g, dtype=torch.float64),
        torch.randn(2, 2, 40, 16, generator=g, dtype=torch.float64),
    )
    return q, k, v, masks.padding(torch.tensor([30, 40]))


def _formula(q, k, v, mask):
    return naive_attention(q, k, v, mask.materialize(q.shape[2], k.shape[2]))[0]


# --- 1. forward-mode AD ---------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["jvp", "forward_ad", "jacfwd"])
@pytest.mark.parametrize("kernel", ["auto", "reference"])
def test_forward_mode_ad_equals_the_formulas_tangent(how, kernel):
    """torch.func.jvp, jacfwd and torch.autograd.forward_ad give the formula's tangent (they gave
    zeros, or None, through the native engine's operators)."""
    q64, k64, v64, mask = _problem()
    q, k, v = q64.float(), k64.float(), v64.float()
    t = torch.randn_like(q)

    def ours(x):
        return attnkit.attention(x, k, v, mask, kernel=kernel)

    def gold(x):
        return _formula(x, k64, v64, mask)

    if how == "jvp":
        got = torch.func.jvp(ours, (q,), (t,))[1]
        want = torch.func.jvp(gold, (q64,), (t.double(),))[1]
    elif how == "forward_ad":
        with fwAD.dual_level():
            got = fwAD.unpack_dual(ours(fwAD.make_dual(q, t))).tangent
        with fwAD.dual_level():
            want = fwAD.unpack_dual(gold(fwAD.make_dual(q64, t.double()))).tangent
    else:
        got = torch.func.jacfwd(lambda x: ours(x)[0, 0, 0])(q)
        want = torch.func.jacfwd(lambda x: gold(x)[0, 0, 0])(q64)
    assert got is not None and got.abs().max() > 0.1
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("kernel", FORCED)
def test_kernels_without_a_forward_mode_rule_refuse_clearly(kernel):
    """A kernel whose operators have no forward-mode formula refuses a jvp with words that say so
    and what to use, instead of a zero tangent or PyTorch's NotImplementedError."""
    if kernel == "native" and not native_build.available():
        pytest.skip(native_build.status()[1])
    q, k, v, mask = (x.float() if isinstance(x, torch.Tensor) else x for x in _problem())
    with pytest.raises(ValueError, match="cannot run under torch.func.*kernel='auto' runs the reference kernel"):
        torch.func.jvp(lambda x: attnkit.attention(x, k, v, mask, kernel=kernel), (q,), (torch.randn_like(q),))
    with fwAD.dual_level():
        dual = fwAD.make_dual(q, torch.randn_like(q))
        with pytest.raises(ValueError, match="cannot run under forward-mode AD"):
            attnkit.attention(dual, k, v, mask, kernel=kernel)


# --- 2. torch.func ---------------------------------------------------------------------------------


@pytest.mark.parametrize("transform", ["grad", "vjp", "jacrev", "vmap"])
def test_torch_func_transforms_run_and_are_exact(transform):
    """grad, vjp, jacrev and vmap over attention run on the default path (they raised raw errors:
    a data pointer read in prepare, an autograd.Function without setup_context, or the
    double-backward refusal for a first derivative) and equal the float64 formula's."""
    q64, k64, v64, mask = _problem()
    q, k, v = q64.float(), k64.float(), v64.float()
    if transform == "grad":
        got = torch.func.grad(lambda x: attnkit.attention(x, k, v, mask).sum())(q)
        want = torch.func.grad(lambda x: _formula(x, k64, v64, mask).sum())(q64)
    elif transform == "vjp":
        up = torch.randn_like(q)
        got = torch.func.vjp(lambda x: attnkit.attention(x, k, v, mask), q)[1](up)[0]
        want = torch.func.vjp(lambda x: _formula(x, k64, v64, mask), q64)[1](up.double())[0]
    elif transform == "jacrev":
        got = torch.func.jacrev(lambda x: attnkit.attention(x, k, v, mask)[1, 2, 3])(q)
        want = torch.func.jacrev(lambda x: _formula(x, k64, v64, mask)[1, 2, 3])(q64)
    else:
        got = torch.func.vmap(lambda x: attnkit.attention(x, k[0], v[0], masks.causal()))(q)
        want = torch.stack(
            [naive_attention(x, k64[0], v64[0], masks.causal().materialize(4, 40)[0, 0])[0] for x in q64]
        )
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("kernel", FORCED)
def test_torch_func_on_a_forced_kernel_is_one_clear_error(kernel):
    if kernel == "native" and not native_build.available():
        pytest.skip(native_build.status()[1])
    q, k, v, mask = (x.float() if isinstance(x, torch.Tensor) else x for x in _problem())
    with pytest.raises(ValueError, match=f"kernel='{kernel}' cannot run this call: cannot run under torch.func"):
        torch.func.grad(lambda x: attnkit.attention(x, k, v, mask, kernel=kernel).sum())(q)


# --- 3 and 4. torch.compile: masks built inside, dynamic shapes, export -------------------------------

L = 96
MASKS = {
    "causal": lambda n: masks.causal(),
    "window": lambda n: masks.sliding_window(8),
    "prefix_lm": lambda n: masks.prefix_lm(n),
    "padding": lambda n: masks.padding(n),
    "causal & padding": lambda n: masks.causal() & masks.padding(n),
    "document": lambda n: masks.document((torch.arange(L) // 32).expand(2, L)),
}


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("inside", [True, False])
@pytest.mark.parametrize("kind", list(MASKS))
def test_every_mask_kind_compiles_with_fullgraph(kind, inside, dynamic):
    """Each mask kind, built inside the compiled function (from a tensor argument) or outside it,
    traces with fullgraph=True, with and without dynamic shapes (padding and prefix_lm of a tensor
    had data-dependent Python in their constructors; dynamic=True failed on SDPA's enable_gqa)."""
    torch._dynamo.reset()
    q, k, v = randn(2, 4, L, 16), randn(2, 2, L, 16), randn(2, 2, L, 16)
    n = torch.tensor([40, L])
    made = MASKS[kind]
    if inside:
        fn = torch.compile(lambda q, k, v, n: attnkit.attention(q, k, v, made(n)), fullgraph=True, dynamic=dynamic)
    else:
        mask = made(n)
        fn = torch.compile(lambda q, k, v, n: attnkit.attention(q, k, v, mask), fullgraph=True, dynamic=dynamic)
    out = fn(q, k, v, n)
    gold, naive = gold_and_naive(q, k, v, made(n).materialize(L, L))
    assert_oracle(out, gold, naive, what=f"{kind} inside={inside} dynamic={dynamic}")


@pytest.mark.parametrize("kind", ["padding", "prefix_lm", "causal & padding"])
def test_export_of_attention_with_a_mask_built_from_a_tensor(kind):
    """torch.export of attention with a padding (or prefix) mask built inside (a 57-frame
    GuardOnDataDependentSymNode before): the exported program equals the formula for other lengths."""

    class Attend(torch.nn.Module):
        def forward(self, q, k, v, n):
            return attnkit.attention(q, k, v, MASKS[kind](n))

    q, k, v = randn(2, 4, L, 16), randn(2, 2, L, 16), randn(2, 2, L, 16)
    program = torch.export.export(Attend(), (q, k, v, torch.tensor([40, L])))
    n = torch.tensor([7, 60])
    gold, naive = gold_and_naive(q, k, v, MASKS[kind](n).materialize(L, L))
    assert_oracle(program.module()(q, k, v, n), gold, naive)


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("kernel", ["auto", "native", "fused", "math", "sdpa", "reference"])
def test_a_prepared_mask_compiles_on_every_kernel_path(kernel, dynamic):
    """A PreparedMask made outside runs block-sparse under fullgraph on each CPU kernel, with and
    without dynamic shapes; the native engine is built and loaded at trace time if it was not yet
    (nothing is built at import)."""
    if kernel == "native" and not native_build.available():
        pytest.skip(native_build.status()[1])
    torch._dynamo.reset()
    q, k, v = randn(2, 4, 256, 16), randn(2, 2, 256, 16), randn(2, 2, 256, 16)
    mask = masks.document((torch.arange(256) // 64).expand(2, 256)) & masks.causal()
    prepared = attnkit.prepare(mask, 256, 256)
    fn = torch.compile(lambda q, k, v, p: attnkit.attention(q, k, v, p, kernel=kernel), fullgraph=True, dynamic=dynamic)
    gold, naive = gold_and_naive(q, k, v, prepared.materialize())
    assert_oracle(fn(q, k, v, prepared), gold, naive)


def test_a_module_with_a_kv_cache_compiles_with_fullgraph():
    """MultiHeadAttention(cache=KVCache) under fullgraph (it failed on the lengths' version counter):
    decoding step by step equals recomputing each prefix."""
    torch._dynamo.reset()
    mha = attnkit.MultiHeadAttention(32, 4, num_kv_heads=2)
    cache = attnkit.KVCache(2, 2, 16, 8)
    step = torch.compile(lambda x: mha(x, mask=masks.causal(), cache=cache)[0], fullgraph=True)
    x = randn(2, 6, 32)
    with torch.no_grad():
        outs = [step(x[:, :3])] + [step(x[:, i : i + 1]) for i in range(3, 6)]
        for i, out in zip(range(3, 7), outs):
            fresh, _ = mha(x[:, :i], mask=masks.causal())
            torch.testing.assert_close(out[:, -1], fresh[:, -1], atol=1e-5, rtol=1e-5)


# --- 5. threads --------------------------------------------------------------------------------------


def test_use_kernels_is_per_thread():
    """A use_kernels block in one thread leaves another thread's choice alone (thread B's return_lse
    call raised "no kernel allowed here" while thread A pinned sdpa), and blocks exited out of
    order never pop another thread's entry."""
    q = randn(1, 2, 64, 16)
    entered, release, errors, seen = threading.Event(), threading.Event(), [], {}

    def pinned():
        with attnkit.use_kernels("sdpa"):
            entered.set()
            release.wait(10)
            seen["a"] = attnkit.explain(q, q, q).kernel

    def other():
        entered.wait(10)
        try:
            out, lse = attnkit.attention(q, q, q, masks.causal(), return_lse=True)
            seen["b"] = attnkit.explain(q, q, q, masks.causal(), return_lse=True).kernel
        except Exception as err:  # noqa: BLE001 (reported below)
            errors.append(err)
        finally:
            release.set()

    threads = [threading.Thread(target=pinned), threading.Thread(target=other)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    assert seen["a"] == "sdpa" and seen["b"] != "sdpa"
    # interleaved exits: each block pops its own entry
    first, second = attnkit.use_kernels("math"), attnkit.use_kernels("reference")
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)
    assert attnkit.explain(q, q, q).kernel == "reference"
    second.__exit__(None, None, None)
    assert attnkit.kernels.registry.active() is None


def test_capture_records_only_its_own_threads_calls():
    """capture(model) records the calls of the thread that opened it, not another request's calls
    of the same model served by another thread."""
    mha = attnkit.MultiHeadAttention(16, 2)
    x_mine, x_other = randn(1, 5, 16), randn(1, 7, 16)
    inside, done = threading.Event(), threading.Event()

    def serve():
        inside.wait(10)
        with torch.no_grad():
            mha(x_other)
        done.set()

    worker = threading.Thread(target=serve)
    worker.start()
    with attnkit.capture(mha) as cap, torch.no_grad():
        inside.set()
        done.wait(10)
        mha(x_mine)
    worker.join(10)
    assert [w.shape[-1] for w in cap.weights] == [5]


# --- 6. attention_stats' topk and sink_tokens ----------------------------------------------------------


def test_attention_stats_clamps_topk_and_sink_tokens_to_the_keys():
    """topk=10**12 asked the allocator for 320 TB: a row has at most Lk keys to rank or count."""
    from attnkit.inspect import attention_stats

    q, k, v = randn(1, 2, 6, 8), randn(1, 2, 9, 8), randn(1, 2, 9, 8)
    huge = attention_stats(q, k, v, masks.causal(), topk=10**12, sink_tokens=10**12)
    exact = attention_stats(q, k, v, masks.causal(), topk=9, sink_tokens=9)
    assert huge.topk_keys.shape == (1, 2, 6, 9)
    for name in ("topk_keys", "topk_weights", "sink_mass", "entropy"):
        assert torch.equal(getattr(huge, name), getattr(exact, name)), name


# --- 7. autocast --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "case",
    ["decode padding", "long masked", "long unmasked", "small masked", "forced native", "forced math", "tensor mask"],
)
def test_autocast_gives_one_output_dtype_on_every_kernel(case):
    """Under torch.autocast("cpu", bfloat16) the output is bfloat16 whichever kernel runs (it was
    bfloat16 where SDPA ran and float32 where the native operator ran), and equals the computation
    on the bfloat16-cast inputs; float64 stays float64."""
    if case == "forced native" and not native_build.available():
        pytest.skip(native_build.status()[1])
    shapes = {"decode padding": (2, 4, 1, 64), "small masked": (1, 2, 32, 32)}.get(case, (1, 4, 512, 512))
    b, h, lq, lk = shapes
    q, k, v = randn(b, h, lq, 16), randn(b, h, lk, 16), randn(b, h, lk, 16)
    mask = {
        "decode padding": masks.padding(torch.tensor([40, 64])),
        "long unmasked": None,
        "tensor mask": torch.rand(lq, lk) > 0.3,
    }.get(case, masks.sliding_window(64))
    kernel = {"forced native": "native", "forced math": "math"}.get(case, "auto")
    with torch.autocast("cpu", torch.bfloat16):
        out = attnkit.attention(q, k, v, mask, kernel=kernel)
        out64 = attnkit.attention(q.double(), k.double(), v.double(), mask if not case == "tensor mask" else None)
    assert out.dtype == torch.bfloat16 and out64.dtype == torch.float64
    want = attnkit.attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), mask, kernel="reference")
    torch.testing.assert_close(out.float(), want.float(), atol=2e-2, rtol=2e-2)


# --- 9. NaN: exactly what docs/transforms.md's table (and the README) says -------------------------

#: (where the NaN is, kernel) -> whether rows that do not read it may turn NaN (the table's cells).
MAY_SPREAD = {
    ("q", kernel): False for kernel in ("native", "fused", "math", "sdpa", "reference")
} | {
    ("k", "native"): False, ("k", "reference"): False, ("k", "fused"): True, ("k", "math"): True, ("k", "sdpa"): True,
    ("v", "native"): True, ("v", "reference"): True, ("v", "fused"): True, ("v", "math"): True, ("v", "sdpa"): True,
}  # fmt: skip


@pytest.mark.parametrize("where, kernel", list(MAY_SPREAD))
@pytest.mark.parametrize("lq", [64, 4])
def test_nan_reaches_the_rows_the_documented_table_says(where, kernel, lq):
    """A NaN a visible pair reads is NaN in every row that reads it (every kernel); the rows that do
    not read it are finite wherever the table says so (its cells: per row or per tile), and on the
    native row path (1-8 queries) for any of q, k, v. The README promised "NaN only where the
    formula has it" on every kernel, which the tile paths do not keep for rows that hide the key."""
    if kernel == "native" and not native_build.available():
        pytest.skip(native_build.status()[1])
    mask = masks.sliding_window(8) if lq == 64 else masks.padding(torch.tensor([40]))
    q, k, v = randn(1, 2, lq, 16), randn(1, 2, 64, 16), randn(1, 2, 64, 16)
    at = min(10, lq - 1) if where == "q" else 10
    {"q": q, "k": k, "v": v}[where][0, :, at] = float("nan")
    out = attnkit.attention(q, k, v, mask, kernel=kernel)
    nan = torch.isnan(out[0]).any(-1)  # (H, Lq)
    reads = (torch.arange(lq) == at) if where == "q" else mask.materialize(lq, 64)[0, 0, :, at]
    assert nan[:, reads].all(), "a row that reads the NaN came out finite"
    row_path = kernel == "native" and lq <= 8
    if not MAY_SPREAD[(where, kernel)] or row_path:
        assert not nan[:, ~reads].any(), "a row that does not read the NaN turned NaN"
