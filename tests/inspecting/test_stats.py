"""attention_stats, attention_weights(rows=, heads=) and capture(mode="stats") against dense float64 weights."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import attnkit
from attnkit import bias, masks
from attnkit.inspect import AttentionStats, attention_stats

torch.manual_seed(0)


def dense_stats(q, k, v, mask, *, sink_tokens=1, topk=3, positions=None, dtype=torch.float64, **mods) -> dict:
    """Every statistic from the weights computed whole (a softmax): in float64, or in ``dtype``."""
    w = attnkit.attention_weights(q.to(dtype), k.to(dtype), v.to(dtype), mask, **mods)
    lq, lk = w.shape[-2:]
    entropy = -torch.special.xlogy(w, w).sum(-1)
    if mods.get("sinks") is not None:
        sink = (1 - w.sum(-1)).clamp_min(0)
        entropy = entropy - torch.special.xlogy(sink, sink)
    top, arg = w.max(-1)
    qpos = torch.arange(lq, dtype=torch.float64) + (lk - lq) if positions is None else positions
    kpos = torch.arange(lk, dtype=torch.float64)
    values, keys = w.topk(min(topk, lk), -1)
    return {
        "entropy": entropy,
        "max_weight": top,
        "argmax": torch.where(top > 0, arg, -1),
        "sink_mass": w[..., :sink_tokens].sum(-1),
        "received": w.sum(-2),
        "mean_distance": (w * (qpos[:, None] - kpos[None, :]).abs()).sum(-1),
        "topk_weights": values,
        "topk_keys": torch.where(values > 0, keys, -1),
    }


def assert_stats_match(st: AttentionStats, want: dict, scale_of: dict | None = None):
    for name, ref in want.items():
        got = getattr(st, name)
        assert got.shape == ref.shape, (name, got.shape, ref.shape)
        if name in ("argmax", "topk_keys"):
            # ties aside (equal weights), the key of the largest weight is the same
            w_at = want["max_weight"] if name == "argmax" else want["topk_weights"]
            differ = (got != ref) & (w_at > 1e-6)
            assert int(differ.sum()) <= max(1, ref.numel() // 1000), (name, int(differ.sum()))
            continue
        # float32 statistics of float64 weights: rounding of the scores (~1e-6 relative)
        # times the size of the quantity summed
        size = 1.0 if name not in ("mean_distance", "received") else max(1.0, float(ref.abs().max()))
        err = (got.double() - ref).abs().max().item() if ref.numel() else 0.0
        assert err <= 2e-5 * size, (name, err)


L = 200


def _ids(seed, length=L, batch=2):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 6, (batch, length), generator=g).sort(-1).values


CASES = {
    "causal": (masks.causal(), {}),
    "document_causal": (masks.document(_ids(1)) & masks.causal(), {}),
    "none": (None, {}),
    "padding_empty_rows": (masks.causal() & masks.padding([0, 150]), {}),
    # row 0 sees no key while the rest of its block does (make fuzz found NaN received mass there)
    "causal_first_row_empty": (masks.causal() & masks.from_fn(lambda b, h, q, k: q != 0), {}),
    "window": (masks.sliding_window(17, 3), {}),
    "prefix": (masks.prefix_lm(torch.tensor([40, 7])), {}),
    "from_fn_per_head": (masks.from_fn(lambda b, h, q, k: (q + h) % 3 != k % 3, num_heads=4), {}),
    "dense_bool": (torch.rand(2, 1, L, L, generator=torch.Generator().manual_seed(3)) > 0.3, {}),
    "alibi_softcap": (masks.causal(), {"attn_bias": bias.alibi(bias.alibi_slopes(4)), "softcap": 8.0}),
    "relative": (masks.document(_ids(2)), {"attn_bias": bias.relative(torch.randn(16, 4), 16, 64)}),
    "sinks": (masks.causal(), {"sinks": torch.randn(4)}),
}


@pytest.mark.parametrize("path", ["native", "math"])
@pytest.mark.parametrize("name", list(CASES))
def test_every_statistic_equals_the_dense_computation(name, path, monkeypatch):
    """On the native engine's own two passes (``torch.ops.attnkit.native_stats``) where it can run
    the call, and from a kernel's lse (here the math kernel's) otherwise."""
    from attnkit.kernels.native import build as native_build
    from attnkit.kernels.native.kernel import NativeKernel

    if path == "native" and not native_build.available():
        pytest.skip(native_build.status()[1])
    mask, mods = CASES[name]
    q, k, v = torch.randn(2, 4, L, 16), torch.randn(2, 2, L, 16), torch.randn(2, 2, L, 16)  # GQA
    engine_calls = []
    on_the_engine = NativeKernel.stats
    monkeypatch.setattr(NativeKernel, "stats", lambda *a: engine_calls.append(1) or on_the_engine(*a))
    if path == "native":
        st = attention_stats(q, k, v, mask, topk=3, sink_tokens=2, **mods)
        assert engine_calls == [1], name
    else:
        with attnkit.use_kernels("math"):
            st = attention_stats(q, k, v, mask, topk=3, sink_tokens=2, **mods)
        assert engine_calls == []
    assert_stats_match(st, dense_stats(q, k, v, mask, topk=3, sink_tokens=2, **mods))
    # the lse is the kernel's
    _, lse = attnkit.attention(q, k, v, mask, return_lse=True, **mods)
    torch.testing.assert_close(st.lse, lse)


@pytest.mark.parametrize("engine", ["native", "math"])
@pytest.mark.parametrize("scale", [4.0, 6.0])
@pytest.mark.parametrize("sinks", [False, True])
def test_weights_under_large_logits_as_exact_as_a_softmax(sinks, scale, engine):
    """Logits near 100 (lse 40-80, as a trained model's can be): a float32 lse is off by up to half
    an ulp (4e-6 at 80), an error common to its row that exp(s - lse) would make a relative error of
    every weight. Both engines form each weight from the row's largest score and its sum, found in a
    first pass (the native engine as exp(s - max) times the row's share, the math kernel as
    exp((s - max) - log sum)), a sink counted in the sum: the top-k weights, the mass each key
    receives and the statistics of each row are as exact as a float32 softmax's (TESTING.md's rule
    against the float64 weights; with exp(s - lse), the received mass reached 2.9x the softmax's
    error and the sink tokens' mass 2.6x)."""
    from _oracle import assert_oracle

    from attnkit.kernels.native import build as native_build

    if engine == "native" and not native_build.available():
        pytest.skip(native_build.status()[1])
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 4, 160, 16, generator=g) for _ in range(3))
    mods = {"scale": scale, **({"sinks": torch.tensor([30.0, -5.0, 60.0, 0.0]) * scale / 4} if sinks else {})}
    mask = masks.causal()
    with attnkit.use_kernels(engine):
        st = attention_stats(q, k, v, mask, topk=4, **mods)
    assert st.lse.abs().max() > 40
    gold = dense_stats(q, k, v, mask, topk=4, **mods)
    naive = dense_stats(q, k, v, mask, topk=4, dtype=torch.float32, **mods)
    for name in ("max_weight", "topk_weights", "received", "sink_mass", "entropy", "mean_distance"):
        assert_oracle(getattr(st, name), gold[name], naive[name], what=f"{name}, large logits")


