"""attnkit.flex as the module torch users import: every name of torch.nn.attention.flex_attention's
``__all__``, the BlockMask methods on attnkit's BlockMask equal to torch's, and the inputs torch
accepts (K/V of batch 1 for paged attention, torch's empty BlockMask, float8 K/V), each against a
float64 formula or torch's own answer."""

from __future__ import annotations

import pytest
import torch
from _oracle import assert_oracle
from torch.nn.attention import flex_attention as torch_flex

from attnkit import flex

attn_gym = pytest.importorskip("attn_gym")

L = 256


def formula(q, k, v, allowed, scale=None):
    s = q @ k.transpose(-2, -1) * (q.shape[-1] ** -0.5 if scale is None else scale)
    s = s.masked_fill(~allowed, float("-inf"))
    return torch.softmax(s, -1).nan_to_num(0) @ v


def _dense(mask_mod, b, h, lq, lk):
    return torch_flex.create_mask(mask_mod, b, h, lq, lk, device="cpu")


def _exact(out, q, k, v, allowed):
    assert_oracle(out, formula(q.double(), k.double(), v.double(), allowed), formula(q, k, v, allowed))


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def test_every_name_of_torchs_flex_module_is_here():
    missing = [name for name in torch_flex.__all__ if not hasattr(flex, name)]
    assert not missing
    for name in ("and_masks", "or_masks", "noop_mask", "create_mask", "BlockMask", "AuxRequest", "FlexKernelOptions"):
        assert getattr(flex, name) is getattr(torch_flex, name)  # torch's own objects: identity checks hold
    assert set(torch_flex.FlexKernelOptions.__annotations__) <= flex.KERNEL_OPTIONS


def test_attention_gym_code_with_and_masks_and_or_masks_runs_with_only_the_import_swapped():
    # from torch.nn.attention.flex_attention import and_masks, create_block_mask, flex_attention, or_masks
    from attnkit.flex import and_masks, create_block_mask, flex_attention, or_masks

    sink = 4

    def sink_tokens(b, h, q_idx, kv_idx):
        return kv_idx < sink

    window = attn_gym.masks.generate_sliding_window(32)
    streaming = or_masks(and_masks(attn_gym.masks.causal_mask, window), and_masks(sink_tokens, causal))
    block_mask = create_block_mask(streaming, None, None, L, L)
    q, k, v = (torch.randn(2, 4, L, 16) for _ in range(3))
    _exact(flex_attention(q, k, v, block_mask=block_mask), q, k, v, _dense(streaming, 1, 1, L, L))


