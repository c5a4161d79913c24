"""rollout (both methods) against a float64 dense computation from eager weights, written here:
rollout from the captured weights of each layer, Chefer's rule from the gradients of eager
attention probabilities (an attnkit model written out by hand, and transformers' eager
implementation with output_attentions), with padding, GQA, windows and softcap."""

from __future__ import annotations

import copy
import sys

import pytest
import torch
from _oracle import assert_oracle
from torch import nn

import attnkit
from attnkit import masks
from attnkit.inspect import capture, rollout

transformers = pytest.importorskip("transformers")
from transformers import (  # noqa: E402
    AutoModel,
    AutoModelForCausalLM,
    BertConfig,
    Gemma2Config,
    LlamaConfig,
    MistralConfig,
)

import attnkit.integrations.transformers  # noqa: E402,F401  (registers attn_implementation="attnkit")

H, D, V = 4, 32, 50


class Tiny(nn.Module):
    """Two attnkit layers with residuals over a causal & padding mask, and a vocabulary head."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.blocks = nn.ModuleList(attnkit.MultiHeadAttention(D, H) for _ in range(2))
        self.head = nn.Linear(D, V)

    def forward(self, ids, lengths):
        x = self.embed(ids)
        mask = masks.causal() & masks.padding(lengths)
        for block in self.blocks:
            x = x + block(x, mask=mask)[0]
        return self.head(x)

    def by_hand(self, ids, lengths):
        """The same forward with the weights as explicit softmax tensors: (logits, [A per layer])."""
        x = self.embed(ids)
        length = ids.shape[1]
        allowed = masks.causal().materialize(length, length) & (torch.arange(length) < lengths.view(-1, 1, 1, 1))
        weights = []
        for block in self.blocks:
            q, k, v = block.project(x, x, x)
            s = (q @ k.transpose(-2, -1)) / block.head_dim**0.5
            a = torch.softmax(s.masked_fill(~allowed, float("-inf")), dim=-1)
            a.retain_grad()
            weights.append(a)
            x = x + block.out_proj(block.merge_heads(a @ v))
        return self.head(x), weights


def dense_rollout(weights, rows, residual=0.5, heads=None):
    b, length = weights[0].shape[0], weights[0].shape[-1]
    r = torch.zeros(b, len(rows), length, dtype=weights[0].dtype)
    r[:, torch.arange(len(rows)), torch.tensor(rows) % length] = 1
    for layer in reversed(range(len(weights))):
        if heads is None:
            a = weights[layer]
        else:
            a = weights[layer][:, heads[layer] if isinstance(heads[layer], list) else [heads[layer]]]
        r = residual * r + (1 - residual) * r @ a.mean(1)
    return r


def dense_grad(weights, rows):
    """Chefer's rule: r <- r + r @ mean_h((dA * A)^+), one backward (already run) per row."""
    b, length = weights[0][0][0].shape[0], weights[0][0][0].shape[-1]
    out = []
    for j, (per_layer, grads) in enumerate(weights):
        r = torch.zeros(b, 1, length, dtype=per_layer[0].dtype)
        r[:, 0, rows[j] % length] = 1
        for a, da in zip(reversed(per_layer), reversed(grads)):
            r = r + r @ (da * a).clamp_min(0).mean(1)
        out.append(r)
    return torch.cat(out, dim=1)


def _tiny(seed=0):
    torch.manual_seed(seed)
    model = Tiny().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(2.0)
    return model


def _inputs():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, V, (2, 13), generator=g), torch.tensor([13, 9])


@pytest.mark.parametrize("heads", [None, [[0, 2], 3]])
def test_rollout_equals_the_dense_formula_from_captured_weights(heads):
    model, (ids, lengths) = _tiny(), _inputs()
    rows = [8] if heads else [-1, 5]
    residual = 0.5 if heads is None else 0.3
    got = rollout(model, ids, lengths, rows=rows, heads=heads or "mean", residual=residual)
    expected = []
    for m in (copy.deepcopy(model).double(), model):
        with torch.no_grad(), capture(m) as cap:
            m(ids, lengths)
        expected.append(dense_rollout(cap.weights, rows, residual=residual, heads=heads))
    assert_oracle(got, expected[0], expected[1], what=f"rollout heads={heads}")
    torch.testing.assert_close(got.sum(-1), torch.ones_like(got.sum(-1)))  # rollout keeps each row's mass


