"""The oracle of TESTING.md: a float64 naive formula, written here independently of attnkit, and
the helpers the tests share (random inputs, pinning the tiled group to one engine, counting the
fused kernel's calls). Test modules import it as ``_oracle``; fixtures live in conftest.py."""

from __future__ import annotations

import contextlib
import math
import os

import pytest
import torch
import torch.utils._python_dispatch
from torch.utils._python_dispatch import TorchDispatchMode

import attnkit
from attnkit import bias, masks

DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]
NEG_INF = float("-inf")


def naive_attention(q, k, v, mask=None, scale=None):
    """softmax(q @ k^T * scale + bias) @ v in the inputs' dtype; fully masked rows give 0.

    ``mask`` is None, bool (True = may attend) or additive float, broadcastable to
    (..., Hq, Lq, Lk). Returns (out, weights).
    """
    if scale is None:
        scale = q.shape[-1] ** -0.5
    if q.dim() >= 3 and k.shape[-3] != q.shape[-3]:
        group = q.shape[-3] // k.shape[-3]
        k = k.repeat_interleave(group, dim=-3)
        v = v.repeat_interleave(group, dim=-3)
    scores = q @ k.transpose(-2, -1) * scale
    if mask is not None:
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, float("-inf"))
        else:
            scores = scores + mask
    weights = torch.softmax(scores, dim=-1)
    weights = torch.nan_to_num(weights, nan=0.0)  # fully masked rows: softmax of all -inf
    return weights @ v, weights


def oracle(q, k, v, allowed=None, add=None, softcap=None, sinks=None, scale=None):
    """softmax over [scores, sink] of (softcap(q k^T * scale) + add, masked) @ v; empty rows 0."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    group = q.shape[-3] // k.shape[-3]
    k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    s = q @ k.transpose(-2, -1) * scale
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap  # Gemma 2: before the mask
    if add is not None:
        s = s + add
    if allowed is not None:
        s = s.masked_fill(~allowed, float("-inf"))
    if sinks is not None:  # gpt-oss: the sink is one more logit per head, its value 0
        s = torch.cat([s, sinks.to(s.dtype).view(1, -1, 1, 1).expand(*s.shape[:-1], 1)], dim=-1)
    w = torch.nan_to_num(torch.softmax(s, dim=-1), nan=0.0)
    if sinks is not None:
        w = w[..., :-1]
    return w @ v


def alibi_formula(slopes, lq, lk, causal=False, q_offset=0, kv_offset=0):
    i = torch.arange(lq, dtype=torch.float64)[:, None] + (lk - lq) + q_offset
    j = torch.arange(lk, dtype=torch.float64)[None, :] + kv_offset
    d = (i - j) if causal else (i - j).abs()
    return -slopes.double().view(-1, 1, 1) * d  # (H, Lq, Lk)


def t5_bucket(rel, num_buckets, max_distance, bidirectional):
    """T5's bucket of one relative position (key minus query), one integer at a time."""
    out = 0
    if bidirectional:
        num_buckets //= 2
        if rel > 0:
            out += num_buckets
        n = abs(rel)
    else:
        n = max(-rel, 0)
    exact = num_buckets // 2
    if n < exact:
        return out + n
    far = exact + int(math.log(n / exact) / math.log(max_distance / exact) * (num_buckets - exact))
    return out + min(far, num_buckets - 1)


def relative_formula(table, lq, lk, num_buckets=32, max_distance=128, bidirectional=True):
    idx = torch.tensor(
        [[t5_bucket(j - (i + lk - lq), num_buckets, max_distance, bidirectional) for j in range(lk)] for i in range(lq)]
    )
    return table.double()[idx].permute(2, 0, 1)  # (Lq, Lk, H) -> (H, Lq, Lk)


def gold_and_naive(q, k, v, mask=None, scale=None):
    """(gold, naive): the naive formula in float64 and in q's dtype (outputs only)."""
    m64 = mask if mask is None or mask.dtype == torch.bool else mask.double()
    gold, _ = naive_attention(q.double(), k.double(), v.double(), m64, scale)
    naive, _ = naive_attention(q, k, v, mask, scale)
    return gold, naive


def rounding_atol(gold: torch.Tensor, dtype: torch.dtype) -> float:
    """2 * the rounding cost of one operation in ``dtype`` at the scale of ``gold``."""
    g = gold.to(dtype)
    return 2 * ((g + 0.3 - 0.3).double() - gold).abs().max().item() if gold.numel() else 0.0


