"""attnkit.flex: FlexAttention's API on attnkit's kernels, checked with attention-gym's own catalogue.

Every mask_mod and score_mod attention-gym ships (attn_gym.masks, attn_gym.mods) runs through
``attnkit.flex.flex_attention`` with a block mask made by torch's ``create_block_mask`` and by
attnkit's, forward and gradients against a float64 formula written here (the mask from torch's own
``create_mask``, the score_mod evaluated one pair at a time under torch.vmap, as FlexAttention
defines it), within TESTING.md's rule; torch's ``flex_attention`` (forward: it has no CPU
backward) agrees.
"""

from __future__ import annotations

import math

import pytest
import torch
from _oracle import assert_oracle

attn_gym = pytest.importorskip("attn_gym")
flex_module = pytest.importorskip("torch.nn.attention.flex_attention")

from _gym import catalogue  # noqa: E402  (tests/_gym.py: attention-gym's masks)

import attnkit  # noqa: E402
from attnkit import flex  # noqa: E402

L = 256


def _vmapped(fn):
    """fn(score, b, h, q, kv) of one pair over a (B, H, L, S) tile: FlexAttention's definition."""
    f = torch.vmap(fn, in_dims=(0, None, None, None, 0))
    f = torch.vmap(f, in_dims=(0, None, None, 0, None))
    f = torch.vmap(f, in_dims=(0, None, 0, None, None))
    return torch.vmap(f, in_dims=(0, 0, None, None, None))


def formula(q, k, v, mask_mod, score_mod, scale=None):
    """softmax(score_mod(q k^T * scale) masked) @ v in q's dtype, GQA by repeating K/V heads."""
    b, h, lq, d = q.shape
    lk = k.shape[2]
    rep = h // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = q @ k.transpose(-2, -1) * (d**-0.5 if scale is None else scale)
    if score_mod is not None:
        s = _vmapped(score_mod)(s, torch.arange(b), torch.arange(h), torch.arange(lq), torch.arange(lk))
    if mask_mod is not None:
        allowed = flex_module.create_mask(mask_mod, b, h, lq, lk, device="cpu")
        s = s.masked_fill(~allowed, float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return p @ v


# --- the catalogue: each entry builds (mask_mod, Q_LEN, KV_LEN) --------------------------------------

M = attn_gym.masks
MASKS = catalogue(L)

D = attn_gym.mods


def _graphormer_spatial(dtype):
    torch.manual_seed(2)
    adjacency = torch.rand(2, L, L) < 0.02
    adjacency = adjacency | adjacency.transpose(1, 2)
    distances = D.shortest_path_distances(adjacency, 4)
    table = torch.randn(4, 6, dtype=dtype, requires_grad=True)  # (heads, distances): learnable
    return D.generate_graphormer_spatial_bias(table, distances), [table]


def _graphormer_edge(dtype):
    torch.manual_seed(3)
    adjacency = torch.rand(2, L, L) < 0.02
    adjacency = adjacency | adjacency.transpose(1, 2)
    types = torch.randint(0, 3, (2, L, L))
    path_types, path_lengths = D.shortest_path_edge_types(adjacency, types, 3)
    table = torch.randn(4, 3, 3, dtype=dtype, requires_grad=True)  # (heads, path positions, edge types)
    return D.generate_graphormer_edge_bias(table, path_types, path_lengths), [table]


def _mla(dtype):
    torch.manual_seed(4)
    q_rope, k_rope = torch.randn(2, 4, L, 8, dtype=dtype), torch.randn(2, 4, L, 8, dtype=dtype)
    return D.generate_mla_rope_score_mod(q_rope, k_rope, 4, scale=0.2), []


#: Each builds (score_mod, its learnable tensors) with tensors of a dtype (the formula gets float64 ones).
SCORE_MODS = {
    "alibi": lambda dtype: (D.generate_alibi_bias(4), []),
    "tanh_softcap": lambda dtype: (D.generate_tanh_softcap(3), []),
    "activation": lambda dtype: (D.generate_activation_score_mod(), []),
    "sandwich": lambda dtype: (D.generate_sandwich_bias(4, L, d_bar=16), []),
    "graphormer_spatial": _graphormer_spatial,
    "graphormer_edge": _graphormer_edge,
    "mla_rope": _mla,
}


def _inputs(lq, lk, hq=4, hkv=2, b=2, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, lq, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, hkv, lk, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, hkv, lk, d, generator=g, dtype=torch.float64)
    return q, k, v


def _check(q64, k64, v64, mask_mod, score_mod, block_mask, params=(), gold_mod=None, params64=()):
    """attnkit.flex's output and gradients (q, k, v and the score_mod's ``params``) against the
    float64 formula (``gold_mod``: the score_mod over float64 copies ``params64``)."""
    q, k, v = (t.float().requires_grad_() for t in (q64, k64, v64))
    out = flex.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=True)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v, *params), grad)
    leaves64 = [t.clone().requires_grad_() for t in (q64, k64, v64)]
    gold = formula(*leaves64, mask_mod, score_mod if gold_mod is None else gold_mod)
    want = torch.autograd.grad(gold, (*leaves64, *params64), grad.double())
    naive = formula(*(t.float() for t in (q64, k64, v64)), mask_mod, score_mod)
    assert_oracle(out.detach(), gold.detach(), naive.detach(), what="output")
    leaves32 = [t.float().requires_grad_() for t in (q64, k64, v64)]
    naive_grads = torch.autograd.grad(formula(*leaves32, mask_mod, score_mod), (*leaves32, *params), grad)
    for name, g, w, n in zip(["dq", "dk", "dv", *(f"param{i}" for i in range(len(params)))], got, want, naive_grads):
        assert_oracle(g, w, n, factor=3.0, what=name, small=True)
    return out.detach()