def test_grad_method_equals_chefer_from_eager_probabilities():
    model, (ids, lengths) = _tiny(3), _inputs()
    rows = [8, 4]
    got = rollout(model, ids, lengths, rows=rows, method="grad")
    expected = []
    for m in (copy.deepcopy(model).double(), copy.deepcopy(model)):
        per_row = []
        for row in rows:
            logits, weights = m.by_hand(ids, lengths)
            logits[:, row].max(-1).values.sum().backward()
            per_row.append(([a.detach() for a in weights], [a.grad for a in weights]))
        expected.append(dense_grad(per_row, rows))
    assert_oracle(got, expected[0], expected[1], what="grad")
    assert got.shape == (2, 2, 13) and (got[1, :, 9:] == 0).all()  # padding keys get nothing


HF = {
    "bert (encoder, padding)": (
        AutoModel,
        lambda: BertConfig(
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            vocab_size=61,
            max_position_embeddings=64,
        ),
    ),
    "llama (GQA)": (
        AutoModelForCausalLM,
        lambda: LlamaConfig(
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=61,
            pad_token_id=0,
        ),
    ),
    "mistral (sliding window, GQA)": (
        AutoModelForCausalLM,
        lambda: MistralConfig(
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            sliding_window=5,
            vocab_size=61,
            pad_token_id=0,
        ),
    ),
    "gemma2 (softcap)": (
        AutoModelForCausalLM,
        lambda: Gemma2Config(
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            sliding_window=5,
            attn_logit_softcapping=5.0,
            query_pre_attn_scalar=8,
            vocab_size=61,
            pad_token_id=0,
        ),
    ),
}


PROBE = torch.randn(32, generator=torch.Generator().manual_seed(5))


def _target(output):
    found = getattr(output, "logits", None)
    if found is None:  # an encoder: a fixed direction of the chosen rows' (layer-normed) hidden states
        hidden = output.last_hidden_state[:, [6, 2]]
        return hidden @ PROBE.to(hidden.dtype)
    return found[:, [6, 2]].max(-1).values


@pytest.mark.parametrize("method", ["rollout", "grad"])
@pytest.mark.parametrize("name", list(HF))
def test_transformers_models_equal_eager(name, method):
    auto, make = HF[name]
    torch.manual_seed(0)
    eager = auto.from_config(make(), attn_implementation="eager").eval()
    with torch.no_grad():
        for p in eager.parameters():
            if p.dim() == 2:
                p.mul_(3.0)
    ours = auto.from_config(make(), attn_implementation="attnkit").eval()
    ours.load_state_dict(eager.state_dict())
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(3, 61, (2, 10), generator=g)
    attention_mask = torch.ones(2, 10, dtype=torch.long)
    attention_mask[1, -2:] = 0  # padding on the right (eager's float64 NaN rows stay out of every real row)
    rows = [6, 2]
    got = rollout(ours, input_ids=ids, attention_mask=attention_mask, rows=rows, method=method, target=_target)
    expected = []
    for m in (copy.deepcopy(eager).double(), eager):
        if method == "rollout":
            with torch.no_grad():
                weights = m(input_ids=ids, attention_mask=attention_mask, output_attentions=True).attentions
            expected.append(dense_rollout([w.to(m.dtype) for w in weights], rows))
        else:
            per_row = []
            for j in range(len(rows)):
                out = m(input_ids=ids, attention_mask=attention_mask, output_attentions=True)
                for a in out.attentions:
                    a.retain_grad()
                _target(out)[:, j].sum().backward()
                per_row.append(([a.detach() for a in out.attentions], [a.grad for a in out.attentions]))
            expected.append(dense_grad(per_row, rows))
    assert_oracle(got, expected[0], expected[1], what=f"{name} {method}")


