"""TODO"""

from __future__ import annotations

import pytest
import torch
import torch.utils._python_dispatch
from _oracle import TILED_KERNELS, assert_oracle, gold_and_naive, randn

import attnkit
from attnkit import masks
from attnkit.kernels import KERNELS, PRIORITY, Kernel, register_kernel, unregister_kernel


def test_sdpa_refuses_return_lse_with_a_reason():
    q = randn(1, 1, 4, 8)
    with pytest.raises(ValueError, match="kernel='sdpa' cannot run this call: does not return the log-sum-exp"):
        attnkit.attention(q, q, q, kernel="sdpa", return_lse=True)


def test_explain_lists_every_other_kernels_reasons():
    q = randn(1, 2, 2048, 16)
    plan = attnkit.explain(q, q, q, masks.document(torch.arange(2048) // 256), dropout_p=0.0, return_lse=True)
    assert plan.kernel in TILED_KERNELS
    assert set(plan.rejected) == set(KERNELS) - {plan.kernel}
    assert plan.rejected["sdpa"] == ("does not return the log-sum-exp (return_lse=True)",)
    report = plan.report()
    assert report.startswith(f"chosen {plan.kernel}:") and "sdpa: does not return the log-sum-exp" in report
    rank5 = attnkit.explain(q[None], q[None], q[None], masks.causal() & masks.sliding_window(3))
    for name in TILED_KERNELS:
        assert "takes inputs of rank 2 to 4, not 5" in " ".join(rank5.rejected[name]), name


def test_dispatch_is_device_aware():
    """Off the CPU, auto never picks the math kernel's Python loop (meta tensors stand in for a GPU),
    and the CPU kernels say they run on the CPU."""
    q = torch.empty(1, 2, 2048, 16, device="meta")
    plan = attnkit.explain(q, q, q, masks.sliding_window(64) & masks.causal())
    assert plan.kernel == "sdpa"
    assert "Python loop" in plan.rejected["math"][0] and "kernel='math' forces it" in plan.rejected["math"][0]
    assert (
        plan.rejected["native"][0] == "runs on cpu, not meta" and plan.rejected["fused"][0] == "runs on cpu, not meta"
    )


class ToyKernel(Kernel):
    """Plain softmax attention for windows only: enough to show auto picking a new kernel."""

    name = "toy"
    devices = ("cpu",)
    block_size = (32, 32)
    supports_lse = True
    max_rank = 4
    runs = 0

    def _reasons(self, call):
        return [] if call.band() is not None else ["only band masks (causal, windows)"]

    def prefers(self, call):
        return True, f"a toy for bands, {call.prepared_at(self.block_size).kept:.0%} of blocks kept"

    def run(self, call):
        ToyKernel.runs += 1
        prepared = call.prepared_at(self.block_size)
        assert prepared.block_size == self.block_size and prepared.band is not None
        lo, hi = prepared.band
        i = torch.arange(call.shapes.lq)[:, None]
        j = torch.arange(call.shapes.lk)[None, :]
        allowed = ((lo is None) | (j - i >= (lo if lo is not None else 0))) & (j - i <= (hi if hi is not None else j))
        s = (call.q @ call.k.transpose(-2, -1) * call.scale).masked_fill(~allowed, float("-inf"))
        lse = torch.logsumexp(s, -1)
        return torch.softmax(s, -1).nan_to_num(0.0) @ call.v, lse if call.return_lse else None


@pytest.fixture
def toy():
    kernel = register_kernel(ToyKernel())
    try:
        yield kernel
    finally:
        unregister_kernel(kernel)


def test_a_registered_kernel_is_picked_by_auto(toy):
    assert PRIORITY[0] is toy and KERNELS["toy"] is toy
    q, k, v = randn(1, 2, 100, 16), randn(1, 2, 100, 16), randn(1, 2, 100, 16)
    plan = attnkit.explain(q, k, v, masks.sliding_window(9))
    assert plan.kernel == "toy" and "a toy for bands" in str(plan)
    before = ToyKernel.runs
    out = attnkit.attention(q, k, v, masks.sliding_window(9))
    assert ToyKernel.runs == before + 1
    gold, naive = gold_and_naive(q, k, v, masks.sliding_window(9).materialize(100, 100))
    assert_oracle(out, gold, naive)
    # what it refuses goes to the next kernel, and explain says why
    other = attnkit.explain(q, k, v, masks.document(torch.arange(100) // 10))
    assert other.kernel != "toy" and other.rejected["toy"] == ("only band masks (causal, windows)",)
    # a kernel object names it, as its name does
    assert attnkit.explain(q, k, v, masks.causal(), kernel=toy).kernel == "toy"


class LongKeysKernel(ToyKernel):
    """Takes unmasked calls from 100 keys on: its choice depends on Lk."""

    name = "long_keys"

    def _reasons(self, call):
        return [] if call.mask is None else ["unmasked calls only"]

    def prefers(self, call):
        return call.shapes.lk >= 100, "100 keys or more"

    def run(self, call):
        ToyKernel.runs += 1
        s = call.q @ call.k.transpose(-2, -1) * call.scale
        return torch.softmax(s, -1) @ call.v, torch.logsumexp(s, -1) if call.return_lse else None


def test_a_registered_kernel_sees_every_length_of_a_growing_cache():
    """The lean path's any-length entries are for the built-in registry only: a kernel whose
    choice depends on Lk gets the calls it prefers as the cache grows."""
    q, keys, values = randn(1, 2, 1, 16), randn(1, 2, 130, 16), randn(1, 2, 130, 16)
    with torch.no_grad():
        attnkit.attention(q, keys[:, :, :60], values[:, :, :60])  # the built-in registry: SDPA, any length
        kernel = register_kernel(LongKeysKernel())
        try:
            before = ToyKernel.runs
            for n in range(90, 110):
                out = attnkit.attention(q, keys[:, :, :n], values[:, :, :n])
                gold, naive = gold_and_naive(q, keys[:, :, :n], values[:, :, :n], None)
                assert_oracle(out, gold, naive)
            assert ToyKernel.runs - before == 10  # Lk = 100 .. 109
            assert not attnkit.kernels.fastpath.builtin_registry()
        finally:
            unregister_kernel(kernel)
    assert attnkit.kernels.fastpath.builtin_registry()  # registered and removed: the built-in registry again


def test_register_kernel_places_and_replaces():
    first = register_kernel(ToyKernel(), after="sdpa")
    try:
        assert PRIORITY.index(first) == PRIORITY.index(KERNELS["sdpa"]) + 1
        again = register_kernel(ToyKernel())  # the same name: replaced in its place
        assert KERNELS["toy"] is again and PRIORITY.index(again) == PRIORITY.index(KERNELS["sdpa"]) + 1
        assert first not in PRIORITY
    finally:
        unregister_kernel("toy")
    with pytest.raises(ValueError, match="a kernel needs a name other than 'auto'"):
        register_kernel(type("Nameless", (Kernel,), {})())
    with pytest.raises(TypeError, match="register_kernel takes a Kernel instance"):
        register_kernel("tiled")


def test_use_kernels_restricts_and_orders_the_choice():
    q = randn(1, 2, 300, 16)
    assert attnkit.explain(q, q, q).kernel == "sdpa"
    with attnkit.use_kernels(attnkit.kernels.TILED, "reference"):
        assert attnkit.explain(q, q, q).kernel in TILED_KERNELS
        with attnkit.use_kernels("reference"):
            assert attnkit.explain(q, q, q, masks.causal()).kernel == "reference"
        assert attnkit.explain(q, q, q, masks.causal()).kernel in TILED_KERNELS  # the order is the preference
        assert attnkit.explain(q[None], q[None], q[None]).kernel == "reference"  # rank 5: tiled refuses
    with attnkit.use_kernels("sdpa"):
        with pytest.raises(ValueError, match="no kernel allowed here can run this call.*sdpa: does not return"):
            attnkit.attention(q, q, q, return_lse=True)
    with pytest.raises(ValueError, match="kernel must be 'auto', a registered kernel's name"):
        with attnkit.use_kernels("flash"):
            pass


def test_use_kernels_reaches_modules_and_capture():
    mha = attnkit.MultiHeadAttention(32, 4)
    seen = []
    mha.register_attention_hook(
        lambda m, q, k, v, mask, kw: seen.append(attnkit.explain(q, k, v, mask, **kw).kernel), with_kwargs=True
    )
    with attnkit.use_kernels("reference"):
        mha(randn(2, 9, 32), mask=masks.causal())
    assert seen == ["reference"]


def test_every_capable_kernel_declining_runs_the_first_of_them():
    """A registry whose kernels that can run a call all decline it (prefers() is False) runs the
    first of them, says so, and is exact (it used to fail formatting its own error)."""
    from attnkit.kernels import registry

    saved = list(registry.PRIORITY)
    try:
        for k in saved:
            if k is not attnkit.kernels.FUSED:
                registry.unregister_kernel(k)
        q, k, v = (randn(1, 2, 64, 16) for _ in range(3))
        plan = attnkit.explain(q, k, v, masks.causal())  # tiled prefers SDPA's is_causal here
        assert plan.kernel in TILED_KERNELS and "the only registered kernel" in plan.reason
        out = attnkit.attention(q, k, v, masks.causal())
        gold, naive = gold_and_naive(q, k, v, masks.causal().materialize(64, 64))
        assert_oracle(out, gold, naive)
    finally:  # the registry as it was, through its own API (which every cache key follows)
        registry.unregister_kernel(attnkit.kernels.FUSED)
        for kernel in reversed(saved):
            registry.register_kernel(kernel)
        assert registry.PRIORITY == saved


def test_the_report_says_why_each_kernel_that_could_run_the_call_lost():
    """explain(...).report() said "not preferred here" for every kernel after the chosen one: now each says
    what it would do with the call and that the chosen one comes first (a plain causal mask: SDPA's is_causal)."""
    q = torch.randn(1, 4, 1024, 64)
    plan = attnkit.explain(q, q, q, attnkit.masks.causal())
    report = plan.report()
    assert "not preferred here" not in report
    if plan.kernel == "native":
        (sdpa,) = plan.rejected["sdpa"]
        assert "is_causal" in sdpa and "native comes before it in the priority order" in sdpa, sdpa
    for name, why in plan.rejected.items():
        assert why and all(len(w) > 12 for w in why), (name, why)