@pytest.mark.parametrize("maker", ["torch", "attnkit"])
@pytest.mark.parametrize("name", list(MASKS))
def test_every_attention_gym_mask_mod(name, maker):
    mask_mod, lq, lk, *lead = MASKS[name]()
    b, h = lead or (None, None)  # a map per sequence and head where the mask_mod reads b and h
    make = flex_module.create_block_mask if maker == "torch" else flex.create_block_mask
    block_mask = make(mask_mod, b, h, lq, lk, device="cpu")
    q, k, v = _inputs(lq, lk)
    out = _check(q, k, v, mask_mod, None, block_mask)
    theirs = flex_module.flex_attention(q.float(), k.float(), v.float(), block_mask=block_mask, enable_gqa=True)
    torch.testing.assert_close(out, theirs, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("name", list(SCORE_MODS))
def test_every_attention_gym_score_mod(name):
    score_mod, params = SCORE_MODS[name](torch.float32)
    gold_mod, params64 = SCORE_MODS[name](torch.float64)  # the same values (seeded), in float64
    block_mask = flex.create_block_mask(M.causal_mask, None, None, L, L, device="cpu")
    q, k, v = _inputs(L, L, hq=4, hkv=4)
    out = _check(q, k, v, M.causal_mask, score_mod, block_mask, params, gold_mod, params64)
    with torch.no_grad():
        theirs = flex_module.flex_attention(q.float(), k.float(), v.float(), score_mod=score_mod, block_mask=block_mask)
    torch.testing.assert_close(out, theirs, atol=2e-5, rtol=1e-4)


def test_a_block_mask_of_another_block_size_and_per_head_maps():
    """torch's BlockMask at BLOCK_SIZE 64 and per (sequence, head) maps: attnkit's blocks are judged
    from the ones they cover, and the mask_mod is asked only where torch's map says partial."""
    asked = []

    def per_head(b, h, q_idx, kv_idx):
        asked.append(q_idx.numel())
        return (q_idx - kv_idx).abs() <= 16 * (h + 1) + 8 * b

    bm = flex_module.create_block_mask(per_head, 2, 4, L, L, device="cpu", BLOCK_SIZE=64)
    asked.clear()
    q, k, v = _inputs(L, L)
    _check(q, k, v, per_head, None, bm)
    assert asked, "the partial blocks ask the mask_mod"
    mask = attnkit.masks.from_block_mask(bm)
    prepared = attnkit.prepare(mask, L, L, block_size=(128, 128))  # each block covers 2 x 2 of torch's
    assert prepared.codes.shape == (2, 4, 2, 2)
    dense = flex_module.create_mask(per_head, 2, 4, L, L, device="cpu")
    assert torch.equal(mask.materialize(L, L), dense)


def test_full_blocks_are_never_asked_and_unlisted_blocks_are_empty():
    """A BlockMask from_kv_blocks whose full block disagrees with its mask_mod: attnkit keeps the
    full block whole without asking, as FlexAttention's kernels do (its unfused CPU path asks the
    mask_mod everywhere, so for such an inconsistent BlockMask it returns zeros)."""
    asked = []

    def never(b, h, q_idx, kv_idx):  # hides every pair it is asked about (elementwise: asked by broadcasting)
        asked.append(kv_idx)
        return q_idx < 0

    kv_num = torch.tensor([[[1, 0]]], dtype=torch.int32)
    kv_idx = torch.tensor([[[[0, 0], [0, 0]]]], dtype=torch.int32)
    full_num = torch.tensor([[[0, 1]]], dtype=torch.int32)
    full_idx = torch.tensor([[[[0, 0], [1, 0]]]], dtype=torch.int32)
    bm = flex_module.BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=128, mask_mod=never)
    allowed = attnkit.masks.from_block_mask(bm).materialize(256, 256)
    assert not allowed[0, 0, :128].any() and allowed[0, 0, 128:, 128:].all() and not allowed[0, 0, 128:, :128].any()
    assert (
        asked and max(int(t.max()) for t in asked) < 128
    )  # only the partial block (keys 0-127 of rows 0-127) was asked
    q, k, v = _inputs(256, 256, hq=2, hkv=2, b=1)
    out = flex.flex_attention(q.float(), k.float(), v.float(), block_mask=bm)
    gold = formula(q, k, v, lambda b, h, qi, ki: (qi >= 128) & (ki >= 128), None)
    naive = formula(q.float(), k.float(), v.float(), lambda b, h, qi, ki: (qi >= 128) & (ki >= 128), None)
    assert_oracle(out, gold, naive)
    assert (out[..., :128, :] == 0).all()  # rows that see no key: zeros, as FlexAttention's


