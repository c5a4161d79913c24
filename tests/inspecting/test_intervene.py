"""intervene and head_effects: the logits of a run with heads ablated / scaled / patched equal the
same model run eagerly with those heads' outputs changed by a hook written here (on the input of
the output projection), for attnkit models and transformers decoders; an empty intervention is
bit-identical, and nothing remains after the block."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from _oracle import assert_oracle
from torch import nn

import attnkit
from attnkit import masks
from attnkit.inspect import capture, head_effects, intervene

transformers = pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM, Gemma2Config, LlamaConfig, MistralConfig  # noqa: E402

import attnkit.integrations.transformers  # noqa: E402,F401  (registers attn_implementation="attnkit")

H, HD, D = 4, 8, 32


class Tiny(nn.Module):
    """Two attnkit layers with residuals and a vocabulary head: enough to see heads matter."""

    def __init__(self, vocab=50):
        super().__init__()
        self.embed = nn.Embedding(vocab, D)
        self.blocks = nn.ModuleList(attnkit.MultiHeadAttention(D, H) for _ in range(2))
        self.head = nn.Linear(D, vocab)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = x + block(x, mask=masks.causal())[0]
        return self.head(x)


def _by_hand(projections, head_dim, change):
    """Pre-hooks on each layer's output projection: ``change(layer, heads (B, L, H, hd))`` returns the
    new heads (the eager way: TransformerLens and nnsight hook the same place)."""
    handles = []
    for layer, proj in enumerate(projections):

        def hook(module, args, layer=layer):
            (x,) = args
            b, length, width = x.shape
            return (change(layer, x.view(b, length, width // head_dim, head_dim)).reshape(b, length, width),)

        handles.append(proj.register_forward_pre_hook(hook))
    return handles


def _tiny_by_hand(model, by_hand, ids):
    """``model(ids)`` with the change written by hand on its output projections (hooks removed after)."""
    handles = _by_hand([b.out_proj for b in model.blocks], HD, by_hand)
    try:
        return model(ids)
    finally:
        for h in handles:
            h.remove()


def _changes(kind):
    """(intervene keyword arguments, the same change written by hand on (B, L, H, hd))."""
    if kind == "zero":
        return {"ablate": {0: [1], 1: [0, 3]}}, lambda layer, x: _set(x, {0: [1], 1: [0, 3]}[layer], 0.0)
    if kind == "mean":

        def mean(layer, x):
            out = x.clone()
            for h in {0: [2], 1: [1]}[layer]:
                out[:, :, h] = x[:, :, h].mean(dim=1, keepdim=True)
            return out

        return {"ablate": {0: [2], 1: [1]}, "mode": "mean"}, mean
    if kind == "scale":

        def scale(layer, x):
            out = x.clone()
            factor = {(0, 0): 3.0, (1, 2): -0.5}
            for (lay, h), f in factor.items():
                if lay == layer:
                    out[:, :, h] = x[:, :, h] * f
            return out

        return {"scale": {(0, 0): 3.0, (1, 2): -0.5}}, scale
    raise AssertionError(kind)


def _set(x, heads, value):
    out = x.clone()
    out[:, :, heads] = value
    return out


@pytest.mark.parametrize("kind", ["zero", "mean", "scale"])
def test_attnkit_model_equals_the_hook_written_by_hand(kind):
    torch.manual_seed(0)
    model = Tiny().eval()
    ids = torch.randint(0, 50, (2, 12))
    kwargs, by_hand = _changes(kind)
    with torch.no_grad():
        with intervene(model, **kwargs):
            ours = model(ids)
        want = _tiny_by_hand(model, by_hand, ids)
        plain = model(ids)
    torch.testing.assert_close(ours, want, rtol=1e-6, atol=1e-6)
    assert (ours - plain).abs().max() > 1e-3  # the change mattered


def test_empty_intervention_is_bit_identical_and_nothing_remains():
    torch.manual_seed(1)
    model = Tiny().eval()
    ids = torch.randint(0, 50, (2, 9))
    with torch.no_grad():
        before = model(ids)
        with intervene(model) as iv:
            same = model(ids)
        assert torch.equal(before, same) and iv._sites is None
        with intervene(model, ablate={0: [0]}):
            model(ids)
        after = model(ids)
    assert torch.equal(before, after)
    assert all(not b.hook_points for b in model.blocks)


def _hf_pair(config, dtype):
    torch.manual_seed(0)
    eager = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="eager").eval()
    ours = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="attnkit").eval()
    with torch.no_grad():
        for p in eager.parameters():
            if p.dim() == 2:
                p.mul_(3.0)
    ours.load_state_dict(eager.state_dict())
    return eager.to(dtype), ours


CONFIGS = {
    "llama (GQA)": lambda: LlamaConfig(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=61,
        pad_token_id=0,
    ),
    "mistral (sliding window)": lambda: MistralConfig(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=5,
        vocab_size=61,
        pad_token_id=0,
    ),
    "gemma2 (softcap)": lambda: Gemma2Config(
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
}


def _o_projs(model):
    return [layer.self_attn.o_proj for layer in model.model.layers]


@pytest.mark.parametrize("kind", ["zero", "mean", "scale", "patch"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_transformers_logits_equal_eager_with_the_same_heads_changed(name, kind):
    config = CONFIGS[name]()
    eager64, ours = _hf_pair(config, torch.float64)
    eager32 = copy.deepcopy(eager64).float()
    g = torch.Generator().manual_seed(3)
    ids, corrupt = torch.randint(3, 61, (2, 11), generator=g), torch.randint(3, 61, (2, 11), generator=g)
    attention_mask = torch.ones(2, 11, dtype=torch.long)
    attention_mask[1, -3:] = 0  # padding (on the right: float64 eager makes NaN rows of left padding)

    def logits(model, x):  # at the real tokens (eager leaves padding rows undefined)
        return model(input_ids=x, attention_mask=attention_mask).logits[attention_mask.bool()]

    with torch.no_grad():
        if kind == "patch":
            with capture(ours, mode="heads") as clean:
                logits(ours, ids)
            kwargs = {"patch": clean, "heads": {1: [0, 2]}, "positions": [4, 7, 10]}
            refs = {}
            for model in (eager64, eager32):  # the clean run's o_proj inputs, recorded by hand
                store = []
                handles = [
                    p.register_forward_pre_hook(lambda mod, args, store=store: store.append(args[0].clone()))
                    for p in _o_projs(model)
                ]
                logits(model, ids)
                for h in handles:
                    h.remove()
                refs[id(model)] = store

            def change_for(model):
                def change(layer, x):
                    if layer != 1:
                        return x
                    clean_x = refs[id(model)][1].view_as(x)
                    out = x.clone()
                    for h in (0, 2):
                        out[:, [4, 7, 10], h] = clean_x[:, [4, 7, 10], h]
                    return out

                return change
        else:
            kwargs, change = _changes(kind)

            def change_for(model):
                return change

        with intervene(ours, **kwargs):
            got = logits(ours, corrupt)
        expected = []
        for model in (eager64, eager32):
            handles = _by_hand(_o_projs(model), 8, change_for(model))
            expected.append(logits(model, corrupt))
            for h in handles:
                h.remove()
        plain = logits(ours, corrupt)
    assert_oracle(got, expected[0], expected[1], what=f"{name} {kind}")
    assert (got - plain).abs().max() > 1e-4  # the intervention changed the logits
    torch.testing.assert_close(logits(ours, corrupt), plain, rtol=0, atol=0)  # nothing remains


def test_head_effects_match_the_eager_sweep(tmp_path):
    torch.manual_seed(2)
    model = Tiny().eval()
    clean, corrupt = torch.randint(0, 50, (1, 10)), torch.randint(0, 50, (1, 10))

    def metric(logits):
        return logits[0, -1, 7] - logits[0, -1, 3]

    effects = head_effects(model, clean, corrupt, metric)
    assert effects.values.shape == (2, H) and effects.names == ["blocks.0", "blocks.1"]
    with torch.no_grad():
        store = []
        handles = [b.out_proj.register_forward_pre_hook(lambda m, a: store.append(a[0].clone())) for b in model.blocks]
        clean_metric = float(metric(model(clean)))
        for h in handles:
            h.remove()
        sweep = torch.empty(2, H)
        for layer in range(2):
            for head in range(H):

                def change(lay, x, layer=layer, head=head):
                    if lay != layer:
                        return x
                    out = x.clone()
                    out[:, :, head] = store[layer].view_as(x)[:, :, head]
                    return out

                handles = _by_hand([b.out_proj for b in model.blocks], HD, change)
                sweep[layer, head] = float(metric(model(corrupt)))
                for h in handles:
                    h.remove()
    torch.testing.assert_close(effects.values, sweep, rtol=1e-5, atol=1e-5)
    assert effects.clean == pytest.approx(clean_metric, rel=1e-5, abs=1e-5)
    assert effects.values.std() > 0  # the heads differ
    png, html = effects.save(tmp_path / "effects.png"), effects.save(tmp_path / "effects.html")
    assert png.stat().st_size > 2000 and html.read_text().count("<td") == 2 * H
    assert effects._repr_html_().startswith('<div class="attnkit-head-effects">')


def test_only_the_opening_thread_is_changed():
    torch.manual_seed(4)
    model = Tiny().eval()
    ids = torch.randint(0, 50, (1, 8))
    with torch.no_grad():
        plain = model(ids)
        other = {}
        with intervene(model, ablate={0: [0, 1, 2, 3]}):
            thread = threading.Thread(target=lambda: other.setdefault("out", model(ids)))
            thread.start()
            thread.join()
            mine = model(ids)
    assert torch.equal(other["out"], plain) and not torch.equal(mine, plain)


def test_bad_requests_name_the_values():
    model = Tiny().eval()
    ids = torch.randint(0, 50, (1, 6))
    with pytest.raises(ValueError, match=r"layer\(s\) 5.*called 2 attention layer"):
        with intervene(model, ablate={5: [0]}):
            model(ids)
    with pytest.raises(ValueError, match=r"head\(s\) \[9\] of layer 0"):
        with intervene(model, ablate={0: [9]}):
            model(ids)
    with pytest.raises(ValueError, match="mode must be 'zero' or 'mean'"):
        intervene(model, ablate={0: [0]}, mode="resample")
    with pytest.raises(TypeError, match="Capture of a clean run"):
        intervene(model, patch=torch.zeros(3))
    with pytest.raises(TypeError, match="heads as an int or a list"):
        intervene(model, ablate={0: "all"})
    with pytest.raises(TypeError, match=r"\(layer, head\) pairs"):
        intervene(model, scale={0: 2.0})
    with torch.no_grad(), capture(model, mode="heads") as clean:
        model(ids)
    with pytest.raises(ValueError, match="same batch size and length"):
        with intervene(model, patch=clean), torch.no_grad():
            model(torch.randint(0, 50, (1, 7)))
    with pytest.raises(ValueError, match="no attnkit.MultiHeadAttention"):
        with intervene(nn.Linear(2, 2), ablate={0: [0]}):
            pass


@pytest.mark.parametrize("kind", ["zero", "scale"])
def test_interventions_hold_while_decoding_with_a_kv_cache(kind):
    """Zeroing or scaling a head is per position, so decoding token by token over KV caches with the
    intervention gives the logits of the whole text changed by the hand-written hook."""
    torch.manual_seed(1)
    model = Tiny().eval()
    ids = torch.randint(0, 50, (2, 10))
    kwargs, by_hand = _changes(kind)

    def decode(ids):
        caches = attnkit.KVCache.for_layers(2, 2, H, 16, HD)
        out = []
        for t in range(ids.shape[1]):
            x = model.embed(ids[:, t : t + 1])
            for block, cache in zip(model.blocks, caches):
                x = x + block(x, mask=masks.causal(), cache=cache)[0]
            out.append(model.head(x))
        return torch.cat(out, dim=1)

    with torch.no_grad():
        with intervene(model, **kwargs):
            ours = decode(ids)
        want = _tiny_by_hand(model, by_hand, ids)
    torch.testing.assert_close(ours, want, rtol=1e-5, atol=1e-5)


def test_interventions_on_a_compiled_model():
    """torch.compile traces the head output hooks present when it runs: the intervention holds inside
    the block, and after it the compiled model gives the plain logits again (it recompiles)."""
    torch.manual_seed(2)
    model = Tiny().eval()
    ids = torch.randint(0, 50, (2, 12))
    compiled = torch.compile(model, backend="aot_eager")
    kwargs, _ = _changes("zero")
    with torch.no_grad():
        plain = model(ids)
        with intervene(model, **kwargs):
            eager = model(ids)
            inside = compiled(ids)
        after = compiled(ids)
    torch.testing.assert_close(inside, eager, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(after, plain, rtol=1e-5, atol=1e-5)
    assert (eager - plain).abs().max() > 1e-3


def _first_order(model, projections, head_dim, clean, corrupt, metric, run):
    """The first-order effect of patching each head, written here on an eager model: the clean and
    corrupt inputs of the output projections recorded by hand, then ``d metric / d e[l, h]`` at 0 of the
    corrupt run with ``z[l, h] + e[l, h] (z_clean - z_corrupt)[l, h]`` (autograd through the eager code)."""
    stores = {}
    with torch.no_grad():
        for name, ids in (("clean", clean), ("corrupt", corrupt)):
            store = []
            handles = [
                p.register_forward_pre_hook(lambda m, a, store=store: store.append(a[0].clone())) for p in projections
            ]
            run(model, ids)
            for h in handles:
                h.remove()
            stores[name] = store
    heads = stores["clean"][0].shape[-1] // head_dim
    e = torch.zeros(len(projections), heads, dtype=torch.float64, requires_grad=True)

    def change(layer, x):
        delta = (stores["clean"][layer] - stores["corrupt"][layer]).view_as(x)
        return x + e[layer].view(1, 1, -1, 1).to(x.dtype) * delta

    handles = _by_hand(projections, head_dim, change)
    value = metric(run(model, corrupt))
    for h in handles:
        h.remove()
    (slope,) = torch.autograd.grad(value, e)
    return slope, float(value.detach())


def test_attribution_patching_equals_the_first_order_formula_on_attnkit_layers():
    torch.manual_seed(5)
    model = Tiny().double().eval()
    clean, corrupt = torch.randint(0, 50, (2, 10)), torch.randint(0, 50, (2, 10))

    def metric(logits):
        return logits[:, -1, 7].sum() - logits[:, -1, 3].sum()

    effects = head_effects(model, clean, corrupt, metric, method="atp")
    slope, corrupt_value = _first_order(
        model, [b.out_proj for b in model.blocks], HD, clean, corrupt, metric, lambda m, x: m(x)
    )
    assert effects.method == "atp" and effects.values.shape == (2, H)
    assert effects.corrupt == pytest.approx(corrupt_value, rel=1e-9)
    torch.testing.assert_close((effects.values.double() - effects.corrupt), slope, rtol=1e-5, atol=1e-6)
    assert slope.abs().max() > 1e-2  # the heads matter
    exact = head_effects(model, clean, corrupt, metric)  # and the estimate ranks as the sweep does here
    top_atp = set(torch.topk((effects.values - effects.corrupt).abs().flatten(), 3).indices.tolist())
    top_patch = set(torch.topk((exact.values - exact.corrupt).abs().flatten(), 3).indices.tolist())
    assert len(top_atp & top_patch) >= 2, (effects.values, exact.values)


def test_attribution_patching_on_a_transformers_model_equals_the_first_order_formula():
    config = CONFIGS["llama (GQA)"]()
    eager64, ours = _hf_pair(config, torch.float64)
    ours = ours.double()
    g = torch.Generator().manual_seed(9)
    clean, corrupt = torch.randint(3, 61, (2, 9), generator=g), torch.randint(3, 61, (2, 9), generator=g)

    def metric(logits):
        return logits[:, -1, 5].sum()

    def run(model, ids):
        return model(input_ids=ids).logits

    effects = head_effects(
        ours, {"input_ids": clean}, {"input_ids": corrupt}, lambda out: metric(out.logits), method="atp"
    )
    slope, corrupt_value = _first_order(eager64, _o_projs(eager64), 8, clean, corrupt, metric, run)
    # Llama's RMSNorm computes in float32 (also in a float64 model): the two models agree to float32's rounding
    assert effects.corrupt == pytest.approx(corrupt_value, rel=1e-6)
    torch.testing.assert_close(effects.values.double() - effects.corrupt, slope, rtol=1e-4, atol=1e-5)


def test_attribution_patching_refuses_a_metric_that_is_not_a_differentiable_scalar():
    model = Tiny().eval()
    ids = torch.randint(0, 50, (1, 6))
    with pytest.raises(ValueError, match="scalar tensor"):
        head_effects(model, ids, ids, lambda logits: float(logits[0, -1, 0]), method="atp")
    with pytest.raises(ValueError, match="'patch'"):
        head_effects(model, ids, ids, lambda logits: logits[0, -1, 0], method="exact")


def test_mean_ablation_over_real_positions_with_left_padding_equals_an_eager_hook():
    """With ``attention_mask``, ``mode="mean"`` averages each sequence's real positions only; with left
    padding that equals an eager model whose hook (written here) averages the unpadded positions."""
    config = CONFIGS["llama (GQA)"]()
    eager64, ours = _hf_pair(config, torch.float64)
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(3, 61, (2, 10), generator=g)
    attention_mask = torch.ones(2, 10, dtype=torch.long)
    attention_mask[1, :4] = 0  # left padding
    real = attention_mask.bool()

    def change(layer, x):
        if layer != 1:
            return x
        out = x.clone()
        for b in range(x.shape[0]):
            out[b, :, 2] = x[b, real[b], 2].mean(dim=0)
        return out

    # float64 eager attention gives the left-padded rows NaN (two finfo.min added make -inf), which would reach
    # the real rows through 0 * NaN; those rows reach nothing else, so they are set to 0 after each layer
    calm = [
        layer.register_forward_hook(
            lambda m, a, out: (out[0].nan_to_num(0.0), *out[1:]) if isinstance(out, tuple) else out.nan_to_num(0.0)
        )
        for layer in eager64.model.layers
    ]
    with torch.no_grad():
        with intervene(ours, ablate={1: [2]}, mode="mean", attention_mask=attention_mask):
            got = ours(input_ids=ids, attention_mask=attention_mask).logits[real]
        handles = _by_hand(_o_projs(eager64), 8, change) + calm
        want = eager64(input_ids=ids, attention_mask=attention_mask).logits[real]
        for h in handles:
            h.remove()
        with intervene(ours, ablate={1: [2]}, mode="mean"):  # every position: padding in the mean
            padded = ours(input_ids=ids, attention_mask=attention_mask).logits[real]
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)
    assert (padded.double() - want).abs().max() > 1e-3  # padding changed the mean
    with pytest.raises(ValueError, match="mode='mean'"):
        intervene(ours, ablate={1: [2]}, attention_mask=attention_mask)
    with pytest.raises(ValueError, match="attention_mask has shape"):
        with torch.no_grad(), intervene(ours, ablate={1: [2]}, mode="mean", attention_mask=attention_mask[:, :5]):
            ours(input_ids=ids, attention_mask=attention_mask)
