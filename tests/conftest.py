"""The oracle of TESTING.md: a float64 naive formula, written here independently of attnkit."""

from __future__ import annotations

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


def assert_oracle(out, gold, naive, factor: float = 2.0, what: str = ""):
    """TESTING.md's rule: max|out - gold| <= factor * max|naive - gold| + atol; no NaN/Inf."""
    assert out.shape == gold.shape, (out.shape, gold.shape)
    assert torch.isfinite(out).all(), f"output holds NaN or Inf {what}"
    if gold.numel() == 0:
        return
    err = (out.double() - gold).abs().max().item()
    if out.dtype == torch.float64:
        bound = 1e-12 * max(1.0, gold.abs().max().item())
    else:
        bound = factor * (naive.double() - gold).abs().max().item() + rounding_atol(gold, out.dtype)
    assert err <= bound, f"max error {err:.3e} exceeds bound {bound:.3e} ({out.dtype}) {what}"


ENGINES = ["native", "fused", "math"]


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