def assert_oracle(out, gold, naive, factor: float = 2.0, what: str = "", small: bool = False):
    """TESTING.md's rule: max|out - gold| <= factor * max|naive - gold| + atol; no NaN/Inf.

    ``small``: a fuzzed problem small enough (a few rows, or few entries in a gradient) that the
    naive error can be a lucky rounding far below its typical size: the naive error is floored at
    four roundings of gold's scale."""
    assert out.shape == gold.shape, (out.shape, gold.shape)
    assert torch.isfinite(out).all(), f"output holds NaN or Inf {what}"
    if gold.numel() == 0:
        return
    err = (out.double() - gold).abs().max().item()
    if out.dtype == torch.float64:
        bound = 1e-12 * max(1.0, gold.abs().max().item())
    else:
        naive_err = (naive.double() - gold).abs().max().item()
        if small:
            naive_err = max(naive_err, 4 * torch.finfo(out.dtype).eps * max(1.0, gold.abs().max().item()))
        bound = factor * naive_err + rounding_atol(gold, out.dtype)
    assert err <= bound, f"max error {err:.3e} exceeds bound {bound:.3e} ({out.dtype}) {what}"


ENGINES = ["native", "fused", "math"]


def _without(*names: str) -> tuple:
    """The registered kernels in priority order, without those named."""
    return tuple(k for k in attnkit.kernels.PRIORITY if k.name not in names)


@contextlib.contextmanager
def engine_pinned(engine: str):
    """Within the block ``kernel="auto"`` chooses as usual among the registered kernels but the other
    block-sparse CPU engines (``use_kernels(..., prefer=True)``), so the tiled kernel runs ``engine``
    where it can: "native" (as is), "fused" (native left out) or "math" (native and fused left out).
    For Hypothesis tests, which cannot take a fixture."""
    left_out = {"native": (), "fused": ("native",), "math": ("native", "fused")}[engine]
    with attnkit.use_kernels(*_without(*left_out), prefer=True):
        yield


def pin_engine(request, engine: str) -> None:
    """Make the tiled kernel run ``engine`` where it can for the rest of the test: "native" (skips the
    test where the C++ engine cannot be built), "fused" or "math" (through :func:`engine_pinned`)."""
    from attnkit.kernels.native import build as native_build
    from attnkit.kernels.runs import aten

    if engine == "native":
        if not native_build.available():
            if native_build.ENABLED and os.environ.get("ATTNKIT_REQUIRE_NATIVE") == "1":  # CI: it must build
                pytest.fail(f"the native engine must run here (ATTNKIT_REQUIRE_NATIVE=1): {native_build.status()[1]}")
            pytest.skip(native_build.status()[1])
        return
    if engine == "fused" and not aten.AVAILABLE:
        pytest.skip("PyTorch's fused CPU kernel is not available")
    pinned = engine_pinned(engine)
    pinned.__enter__()
    request.addfinalizer(lambda: pinned.__exit__(None, None, None))


class FusedCalls:
    """Records the fused CPU engine's calls (``attnkit.kernels._aten``), forward and backward:
    whether each had an additive mask, whether it was causal, and its number of queries.
    It pins the fused engine (the native one turned off)."""

    def __init__(self, monkeypatch, request):
        from attnkit.kernels.runs import aten as _aten

        pin_engine(request, "fused")

        self.calls: list[tuple[bool, bool, int]] = []
        for name in ("flash_forward", "flash_backward"):
            real = getattr(_aten, name)

            def counted(*a, _real=real, _backward=name == "flash_backward", **kw):
                q = a[1] if _backward else a[0]  # backward: (grad_out, q, ...)
                self.calls.append((kw.get("attn_mask") is not None, bool(kw.get("is_causal", False)), q.shape[2]))
                return _real(*a, **kw)

            monkeypatch.setattr(_aten, name, counted)

    @property
    def masked(self) -> int:
        """Calls that carried an additive mask."""
        return sum(masked for masked, _, _ in self.calls)

    def causal(self, min_rows: int) -> int:
        """is_causal calls of at least ``min_rows`` queries."""
        return sum(causal and rows >= min_rows for _, causal, rows in self.calls)


def randn(*shape, dtype=torch.float32, requires_grad=False):
    return torch.randn(*shape, dtype=torch.float64).to(dtype).requires_grad_(requires_grad)


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


def mixed_fill_decode(mha, mask, attn_bias, steps=4, capture_mode=None):
    """Decode a batch whose sequences hold 5 and 2 tokens; compare each step with recomputing the prefix.

    Returns (max difference of the outputs, per-step stats if ``capture_mode``)."""
    d = mha.d_model
    x = randn(2, 5 + steps, d)
    fills = [5, 2]
    cache = attnkit.KVCache(2, mha.num_kv_heads, 16, mha.head_dim)
    prompt = torch.zeros(2, 5, d)
    prompt[0], prompt[1, :2] = x[0, :5], x[1, :2]
    worst, stats = 0.0, []
    with torch.no_grad():
        mha(prompt, mask=mask, cache=cache, counts=torch.tensor(fills), attn_bias=attn_bias)
        for step in range(steps):
            new = torch.stack([x[0, 5 + step], x[1, 2 + step]])[:, None]
            if capture_mode:
                with attnkit.capture(mha, mode=capture_mode) as cap:
                    out, _ = mha(new, mask=mask, cache=cache, attn_bias=attn_bias)
                stats.append(cap.stats[0])
            else:
                out, _ = mha(new, mask=mask, cache=cache, attn_bias=attn_bias)
            for s, n in ((0, 5 + step), (1, 2 + step)):
                full, _ = mha(x[s : s + 1, : n + 1], mask=mask, attn_bias=attn_bias)
                worst = max(worst, (full[0, -1] - out[s, 0]).abs().max().item())
    return worst, stats


