"""The oracle of TESTING.md: a float64 naive formula, written here independently of attnkit."""

from __future__ import annotations

import contextlib
import math
import os
import zlib

# Triton kernels run in Triton's interpreter, on CPU tensors, in this suite (set before
# Triton decorates attnkit's kernels, at import).
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]


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


@contextlib.contextmanager
def engine_pinned(engine: str):
    """Within the block the tiled kernel runs ``engine`` where it can (for Hypothesis tests, which
    cannot take the monkeypatch fixture): "native" (as is), "fused" or "math"."""
    from attnkit.kernels import _aten, native

    saved = native.ENABLED, _aten.AVAILABLE
    try:
        native.ENABLED = saved[0] and engine == "native"
        _aten.AVAILABLE = saved[1] and engine != "math"
        yield
    finally:
        native.ENABLED, _aten.AVAILABLE = saved


def pin_engine(monkeypatch, engine: str) -> None:
    """Make the tiled kernel run ``engine`` where it can: "native" (skips the test where the C++
    engine cannot be built), "fused" (native turned off) or "math" (native and fused turned off)."""
    from attnkit.kernels import _aten, native

    if engine == "native":
        if not native.available():
            pytest.skip(native.status()[1])
        return
    monkeypatch.setattr(native, "ENABLED", False)
    if engine == "fused" and not _aten.AVAILABLE:
        pytest.skip("PyTorch's fused CPU kernel is not available")
    if engine == "math":
        monkeypatch.setattr(_aten, "AVAILABLE", False)


class FusedCalls:
    """Records the fused CPU engine's calls (``attnkit.kernels._aten``), forward and backward:
    whether each had an additive mask, whether it was causal, and its number of queries.
    It pins the fused engine (the native one turned off)."""

    def __init__(self, monkeypatch):
        from attnkit.kernels import _aten

        pin_engine(monkeypatch, "fused")

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


@pytest.fixture(autouse=True)
def _fresh_seed(request):
    """A different seed per test, the same on every run."""
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))