def test_no_weight_matrix_at_length(monkeypatch):
    """At L=2048 no tensor of L x L elements per head is made (the received reduction is a backward)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    model = _tiny()
    ids, lengths = torch.randint(0, V, (1, 2048)), torch.tensor([2048])
    sizes = []

    class Sizes(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    sizes.append(t.numel())
            return out

    with Sizes():
        r = rollout(model, ids, lengths, rows=[-1])
    assert r.shape == (1, 1, 2048) and max(sizes) < 2048 * 2048


def test_bad_requests_name_the_values():
    model, (ids, lengths) = _tiny(), _inputs()
    with pytest.raises(ValueError, match="method must be"):
        rollout(model, ids, lengths, rows=[0], method="lrp")
    with pytest.raises(ValueError, match=r"rows \[40\] are out of range for the 13 queries"):
        rollout(model, ids, lengths, rows=[40])
    with pytest.raises(ValueError, match="heads has 1 entries but the model ran 2"):
        rollout(model, ids, lengths, rows=[0], heads=[0])
    with pytest.raises(ValueError, match="residual must be"):
        rollout(model, ids, lengths, rows=[0], residual=2)
    with pytest.raises(TypeError, match="rows must be"):
        rollout(model, ids, lengths, rows="last")
    with pytest.raises(ValueError, match="target must return"):
        rollout(model, ids, lengths, rows=[0, 1], method="grad", target=lambda out: out[:, 0, 0])
    cross = attnkit.MultiHeadAttention(D, H)
    found = rollout(cross, torch.randn(1, 4, D), torch.randn(1, 6, D), rows=[0])  # cross-attention alone
    assert found.target.shape == (1, 1, 4) and found.source.shape == (1, 1, 6)


def test_grad_method_with_a_bias_and_softcap_equals_the_formula():
    """One attnkit layer with ALiBi and softcap: Chefer's rule against autograd on its eager weights."""
    from attnkit import bias

    torch.manual_seed(6)
    layer = attnkit.MultiHeadAttention(D, H, softcap=4.0).eval()
    x = torch.randn(2, 11, D)
    alibi = bias.alibi(bias.alibi_slopes(H))
    probe = torch.randn(D)
    rows = [10, 6]

    def target(output):
        return output[0][:, rows] @ probe

    got = rollout(layer, x, rows=rows, method="grad", target=target, mask=masks.causal(), attn_bias=alibi)
    expected = []
    for dtype in (torch.float64, torch.float32):
        m, xx = copy.deepcopy(layer).to(dtype), x.to(dtype)
        per_row = []
        for j in range(len(rows)):
            q, k, v = m.project(xx, xx, xx)
            s = torch.tanh((q @ k.transpose(-2, -1)) / m.head_dim**0.5 / 4.0) * 4.0
            s = s + alibi.dense(2, H, 11, 11, "cpu").to(dtype)
            a = torch.softmax(s.masked_fill(~masks.causal().materialize(11, 11), float("-inf")), dim=-1)
            a.retain_grad()
            out = m.out_proj(m.merge_heads(a @ v))
            (out[:, rows] @ probe.to(dtype))[:, j].sum().backward()
            per_row.append(([a.detach()], [a.grad]))
        expected.append(dense_grad(per_row, rows))
    assert_oracle(got, expected[0], expected[1], what="grad with alibi and softcap")


class Masked(Tiny):
    """Tiny under any mask object (documents, windows, padding), written out by hand the same way."""

    def __init__(self, mask):
        super().__init__()
        self.mask = mask

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = x + block(x, mask=self.mask)[0]
        return self.head(x)

    def by_hand(self, ids):
        x = self.embed(ids)
        allowed = masks.as_mask(self.mask).materialize(ids.shape[1], ids.shape[1])
        weights = []
        for block in self.blocks:
            q, k, v = block.project(x, x, x)
            s = (q @ k.transpose(-2, -1)) / block.head_dim**0.5
            a = torch.nan_to_num(torch.softmax(s.masked_fill(~allowed, float("-inf")), dim=-1))
            a.retain_grad()
            weights.append(a)
            x = x + block.out_proj(block.merge_heads(a @ v))
        return self.head(x), weights