BIASES = {
    "relative": lambda h: bias.relative(torch.randn(32, h), 32, 128, bidirectional=False),
    "from_fn": lambda h: bias.from_fn(lambda b, hh, i, j: -0.3 * (i - j).abs().float()),
    "alibi+relative": lambda h: bias.alibi(bias.alibi_slopes(h)) + bias.relative(torch.randn(8, h), 8, 16),
}


ALL_KERNELS = ["auto", "sdpa", "tiled", "reference"]


def mask_kinds(b=2, length=150):
    ids = torch.sort(torch.randint(0, 4, (b, length)), dim=-1).values
    return {
        "causal": masks.causal(),
        "window": masks.sliding_window(9),
        "prefix": masks.prefix_lm(20) & masks.causal(),
        "padding": masks.padding(torch.tensor([70, length])),
        "document": masks.document(ids) & masks.causal(),
        "bool": torch.rand(b, 1, length, length) > 0.5,
        "from_fn": masks.from_fn(lambda b_, h, q, kv: (q - kv).abs() <= 5),
        "cached": masks.cached(masks.causal(), torch.tensor([0, 0]), torch.tensor([length, 100])),
    }


def dense_of(mask, lq, lk):
    return mask if isinstance(mask, torch.Tensor) else mask.materialize(lq, lk)


class Ops(torch.utils._python_dispatch.TorchDispatchMode):
    """Records every ATen op and the size of the new memory it creates (views excluded)."""

    def __init__(self):
        super().__init__()
        self.names, self.largest = [], 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.names.append(str(func))
        inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.largest = max(self.largest, t.numel())
        return out


class OpCounter(TorchDispatchMode):
    """Counts the calls of some operators (``"ns::name"``) while active, below autograd: forward and
    backward passes both, whatever Python function made them."""

    def __init__(self, *names: str):
        super().__init__()
        self.counts = {name: 0 for name in names}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        if name in self.counts:
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))


def run_engine(engine: str, q, k, v, prepared, scale, **mods):
    """``(out, lse)`` of one block-sparse kernel on this very plan (at its own block size), or None
    where that kernel cannot run it: "native" (its operators), "fused" or "math" (the walk)."""
    from attnkit.kernels.native import build as native_build
    from attnkit.kernels.native import kernel as native
    from attnkit.kernels.runs import aten as _aten
    from attnkit.kernels.runs import walk as blocksparse

    if engine == "native":
        if not native_build.available() or q.dtype == torch.float64 or prepared.block_size[0] % 32:
            return None
        if mods.get("dropout_p") or mods.get("score_mod") is not None or mods.get("bias") is not None:
            return None
        return native.forward(q, k, v, prepared, scale=scale, softcap=mods.get("softcap"))
    if engine == "fused":
        if not _aten.AVAILABLE or q.shape[-1] != v.shape[-1] or any(mods.get(m) for m in ("dropout_p", "softcap")):
            return None
        if mods.get("score_mod") is not None or mods.get("bias") is not None:
            return None
    return blocksparse.attention(q, k, v, prepared, engine=engine, scale=scale, **mods)


def run_engines(q, k, v, prepared, scale, **mods):
    """``{engine: (out, lse)}`` of every block-sparse kernel that can run this plan."""
    found = {e: run_engine(e, q, k, v, prepared, scale, **mods) for e in ENGINES}
    return {e: r for e, r in found.items() if r is not None}


#: The kernels of the "tiled" group (attnkit's block-sparse CPU kernels).
TILED_KERNELS = ("native", "fused", "math")


@contextlib.contextmanager
def engine_evaluations():
    """Every evaluation of a ``from_fn`` predicate on the native engine, however small
    (``NATIVE_FROM = 0``), every attnkit cache cleared first; yields a list that records, per
    evaluation asked of the engine, whether it answered (False: torch's path took it)."""
    from unittest import mock

    from attnkit import _cache
    from attnkit.masks import _from_fn, _program

    answered = []
    evaluate = _program.evaluate

    def counting(*args, **kwargs):
        out = evaluate(*args, **kwargs)
        answered.append(out is not None)
        return out

    with mock.patch.object(_from_fn, "NATIVE_FROM", 0), mock.patch.object(_program, "evaluate", counting):
        _cache.clear()
        yield answered