MAKE = {
    "causal, one map": (causal, None, None, 128),
    "document per sequence, per head": (
        lambda b, h, q, kv: ((q // (50 + 30 * b)) == (kv // (50 + 30 * b))) & (q >= kv - h),
        2,
        3,
        128,
    ),
    "window, other block sizes": (lambda b, h, q, kv: (q - kv).abs() < 40, None, 2, (64, 32)),
    "blocks that do not tile attnkit's": (causal, None, None, (96, 80)),
}


@pytest.mark.parametrize("separate_full_blocks", [True, False])
@pytest.mark.parametrize("name", list(MAKE))
def test_attnkits_block_mask_is_torchs_block_mask(name, separate_full_blocks):
    """The lists, and every method that reads them, equal those of torch's create_block_mask."""
    mask_mod, b, h, size = MAKE[name]
    ours = flex.create_block_mask(mask_mod, b, h, L, L, BLOCK_SIZE=size, separate_full_blocks=separate_full_blocks)
    theirs = torch_flex.create_block_mask(
        mask_mod, b, h, L, L, device="cpu", BLOCK_SIZE=size, separate_full_blocks=separate_full_blocks
    )
    assert isinstance(ours, torch_flex.BlockMask)
    for attr in torch_flex.BlockMask._TENSOR_ATTRS:
        a, t = getattr(ours, attr), getattr(theirs, attr)
        assert (a is None) == (t is None), attr
        if a is not None:
            assert torch.equal(a, t), attr
    assert ours.shape == theirs.shape and ours.BLOCK_SIZE == theirs.BLOCK_SIZE
    assert torch.equal(ours.to_dense(), theirs.to_dense())
    assert ours.to_string() == theirs.to_string() and ours.sparsity() == theirs.sparsity()
    assert [x for x in ours.as_tuple() if not callable(x)].__len__() == [
        x for x in theirs.as_tuple() if not callable(x)
    ].__len__()
    assert torch.equal(ours[0].to_dense(), theirs[0].to_dense())
    adjusted_ours, adjusted_theirs = ours._adjust(L // 2, L // 2), theirs._adjust(L // 2, L // 2)
    assert torch.equal(adjusted_ours.to_dense(), adjusted_theirs.to_dense())
    q, k, v = (torch.randn(b or 1, h or 1, L // 2, 16) for _ in range(3))
    allowed = _dense(mask_mod, b or 1, h or 1, L // 2, L // 2)
    _exact(flex.flex_attention(q, k, v, block_mask=adjusted_ours), q, k, v, allowed)  # a BlockMask without a plan


def test_the_dq_write_order_is_torchs_and_a_tensor_order_is_refused_as_torch_refuses_it():
    ours = flex.create_block_mask(causal, 1, 2, L, L, compute_dq_write_order=True, dq_kv_order=False)
    theirs = torch_flex.create_block_mask(
        causal, 1, 2, L, L, device="cpu", compute_dq_write_order=True, dq_kv_order=False
    )
    assert torch.equal(ours.dq_write_order, theirs.dq_write_order)
    assert ours.dq_kv_order_spt is theirs.dq_kv_order_spt is False
    with pytest.raises(ValueError, match="dq_kv_order must be a bool"):
        flex.create_block_mask(causal, 1, 1, L, L, dq_kv_order=torch.arange(2))
    with pytest.raises(ValueError, match="dq_kv_order must be a bool"):
        torch_flex.create_block_mask(causal, 1, 1, L, L, device="cpu", dq_kv_order=torch.arange(2))


def test_a_sliced_block_mask_is_refused_as_torch_refuses_it():
    bm = flex.create_block_mask(causal, 2, 1, L, L)
    q = torch.randn(1, 1, L, 16)
    with pytest.raises(ValueError, match="sliced"):
        flex.flex_attention(q, q, q, block_mask=bm[0])


def test_key_and_value_of_batch_one_serve_every_query_sequence():
    """torch's rule: K/V of batch 1 with a block mask made for the query's batch (the paged cache's
    layout); attnkit refused it. Gradients reach the one K/V."""
    q = torch.randn(3, 2, L, 16, requires_grad=True)
    k, v = (torch.randn(1, 2, L, 16, requires_grad=True) for _ in range(2))
    doc = lambda b, h, qi, ki: (qi // (40 * (b + 1)) == ki // (40 * (b + 1))) & (qi >= ki)  # noqa: E731
    bm = flex.create_block_mask(doc, 3, None, L, L)
    out = flex.flex_attention(q, k, v, block_mask=bm)
    allowed = _dense(doc, 3, 1, L, L)
    kx, vx = k.expand(3, -1, -1, -1), v.expand(3, -1, -1, -1)
    _exact(out.detach(), q.detach(), kx.detach(), vx.detach(), allowed)
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), g)
    ref = [t.detach().double().requires_grad_() for t in (q, k, v)]
    formula(ref[0], ref[1].expand(3, -1, -1, -1), ref[2].expand(3, -1, -1, -1), allowed).backward(g.double())
    for a, r in zip(got, ref):
        torch.testing.assert_close(a.double(), r.grad, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="block mask must be made for the query's batch"):
        flex.flex_attention(q, k, v, block_mask=flex.create_block_mask(doc, 2, None, L, L))
    with pytest.raises(ValueError, match="block_mask=None"):
        flex.flex_attention(q, k, v)
    with pytest.raises(ValueError, match="batch 1"):
        flex.flex_attention(q, torch.randn(2, 2, L, 16), torch.randn(2, 2, L, 16), block_mask=bm)


def test_paged_decoding_through_torchs_paged_attention():
    """torch's PagedAttention keeps one (1, H, pages * page_size, D) cache for every sequence and a
    BlockMask over physical pages; decoding one token per sequence through attnkit.flex equals the
    float64 formula over each sequence's own keys."""
    from torch.nn.attention.experimental._paged_attention import PagedAttention

    page, heads, d, batch = 32, 2, 16, 3
    lengths = torch.tensor([70, 128, 33])
    max_len = 128
    n_pages = batch * max_len // page + 2
    paged = PagedAttention(n_pages, page, batch, device="cpu")
    k_cache = torch.zeros(1, heads, n_pages * page, d)
    v_cache = torch.zeros(1, heads, n_pages * page, d)
    keys = [torch.randn(1, heads, int(n), d) for n in lengths]
    values = [torch.randn(1, heads, int(n), d) for n in lengths]
    for b in range(batch):
        paged.reserve(torch.tensor(b), lengths[b])
        paged.assign(torch.tensor([b]), torch.arange(int(lengths[b]))[None], keys[b], values[b], k_cache, v_cache)
    last = lengths - 1

    def decode(b, h, q_idx, kv_idx):  # one query per sequence, at its last position
        return kv_idx <= last[b]

    logical = flex.create_block_mask(decode, batch, None, 1, max_len, BLOCK_SIZE=(1, page))
    physical = paged.convert_logical_block_mask(logical, kv_len=lengths)
    q = torch.randn(batch, heads, 1, d)
    out = flex.flex_attention(q, k_cache, v_cache, block_mask=physical)
    theirs = torch_flex.flex_attention(q, k_cache, v_cache, block_mask=physical)  # torch's eager answer
    for b in range(batch):
        qb = q[b : b + 1]
        gold = formula(
            qb.double(), keys[b].double(), values[b].double(), torch.ones(1, 1, 1, int(lengths[b]), dtype=torch.bool)
        )
        naive = formula(qb, keys[b], values[b], torch.ones(1, 1, 1, int(lengths[b]), dtype=torch.bool))
        assert_oracle(out[b : b + 1], gold, naive)
    torch.testing.assert_close(out, theirs, atol=1e-5, rtol=1e-5)


def test_torchs_empty_block_mask_means_no_mask():
    q, k, v = (torch.randn(2, 2, 100, 16) for _ in range(3))
    empty = torch_flex._create_empty_block_mask(q, k)  # what torch's flex_attention makes for block_mask=None
    _exact(flex.flex_attention(q, k, v, block_mask=empty), q, k, v, torch.ones(100, 100, dtype=torch.bool))


def test_key_and_value_in_float8_are_read_in_the_querys_dtype():
    q = torch.randn(1, 2, 64, 16, dtype=torch.float16)
    k8, v8 = (torch.randn(1, 2, 64, 16).to(torch.float8_e4m3fn) for _ in range(2))
    out = flex.flex_attention(q, k8, v8)
    assert out.dtype == torch.float16
    k, v = k8.to(torch.float16), v8.to(torch.float16)
    _exact(out, q, k, v, torch.ones(64, 64, dtype=torch.bool))
    theirs = torch_flex.flex_attention(q, k8, v8)
    assert theirs.dtype == torch.float16
    torch.testing.assert_close(out, theirs, atol=2e-3, rtol=2e-3)
    with pytest.raises(TypeError, match="the query must be float16"):
        flex.flex_attention(q.to(torch.float8_e4m3fn), k.float(), v.float())