@pytest.mark.parametrize("kind", ["documents & causal", "sliding window", "causal & padding, a head per layer"])
def test_grad_rule_over_many_row_blocks_equals_the_formula(monkeypatch, kind):
    """L=300 in tiles of one row block and ~230 keys (the tile loops, the block codes' reach and the
    element mask on partial columns only), masks with partial blocks away from the diagonal,
    per-sequence key limits and chosen heads, against Chefer's rule on eager float64 probabilities."""
    length = 300
    ids = torch.randint(0, V, (2, length), generator=torch.Generator().manual_seed(4))
    heads = None
    if kind == "documents & causal":
        doc = torch.cat([torch.zeros(70), torch.ones(140), torch.full((90,), 2)]).long()
        mask = masks.document(torch.stack([doc, doc.roll(40)])) & masks.causal()
    elif kind == "sliding window":
        mask = masks.sliding_window(90)
    else:
        mask, heads = masks.causal() & masks.padding(torch.tensor([300, 170])), [[1, 3], [2]]
    torch.manual_seed(8)
    model = Masked(mask).eval()
    monkeypatch.setattr(sys.modules["attnkit.kernels.runs.relevance"], "KEYS", 100)  # several key tiles
    rows = [299, 150]
    got = rollout(model, ids, rows=rows, method="grad", heads=heads or "mean")
    expected = []
    for m in (copy.deepcopy(model).double(), copy.deepcopy(model)):
        per_row = []
        for row in rows:
            logits, weights = m.by_hand(ids)
            logits[:, row].max(-1).values.sum().backward()
            if heads is not None:
                grads = [a.grad[:, hs] for a, hs in zip(weights, heads)]
                weights = [a[:, hs] for a, hs in zip(weights, heads)]
            else:
                grads = [a.grad for a in weights]
            per_row.append(([a.detach() for a in weights], grads))
        expected.append(dense_grad(per_row, rows))
    assert_oracle(got, expected[0], expected[1], what=f"grad, {kind}")