def test_lse_and_max_scores():
    q, k, v = (t.float() for t in _inputs(L, L, hq=2, hkv=2, b=1))
    bm = flex.create_block_mask(M.generate_sliding_window(40), None, None, L, L)
    out, lse = flex.flex_attention(q, k, v, block_mask=bm, return_lse=True)
    _, theirs = flex_module.flex_attention(q, k, v, block_mask=bm, return_aux=flex_module.AuxRequest(lse=True))
    torch.testing.assert_close(lse, theirs.lse, atol=1e-5, rtol=1e-5)
    _, aux = flex.flex_attention(q, k, v, block_mask=bm, return_aux=flex_module.AuxRequest(lse=True, max_scores=True))
    s = (q @ k.transpose(-2, -1) / 4).masked_fill(
        ~flex_module.create_mask(M.generate_sliding_window(40), 1, 2, L, L, device="cpu"), -math.inf
    )
    torch.testing.assert_close(aux.max_scores, s.amax(-1), atol=1e-5, rtol=1e-5)  # torch has none on the CPU
    torch.testing.assert_close(aux.lse, lse)


def test_what_differs_from_torch_is_said():
    q = k = v = torch.randn(1, 4, 64, 16)
    with pytest.raises(ValueError, match="enable_gqa=True"):
        flex.flex_attention(q, k[:, :2], v[:, :2])
    with pytest.raises(ValueError, match="KERNEL_OPTIONS"):
        flex.flex_attention(q, k, v, kernel_options={"NOT_A_KNOB": 1})
    out = flex.flex_attention(q, k, v, kernel_options={"BLOCK_M": 64, "num_warps": 4, "PRESCALE_QK": True})
    torch.testing.assert_close(out, flex.flex_attention(q, k, v))  # tuning knobs: documented no-ops
    with pytest.raises(ValueError, match="Q_LEN=64, KV_LEN=64"):
        flex.flex_attention(
            q[:, :, :32],
            k,
            v,
            block_mask=flex_module.create_block_mask(M.causal_mask, None, None, 64, 64, device="cpu"),
        )
    with pytest.raises(ValueError, match=r"\(B, H, L, D\)"):
        flex.flex_attention(q[0], k[0], v[0])
    with pytest.raises(TypeError, match="block_mask must be"):
        flex.flex_attention(q, k, v, block_mask="causal")