def test_fully_masked_rows_are_documented_zeros():
    q = k = v = torch.randn(2, 2, 30, 8)
    st = attention_stats(q, k, v, masks.padding([0, 30]), topk=2)
    assert torch.isinf(st.lse[0]).all() and (st.lse[0] < 0).all()
    for name in ("entropy", "max_weight", "sink_mass", "mean_distance"):
        assert (getattr(st, name)[0] == 0).all()
    assert (st.argmax[0] == -1).all() and (st.topk_keys[0] == -1).all() and (st.received[0] == 0).all()
    assert not st.valid[0].any() and st.valid[1].all()


def test_offsets_and_cross_lengths():
    """A chunk of queries late in a sequence (q_offset) and Lq != Lk: positions follow the mask."""
    q, k, v = torch.randn(1, 2, 40, 8), torch.randn(1, 2, 300, 8), torch.randn(1, 2, 300, 8)
    mask = masks.causal(align="top_left", q_offset=200)
    st = attention_stats(q, k, v, mask, topk=4)
    positions = torch.arange(40, dtype=torch.float64) + 200
    assert_stats_match(st, dense_stats(q, k, v, mask, topk=4, positions=positions))


def test_rank_two_and_three_inputs():
    q = k = v = torch.randn(3, 20, 8)
    st = attention_stats(q, k, v, masks.causal())
    assert st.entropy.shape == (3, 20)
    torch.testing.assert_close(st.entropy, attention_stats(q[None], k[None], v[None], masks.causal()).entropy[0])
    st2 = attention_stats(q[0], k[0], v[0], masks.causal())
    assert st2.entropy.shape == (20,)


def test_head_summary_averages_rows_that_attend():
    q = k = v = torch.randn(2, 3, 25, 8)
    st = attention_stats(q, k, v, masks.padding([0, 25]))
    summary = st.head_summary()
    torch.testing.assert_close(summary["entropy"], st.entropy[1].mean(-1))


def test_bad_arguments():
    q = torch.randn(1, 1, 4, 8)
    with pytest.raises(ValueError, match="topk"):
        attention_stats(q, q, q, topk=-1)
    with pytest.raises(TypeError, match="attn_bias"):
        attention_stats(q, q, q, torch.zeros(4, 4))
    with pytest.raises(ValueError, match="rank 2 to 4"):
        attention_stats(q[None], q[None], q[None])


