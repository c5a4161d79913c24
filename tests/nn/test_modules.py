"""MultiHeadAttention: parity with torch.nn.MultiheadAttention, GQA, cross-attention, masks."""

import pytest
import torch
import torch.utils._python_dispatch
from _oracle import naive_attention, randn
from torch import nn

import attnkit
from attnkit import masks


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("kdim,vdim", [(None, None), (12, 20)])
def test_from_torch_matches_outputs_and_per_head_weights(bias, kdim, vdim):
    ref = nn.MultiheadAttention(32, 4, bias=bias, kdim=kdim, vdim=vdim, batch_first=True).eval()
    mha = attnkit.MultiHeadAttention.from_torch(ref).eval()
    x = randn(3, 7, 32)
    key = randn(3, 9, kdim or 32)
    value = randn(3, 9, vdim or 32)
    hidden = torch.rand(3, 4, 7, 9) > 0.7  # torch: True = hidden
    hidden[..., 0] = False
    want, want_w = ref(x, key, value, attn_mask=hidden.reshape(12, 7, 9), average_attn_weights=False)
    got, got_w = mha(x, key, value, mask=~hidden, need_weights=True)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    torch.testing.assert_close(got_w, want_w, rtol=0, atol=1e-5)
    no_weights = mha(x, key, value, mask=~hidden)
    assert no_weights[1] is None
    torch.testing.assert_close(no_weights[0], want, rtol=0, atol=1e-5)


def test_from_torch_causal_self_attention_and_padding():
    ref = nn.MultiheadAttention(16, 2, batch_first=True).eval()
    mha = attnkit.MultiHeadAttention.from_torch(ref)
    x = randn(2, 6, 16)
    lengths = torch.tensor([4, 6])
    pad = torch.arange(6)[None] >= lengths[:, None]  # torch: True = padding
    causal = torch.ones(6, 6, dtype=torch.bool).triu(1)
    want, want_w = ref(x, x, x, attn_mask=causal, key_padding_mask=pad, average_attn_weights=False)
    got, got_w = mha(x, mask=masks.causal() & masks.padding(lengths), need_weights=True)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    torch.testing.assert_close(got_w, want_w, rtol=0, atol=1e-5)


def test_from_torch_rejects_extra_keys():
    with pytest.raises(ValueError, match="add_bias_kv=True or add_zero_attn=True"):
        attnkit.MultiHeadAttention.from_torch(nn.MultiheadAttention(8, 2, add_bias_kv=True))
    with pytest.raises(TypeError, match="expects a torch.nn.MultiheadAttention, but got Linear"):
        attnkit.MultiHeadAttention.from_torch(nn.Linear(2, 2))


def test_module_is_the_formula_written_out():
    mha = attnkit.MultiHeadAttention(24, 6, num_kv_heads=2).double()
    x = randn(2, 5, 24, dtype=torch.float64)
    mask = masks.causal()
    q = mha.q_proj(x).view(2, 5, 6, 4).transpose(1, 2)  # (B, H, L, hd)
    k = mha.k_proj(x).view(2, 5, 2, 4).transpose(1, 2)  # (B, Hkv, L, hd)
    v = mha.v_proj(x).view(2, 5, 2, 4).transpose(1, 2)
    out, w = naive_attention(q, k, v, mask.materialize(5, 5))
    want = mha.out_proj(out.transpose(1, 2).reshape(2, 5, 24))
    got, got_w = mha(x, mask=mask, need_weights=True)
    assert torch.allclose(got, want, atol=1e-12)
    assert got_w.shape == (2, 6, 5, 5) and torch.allclose(got_w, w, atol=1e-12)


def test_gqa_module_shares_kv_heads():
    mha = attnkit.MultiHeadAttention(32, 8, num_kv_heads=2)
    assert mha.k_proj.out_features == 8 and mha.v_proj.out_features == 8
    out, w = mha(randn(2, 5, 32), need_weights=True)
    assert out.shape == (2, 5, 32) and w.shape == (2, 8, 5, 5)


def test_cross_attention_from_another_width():
    mha = attnkit.MultiHeadAttention(16, 4, kdim=10, vdim=6)
    out, w = mha(randn(2, 3, 16), randn(2, 8, 10), randn(2, 8, 6), need_weights=True)
    assert out.shape == (2, 3, 16) and w.shape == (2, 4, 3, 8)


def test_every_mask_form():
    mha = attnkit.MultiHeadAttention(16, 4).double().eval()
    x = randn(2, 5, 16, dtype=torch.float64)
    dense = torch.ones(5, 5, dtype=torch.bool).tril()
    want = mha(x, mask=dense)[0]
    assert torch.allclose(mha(x, mask=masks.causal())[0], want, atol=1e-12)
    additive = torch.zeros(5, 5, dtype=torch.float64).masked_fill(~dense, float("-inf"))
    assert torch.allclose(mha(x, mask=additive)[0], want, atol=1e-12)
    pad = attnkit.create_padding_mask(torch.tensor([[1, 2, 3, 0, 0], [1, 2, 3, 4, 5]]))
    assert torch.allclose(
        mha(x, mask=pad & attnkit.create_causal_mask(5))[0],
        mha(x, mask=masks.padding(torch.tensor([3, 5])) & masks.causal())[0],
        atol=1e-12,
    )


def test_unbatched_inputs():
    mha = attnkit.MultiHeadAttention(16, 4).eval()
    x = randn(5, 16)
    out, w = mha(x, need_weights=True)
    assert out.shape == (5, 16) and w.shape == (4, 5, 5)
    assert torch.allclose(out, mha(x[None])[0][0], atol=1e-6)


def test_dropout_only_in_training():
    mha = attnkit.MultiHeadAttention(16, 4, dropout=0.5)
    x = randn(2, 6, 16)
    mha.eval()
    assert torch.equal(mha(x)[0], mha(x)[0])
    mha.train()
    torch.manual_seed(0)
    a = mha(x)[0]
    torch.manual_seed(0)
    assert torch.equal(a, mha(x)[0])
    assert not torch.allclose(a, mha(x)[0])
    a.sum().backward()
    assert mha.q_proj.weight.grad is not None


def test_repr():
    assert "num_kv_heads=2" in repr(attnkit.MultiHeadAttention(16, 4, num_kv_heads=2))


def test_split_and_merge_heads_are_inverse():
    x = randn(2, 5, 12)
    heads = attnkit.MultiHeadAttention.split_heads(x, 3)
    assert heads.shape == (2, 3, 5, 4)
    assert torch.equal(attnkit.MultiHeadAttention.merge_heads(heads), x)


def test_attention_hooks_are_removable_handles():
    mha = attnkit.MultiHeadAttention(16, 4, num_kv_heads=2)
    calls = []
    handle = mha.register_attention_hook(lambda m, q, k, v, mask: calls.append((m, q.shape, k.shape, mask)))
    x = randn(2, 5, 16)
    mha(x, mask=masks.causal())
    assert calls[0][0] is mha and calls[0][1] == (2, 4, 5, 4) and calls[0][2] == (2, 2, 5, 4)
    handle.remove()
    mha(x)
    assert len(calls) == 1
    with pytest.raises(TypeError, match="hook must be callable"):
        mha.register_attention_hook(3)