# --- an unmodified Flex training snippet, with only its import swapped --------------------------------

SNIPPET = """
import torch
from torch import nn
from torch.nn.attention.flex_attention import flex_attention, create_block_mask

class Block(nn.Module):
    def __init__(self, dim=32, heads=4, max_len=256):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.rel = nn.Parameter(torch.zeros(heads, 2 * max_len))   # a learnable relative bias

    def forward(self, x, block_mask):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        rel = self.rel

        def relative_bias(score, b, h, q_idx, kv_idx):
            return score + rel[h, q_idx - kv_idx + n]

        y = flex_attention(q, k, v, score_mod=relative_bias, block_mask=block_mask)
        return self.out(y.transpose(1, 2).reshape(b, n, -1))

docs = torch.tensor([0] * 100 + [1] * 90 + [2] * 66)

def document_causal(b, h, q_idx, kv_idx):
    return (docs[q_idx] == docs[kv_idx]) & (q_idx >= kv_idx)

torch.manual_seed(0)
model = Block()
block_mask = create_block_mask(document_causal, None, None, 256, 256, device="cpu")
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x = torch.randn(2, 256, 32)
loss = model(x, block_mask).square().mean()
loss.backward()
grads = {name: p.grad.clone() for name, p in model.named_parameters()}
opt.step()
"""


def test_an_unmodified_flex_training_snippet_trains_with_only_its_import_swapped():
    """FlexAttention raises NotImplementedError on this snippet's backward on the CPU; with the import
    swapped it trains, and every gradient (the learnable relative bias's included) equals the float64
    formula's."""
    swapped = SNIPPET.replace("from torch.nn.attention.flex_attention import", "from attnkit.flex import")
    assert swapped != SNIPPET
    scope: dict = {}
    exec(compile(swapped, "flex_snippet", "exec"), scope)
    grads, x = scope["grads"], scope["x"]
    assert grads["rel"].abs().sum() > 0  # the captured bias got its gradient
    assert not torch.equal(scope["model"].rel.detach(), torch.zeros_like(scope["model"].rel))  # and a step
    # the float64 formula in flex_attention's place, from the same initial weights
    torch.manual_seed(0)
    ref = scope["Block"]().double()  # the snippet's first model after manual_seed(0), in float64
    mask_mod = scope["document_causal"]
    scope["flex_attention"] = lambda q, k, v, score_mod=None, block_mask=None: formula(q, k, v, mask_mod, score_mod)
    ref(x.double(), None).square().mean().backward()
    for name, p in ref.named_parameters():
        want, got = p.grad, grads[name].double()
        bound = 1e-4 * max(want.abs().max().item(), 1e-6)
        assert (got - want).abs().max().item() <= bound, (name, (got - want).abs().max().item(), bound)