class _LargestTensor(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize(
    "mask", [masks.causal(), masks.document(torch.arange(16384) // 1000) & masks.causal()], ids=["causal", "document"]
)
def test_no_tensor_of_lq_lk_over_16_at_16384(mask):
    length = 16384
    q = k = v = torch.randn(1, 1, length, 16)
    with _LargestTensor() as seen:
        st = attention_stats(q, k, v, mask, topk=2)
    assert seen.largest < length * length // 16, seen.largest
    assert torch.isfinite(st.entropy).all()


# --- attention_weights(rows=, heads=) -------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    ["causal", "document_causal", "padding_empty_rows", "alibi_softcap", "sinks", "from_fn_per_head", "dense_bool"],
)
def test_chosen_rows_and_heads_are_slices_of_the_weights(name):
    mask, mods = CASES[name]
    q, k, v = torch.randn(2, 4, L, 16), torch.randn(2, 2, L, 16), torch.randn(2, 2, L, 16)
    full = attnkit.attention_weights(q, k, v, mask, **mods)
    for rows, heads in ((-1, None), ([0, 17, 199], [1, 3]), (slice(50, 60), 2), (None, [0])):
        got = attnkit.attention_weights(q, k, v, mask, rows=rows, heads=heads, **mods)
        r = (
            torch.arange(L)[rows]
            if isinstance(rows, slice)
            else torch.arange(L)
            if rows is None
            else torch.tensor(rows).reshape(-1) % L
        )
        h = torch.arange(4) if heads is None else torch.tensor(heads).reshape(-1)
        torch.testing.assert_close(got, full[:, h][:, :, r])


def test_chosen_rows_bad_indices():
    q = torch.randn(1, 2, 5, 4)
    with pytest.raises(ValueError, match="out of range"):
        attnkit.attention_weights(q, q, q, rows=[5])
    with pytest.raises(ValueError, match="out of range"):
        attnkit.attention_weights(q, q, q, heads=-3)
    with pytest.raises(TypeError, match="integer"):
        attnkit.attention_weights(q, q, q, rows=torch.tensor([0.5]))
    with pytest.raises(TypeError, match="rows must be"):
        attnkit.attention_weights(q, q, q, rows="last")


def test_chosen_rows_memory_is_what_is_returned():
    length = 8192
    q = k = v = torch.randn(1, 2, length, 16)
    with _LargestTensor() as seen:
        w = attnkit.attention_weights(q, k, v, masks.causal(), rows=[-1, -2], heads=[0])
    assert w.shape == (1, 1, 2, length)
    assert seen.largest <= max(k.numel(), 4 * w.numel())  # inputs and the result, never Lq x Lk


# --- capture ------------------------------------------------------------------------------------


def test_capture_stats_mode_on_attnkit_layers():
    torch.manual_seed(0)
    model = torch.nn.ModuleList([attnkit.MultiHeadAttention(16, 4, softcap=5.0, sinks=True) for _ in range(2)])
    x = torch.randn(1, 40, 16)
    with attnkit.capture(model, mode="stats", rows=[-1], topk=2) as cap:
        h = model[0](x, mask=masks.causal())[0]
        model[1](h, mask=masks.causal())
    with attnkit.capture(model) as full:
        h = model[0](x, mask=masks.causal())[0]
        model[1](h, mask=masks.causal())
    assert len(cap.stats) == 2 and cap.stack_stats("entropy").shape == (2, 4, 40)
    for st, w, last in zip(cap.stats, full.weights, cap.weights):
        ent = -torch.special.xlogy(w.double(), w.double()).sum(-1)
        sink = (1 - w.double().sum(-1)).clamp_min(0)
        torch.testing.assert_close(st.entropy.double(), ent - torch.special.xlogy(sink, sink), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(last, w[:, :, -1:])


def test_capture_refuses_full_weights_of_a_long_input(monkeypatch):
    import sys

    monkeypatch.setattr(sys.modules["attnkit.inspect.capturing"], "FULL_WEIGHTS_BUDGET", 1000)
    model = torch.nn.Sequential(attnkit.MultiHeadAttention(8, 2))
    with pytest.raises(ValueError, match="mode='stats'"):
        with attnkit.capture(model):
            model(torch.randn(1, 40, 8))
    with attnkit.capture(model, rows=[-1]) as cap:  # chosen rows still fit
        model(torch.randn(1, 40, 8))
    assert cap.weights[0].shape == (1, 2, 1, 40)
    with pytest.raises(ValueError, match="mode must be"):
        attnkit.capture(model, mode="all")
