"""Hooks by site name (``layers.{i}.attn.{weights,stats,lse,z}``) through attnkit.inspect.Sites, on
attnkit layers and transformers models alike: what a hook sees equals what the model's eager
attention computes, and what a ``z`` hook returns is what the model continues with."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from torch import nn

import attnkit
from attnkit import masks
from attnkit.inspect import Sites, capture, intervene

transformers = pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM, LlamaConfig  # noqa: E402

import attnkit.integrations.transformers  # noqa: E402,F401  (registers attn_implementation="attnkit")


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(40, 32)
        self.blocks = nn.ModuleList(attnkit.MultiHeadAttention(32, 4) for _ in range(2))
        self.head = nn.Linear(32, 40)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = x + block(x, mask=masks.causal())[0]
        return self.head(x)


def _llama():
    config = LlamaConfig(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=40, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    eager = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="eager").eval()
    ours = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="attnkit").eval()
    ours.load_state_dict(eager.state_dict())
    return eager.double(), ours.double()


def test_hooks_by_name_on_attnkit_layers():
    torch.manual_seed(1)
    model = Tiny().double().eval()
    ids = torch.randint(0, 40, (2, 9))
    seen: dict = {"weights": {}, "lse": {}, "stats": {}}
    with torch.no_grad(), Sites(model) as s:
        for what in ("weights", "lse", "stats"):
            s.add_hook(f"layers.*.attn.{what}", lambda site, x, what=what: seen[what].setdefault(site.index, x))
        s.add_hook("layers.1.attn.z", lambda site, z: torch.zeros_like(z))
        out = model(ids)
    assert [site.path for site in s.called] == ["layers.0.attn", "layers.1.attn"]
    assert [site.name for site in s.called] == ["blocks.0", "blocks.1"]
    with torch.no_grad(), capture(model) as cap:
        model(ids)
    with torch.no_grad(), intervene(model, ablate={1: [0, 1, 2, 3]}):
        ablated = model(ids)
    torch.testing.assert_close(seen["weights"][0], cap.weights[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out, ablated, rtol=1e-12, atol=1e-12)  # the z hook's zeros went on
    w = cap.weights[0]
    entropy = -(w * w.clamp_min(1e-300).log()).sum(-1)
    torch.testing.assert_close(seen["stats"][0].entropy, entropy, rtol=1e-9, atol=1e-9)
    assert seen["lse"][0].shape == (2, 4, 9)
    assert not any(block.hook_points for block in model.blocks)  # nothing remains after the block


def test_hooks_by_name_on_a_transformers_model_equal_its_eager_attention():
    eager, ours = _llama()
    ids = torch.randint(3, 40, (2, 7))
    weights = {}
    with torch.no_grad():
        want = eager(input_ids=ids, output_attentions=True).attentions
        with Sites(ours) as s:
            s.add_hook("layers.*.attn.weights", lambda site, w: weights.setdefault(site.index, w))
            ours(input_ids=ids)
        with Sites(ours) as s:
            s.add_hook("layers.0.attn.z", lambda site, z: z * 0.5)
            halved = ours(input_ids=ids).logits
        with intervene(ours, scale={(0, h): 0.5 for h in range(4)}):
            scaled = ours(input_ids=ids).logits
    assert sorted(weights) == [0, 1] and [site.name for site in s.called] == [
        "model.layers.0.self_attn",
        "model.layers.1.self_attn",
    ]
    for i in range(2):  # Llama's RMSNorm computes in float32, also in a float64 model
        torch.testing.assert_close(weights[i], want[i], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(halved, scaled, rtol=1e-12, atol=1e-12)


def test_only_the_opening_thread_and_this_model_are_heard():
    torch.manual_seed(2)
    model, other = Tiny().eval(), Tiny().eval()
    ids = torch.randint(0, 40, (1, 5))
    heard = []
    with torch.no_grad(), Sites(model) as s:
        s.add_hook("layers.*.attn.lse", lambda site, lse: heard.append(site.index))
        thread = threading.Thread(target=lambda: model(ids))
        thread.start()
        thread.join()
        other(ids)
        assert heard == []
        model(ids)
    assert heard == [0, 1]


@pytest.mark.parametrize("name", ["layers.0.attn", "layers.x.attn.z", "blocks.0.attn.z", "layers.0.attn.pattern", 3])
def test_bad_site_names_are_refused_with_the_form(name):
    with pytest.raises(ValueError, match=r"layers\.<i>\.attn\.<what>"):
        Sites(Tiny()).add_hook(name, lambda site, x: None)


def test_a_model_without_attnkit_attention_is_refused():
    with pytest.raises(ValueError, match="no attnkit.MultiHeadAttention"):
        Sites(nn.Linear(3, 3))
