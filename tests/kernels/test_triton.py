"""The Triton kernel, run on the CPU by Triton's interpreter (TRITON_INTERPRET=1, set in conftest.py),
against the float64 oracle: forward, lse and gradients, every mask kind and modification."""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton", reason="Triton is not installed: pip install 'attnkit[gpu]' (make test does)")

from _oracle import assert_oracle, rounding_atol  # noqa: E402

import attnkit  # noqa: E402
from attnkit import bias, masks  # noqa: E402
from attnkit.kernels.triton import kernel as tk  # noqa: E402

pytestmark = pytest.mark.skipif(not tk.interpreted(), reason="needs TRITON_INTERPRET=1 (set by conftest.py)")


def _docs(length, seed=0, batch=2):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 5, (batch, length), generator=g).sort(-1).values


MASKS = {
    "none": lambda L, K: None,
    "causal": lambda L, K: masks.causal(),
    "causal_top_left_offset": lambda L, K: masks.causal(align="top_left", q_offset=9),
    "window": lambda L, K: masks.sliding_window(11, 3),
    "document_causal": lambda L, K: masks.document(_docs(L)) & masks.causal(),
    "prefix": lambda L, K: masks.prefix_lm(torch.tensor([20, 45])),
    "padding": lambda L, K: masks.padding([0, K - 13]),
    "dense": lambda L, K: torch.rand(2, 1, L, K, generator=torch.Generator().manual_seed(2)) > 0.5,
    "from_fn_per_head": lambda L, K: masks.from_fn(lambda b, h, q, k: (q + h) % 3 != k % 3, num_heads=4),
    "union": lambda L, K: masks.sliding_window(4) | masks.prefix_lm(7),
}


