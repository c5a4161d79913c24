"""The kernel contract as the architecture page describes it: kernels read the prepared
plan's facts (never a mask's class), the registry is a priority list that a new kernel
joins with one call, and a mask is prepared once per (mask, lengths, block size, device)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from conftest import assert_oracle, gold_and_naive, randn

import attnkit
from attnkit import bias, masks
from attnkit.kernels import KERNELS, PRIORITY, Kernel, register_kernel, unregister_kernel
from attnkit.prepare import PREPARATIONS

SRC = Path(attnkit.__file__).parent


def _sources():
    return {p.relative_to(SRC).as_posix(): p.read_text(encoding="utf-8") for p in SRC.rglob("*.py")}


def test_no_module_reaches_into_a_masks_private_names():
    """Mask structure is published (band, limit_only, positions, elements, block_codes, key_limit,
    tensors); only masks.py and prepare.py touch what is private to masks."""
    private = re.compile(
        r"masks\._[A-Za-z]|\._(block_map|dense|held|kv_limit|shift|q_pos|k_pos|position_key|"
        r"position_value|index_shift)\(|\bmask\._(key|part|in_cache)\("
    )
    offenders = [
        f"{name}:{i + 1}: {line.strip()}"
        for name, text in _sources().items()
        if name not in ("masks.py", "prepare.py")
        for i, line in enumerate(text.splitlines())
        if private.search(line)
    ]  # (biases have a _part and _in_cache of their own, in bias.py)
    assert not offenders, "\n".join(offenders)


def test_no_kernel_module_uses_another_modules_private_names():
    modules = ("tiled", "tiles", "lse", "sdpa", "reference", "registry", "triton_attention")
    pattern = re.compile(
        r"\b(?:_?(?:"
        + "|".join(modules)
        + r"))\._[a-z]\w*|from attnkit\.kernels\.(?:"
        + "|".join(modules)
        + r") import [^\n]*\b_[a-z]"
    )
    offenders = [
        f"{name}:{i + 1}: {line.strip()}"
        for name, text in _sources().items()
        for i, line in enumerate(text.splitlines())
        if pattern.search(line)
    ]
    assert not offenders, "\n".join(offenders)


# --- a toy kernel joins with one register_kernel call ------------------------------------------


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
            assert not attnkit.kernels.registry.builtin_registry()
        finally:
            unregister_kernel(kernel)
    assert attnkit.kernels.registry.builtin_registry()  # registered and removed: the built-in registry again


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
        assert attnkit.explain(q, q, q).kernel == "tiled"
        with attnkit.use_kernels("reference"):
            assert attnkit.explain(q, q, q, masks.causal()).kernel == "reference"
        assert attnkit.explain(q, q, q, masks.causal()).kernel == "tiled"  # the order is the preference
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


# --- preparations --------------------------------------------------------------------------------


def test_decoding_prepares_each_steps_mask_once_for_all_layers():
    """12 layers x 20 decoding steps over a batch of mixed fills: the cache masks of one step are
    equal values in every layer, so they are prepared once per step, not once per layer."""
    torch.manual_seed(0)
    layers = [attnkit.MultiHeadAttention(32, 4).eval() for _ in range(12)]
    caches = attnkit.KVCache.for_layers(12, 2, 4, 40, 8)
    alibi = bias.alibi(bias.alibi_slopes(4))  # a bias: the tiled kernel prepares the mask
    x = randn(2, 6, 32)
    with torch.no_grad():
        start = PREPARATIONS["count"]
        h = x
        for layer, cache in zip(layers, caches):
            h, _ = layer(h, mask=masks.causal(), cache=cache, counts=torch.tensor([6, 3]), attn_bias=alibi)
        assert PREPARATIONS["count"] - start == 1  # the prefill
        for _ in range(20):
            h = randn(2, 1, 32)
            for layer, cache in zip(layers, caches):
                h, _ = layer(h, mask=masks.causal(), cache=cache, attn_bias=alibi)
        assert PREPARATIONS["count"] - start == 21


def test_a_prepared_mask_is_reprepared_once_for_another_block_size():
    mask = masks.document(torch.arange(256) // 40) & masks.causal()
    prepared = attnkit.prepare(mask, 256, 256)  # the default (CPU kernel's) block size
    start = PREPARATIONS["count"]
    other = [prepared.with_block_size((64, 64)) for _ in range(5)]
    assert PREPARATIONS["count"] - start == 1 and all(p is other[0] for p in other)
    assert other[0].block_size == (64, 64) and prepared.with_block_size((128, 64)) is prepared
    torch.testing.assert_close(other[0].materialize(), prepared.materialize())


def test_prepared_facts():
    p = attnkit.prepare(masks.causal(), 300, 300)
    assert p.band == (None, 0) and p.causal_shift == 0 and not p.hides_nothing and not p.limit_only
    w = attnkit.prepare(masks.sliding_window(5, 2) & masks.causal(), 300, 300)
    assert w.band == (-5, 0) and w.causal_shift is None
    assert attnkit.prepare(masks.causal(), 1, 300).hides_nothing
    pad = attnkit.prepare(masks.padding([100, 300]), 4, 300)
    assert pad.limit_only and pad.band is None and pad.kv_limit.tolist() == [100, 300]
    assert attnkit.prepare(masks.document(torch.arange(300) // 30), 300, 300).band is None


def test_every_capable_kernel_declining_runs_the_first_of_them():
    """A registry whose kernels that can run a call all decline it (prefers() is False) runs the
    first of them, says so, and is exact (it used to fail formatting its own error)."""
    from attnkit.kernels import registry

    saved, kernels = list(registry.PRIORITY), dict(registry.KERNELS)
    try:
        for k in saved:
            if k is not attnkit.kernels.TILED:
                registry.unregister_kernel(k)
        q, k, v = (randn(1, 2, 64, 16) for _ in range(3))
        plan = attnkit.explain(q, k, v, masks.causal())  # tiled prefers SDPA's is_causal here
        assert plan.kernel == "tiled" and "the only registered kernel" in plan.reason
        out = attnkit.attention(q, k, v, masks.causal())
        gold, naive = gold_and_naive(q, k, v, masks.causal().materialize(64, 64))
        assert_oracle(out, gold, naive)
    finally:
        registry.PRIORITY[:] = saved
        registry.KERNELS.clear()
        registry.KERNELS.update(kernels)
        registry._GENERATION[0] += 1
