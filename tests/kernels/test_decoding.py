"""Decoding steps: the lean runners for mask objects and the KV cache's common fill.

A decoding step repeats one call signature in every layer and step; the lean path validates and
chooses once per signature. A padding mask (a memory's lengths, a cache with room left) runs on
the native engine's row path, which reads only each sequence's keys (or, without the engine, as
SDPA over each sequence's keys); for another mask object (its value is part of the signature)
the SDPA kernel's runner makes the dense mask, the used keys and the visible queries once, and
the keys no query uses are zeroed on every call (test_cache.py: why no copy is reused).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
import torch.utils._python_dispatch
from _oracle import OpCounter, Ops, assert_oracle, gold_and_naive, naive_attention, randn

import attnkit
from attnkit import call, functional, masks
from attnkit.kernels import fastpath, sdpa
from attnkit.kernels.native import build as native_build
from attnkit.nn import KVCache

#: The kernel of a decoding step with a padding mask: the native engine's row path where it runs.
PADDING_KERNEL = "native" if native_build.available() else "sdpa"


def _calls(monkeypatch) -> dict:
    """Counts the full path's validations (the lean path skips them)."""
    seen = {"n": 0}
    real = call.make_call

    def counted(*a, **kw):
        seen["n"] += 1
        return real(*a, **kw)

    for module in (functional, fastpath):  # the full path's and the fast path's first call
        monkeypatch.setattr(module, "make_call", counted)
    return seen


def test_a_padding_mask_of_several_lengths_takes_the_lean_path_exactly(monkeypatch):
    """Cross-attention of a decoding step over a padded memory: validated once, then the runner;
    each call equals the formula, and junk in the padded keys never reaches the output."""
    mask = masks.padding(torch.tensor([5, 22, 13, 1]))
    k, v = randn(4, 2, 22, 16), randn(4, 2, 22, 16)
    k[0, :, 5:], v[0, :, 5:] = float("nan"), float("inf")
    k[3, :, 1:], v[3, :, 1:] = float("inf"), float("nan")
    calls = _calls(monkeypatch)
    keep = mask.materialize(1, 22)[:, :, 0, :, None]  # (B, 1, Lk, 1): the keys each sequence holds
    clean_k, clean_v = torch.where(keep, k, 0.0), torch.where(keep, v, 0.0)
    for step in range(4):
        q = randn(4, 2, 1, 16)
        out = attnkit.attention(q, k, v, mask)
        assert torch.isfinite(out).all()
        gold, naive = gold_and_naive(q, clean_k, clean_v, mask.materialize(1, 22))
        assert_oracle(out, gold, naive, what=f"step {step}")
    assert calls["n"] == 1, calls  # the first call only
    assert attnkit.explain(q, k, v, mask).kernel == PADDING_KERNEL


def test_unused_keys_are_zeroed_on_every_call_of_the_lean_runner():
    """The lean runner reads the keys on every call (nothing derived from them is kept): a change
    of a kept key in place and junk written into a padded key later are both seen, or not read."""
    mask = masks.padding(torch.tensor([3, 7]))
    k, v = randn(2, 1, 8, 8), randn(2, 1, 8, 8)
    q = randn(2, 1, 1, 8)
    first = attnkit.attention(q, k, v, mask)
    assert torch.equal(first, attnkit.attention(q, k, v, mask))  # the same computation twice
    with torch.no_grad():
        v[0, :, 1] += 1.0
    moved = attnkit.attention(q, k, v, mask)
    want = naive_attention(q.double(), k.double(), v.double(), mask.materialize(1, 8))[0]
    torch.testing.assert_close(moved.double(), want, atol=1e-6, rtol=1e-5)
    with torch.no_grad():
        k[1, :, 7], v[1, :, 7] = float("nan"), float("nan")  # junk written into a padded key later
    assert torch.isfinite(attnkit.attention(q, k, v, mask)).all()


def test_the_lean_dense_runner_keeps_gradients_and_inference_mode():
    mask = masks.padding(torch.tensor([6, 2])) & masks.causal("top_left")
    q = randn(2, 2, 3, 8, requires_grad=True)
    k, v = (randn(2, 2, 8, 8, requires_grad=True) for _ in range(2))
    dense = mask.materialize(3, 8)
    for _ in range(2):  # the second call runs the runner
        out = attnkit.attention(q, k, v, mask)
        got = torch.autograd.grad(out.sum(), (q, k, v))
        q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
        want = torch.autograd.grad(naive_attention(q64, k64, v64, dense)[0].sum(), (q64, k64, v64))
        for g, w in zip(got, want):
            torch.testing.assert_close(g.double(), w, atol=1e-5, rtol=1e-5)
    with torch.inference_mode():
        qi, ki, vi = (t.detach().clone() for t in (q, k, v))
        for _ in range(2):
            out = attnkit.attention(qi, ki, vi, mask)
        torch.testing.assert_close(out.double(), naive_attention(qi.double(), ki.double(), vi.double(), dense)[0])