def test_lse_hooks_give_the_kernels_lse_and_leave_the_output_unchanged():
    """MultiHeadAttention.register_lse_hook and the transformers integration's register_lse_hook: the
    row log-sum-exp of the call (float64 formula), the same output as without the hook."""
    from attnkit.integrations.transformers import register_lse_hook

    torch.manual_seed(9)
    layer = attnkit.MultiHeadAttention(D, H, num_kv_heads=2).eval()
    x = torch.randn(2, 9, D)
    mask = masks.causal() & masks.padding(torch.tensor([9, 6]))
    seen = []
    with torch.no_grad():
        plain = layer(x, mask=mask)[0]
        handle = layer.register_lse_hook(lambda module, lse: seen.append((module, lse)))
        hooked = layer(x, mask=mask)[0]
        handle.remove()
        layer(x, mask=mask)
    assert len(seen) == 1 and seen[0][0] is layer
    torch.testing.assert_close(hooked, plain)
    q, k, _ = (t.double() for t in layer.project(x, x, x))
    k = k.repeat_interleave(2, dim=1)
    s = (q @ k.transpose(-2, -1)) / layer.head_dim**0.5
    want = torch.logsumexp(s.masked_fill(~mask.materialize(9, 9), float("-inf")), dim=-1)
    torch.testing.assert_close(seen[0][1].double(), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(TypeError, match="hook must be callable"):
        layer.register_lse_hook("lse")

    cls, config = HF["llama (GQA)"]
    torch.manual_seed(0)
    model = cls.from_config(config(), attn_implementation="attnkit").eval()
    found = []
    handle = register_lse_hook(lambda module, lse: found.append(lse.shape))
    with torch.no_grad():
        model(torch.randint(1, 61, (2, 7)))
    handle.remove()
    with torch.no_grad():
        model(torch.randint(1, 61, (2, 7)))
    assert found == [(2, 4, 7), (2, 4, 7)]  # one call per layer, while registered


# --- cross-attention and KV-cached decoding ------------------------------------------------------


def _translator(seed=11):
    from attnkit.models.translator import Config, DateTranslator

    torch.manual_seed(seed)
    model = DateTranslator(Config(d_model=32, num_heads=4, encoder_layers=2, decoder_layers=2, d_ff=48)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3.0)  # weights far from uniform
    src, lengths = model.encode_source(["25th of March 2019", "3/4/1999"])
    target_in = torch.randint(4, 15, (2, 6), generator=torch.Generator().manual_seed(2))
    return model, (src, lengths, target_in)


class _Eager(nn.Module):
    """An attnkit layer's forward written out with softmax weights that keep their gradients (``log``)."""

    def __init__(self, layer, log):
        super().__init__()
        self.layer, self.log = layer, log

    def project_kv(self, memory):
        return self.layer.project_kv(memory)

    def forward(self, x, mask=None, kv=None, cache=None):
        m = self.layer
        q, k, v = m.project(x, x, x)
        if kv is not None:
            k, v = kv
        s = (q @ k.transpose(-2, -1)) / m.head_dim**0.5
        allowed = masks.as_mask(mask).materialize(q.shape[2], k.shape[2])
        a = torch.softmax(s.masked_fill(~allowed, float("-inf")), dim=-1)
        a.retain_grad()
        self.log.append(a)
        return m.out_proj(m.merge_heads(a @ v)), a


def _joint(per_layer, kinds, ls, slots, method, residual=0.5):
    """The relevance ``e_row M_last ... M_first`` over the joint tokens [source; target], each layer a
    (Ls + Lt) x (Ls + Lt) matrix: identity but for the rows its queries write (at ``slots``)."""
    b = per_layer[0].shape[0]
    lt = max(a.shape[-1] for a, kind in zip(per_layer, kinds) if kind == "target") if "target" in kinds else None
    lt = lt or per_layer[-1].shape[2]
    n = ls + lt
    total = torch.eye(n, dtype=per_layer[0].dtype).repeat(b, 1, 1)
    for a, kind in zip(per_layer, kinds):  # total = M_first ... : built from the first layer up
        abar = a.mean(1)  # (B, Lq, Lk)
        m = torch.eye(n, dtype=a.dtype).repeat(b, 1, 1)
        for bi in range(b):
            for i in range(a.shape[2]):
                row = i if kind == "source" else ls + int(slots[bi if slots.shape[0] > 1 else 0, i])
                if row >= n:
                    continue
                cols = slice(0, ls) if kind in ("source", "cross") else slice(ls, ls + a.shape[-1])
                if method == "rollout":
                    m[bi, row] *= residual
                    m[bi, row, cols] += (1 - residual) * abar[bi, i]
                else:
                    m[bi, row, cols] += abar[bi, i]
        total = m @ total
    return total


def test_rollout_through_cross_attention_equals_the_joint_formula():
    """The translator (encoder, causal decoder, cross-attention; padded sources): both rules against a
    float64 product of per-layer matrices over [source; target] from eager weights, and rollout keeps
    each row's mass over the two."""
    from attnkit.inspect import Relevance

    model, (src, lengths, tin) = _translator()
    rows, ls, lt = [5, 2], src.shape[1], tin.shape[1]
    kinds = ["source", "source", "target", "cross", "target", "cross"]
    for method in ("rollout", "grad"):
        got = rollout(model, src, lengths, tin, rows=rows, method=method)
        assert isinstance(got, Relevance) and got.target.shape == (2, 2, lt) and got.source.shape == (2, 2, ls)
        expected = []
        for dtype in (torch.float64, torch.float32):
            m = copy.deepcopy(model).to(dtype)
            log: list = []
            for layer in m.encoder:
                layer.self_attn = _Eager(layer.self_attn, log)
            for layer in m.decoder:
                layer.self_attn, layer.cross_attn = _Eager(layer.self_attn, log), _Eager(layer.cross_attn, log)
            per_row = []
            for row in rows:
                log.clear()
                logits = m(src, lengths, tin)
                if method == "grad":
                    logits[:, row].max(-1).values.sum().backward()
                    weights = [(a.grad * a).clamp_min(0).detach() for a in log]
                else:
                    weights = [a.detach() for a in log]
                joint = _joint(weights, kinds, ls, torch.arange(lt)[None], method)
                per_row.append(joint[:, ls + row])  # (B, Ls + Lt)
            found = torch.stack(per_row, 1)
            expected.append(found)
        got_joint = torch.cat([got.source, got.target], -1)
        assert_oracle(got_joint, expected[0], expected[1], what=f"translator {method}")
        if method == "rollout":
            mass = got.source.sum(-1) + got.target.sum(-1)
            torch.testing.assert_close(mass, torch.ones_like(mass))
        assert (got.source[1, :, 8:] == 0).all()  # the second source's padding gets nothing


class _Step(nn.Module):
    """One decoding step of the translator's decoder over its KV caches and a given memory."""

    def __init__(self, translator):
        super().__init__()
        self.t = translator

    def forward(self, tokens, caches, memory_kv, padding):
        y = self.t.target_embed(tokens) + self.t.target_pos.weight[3]
        for layer, cache, kv in zip(self.t.decoder, caches, memory_kv):
            y = layer(y, kv, padding, cache=cache)
        return self.t.head(self.t.decoder_norm(y))


def _prefilled(model, src, lengths, fills):
    from attnkit.nn import KVCache

    memory, padding = model.encode(src, lengths)
    memory_kv = [layer.cross_attn.project_kv(memory) for layer in model.decoder]
    c = model.config
    caches = KVCache.for_layers(2, 2, c.num_heads, 10, c.d_model // c.num_heads, dtype=memory.dtype)
    prefix = torch.randint(4, 15, (2, max(fills)), generator=torch.Generator().manual_seed(3))
    y = model.target_embed(prefix) + model.target_pos(torch.arange(max(fills)))[None]
    for layer, cache, kv in zip(model.decoder, caches, memory_kv):
        y = layer(y, kv, padding, cache=cache)
    for cache in caches:  # sequences of different fills: the second one's last entries rolled back
        cache.lengths = torch.tensor(fills)
    return caches, memory_kv, padding


def test_rollout_through_a_kv_cached_decoding_step_equals_the_joint_formula():
    """A decoding step over caches of different fills (5 and 3 entries): the new token's query sits at
    each sequence's own slot; relevance lands on the cached entries (inputs of the step) and, through
    the cross-attention, on the source; against the float64 joint product from captured weights."""
    from attnkit.inspect import Relevance

    model, (src, lengths, _) = _translator(4)
    step = _Step(model).eval()
    token = torch.tensor([[7], [9]])
    with torch.no_grad():
        caches, kv, padding = _prefilled(model, src, lengths, [5, 3])
        got = rollout(step, token, caches, kv, padding, rows=[0], encoder=None)
    assert isinstance(got, Relevance) and got.target.shape == (2, 1, 6) and got.source.shape == (2, 1, src.shape[1])
    assert (got.target[1, :, 4:] == 0).all() and got.target[1, 0, 3] > 0  # sequence 1: entries 0-2 and its token at 3
    mass = got.source.sum(-1) + got.target.sum(-1)
    torch.testing.assert_close(mass, torch.ones_like(mass))
    expected = []
    for dtype in (torch.float64, torch.float32):
        m = copy.deepcopy(model).to(dtype)
        with torch.no_grad():
            caches, kv, padding = _prefilled(m, src, lengths, [5, 3])
            with capture(_Step(m)) as cap:
                _Step(m)(token, caches, kv, padding)
        slots = torch.tensor([[5], [3]])
        kinds = ["target", "cross", "target", "cross"]
        joint = _joint(cap.weights, kinds, src.shape[1], slots, "rollout")
        expected.append(torch.stack([joint[b, src.shape[1] + int(slots[b, 0])] for b in range(2)])[:, None])
    assert_oracle(torch.cat([got.source, got.target], -1), expected[0], expected[1], what="cached step rollout")


def test_cross_attention_requests_name_what_is_missing():
    model, (src, lengths, tin) = _translator()

    class NoEncoderName(nn.Module):
        def __init__(self):
            super().__init__()
            self.parts = model

        def forward(self, *args):
            return self.parts(*args)

    with pytest.raises(ValueError, match="encoder=<module>"):
        rollout(NoEncoderName(), src, lengths, tin, rows=[0])
    got = rollout(NoEncoderName(), src, lengths, tin, rows=[0], encoder=model.encoder)
    torch.testing.assert_close(got.source, rollout(model, src, lengths, tin, rows=[0]).source)
    with pytest.raises(TypeError, match="encoder must be"):
        rollout(model, src, lengths, tin, rows=[0], encoder="decoder")


def test_transformers_cached_step_equals_eager_attentions():
    """A Llama's second chunk of 2 tokens over its cache of 6: rollout over the 8 entries against the
    joint formula from transformers' eager attentions of the same step (the queries at slots 6 and 7)."""
    from transformers import DynamicCache

    cls, config = HF["llama (GQA)"]
    ids = torch.randint(1, 61, (2, 8), generator=torch.Generator().manual_seed(6))
    got, expected = None, []
    for impl, dtype in (("attnkit", torch.float32), ("eager", torch.float64), ("eager", torch.float32)):
        torch.manual_seed(0)
        model = cls.from_config(config(), attn_implementation=impl).eval().to(dtype)
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(ids[:, :6], cache=cache, use_cache=True)
            if impl == "attnkit":
                got = rollout(model, ids[:, 6:], cache=cache, use_cache=True, rows=[-1, 0])
                continue
            out = model(ids[:, 6:], cache=cache, use_cache=True, output_attentions=True)
        joint = _joint(list(out.attentions), ["target", "target"], 0, torch.tensor([[6, 7]]), "rollout")
        expected.append(joint[:, [7, 6]])
    assert got.shape == (2, 2, 8)
    assert_oracle(got, expected[0], expected[1], what="llama cached step")
