"""Ring attention over gloo on 127.0.0.1 against single-process attnkit.attention.

Each world size runs in one set of spawned processes (one thread each) that computes
every case under both layouts, so the suite pays the start-up once per world size.
"""

from __future__ import annotations

import collections
import os
import time

import pytest
import torch
from _oracle import randn

import attnkit
from attnkit import bias, masks
from attnkit import distributed as D
from attnkit.distributed.local import RankFailure, run_local
from attnkit.nn import RotaryEmbedding

# --- the cases: built identically on every rank and in the test process ----------------------


def _docs(length: int, seed: int) -> torch.Tensor:
    """Document ids with documents of 1-17 tokens: many cross shard boundaries."""
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(1, 18, (length,), generator=g)
    return torch.repeat_interleave(torch.arange(length), sizes)[:length]


def _skip_odd(b, h, q, kv):
    return ((q - kv) % 3 != 1) | (q == kv)


CASES = {
    # name: (Lq, Lk, Hq, Hkv, mask factory, extras)
    "causal_gqa": (37, 37, 4, 2, lambda L, K: masks.causal(), {}),
    "document_causal": (45, 45, 2, 2, lambda L, K: masks.document(_docs(L, 1)) & masks.causal(), {}),
    "document_per_sequence": (33, 33, 2, 1, lambda L, K: masks.document(torch.stack([_docs(L, 2), _docs(L, 3)])), {}),
    "sliding_window": (41, 41, 2, 2, lambda L, K: masks.sliding_window(6), {}),
    "prefix_lm": (39, 39, 2, 2, lambda L, K: masks.prefix_lm(torch.tensor([5, 20])), {}),
    "padding_empty_rows": (31, 31, 2, 2, lambda L, K: masks.padding([0, 23]) & masks.causal(), {}),
    "from_fn": (35, 35, 2, 2, lambda L, K: masks.from_fn(_skip_odd), {}),
    "dense_bool": (
        29,
        29,
        2,
        2,
        lambda L, K: torch.rand(2, 1, L, K, generator=torch.Generator().manual_seed(4)) > 0.4,
        {},
    ),
    "full": (26, 26, 4, 1, lambda L, K: None, {}),
    "cross_padding": (23, 42, 2, 2, lambda L, K: masks.padding([30, 42]), {}),
    "alibi_softcap": (34, 34, 4, 2, lambda L, K: masks.causal(), {"alibi": True, "softcap": 5.0}),
    "sinks_window": (30, 30, 2, 2, lambda L, K: masks.sliding_window(4), {"sinks": True}),
    "relative_document": (36, 36, 2, 2, lambda L, K: masks.document(_docs(L, 5)), {"relative": True}),
    # equal head sizes: the fused CPU kernel runs (one call per causal square), also with an lse gradient
    "causal_fused": (300, 300, 2, 2, lambda L, K: masks.causal(), {"dv": 8}),
    "window_fused_lse": (290, 290, 2, 1, lambda L, K: masks.sliding_window(40), {"dv": 8, "lse": True}),
    # a fixed ALiBi on the fused kernel as a band (forward and each part's backward)
    "alibi_window_fused": (260, 260, 4, 2, lambda L, K: masks.sliding_window(50), {"dv": 8, "alibi_fixed": True}),
}


def _case(name: str):
    """Global inputs of a case (the same on every process), with the parameters to train."""
    lq, lk, hq, hkv, make_mask, extra = CASES[name]
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    q = torch.randn(2, hq, lq, 8, generator=g)
    k = torch.randn(2, hkv, lk, 8, generator=g)
    dv = extra.get("dv", 6)
    v = torch.randn(2, hkv, lk, dv, generator=g)
    dout = torch.randn(2, hq, lq, dv, generator=g)
    kwargs, params = {}, {}
    if extra.get("lse"):  # the loss also weighs the lse: d loss / d lse = dout[..., 0]
        kwargs["return_lse"] = True
    if extra.get("alibi"):
        params["slopes"] = bias.alibi_slopes(hq).requires_grad_()
        kwargs["attn_bias"] = bias.alibi(params["slopes"], causal=True)
    if extra.get("alibi_fixed"):
        kwargs["attn_bias"] = bias.alibi(bias.alibi_slopes(hq))
    if extra.get("relative"):
        params["table"] = (0.5 * torch.randn(8, hq, generator=g)).requires_grad_()
        kwargs["attn_bias"] = bias.relative(params["table"], num_buckets=8, max_distance=16)
    if extra.get("sinks"):
        params["sinks"] = torch.randn(hq, generator=g).requires_grad_()
        kwargs["sinks"] = params["sinks"]
    if "softcap" in extra:
        kwargs["softcap"] = extra["softcap"]
    return q, k, v, dout, make_mask(lq, lk), kwargs, params