@pytest.mark.parametrize("engine", ["native", "sdpa"])
def test_a_cached_causal_mask_that_hides_nothing_runs_unmasked(monkeypatch, engine):
    """Every sequence of the batch at the same fill: the decoding step's causal mask hides nothing,
    and the runner reads every key with no mask: the native row path over the stored keys where the
    engine runs, else SDPA with no mask."""
    if engine == "native" and not native_build.available():
        pytest.skip(native_build.status()[1])
    pinned = attnkit.use_kernels if engine == "sdpa" else lambda *_: contextlib.nullcontext()
    cache = KVCache(2, 2, 10, 8)
    seen = []
    real_sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy_sdpa(q, k, v, attn_mask=None, **kw):
        seen.append(attn_mask)
        return real_sdpa(q, k, v, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(sdpa.F, "scaled_dot_product_attention", spy_sdpa)
    for _ in range(3):
        cache.append(randn(2, 2, 1, 8), randn(2, 2, 1, 8))
        k, v = cache.stored()
        q = randn(2, 2, 1, 8)
        mask = cache.mask(masks.causal())
        with pinned("sdpa"), OpCounter("attnkit::native_forward") as ops:
            out = attnkit.attention(q, k, v, mask)
        torch.testing.assert_close(out.double(), naive_attention(q.double(), k.double(), v.double())[0])
        if engine == "native":
            assert "the row path reads" in str(attnkit.explain(q, k, v, mask))  # keys as they are, no mask
            assert ops.counts == {"attnkit::native_forward": 1} and not seen
    if engine == "sdpa":
        assert seen and seen[-1] is None


def test_the_cache_appends_a_common_fill_as_a_slice_and_mixed_fills_by_index():
    """Appends while every sequence holds the same number of entries (a slice), then with counts
    (mixed fills, index writes), then after a reset: the stored entries are the same either way,
    and a write to ``lengths`` by hand is respected."""
    fast, slow = KVCache(3, 2, 9, 4), KVCache(3, 2, 9, 4)
    for counts in (None, None, torch.tensor([1, 0, 2]), None):
        t = 2
        k, v = randn(3, 2, t, 4), randn(3, 2, t, 4)
        fast.append(k, v, counts)
        slow.append(k, v, torch.full((3,), t) if counts is None else counts)  # counts: the index path throughout
        assert torch.equal(fast.lengths, slow.lengths)
        assert torch.equal(fast.keys, slow.keys) and torch.equal(fast.values, slow.values)
    fast.reset()
    k, v = randn(3, 2, 1, 4), randn(3, 2, 1, 4)
    fast.append(k, v)
    assert fast._common_length() == 1 and torch.equal(fast.keys[:, :, :1], k)
    fast.lengths[1] = 0  # a sequence emptied by hand: the common fill is no longer known
    assert fast._common_length() is None
    k2, v2 = randn(3, 2, 1, 4), randn(3, 2, 1, 4)
    fast.append(k2, v2)
    assert fast.lengths.tolist() == [2, 1, 2]
    assert torch.equal(fast.keys[1, :, 0], k2[1, :, 0]) and torch.equal(fast.keys[0, :, 1], k2[0, :, 0])


def test_decoding_with_a_prepared_padding_mask_neither_copies_kv_nor_syncs():
    q, k, v = randn(1, 8, 1, 64), randn(1, 8, 4096, 64), randn(1, 8, 4096, 64)
    k[:, :, 4000:] = float("nan")  # padding holds junk: it is never read
    prepared = attnkit.prepare(masks.padding(torch.tensor([4000])), 1, 4096)
    with torch.no_grad(), Ops() as ops:
        out = attnkit.attention(q, k, v, prepared)
    assert torch.isfinite(out).all()
    assert ops.largest < k.numel() // 8, ops.largest  # no copy of K or V
    assert not any("_local_scalar_dense" in name for name in ops.names)  # no .item()/bool()/.tolist()


def test_a_prepared_mask_reused_makes_no_host_sync():
    q = randn(2, 2, 700, 16, requires_grad=True)
    prepared = attnkit.prepare(masks.sliding_window(40) & masks.padding(torch.tensor([700, 500])), 700, 700)
    attnkit.attention(q, q, q, prepared).sum().backward()  # first use evaluates and keeps its tiles
    with Ops() as ops:
        attnkit.attention(q, q, q, prepared).sum().backward()
    assert not any("_local_scalar_dense" in name for name in ops.names)


def test_decoding_over_a_growing_cache_is_validated_once(monkeypatch):
    """An unmasked step over a cache one key longer each time reuses the first step's checks and
    choice (SDPA's runner is the same for any Lk >= 1); wrong lengths and Lk = 0 still get theirs."""
    validated = []
    real = call.make_call
    for module in (functional, fastpath):
        monkeypatch.setattr(module, "make_call", lambda *a, **kw: validated.append(1) or real(*a, **kw))
    q, keys, values = randn(1, 4, 1, 24), randn(1, 2, 90, 24), randn(1, 2, 90, 24)
    with torch.no_grad():
        for n in range(40, 90):
            k, v = keys[:, :, :n], values[:, :, :n]
            out = attnkit.attention(q, k, v)
            gold, naive = gold_and_naive(q, k, v, None)
            # TESTING.md: where attnkit calls SDPA, the bound is 2x the larger of the naive formula's
            # and SDPA's own error (one query row: the naive error alone can be a lucky rounding).
            sdpa = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
            # and SDPA's on the form attnkit hands it: each group's query heads as one head's rows
            rows = F.scaled_dot_product_attention(q.reshape(1, 2, 2, 24), k, v).reshape(q.shape)
            worse = max(naive, sdpa, rows, key=lambda t: (t.double() - gold).abs().max().item())
            assert_oracle(out, gold, worse, what=f"Lk={n}")
        assert len(validated) <= 1
        with pytest.raises(ValueError, match="same length Lk"):
            attnkit.attention(q, keys[:, :, :50], values[:, :, :49])
        for bad_k, bad_v in [(keys[0, 0, :50], values[:, :, :50]), (keys[:, :, :50], values[0, :, :50])]:
            with pytest.raises(ValueError, match="same number of dimensions"):
                attnkit.attention(q, bad_k, bad_v)
        assert torch.equal(attnkit.attention(q, keys[:, :, :0], values[:, :, :0]), torch.zeros(1, 4, 1, 24))


def test_a_decoding_step_with_a_causal_mask_runs_unmasked():
    """One query under a bottom-right causal mask sees every key: the native row path over every
    key where the engine runs (float32 and half precision), else SDPA with no mask."""
    q, k, v = randn(2, 4, 1, 16), randn(2, 4, 600, 16), randn(2, 4, 600, 16)
    half = [t.bfloat16() for t in (q, k, v)]
    if native_build.available():
        assert "row path reads K and V once" in str(attnkit.explain(q, k, v, masks.causal()))
        assert "row path reads K and V once" in str(attnkit.explain(*half, masks.causal()))
    else:
        assert str(attnkit.explain(*half, masks.causal())) == "sdpa: the mask hides nothing here"
    with attnkit.use_kernels("sdpa"):
        torch.testing.assert_close(
            attnkit.attention(q, k, v, masks.causal()), attnkit.attention(q, k, v, masks.causal(), kernel="reference")
        )
    torch.testing.assert_close(
        attnkit.attention(q, k, v, masks.causal()), attnkit.attention(q, k, v, masks.causal(), kernel="reference")
    )
    # the top-left causal of one query sees one key: not "nothing hidden"
    assert "hides nothing" not in str(attnkit.explain(q, k, v, masks.causal("top_left")))
    torch.testing.assert_close(attnkit.attention(q, k, v, masks.causal("top_left")), v[:, :, :1])


def test_small_padding_masks_read_only_each_sequences_keys():
    q, k, v = randn(3, 4, 1, 16), randn(3, 4, 500, 16), randn(3, 4, 500, 16)
    mask = masks.padding(torch.tensor([500, 120, 7]))
    plan = attnkit.explain(q, k, v, mask)
    assert plan.kernel == PADDING_KERNEL and ("only those keys" in str(plan) or "over those keys" in str(plan))
    gold, naive = gold_and_naive(q, k, v, mask.materialize(1, 500))
    assert_oracle(attnkit.attention(q, k, v, mask), gold, naive)


def test_bfloat16_steps_stay_on_sdpa_where_the_engine_multiplies_on_amx_tiles(monkeypatch):
    """Where the engine's bfloat16 products run on AMX tiles (PyTorch's bfloat16 kernel runs on them
    too; an Intel Xeon measured the row path at 1.2-1.3x SDPA's time there), bfloat16 decoding
    steps run SDPA, unmasked, causal or padded; float16 and float32 ones keep the row path. (Here
    the engine is told it has the tiles: the CPUs this suite runs on may have none.)"""
    if not native_build.available():
        pytest.skip(native_build.status()[1])
    from attnkit.kernels.native import kernel as native_kernel

    q, k = randn(4, 8, 1, 16), randn(4, 2, 300, 16)
    padding = masks.padding(torch.tensor([300, 120, 7, 300]))
    for tiles in (False, True):
        monkeypatch.setattr(native_kernel, "_amx", lambda tiles=tiles: tiles)
        for mask in (None, masks.causal(), padding):
            for dtype in (torch.bfloat16, torch.float16, torch.float32):
                plan = attnkit.explain(q.to(dtype), k.to(dtype), k.to(dtype), mask)
                want = "sdpa" if tiles and dtype == torch.bfloat16 else "native"
                assert plan.kernel == want and (want == "sdpa" or "row path" in str(plan)), (tiles, dtype, plan)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_padding_steps_read_only_each_sequences_first_keys(monkeypatch, dtype):
    """Half-precision decoding steps over grouped K/V heads with a new padding mask each step (a
    StaticCache's step: one limit for all; a padded batch: one per sequence, zeros among them): after
    the first step no call is validated or chosen again; junk past the limits is never read; every
    step is the formula's within the error of SDPA's own call on those keys (docs/testing.md). With
    the engine the row path runs it (no SDPA call); without it SDPA sees only each sequence's first
    keys as one query head per K/V head, one SDPA call per distinct limit (over one key: that key's
    value, no SDPA)."""
    b, hq, hkv, lk, d = 4, 8, 2, 90, 16
    engine = native_build.available()
    k, v = randn(b, hkv, lk, d, dtype=dtype), randn(b, hkv, lk, d, dtype=dtype)
    draws = ([40] * b, [41] * b, [1, 7, 90, 33], [0, 0, 5, 5], [0] * b, [90, 90, 89, 90], [1] * b)
    seen = []
    real = F.scaled_dot_product_attention

    def spy(q_, k_, v_, *args, **kw):
        seen.append((tuple(q_.shape), k_.shape[2], kw.get("enable_gqa", False)))
        return real(q_, k_, v_, *args, **kw)

    calls = _calls(monkeypatch)
    with torch.no_grad():
        for step, lengths in enumerate(draws):
            mask = masks.padding(torch.tensor(lengths))
            junk_k, junk_v = k.clone(), v.clone()
            for i, n in enumerate(lengths):
                junk_k[i, :, n:], junk_v[i, :, n:] = float("nan"), float("inf")
            q = randn(b, hq, 1, d, dtype=dtype)
            plan = attnkit.explain(q, junk_k, junk_v, mask)
            cut = any(n < lk for n in lengths)  # limits that cut nothing run as no mask
            assert plan.kernel == PADDING_KERNEL, plan
            assert not engine or ("row path" in str(plan) and "rows widened to float32" in str(plan)), plan
            seen.clear()
            monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
            before = calls["n"]
            out = attnkit.attention(q, junk_k, junk_v, mask)
            monkeypatch.setattr(F, "scaled_dot_product_attention", real)
            assert step == 0 or calls["n"] == before, f"step {step} was validated and chosen again"
            if engine:
                assert not seen, seen  # the row path alone
            elif cut:
                limits = sorted(set(n for n in lengths if n > 1))  # one key: its value, exactly (no SDPA)
                assert sorted(n for _, n, _ in seen) == limits, (lengths, seen)  # each distinct limit once
                assert all(shape[1:3] == (hkv, hq // hkv) and not gqa for shape, _, gqa in seen), seen
            assert not out.isnan().any() and not out.isinf().any(), lengths  # junk past the limits unread
            for i, n in enumerate(lengths):
                if n == 0:
                    assert (out[i] == 0).all()  # a sequence that sees no key gives 0
                    continue
                qi, kn, vn = q[i : i + 1], k[i : i + 1, :, :n], v[i : i + 1, :, :n]
                gold, naive = gold_and_naive(qi, kn.repeat_interleave(4, 1), vn.repeat_interleave(4, 1))
                folded = real(qi.reshape(1, hkv, hq // hkv, d), kn, vn).reshape(1, hq, 1, d)
                worse = max(naive, folded, key=lambda t: (t.double() - gold).abs().max().item())
                assert_oracle(out[i : i + 1], gold, worse, what=f"step {step} sequence {i} of {lengths}")
