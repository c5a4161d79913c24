"""The cross-feature differential suite: whatever a context adds, the answer equals the
float64 formula's for the same pairs and biases.

Every mask kind (offsets, ``from_fn``, prepared, dense, combined) x every score
modification (none, ALiBi, relative, ``from_fn`` bias, dense bias with ``-inf`` and junk at
hidden pairs, sums, softcap, sinks with ``-inf`` and extreme values) x the contexts that
carry attention (a plain call on each kernel, ``MultiHeadAttention`` with rotary embeddings,
a ``KVCache`` of mixed fills decoding step by step, ``capture`` weights and statistics,
ring attention on 1-3 processes, the transformers integration) x dtype (float64, float32,
bfloat16) x layout (contiguous, transposed, strided last dimension, expanded, GQA).

The oracle (``formula`` below) is written here from the definition, in float64, and
knows nothing of attnkit's kernels: it takes the dense pattern of allowed pairs and the
dense bias. ``make test`` runs a small budget (profile ``ci``), ``make fuzz`` fresh seeds.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import Phase, given, note, settings
from hypothesis import strategies as st

import attnkit
from attnkit import bias as B
from attnkit import masks as M

NEG_INF = float("-inf")
FUZZ = os.environ.get("ATTNKIT_FUZZ_PROFILE", "ci") == "fuzz"


# --- the oracle ---------------------------------------------------------------------------------


def formula(q, k, v, allowed=None, bias=None, softcap=None, sinks=None, scale=None, score_mod=None):
    """``(out, weights, lse)`` of softmax(softcap(q k^T scale) + bias, hidden pairs -inf, sinks) @ v.

    ``allowed``: bool broadcastable to (B, Hq, Lq, Lk) or None; ``bias``: float, the same;
    ``sinks``: (Hq,) logits of an extra key of value 0. A row with no finite score gives
    weights 0, output 0 and lse -inf (or the sink's logit). Computed in q's dtype.
    """
    if scale is None:
        scale = q.shape[-1] ** -0.5
    group = q.shape[-3] // k.shape[-3]
    k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    s = q @ k.transpose(-2, -1) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if bias is not None:
        s = s + bias.to(s.dtype)
    if score_mod is not None:
        idx = [torch.arange(n).view(*([1] * i), n, *([1] * (3 - i))) for i, n in enumerate(s.shape[-4:])]
        s = score_mod(s, *idx).to(s.dtype)
    if allowed is not None:
        s = s.masked_fill(~allowed, NEG_INF)  # overwrites whatever the bias held at hidden pairs
    if sinks is not None:
        sink = sinks.to(s.dtype).view(-1, 1, 1).expand(*s.shape[:-1], 1)
        s = torch.cat([s, sink], dim=-1)
    dead = (s == NEG_INF).all(dim=-1, keepdim=True)
    m = s.amax(dim=-1, keepdim=True).masked_fill(dead, 0.0)
    p = torch.exp(s - m)
    total = p.sum(dim=-1, keepdim=True)
    w = p / torch.where(total == 0, 1.0, total)
    lse = (m + total.log()).squeeze(-1)
    w = w[..., : k.shape[-2]]
    return w @ v, w, lse


def bound(out, gold, naive, factor=2.0):
    """TESTING.md: factor x the naive formula's error (same dtype) + one rounding at gold's scale."""
    if out.dtype == torch.float64:
        return 1e-9 * max(1.0, gold.abs().max().item())
    rounding = 2 * ((gold.to(out.dtype) + 0.3 - 0.3).double() - gold).abs().max().item()
    return factor * (naive.double() - gold).abs().max().item() + rounding


def check(got, gold, naive, what, factor=2.0, logit_floor=0.0):
    """``logit_floor``: the error one rounding of the logits causes (see test_plain_call), a floor
    for the bound where the naive error is a single rounding's lucky draw."""
    assert got.shape == gold.shape, (what, got.shape, gold.shape)
    finite = torch.isfinite(gold)
    assert torch.equal(torch.isfinite(got), finite), f"{what}: non-finite values where the formula has none"
    if not finite.any():
        return
    err = (got.double() - gold)[finite].abs().max().item()
    limit = bound(got[finite], gold[finite], naive[finite], factor)
    rows = got.shape[-2] if got.dim() >= 2 else 1
    if rows < 4 and got.dtype != torch.float64:
        # TESTING.md: on one to three rows the naive formula's own error can be a lucky rounding far
        # below its typical size; its floor there is a few roundings of a weighted sum at gold's scale.
        limit = max(limit, factor * 4 * torch.finfo(got.dtype).eps * max(1.0, gold[finite].abs().max().item()))
    limit = max(limit, factor * logit_floor)
    assert err <= limit, f"{what}: error {err:.3e} > {limit:.3e}"


# --- what to draw -----------------------------------------------------------------------------------


@st.composite
def sizes(draw, max_len=96):
    b = draw(st.integers(1, 2))
    hkv = draw(st.integers(1, 2))
    hq = hkv * draw(st.integers(1, 2))
    lq = draw(st.integers(1, max_len))
    lk = draw(st.one_of(st.just(lq), st.integers(1, max_len)))
    d = draw(st.sampled_from([8, 16]))
    dv = draw(st.sampled_from([d, 8]))
    return b, hq, hkv, lq, lk, d, dv


def _offset(draw, b, low=-4, high=8):
    if draw(st.booleans()):
        return draw(st.integers(low, high))
    return torch.tensor([draw(st.integers(low, high)) for _ in range(b)])


def _periodic(b, h, q, kv):
    return ((q - kv) % 3 != 1) | (kv == 0)


def _per_head(b, h, q, kv):
    return (q - kv).abs() <= 2 + 3 * h


@st.composite
def a_mask(draw, b, hq, lq, lk, simple=False):
    """(mask or None, description). ``simple``: kinds a KV cache or a module can align (positions only)."""
    kinds = ["none", "causal", "window", "prefix", "from_fn"]
    if not simple:
        kinds += ["document", "padding", "dense", "per_head", "combo", "prepared"]
    kind = draw(st.sampled_from(kinds))
    # inside a cache only bottom-right masks follow each sequence's end (top-left ones keep their offsets)
    align = "bottom_right" if simple else draw(st.sampled_from(["bottom_right", "top_left"]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    if kind == "none":
        return None, kind
    if kind == "causal":
        off = {} if simple else {"q_offset": _offset(draw, b)}
        return M.causal(align, **off), f"causal({align}, {off})"
    if kind == "window":
        left, right = draw(st.integers(0, 30)), draw(st.integers(0, 4))
        return M.sliding_window(left, right, align), f"window({left},{right},{align})"
    if kind == "prefix":
        n = draw(st.integers(0, lk)) if simple or draw(st.booleans()) else torch.randint(0, lk + 1, (b,), generator=g)
        return M.prefix_lm(n, align), f"prefix({n},{align})"
    if kind == "from_fn":
        return M.from_fn(_periodic), "from_fn(periodic)"
    if kind == "per_head":
        return M.from_fn(_per_head, num_heads=hq), "from_fn(per head)"
    if kind == "document":
        if lq != lk:
            return M.causal(align), "causal (document needs Lq == Lk)"
        ids = torch.sort(torch.randint(0, 4, (b, lq), generator=g), dim=-1).values
        return M.document(ids), f"document({ids.tolist()})"
    if kind == "padding":
        lengths = torch.randint(0, lk + 1, (b,), generator=g)
        return M.padding(lengths), f"padding({lengths.tolist()})"
    if kind == "dense":
        shape = draw(st.sampled_from([(lq, lk), (b, 1, lq, lk), (1, hq, lq, lk), (lk,)]))
        t = torch.rand(*shape, generator=g) > draw(st.floats(0.0, 0.9))
        return M.dense(t), f"dense{shape}"
    if kind == "combo":
        lengths = torch.randint(0, lk + 1, (b,), generator=g)
        other = M.sliding_window(draw(st.integers(0, 20)), 0, align)
        if draw(st.booleans()):
            return M.padding(lengths) & M.causal(align) | other, "padding & causal | window"
        return M.padding(lengths) & other & M.from_fn(_periodic), "padding & window & from_fn"
    inner, what = draw(a_mask(b, hq, lq, lk, simple=True))
    if inner is not None and draw(st.booleans()):
        inner = inner & M.sliding_window(draw(st.integers(0, 20)), 0, align)
    return (None if inner is None else attnkit.prepare(inner, lq, lk)), f"prepared({what})"


@st.composite
def a_bias(draw, b, hq, lq, lk, dtype, simple=False):
    """(bias object or None, its params to differentiate, description)."""
    pd = torch.float64 if dtype == torch.float64 else torch.float32
    kinds = ["none", "alibi", "relative", "from_fn", "sum"] + ([] if simple else ["dense", "dense_junk"])
    kind = draw(st.sampled_from(kinds))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    if kind == "none":
        return None, (), kind
    if kind == "alibi":
        slopes = B.alibi_slopes(hq).to(pd).requires_grad_()
        causal = draw(st.booleans())
        return B.alibi(slopes, causal=causal), (slopes,), f"alibi(causal={causal})"
    if kind == "relative":
        table = torch.randn(16, hq, generator=g, dtype=pd).requires_grad_()
        bi = draw(st.booleans())
        return B.relative(table, 16, 40, bidirectional=bi), (table,), f"relative(bidirectional={bi})"
    if kind == "from_fn":
        w = torch.tensor(0.2, dtype=pd).requires_grad_()
        return B.from_fn(lambda bb, h, i, j: -w * (i - j).abs().to(pd) + 0.1 * h.to(pd), w), (w,), "from_fn"
    if kind == "sum":
        slopes = B.alibi_slopes(hq).to(pd)
        table = torch.randn(8, hq, generator=g, dtype=pd).requires_grad_()
        return B.alibi(slopes) + B.relative(table, 8, 16), (table,), "alibi + relative"
    t = torch.randn(b, hq, lq, lk, generator=g, dtype=pd)
    if kind == "dense_junk":  # -inf on some pairs: those are hidden too
        t = t.masked_fill(torch.rand(b, hq, lq, lk, generator=g) < 0.15, NEG_INF)
        return B.dense(t), (), "dense with -inf"
    t.requires_grad_()
    return B.dense(t), (t,), "dense"


SCORE_MODS = {
    "none": None,
    "relu": lambda s, b, h, i, j: torch.relu(s),
    "gate": lambda s, b, h, i, j: s - torch.sigmoid(0.5 * s + 0.1 * h) - 0.02 * (i - j).abs(),  # -inf stays -inf
    "cap": lambda s, b, h, i, j: 4.0 * torch.tanh(s / 4.0) + 0.3 * b,
}


def _sinks(draw, hq, pd):
    kind = draw(st.sampled_from(["none", "normal", "-inf", "extreme"]))
    if kind == "none":
        return None
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))  # drawn, so a failure replays
    s = torch.randn(hq, generator=g, dtype=pd)
    if kind == "-inf":
        s[0] = NEG_INF
    if kind == "extreme":
        s = s * 30
    return s.requires_grad_()


def _seed_torch(data):
    """Seed torch's global generator from a drawn value (module weights, upstream gradients), so a
    failure replays: Hypothesis seeds Python's ``random``, not torch's."""
    torch.manual_seed(data.draw(st.integers(0, 2**31 - 1)))


def layout(t, kind):
    """The same values in another memory layout."""
    if kind == "transposed":  # (B, H, D, L) storage
        return t.transpose(-1, -2).contiguous().transpose(-1, -2)
    if kind == "strided":  # a unit stride nowhere in the last dim
        wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
        wide[..., ::2] = t
        return wide[..., ::2]
    return t


def _draw_inputs(draw, size, dtype, scale=1.0):
    b, hq, hkv, lq, lk, d, dv = size
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    expand = b > 1 and draw(st.booleans())
    rows = 1 if expand else b
    q = scale * torch.randn(rows, hq, lq, d, generator=g, dtype=torch.float64)
    k = scale * torch.randn(rows, hkv, lk, d, generator=g, dtype=torch.float64)
    v = torch.randn(rows, hkv, lk, dv, generator=g, dtype=torch.float64)
    q, k, v = (t.to(dtype) for t in (q, k, v))
    kinds = [draw(st.sampled_from(["contiguous", "transposed", "strided"])) for _ in range(3)]
    q, k, v = (layout(t, kind) for t, kind in zip((q, k, v), kinds))
    if expand:  # one sequence's values seen by every row of the batch (stride 0)
        q, k, v = (t.expand(b, *t.shape[1:]) for t in (q, k, v))
    return q, k, v, f"layouts={kinds} expanded={expand}"


def _allowed(mask, lq, lk):
    if mask is None:
        return None
    if isinstance(mask, attnkit.PreparedMask):
        return mask.materialize()
    return mask.materialize(lq, lk)


def _dense_bias(bias, b, hq, lq, lk):
    return None if bias is None else bias.dense(b, hq, lq, lk, "cpu").detach().double()


# --- context 1: a plain call on every kernel ---------------------------------------------------------


@given(
    sizes(),
    st.data(),
    st.sampled_from([torch.float64, torch.float32, torch.bfloat16]),
    st.sampled_from(["auto", "tiled", "reference", "sdpa"]),
)
def test_plain_call(size, data, dtype, kernel):
    b, hq, hkv, lq, lk, d, dv = size
    mask, m_what = data.draw(a_mask(b, hq, lq, lk))
    attn_bias, _, b_what = data.draw(a_bias(b, hq, lq, lk, dtype))
    softcap = data.draw(st.one_of(st.none(), st.floats(0.5, 50.0)))
    pd = torch.float64 if dtype == torch.float64 else torch.float32
    sinks = _sinks(data.draw, hq, pd)
    mod_name = data.draw(st.sampled_from(list(SCORE_MODS)))
    q, k, v, l_what = _draw_inputs(data.draw, size, dtype, scale=data.draw(st.sampled_from([1.0, 4.0])))
    note(
        f"{size} {dtype} {kernel} | {m_what} | {b_what} | softcap={softcap} sinks={sinks} score_mod={mod_name} "
        f"| {l_what}"
    )
    mods = {
        "attn_bias": attn_bias,
        "softcap": softcap,
        "sinks": None if sinks is None else sinks.detach(),
        "score_mod": SCORE_MODS[mod_name],
    }
    try:
        out = attnkit.attention(q, k, v, mask, kernel=kernel, **mods)
    except ValueError as err:  # a forced kernel may refuse (SDPA has no sinks): that must be all
        assert kernel != "auto" and "cannot run this call" in str(err), err
        return
    allowed, dense_bias = _allowed(mask, lq, lk), _dense_bias(attn_bias, b, hq, lq, lk)
    gold, w_gold, lse_gold = formula(
        q.double(),
        k.double(),
        v.double(),
        allowed,
        dense_bias,
        softcap,
        None if sinks is None else sinks.detach().double(),
        score_mod=SCORE_MODS[mod_name],
    )
    low = {
        "allowed": allowed,
        "bias": None if dense_bias is None else dense_bias.to(dtype),
        "softcap": softcap,
        "sinks": None if sinks is None else sinks.detach().to(dtype),
        "score_mod": SCORE_MODS[mod_name],
    }
    # docs/testing.md: the larger error of two evaluation orders, the scale applied to the
    # scores and folded into q first
    scores_scaled = formula(q, k, v, **low)[0]
    q_scaled = formula(q * d**-0.5, k, v, scale=1.0, **low)[0]
    naive = max((scores_scaled, q_scaled), key=lambda n: (n.double() - gold).nan_to_num().abs().max().item())
    logit_floor = 0.0
    if dtype != torch.float64 and torch.isfinite(lse_gold).any():
        # docs/testing.md: the naive error is one evaluation's draw; the floor is a few roundings of
        # a sum at v's scale plus what one rounding of the logits moves the weights by (|ds| ~
        # eps |s|, and |s| ~ |lse| where a weight matters): what any float32 evaluation may differ by
        s_max = lse_gold[torch.isfinite(lse_gold)].abs().max().item()
        logit_floor = torch.finfo(dtype).eps * v.double().abs().max().item() * (4.0 + s_max)
    check(out, gold, naive, "out", logit_floor=logit_floor)
    if kernel in ("tiled", "reference", "auto"):
        _, lse = attnkit.attention(q, k, v, mask, kernel=kernel, return_lse=True, **mods)
        finite = torch.isfinite(lse_gold)
        assert torch.equal(torch.isfinite(lse), finite), "lse: -inf rows differ"
        tol = 1e-9 if dtype == torch.float64 else 2e-2 if dtype == torch.bfloat16 else 1e-4
        assert (
            (lse.double() - lse_gold)[finite].abs().max().item() <= tol * max(1.0, lse_gold[finite].abs().max().item())
            if finite.any()
            else True
        )


@given(sizes(max_len=48), st.data(), st.sampled_from(["auto", "tiled", "reference"]))
def test_plain_call_gradients(size, data, kernel):
    """float64: every gradient (q, k, v, bias parameters, sinks) equals the formula's to ~1e-9."""
    b, hq, hkv, lq, lk, d, dv = size
    _seed_torch(data)
    mask, m_what = data.draw(a_mask(b, hq, lq, lk))
    attn_bias, params, b_what = data.draw(a_bias(b, hq, lq, lk, torch.float64))
    softcap = data.draw(st.one_of(st.none(), st.floats(0.5, 50.0)))
    sinks = _sinks(data.draw, hq, torch.float64)
    mod_name = data.draw(st.sampled_from(list(SCORE_MODS)))
    q, k, v, l_what = _draw_inputs(data.draw, size, torch.float64)
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    note(f"{size} {kernel} | {m_what} | {b_what} | softcap={softcap} sinks={sinks} score_mod={mod_name} | {l_what}")
    up = torch.randn(b, hq, lq, dv, dtype=torch.float64)
    wanted = [q, k, v, *params] + ([sinks] if sinks is not None else [])
    out = attnkit.attention(
        q, k, v, mask, kernel=kernel, attn_bias=attn_bias, softcap=softcap, sinks=sinks, score_mod=SCORE_MODS[mod_name]
    )
    ours = torch.autograd.grad(out, wanted, up, allow_unused=True)
    allowed = _allowed(mask, lq, lk)
    dense = None if attn_bias is None else attn_bias.dense(b, hq, lq, lk, "cpu").double()
    gold, _, _ = formula(q, k, v, allowed, dense, softcap, sinks, score_mod=SCORE_MODS[mod_name])
    theirs = torch.autograd.grad(gold, wanted, up, allow_unused=True)
    for i, (a, w) in enumerate(zip(ours, theirs)):
        a = torch.zeros_like(wanted[i]) if a is None else a
        w = torch.zeros_like(wanted[i]) if w is None else w
        assert torch.isfinite(a).all(), f"gradient {i} holds NaN/Inf"
        assert (a - w).abs().max() <= 1e-8 * max(1.0, w.abs().max().item()), f"gradient {i} differs"


# --- context 2: a module with rotary embeddings, decoding from a cache of mixed fills -----------------------


def _module_oracle(mha, x, mask, attn_bias, n):
    """The layer's output for one sequence's first n tokens, from the formula (no attnkit kernel)."""
    q, k, v = mha.project(x[None, :n])
    if mha.rotary is not None:
        pos = torch.arange(n)
        q, k = mha.rotary(q, pos), mha.rotary(k, pos)
    allowed = None if mask is None else mask.materialize(n, n)
    dense = _dense_bias(attn_bias, 1, mha.num_heads, n, n)
    sinks = None if mha.sinks is None else mha.sinks.detach().double()
    out, w, lse = formula(q.double(), k.double(), v.double(), allowed, dense, mha.softcap, sinks)
    return mha.out_proj(mha.merge_heads(out.to(q.dtype)))[0, -1], w[0], lse[0]


@given(st.data(), st.integers(1, 3), st.sampled_from([torch.float32, torch.float64]))
def test_module_decoding_from_a_mixed_fill_cache(data, steps, dtype):
    """Prefill sequences of different lengths into one KVCache, decode step by step: each step's
    output, captured weights and statistics equal the formula on that sequence's own prefix."""
    from attnkit.nn import RotaryEmbedding

    _seed_torch(data)
    hkv = data.draw(st.sampled_from([1, 2]))
    hq = 2 * hkv
    d_model = 8 * hq
    softcap = data.draw(st.one_of(st.none(), st.floats(1.0, 30.0)))
    rotary = RotaryEmbedding(8) if data.draw(st.booleans()) else None
    mha = attnkit.MultiHeadAttention(
        d_model, hq, num_kv_heads=hkv, softcap=softcap, sinks=data.draw(st.booleans()), rotary=rotary, dtype=dtype
    ).eval()
    if mha.sinks is not None:
        with torch.no_grad():
            mha.sinks.copy_(torch.randn(hq))
    fills = [data.draw(st.integers(1, 12)) for _ in range(data.draw(st.integers(1, 3)))]
    longest = max(fills) + steps
    mask, m_what = data.draw(a_mask(len(fills), hq, longest, longest, simple=True))
    attn_bias, _, b_what = data.draw(a_bias(1, hq, longest, longest, dtype, simple=True))
    note(f"fills={fills} steps={steps} {dtype} softcap={softcap} rotary={rotary is not None} | {m_what} | {b_what}")
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    x = torch.randn(len(fills), longest, d_model, generator=g, dtype=torch.float64).to(dtype)
    cache = attnkit.KVCache(len(fills), hkv, longest + 2, mha.head_dim, dtype=dtype)
    prompt = torch.zeros(len(fills), max(fills), d_model, dtype=dtype)
    for s, n in enumerate(fills):
        prompt[s, :n] = x[s, :n]
    tol = 1e-9 if dtype == torch.float64 else 2e-5
    with torch.no_grad():
        mha(prompt, mask=mask, cache=cache, counts=torch.tensor(fills), attn_bias=attn_bias)
        for step in range(steps):
            new = torch.stack([x[s, n + step] for s, n in enumerate(fills)])[:, None]
            with attnkit.capture(mha, mode="stats", rows=[-1]) as cap:
                out, _ = mha(new, mask=mask, cache=cache, attn_bias=attn_bias)
            st_, w_cap = cap.stats[0], cap.weights[0]
            for s, n in enumerate(fills):
                want, w, lse = _module_oracle(mha, x[s], mask, attn_bias, n + step + 1)
                assert (out[s, 0].double() - want.double()).abs().max() <= tol * max(1.0, want.abs().max().item()), (
                    f"step {step} sequence {s}: output"
                )
                row = w[:, -1]  # (H, n + step + 1): the new token's weights over its own prefix
                got = w_cap[s, :, 0, : n + step + 1].double()
                assert (got - row).abs().max() <= tol * 10, f"step {step} sequence {s}: captured weights"
                assert (w_cap[s, :, 0, n + step + 1 :] == 0).all(), "weights on other sequences' slots"
                finite = torch.isfinite(lse[:, -1])
                assert torch.equal(torch.isfinite(st_.lse[s, :, 0]), finite)
                if finite.any():
                    assert (st_.lse[s, :, 0].double() - lse[:, -1])[finite].abs().max() <= tol * 100
                pos = torch.arange(n + step + 1, dtype=torch.float64)
                distance = (row * (n + step - pos).abs()).sum(-1)
                assert (st_.mean_distance[s, :, 0].double() - distance).abs().max() <= tol * 100 * (n + step + 1)


# --- context 3: capture of whole sequences (weights and statistics) -----------------------------------------


@given(st.data(), st.sampled_from([torch.float32, torch.float64]))
def test_capture_weights_and_stats(data, dtype):
    from attnkit.nn import RotaryEmbedding

    _seed_torch(data)
    b, hq, length = data.draw(st.integers(1, 2)), data.draw(st.sampled_from([2, 4])), data.draw(st.integers(1, 70))
    mha = attnkit.MultiHeadAttention(
        8 * hq,
        hq,
        softcap=data.draw(st.one_of(st.none(), st.floats(1.0, 30.0))),
        sinks=data.draw(st.booleans()),
        rotary=RotaryEmbedding(8) if data.draw(st.booleans()) else None,
        dtype=dtype,
    ).eval()
    if mha.sinks is not None:
        with torch.no_grad():
            mha.sinks.copy_(3 * torch.randn(hq))
    mask, m_what = data.draw(a_mask(b, hq, length, length))
    attn_bias, _, b_what = data.draw(a_bias(b, hq, length, length, dtype))
    topk = data.draw(st.integers(0, 3))
    note(f"B={b} H={hq} L={length} {dtype} {mha} | {m_what} | {b_what} | topk={topk}")
    x = torch.randn(b, length, 8 * hq, dtype=torch.float64).to(dtype)
    with torch.no_grad():
        with attnkit.capture(mha) as full:
            mha(x, mask=mask, attn_bias=attn_bias)
        with attnkit.capture(mha, mode="stats", topk=topk, rows=[0, -1]) as stats:
            mha(x, mask=mask, attn_bias=attn_bias)
        q, k, v = mha.project(x)
        if mha.rotary is not None:
            q, k = mha.rotary(q, torch.arange(length)), mha.rotary(k, torch.arange(length))
    allowed = _allowed(mask, length, length)
    sinks = None if mha.sinks is None else mha.sinks.detach().double()
    _, w, lse = formula(
        q.double(), k.double(), v.double(), allowed, _dense_bias(attn_bias, b, hq, length, length), mha.softcap, sinks
    )
    tol = 1e-9 if dtype == torch.float64 else 1e-5
    assert (full.weights[0].double() - w).abs().max() <= tol
    assert (stats.weights[0].double() - w[:, :, [0, length - 1]]).abs().max() <= tol
    st_ = stats.stats[0]
    sink = (1 - w.sum(-1)).clamp(min=0) if sinks is not None else torch.zeros_like(w[..., 0])
    entropy = -torch.special.xlogy(w, w).sum(-1) - torch.special.xlogy(sink, sink)
    finite = torch.isfinite(lse)
    assert torch.equal(torch.isfinite(st_.lse), finite)
    assert (st_.entropy.double() - entropy).abs().max() <= 100 * tol
    assert (st_.received.double() - w.sum(-2)).abs().max() <= 100 * tol * length
    assert (st_.max_weight.double() - w.amax(-1)).abs().max() <= 10 * tol
    positions = (
        None
        if mask is None
        else (mask.mask if isinstance(mask, attnkit.PreparedMask) else mask).positions(length, length)
    )
    qp, kp = positions if positions is not None else (torch.arange(length)[None], torch.arange(length)[None])
    distance = (w * (qp[:, None, :, None] - kp[:, None, None, :]).abs().double()).sum(-1)
    assert (st_.mean_distance.double() - distance).abs().max() <= 100 * tol * length
    if topk:
        best = w.topk(min(topk, length), dim=-1).values
        assert (st_.topk_weights[..., : best.shape[-1]].double() - best).abs().max() <= 10 * tol


# --- context 4: ring attention on 1-3 processes -----------------------------------------------------------


RING_MASKS = ["none", "causal", "window", "document", "padding", "prefix", "from_fn", "dense"]
RING_BIASES = ["none", "alibi", "relative", "dense"]


def ring_case(desc):
    """Inputs, mask and modifications of one described case: plain data in, so ranks rebuild it."""
    g = torch.Generator().manual_seed(desc["seed"])
    b, hq, hkv, length, d, dv = desc["b"], desc["hq"], desc["hkv"], desc["length"], 8, desc["dv"]
    q = torch.randn(b, hq, length, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, hkv, length, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, hkv, length, dv, generator=g, dtype=torch.float64)
    up = torch.randn(b, hq, length, dv, generator=g, dtype=torch.float64)
    kind = desc["mask"]
    mask = {
        "none": lambda: None,
        "causal": lambda: M.causal(),
        "window": lambda: M.sliding_window(5, 2),
        "document": lambda: M.document(torch.sort(torch.randint(0, 5, (b, length), generator=g), -1).values),
        "padding": lambda: M.padding(torch.randint(0, length + 1, (b,), generator=g)) & M.causal(),
        "prefix": lambda: M.prefix_lm(torch.randint(0, length + 1, (b,), generator=g)),
        "from_fn": lambda: M.from_fn(_periodic),
        "dense": lambda: torch.rand(b, 1, length, length, generator=g) > 0.5,
    }[kind]()
    params = {}
    if desc["bias"] == "alibi":
        params["slopes"] = B.alibi_slopes(hq).double().requires_grad_()
        attn_bias = B.alibi(params["slopes"], causal=True)
    elif desc["bias"] == "relative":
        params["table"] = torch.randn(8, hq, generator=g, dtype=torch.float64).requires_grad_()
        attn_bias = B.relative(params["table"], 8, 16)
    elif desc["bias"] == "dense":
        params["dense"] = torch.randn(b, hq, length, length, generator=g, dtype=torch.float64).requires_grad_()
        attn_bias = B.dense(params["dense"])
    else:
        attn_bias = None
    if desc["sinks"]:
        params["sinks"] = torch.randn(hq, generator=g, dtype=torch.float64).requires_grad_()
    return q, k, v, up, mask, attn_bias, params


def ring_worker(rank, world, descs):
    from attnkit import distributed as D

    results = []
    for desc in descs:
        q, k, v, up, mask, attn_bias, params = ring_case(desc)
        parts = [D.shard(t, 2, desc["layout"])[0].clone().requires_grad_() for t in (q, k, v)]
        out = D.ring_attention(
            *parts,
            mask,
            layout=desc["layout"],
            attn_bias=attn_bias,
            softcap=desc["softcap"],
            sinks=params.get("sinks"),
            timeout=60,
        )
        (out * D.shard(up, 2, desc["layout"])[0]).sum().backward()
        whole = [D.unshard(t, 2, desc["layout"]) for t in (out.detach(), *(p.grad for p in parts))]
        results.append((whole, {n: p.grad for n, p in params.items()}))
    return results


@st.composite
def ring_cases(draw):
    hkv = draw(st.integers(1, 2))
    return {
        "seed": draw(st.integers(0, 2**31 - 1)),
        "b": draw(st.integers(1, 2)),
        "hkv": hkv,
        "hq": hkv * draw(st.integers(1, 2)),
        "length": draw(st.integers(3, 40)),
        "dv": draw(st.sampled_from([8, 6])),
        "mask": draw(st.sampled_from(RING_MASKS)),
        "bias": draw(st.sampled_from(RING_BIASES)),
        "softcap": draw(st.one_of(st.none(), st.floats(1.0, 20.0))),
        "sinks": draw(st.booleans()),
        "layout": draw(st.sampled_from(["zigzag", "contiguous"])),
    }


# each example starts 1-3 processes (about 2 s): a small budget, and no shrinking (the example is printed as found)
@settings(max_examples=10 if FUZZ else 1, phases=[Phase.explicit, Phase.reuse, Phase.generate])
@given(st.lists(ring_cases(), min_size=4, max_size=8), st.sampled_from([1, 2, 3]))
def test_ring_attention_on_several_processes(descs, world):
    """Every rank's part of the output, and the summed gradients, equal the formula's (float64)."""
    from attnkit.distributed.local import run_local

    note(f"world={world} {descs}")
    results = run_local(ring_worker, world, (descs,), timeout=240)
    for i, desc in enumerate(descs):
        q, k, v, up, mask, attn_bias, params = ring_case(desc)
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        length = q.shape[-2]
        allowed = None if mask is None else M.as_mask(mask).materialize(length, length)
        dense = None if attn_bias is None else attn_bias.dense(q.shape[0], q.shape[1], length, length, "cpu")
        gold, _, _ = formula(q, k, v, allowed, dense, desc["softcap"], params.get("sinks"))
        wanted = [q, k, v, *params.values()]
        grads = torch.autograd.grad(gold, wanted, up, allow_unused=True)
        (out, dq, dk, dv), param_grads = results[0][i]
        for name, a, w in zip(("out", "dq", "dk", "dv"), (out, dq, dk, dv), (gold.detach(), *grads[:3])):
            assert (a - w).abs().max() <= 1e-8 * max(1.0, w.abs().max().item()), f"case {i} {name}: {desc}"
        for j, n in enumerate(params):  # None: no gradient reached it (every key hidden)
            total = sum(torch.zeros_like(params[n]) if r[i][1][n] is None else r[i][1][n] for r in results)
            w = torch.zeros_like(params[n]) if grads[3 + j] is None else grads[3 + j]
            assert (total - w).abs().max() <= 1e-8 * max(1.0, w.abs().max().item()), f"case {i} d{n}: {desc}"


# --- context 5: the transformers integration ---------------------------------------------------------------


def _tiny(family):
    transformers = pytest.importorskip("transformers")
    small = dict(
        vocab_size=61,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    config = {
        "llama": lambda: transformers.LlamaConfig(**small),
        "mistral": lambda: transformers.MistralConfig(sliding_window=5, **small),
        "gemma2": lambda: transformers.Gemma2Config(
            head_dim=8, sliding_window=5, attn_logit_softcapping=5.0, query_pre_attn_scalar=8, **small
        ),
        "gpt_oss": lambda: transformers.GptOssConfig(
            head_dim=8, num_local_experts=2, num_experts_per_tok=1, sliding_window=5, **small
        ),
    }[family]()
    return config


_MODELS: dict = {}


def _pair(family):
    if family not in _MODELS:
        import copy

        from transformers import AutoModelForCausalLM

        import attnkit.integrations.transformers  # noqa: F401  (registers "attnkit")

        config = _tiny(family)
        torch.manual_seed(0)
        eager = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="eager").eval()
        ours = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="attnkit").eval()
        ours.load_state_dict(eager.state_dict())
        if family == "gpt_oss":  # sinks that matter
            with torch.no_grad():
                for name, p in ours.named_parameters():
                    if name.endswith("sinks"):
                        p.copy_(torch.randn_like(p) * 2)
                        dict(eager.named_parameters())[name].copy_(p)
        _MODELS[family] = (eager, ours)
    return _MODELS[family]


@settings(max_examples=60 if FUZZ else 8)
@given(
    st.sampled_from(["llama", "mistral", "gemma2", "gpt_oss"]),
    st.integers(1, 3),
    st.integers(2, 17),
    st.sampled_from(["left", "right", "none"]),
    st.integers(0, 2**31 - 1),
)
def test_transformers_models_equal_eager(family, batch, length, side, seed):
    eager, ours = _pair(family)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 61, (batch, length), generator=g)
    lengths = torch.randint(1, length + 1, (batch,), generator=g)
    attention_mask = torch.ones(batch, length, dtype=torch.long)
    if side != "none":
        for row, n in enumerate(lengths.tolist()):
            if side == "right":
                attention_mask[row, n:] = 0
            else:
                attention_mask[row, : length - n] = 0
    note(f"{family} B={batch} L={length} {side} lengths={lengths.tolist()}")
    with torch.no_grad():
        want = eager(ids, attention_mask=attention_mask).logits
        got = ours(ids, attention_mask=attention_mask).logits
    keep = attention_mask.bool()  # padded positions' logits are unspecified
    err = (got - want)[keep].abs().max().item()
    assert err <= 1e-4 * max(1.0, want[keep].abs().max().item()), err