def _inputs(lq, lk, dtype, hq=4, hkv=2, d=16):
    g = torch.Generator().manual_seed(lq * 31 + lk)
    q = torch.randn(2, hq, lq, d, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(2, hkv, lk, d, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(2, hkv, lk, d, generator=g, dtype=torch.float64).to(dtype)
    return q, k, v


def _check(q, k, v, mask, **mods):
    """Forward, lse and gradients of the Triton kernel against the float64 reference, with
    TESTING.md's rule: at most 2x the naive formula's error in the same dtype plus one rounding."""
    qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))
    out, lse = attnkit.attention(qs, ks, vs, mask, kernel="triton", return_lse=True, **mods)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    grads = torch.autograd.grad((out.double() * weights).sum() + lse.double().sum(), (qs, ks, vs))

    def run(dtype, kernel):
        ins = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        mods_d = {name: (x.to(dtype) if isinstance(x, torch.Tensor) else x) for name, x in mods.items()}
        o, l_ = attnkit.attention(*ins, mask, kernel=kernel, return_lse=True, **mods_d)
        g = torch.autograd.grad((o.double() * weights).sum() + l_.double().sum(), ins)
        return o, l_, g

    gold_out, gold_lse, gold_grads = run(torch.float64, "reference")
    naive_out, naive_lse, naive_grads = run(q.dtype, "reference")
    assert_oracle(out, gold_out, naive_out, what="(out)")
    finite = torch.isfinite(gold_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    lse_err = (lse.double() - gold_lse)[finite].abs().max().item() if finite.any() else 0.0
    assert (
        lse_err
        <= 1e-5 * max(1.0, gold_lse[finite].abs().max().item())
        + 2 * (naive_lse.double() - gold_lse)[finite].abs().max().item()
    )
    for name, got, gold, naive in zip("qkv", grads, gold_grads, naive_grads):
        err = (got.double() - gold).abs().max().item()
        bound = (
            2 * (naive.double() - gold).abs().max().item()
            + rounding_atol(gold, q.dtype)
            + 1e-5 * gold.abs().max().item()
        )
        assert err <= bound, f"d{name}: {err:.3e} > {bound:.3e}"


@pytest.mark.parametrize("name", list(MASKS))
def test_every_mask_kind_fp32(name):
    q, k, v = _inputs(150, 150, torch.float32)
    _check(q, k, v, MASKS[name](150, 150))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("name", ["causal", "document_causal"])
def test_half_precision(name, dtype):
    q, k, v = _inputs(100, 100, dtype)
    _check(q, k, v, MASKS[name](100, 100))


@pytest.mark.parametrize("lq,lk", [(37, 300), (300, 37), (1, 129)])
def test_uneven_and_cross_lengths(lq, lk):
    q, k, v = _inputs(lq, lk, torch.float32, hq=2, hkv=1, d=24)  # head size 24: padded to 32 in the kernel
    _check(q, k, v, masks.causal())
    _check(q, k, v, masks.padding([lk // 2, lk]))


@pytest.mark.parametrize(
    "mods",
    [
        {"softcap": 4.0},
        {"attn_bias": bias.alibi(bias.alibi_slopes(4))},
        {"attn_bias": bias.alibi(bias.alibi_slopes(4), causal=True)},
        {"sinks": torch.randn(4, dtype=torch.float64)},
    ],
    ids=["softcap", "alibi", "alibi_causal", "sinks"],
)
@pytest.mark.parametrize("name", ["causal", "window", "document_causal"])
def test_score_modifications(name, mods):
    q, k, v = _inputs(120, 120, torch.float32)
    mods = {key: (value.float() if isinstance(value, torch.Tensor) else value) for key, value in mods.items()}
    _check(q, k, v, MASKS[name](120, 120), **mods)


def test_fully_masked_rows_give_zero_and_minus_inf():
    q, k, v = _inputs(70, 70, torch.float32)
    out, lse = attnkit.attention(q, k, v, masks.padding([0, 70]), kernel="triton", return_lse=True)
    assert (out[0] == 0).all() and torch.isneginf(lse[0]).all() and torch.isfinite(out).all()


def test_the_mask_reaches_the_kernel_as_data():
    """Causal and windows are evaluated from their band (two ints): no bit tiles. Other masks keep
    bits for their partial blocks only, never an Lq x Lk tensor; prepared at the kernel's block size."""
    q, k, v = _inputs(256, 256, torch.float32)
    call = attnkit.call.make_call(q, k, v, mask=masks.causal(), return_lse=True)
    prepared = call.prepared_at(tk.TritonKernel.block_size)
    assert prepared.block_size == (tk.BLOCK_Q, tk.BLOCK_K) and prepared.band == (None, 0)
    ids = torch.repeat_interleave(torch.arange(4), torch.tensor([50, 100, 60, 46]))
    call = attnkit.call.make_call(q, k, v, mask=masks.document(ids) & masks.causal(), return_lse=True)
    prepared = call.prepared_at(tk.TritonKernel.block_size)
    bits, listed = prepared.partial_bits()
    partial = int((prepared.codes == masks.PARTIAL).sum())
    assert prepared.band is None and bits.shape[0] == partial < prepared.codes.numel()
    assert bits.shape[1:] == (tk.BLOCK_Q, tk.BLOCK_K) and int((listed >= 0).sum()) == partial


def test_dispatch_and_refusals():
    q, k, v = _inputs(64, 64, torch.float32)
    plan = attnkit.explain(q, k, v, masks.causal())
    assert plan.kernel != "triton"  # on the CPU, auto never picks the interpreter
    rel = bias.relative(torch.randn(8, 4), 8, 16)
    with pytest.raises(ValueError, match="ALiBi biases only"):
        attnkit.attention(q, k, v, masks.causal(), attn_bias=rel, kernel="triton")
    with pytest.raises(ValueError, match="dropout"):
        attnkit.attention(q, k, v, masks.causal(), dropout_p=0.1, kernel="triton")
    with pytest.raises(ValueError, match="float64"):
        attnkit.attention(q.double(), k.double(), v.double(), kernel="triton")
    with pytest.raises(ValueError, match="additive float mask"):
        attnkit.attention(q, k, v, torch.zeros(64, 64), kernel="triton")


def test_gpu_benchmark_runs_end_to_end_in_the_interpreter(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "gpu.json"
    done = subprocess.run(
        [sys.executable, str(root / "benchmarks" / "gpu.py"), "--interpret", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "TRITON_INTERPRET": "1"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "| triton" in done.stdout or "triton" in out.read_text()