def _loss(out, dout):
    if isinstance(out, tuple):  # (out, lse)
        return (out[0] * dout).sum() + (out[1] * dout[..., 0]).sum()
    return (out * dout).sum()


def _worker(rank, world, names, layouts):
    results = {}
    for layout in layouts:
        for name in names:
            q, k, v, dout, mask, kwargs, params = _case(name)
            parts = [D.shard(t, 2, layout)[0].clone().requires_grad_() for t in (q, k, v)]
            out = D.ring_attention(*parts, mask, layout=layout, timeout=60, **kwargs)
            _loss(out, D.shard(dout, 2, layout)[0]).backward()
            out = out[0] if isinstance(out, tuple) else out
            full = [D.unshard(t, 2, layout) for t in (out.detach(), *(p.grad for p in parts))]
            results[layout, name] = (full, {n: p.grad for n, p in params.items()})
    # a model layer on the split sequence equals the unsplit layer
    torch.manual_seed(0)
    ring = D.RingMultiHeadAttention(16, 4, num_kv_heads=2)
    x = torch.randn(2, 27, 16, generator=torch.Generator().manual_seed(9))
    y, _ = ring(D.shard(x, 1)[0], mask=masks.causal())
    results["module"] = D.unshard(y.detach(), 1)
    # with a rotary embedding, at each token's global position (worked out, or from shard)
    torch.manual_seed(0)
    ring = D.RingMultiHeadAttention(16, 4, num_kv_heads=2, rotary=RotaryEmbedding(4))
    part, pos = D.shard(x, 1)
    results["rotary"] = D.unshard(ring(part, mask=masks.causal())[0].detach(), 1)
    results["rotary_positions"] = D.unshard(ring(part, mask=masks.causal(), positions=pos)[0].detach(), 1)
    try:  # capture of a layer that holds a shard: refused on several ranks, plain weights on one
        with attnkit.capture(ring) as cap:
            ring(part, mask=masks.causal())
        results["capture"] = tuple(cap.weights[0].shape)
    except ValueError as err:
        results["capture"] = str(err)
    return results


def _expected(name):
    q, k, v, dout, mask, kwargs, params = _case(name)
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = attnkit.attention(q, k, v, mask, **kwargs)
    _loss(out, dout).backward()
    out = out[0] if isinstance(out, tuple) else out
    return [out.detach(), q.grad, k.grad, v.grad], {n: p.grad for n, p in params.items()}


@pytest.fixture(scope="module")
def expected():
    return {name: _expected(name) for name in CASES}


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_ring_equals_single_process(world, expected):
    t0 = time.monotonic()
    results = run_local(_worker, world, (list(CASES), ["zigzag", "contiguous"]), timeout=240)
    assert time.monotonic() - t0 < 300
    for layout in ("zigzag", "contiguous"):
        for name in CASES:
            want, want_params = expected[name]
            got, _ = results[0][layout, name]
            for what, a, b, tol in zip(("out", "dq", "dk", "dv"), got, want, (1e-5, 1e-4, 1e-4, 1e-4)):
                err = (a - b).abs().max().item() if a.numel() else 0.0
                assert err <= tol, f"{name} {layout} W={world}: {what} differs by {err:.2e}"
            for n, g in want_params.items():  # each rank holds its contribution: their sum is the gradient
                total = sum(r[layout, name][1][n] for r in results)
                torch.testing.assert_close(total, g, atol=1e-4, rtol=1e-4)
            for r in results[1:]:  # every rank gathers the same whole tensors
                assert all(torch.equal(a, b) for a, b in zip(r[layout, name][0], got))
    torch.manual_seed(0)
    mha = attnkit.MultiHeadAttention(16, 4, num_kv_heads=2)
    x = torch.randn(2, 27, 16, generator=torch.Generator().manual_seed(9))
    y, _ = mha(x, mask=masks.causal())
    torch.testing.assert_close(results[0]["module"], y.detach(), atol=1e-5, rtol=1e-5)
    torch.manual_seed(0)
    mha = attnkit.MultiHeadAttention(16, 4, num_kv_heads=2, rotary=RotaryEmbedding(4))
    y, _ = mha(x, mask=masks.causal())
    for key in ("rotary", "rotary_positions"):  # F6: the ring layer used to ignore its rotary embedding
        torch.testing.assert_close(results[0][key], y.detach(), atol=1e-5, rtol=1e-5)
    if world == 1:
        assert results[0]["capture"] == (2, 4, 27, 27)
    else:
        assert all("holds a shard" in r["capture"] and "MultiHeadAttention" in r["capture"] for r in results)


# --- faults -------------------------------------------------------------------------------------


def _dies(rank, world, how):
    q, k, v, _, mask, _, _ = _case("causal_gqa")
    if rank == 1:
        if how == "exit":
            os._exit(3)
        raise ValueError("rank 1 broke on purpose")
    if how == "late" and rank == 2:
        time.sleep(2.0)  # rank 0 has found rank 1 gone and failed before rank 2 asks it anything
    try:
        D.ring_attention(*(D.shard(t, 2)[0] for t in (q, k, v)), mask, timeout=20)
    except D.RingError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("how", ["exit", "raise", "late"])
def test_dead_rank_gives_clear_error_on_the_others(how):
    t0 = time.monotonic()
    results = run_local(_dies, 3, (how,), timeout=60, return_exceptions=True)
    assert time.monotonic() - t0 < 90
    assert isinstance(results[1], RankFailure)
    for message in (results[0], results[2]):
        assert isinstance(message, str) and "rank 1" in message and "ring attention on rank" in message, message


def _disagree(rank, world, what):
    q, k, v, _, _, _, _ = _case("sliding_window")
    parts = [D.shard(t, 2)[0] for t in (q, k, v)]
    mask = masks.sliding_window(6 if rank == 0 else 5) if what == "mask" else masks.sliding_window(6)
    if what == "length":
        parts = [t[..., :15, :] if rank == 0 else t[..., 15:, :] for t in (q, k, v)]  # 15 + 26: not a layout
    try:
        D.ring_attention(*parts, mask, timeout=30)
    except (D.RingError, ValueError) as e:
        return type(e).__name__, str(e)
    return "no error", ""


def test_ranks_that_disagree_are_refused_up_front():
    for what, needle in (("mask", "disagree on the mask"), ("length", "attnkit.distributed.shard")):
        results = run_local(_disagree, 2, (what,), timeout=60)
        for kind, message in results:
            assert needle in message, (what, kind, message)


def _counted(rank, world, name):
    """The kernel calls and preparations of one ring forward and backward, counted on this rank."""
    from attnkit.kernels import registry
    from attnkit.plan import PreparedMask

    counts: collections.Counter = collections.Counter()
    phase = ["forward"]
    for kernel in registry.KERNELS.values():  # an instance attribute in front of each class's method
        for method in ("run", "backward_part"):

            def counting(*args, _kernel=kernel.name, _method=method, _original=getattr(kernel, method)):
                counts[phase[0], _method, _kernel] += 1
                return _original(*args)

            setattr(kernel, method, counting)
    init = PreparedMask.__init__

    def prepared(self, *args, **kwargs):
        counts[phase[0], "prepare", ""] += 1
        init(self, *args, **kwargs)

    PreparedMask.__init__ = prepared  # type: ignore[method-assign]
    q, k, v, dout, mask, kwargs, _ = _case(name)
    parts = [D.shard(t, world)[0].clone().requires_grad_() for t in (q, k, v)]
    out = D.ring_attention(*parts, mask, timeout=60, **kwargs)
    phase[0] = "backward"
    _loss(out, D.shard(dout, world)[0]).backward()
    return dict(counts)


@pytest.mark.parametrize("name", ["document_causal", "causal_fused"])
def test_ring_backward_runs_through_the_registry_on_the_forward_plans(name):
    """Each rectangle's backward is one ``backward_part`` call of a registered kernel (the
    registry's choice), as many as the forward's kernel runs; no forward is recomputed and no
    mask is prepared again in the backward: the forward's plans serve it."""
    from attnkit.kernels import registry

    capable = {k.name for k in registry.KERNELS.values() if k.supports_backward_part}
    for counts in run_local(_counted, 2, (name,), timeout=120):
        runs = sum(n for (phase, what, _), n in counts.items() if (phase, what) == ("forward", "run"))
        parts = {
            kernel: n for (phase, what, kernel), n in counts.items() if (phase, what) == ("backward", "backward_part")
        }
        assert runs >= 2, counts  # two rectangles at least: its own keys and the other rank's
        assert sum(parts.values()) == runs, counts
        assert set(parts) <= capable, counts
        assert not any(key[:2] == ("backward", "run") for key in counts), counts
        assert counts.get(("backward", "prepare", ""), 0) == 0, counts
        assert counts.get(("forward", "prepare", ""), 0) >= 1, counts


# --- one process: layouts, plans, errors --------------------------------------------------------


def test_layouts_cover_the_sequence_once():
    for length in (0, 1, 7, 64, 101):
        for world in (1, 2, 3, 4):
            for layout in ("contiguous", "zigzag"):
                parts = D.pieces(length, world, layout)
                covered = sorted(i for rank in parts for a, b in rank for i in range(a, b))
                assert covered == list(range(length))
                sizes = [sum(b - a for a, b in rank) for rank in parts]
                assert max(sizes) - min(sizes) <= (1 if layout == "contiguous" else 2)
    assert D.pieces(10, 2, "zigzag") == [[(0, 3), (8, 10)], [(3, 6), (6, 8)]]


def test_explain_reports_balance_and_skipped_traffic():
    zig = D.explain(masks.causal(), 4096, world_size=4, layout="zigzag")
    contiguous = D.explain(masks.causal(), 4096, world_size=4, layout="contiguous")
    assert zig.balance <= 1.1 < contiguous.balance
    assert sum(zig.work) == sum(contiguous.work) == zig.dense_work
    # causal contiguous: rank 3 needs every other rank's keys, rank 0 none
    assert contiguous.received[0] == 0 and contiguous.received[3] == 3 * 1024
    # documents inside shards: nothing travels
    docs = D.explain(masks.document(torch.arange(4096) // 256), 4096, world_size=4, layout="contiguous")
    assert docs.sent == (0, 0, 0, 0)
    assert "work balance" in str(zig)


def test_single_process_and_bad_inputs():
    q = torch.randn(1, 2, 10, 8)
    torch.testing.assert_close(D.ring_attention(q, q, q, masks.causal()), attnkit.attention(q, q, q, masks.causal()))
    with pytest.raises(ValueError, match="layout must be"):
        D.ring_attention(q, q, q, layout="spiral")
    with pytest.raises(TypeError, match="not a PreparedMask"):
        D.ring_attention(q, q, q, attnkit.prepare(masks.causal(), 10, 10))
    with pytest.raises(TypeError, match="bool masks"):
        D.ring_attention(q, q, q, torch.zeros(10, 10))
    with pytest.raises(ValueError, match="timeout"):
        D.ring_attention(q, q, q, timeout=0)
    with pytest.raises(ValueError, match="L_local"):
        D.ring_attention(q[0], q[0], q[0])
    with pytest.raises(ValueError, match="need_weights"):
        D.RingMultiHeadAttention(8, 2)(torch.randn(1, 4, 8), need_weights=True)
    with pytest.raises(ValueError, match="cannot be split"):
        masks.cached(masks.causal(), torch.tensor([0]), torch.tensor([3])).part(2, 4, q=slice(0, 1))


@pytest.mark.parametrize(
    "mask",
    [
        masks.causal(),
        masks.causal(align="top_left", q_offset=2),
        masks.sliding_window(3, 2),
        masks.prefix_lm(4),
        masks.padding([9, 5]),
        masks.document(torch.tensor([0, 0, 1, 1, 1, 2, 2, 3, 3, 3, 3, 3, 4])),
        masks.from_fn(_skip_odd),
        masks.causal() | masks.prefix_lm(torch.tensor([2, 6])),
        masks.dense(torch.rand(2, 1, 13, 13) > 0.5),
    ],
    ids=repr,
)
def test_mask_part_is_the_slice_of_the_whole(mask):
    full = mask.materialize(13, 13)
    for a, b, c, d in ((0, 5, 0, 4), (3, 9, 2, 13), (12, 13, 0, 13), (4, 4, 0, 3)):
        part = mask.part(13, 13, q=slice(a, b), kv=slice(c, d))
        assert torch.equal(part.materialize(b - a, d - c), full[..., a:b, c:d])
        # block maps of the part agree with the whole's at element level
        assert torch.equal(part.block_map(b - a, d - c, 1, 1), mask.block_map(13, 13, 1, 1)[..., a:b, c:d])


def test_bias_part_is_the_slice_of_the_whole():
    slopes = bias.alibi_slopes(4).requires_grad_()
    table = torch.randn(8, 4, requires_grad=True)
    for b in (
        bias.alibi(slopes),
        bias.relative(table, 8, 16),
        bias.alibi(slopes) + bias.relative(table, 8, 16),
        bias.from_fn(lambda bb, h, i, j: -0.1 * (i - j).abs().float()),
        bias.dense(torch.randn(2, 4, 11, 9)),
    ):
        full = b.dense(2, 4, 11, 9, "cpu")
        part = b.part(11, 9, q=slice(2, 7), kv=slice(3, 9)).dense(2, 4, 5, 6, "cpu")
        torch.testing.assert_close(part.expand(2, 4, 5, 6), full[..., 2:7, 3:9].expand(2, 4, 5, 6))


def test_document_mask_sends_only_the_keys_it_reaches():
    ids = torch.repeat_interleave(torch.arange(16), 256)  # 16 documents of 256 tokens
    ids = torch.cat([ids[100:], torch.full((100,), 16)])  # documents straddle every piece boundary
    docs = D.explain(masks.document(ids) & masks.causal(), 4096, world_size=4, layout="contiguous")
    causal = D.explain(masks.causal(), 4096, world_size=4, layout="contiguous")
    assert 0 < sum(docs.received) <= sum(causal.received) // 4


def test_two_process_example_runs_under_torchrun():
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(root / "examples" / "ring.py")],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    error = float(done.stdout.rsplit("=", 1)[1])
    assert error < 1e-5, done.stdout


# regression: finding F6 of the review of the seams between features
def test_ring_layer_applies_its_rotary_embedding():
    from attnkit.distributed import RingMultiHeadAttention
    from attnkit.nn import RotaryEmbedding

    ring = RingMultiHeadAttention(32, 4, rotary=RotaryEmbedding(8)).eval()
    plain = attnkit.MultiHeadAttention(32, 4, rotary=RotaryEmbedding(8)).eval()
    plain.load_state_dict(ring.state_dict())
    x = randn(2, 10, 32)
    torch.testing.assert_close(ring(x, mask=masks.causal())[0], plain(x, mask=masks.causal())[0])
    torch.testing.assert_close(
        ring(x, mask=masks.causal(), positions=torch.arange(10) + 3)[0],
        plain(x, mask=masks.causal(), positions=torch.arange(10) + 3)[0],
    )


def test_ring_sinks_must_be_a_tensor():
    from attnkit.distributed import ring_attention

    q = randn(1, 2, 5, 8)
    with pytest.raises(TypeError, match=r"sinks must be a float tensor of shape \(Hq,\) = \(2,\)"):
        ring_attention(q, q, q, sinks=[0.0, 0.0])


def test_ring_error_names_each_peer_once():
    from attnkit.distributed.ring import RingGroup

    message = str(RingGroup(None, 5).error(1, "receiving from rank 1", None))
    assert message.count("rank 1") == 1 and "It may have died" in message
    assert "Rank 1 and rank 2 may have died" in str(RingGroup(None, 5).error([1, 2], "gathering", None))
