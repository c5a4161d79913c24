"""The tutorial's names, with the tutorial's meaning and its mask bug fixed."""

import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import attnkit
from conftest import naive_attention, randn

ROOT = Path(__file__).resolve().parents[1]


def test_scaled_dot_product_attention_returns_output_and_weights():
    Q, K, V = randn(2, 4, 8, dtype=torch.float64), randn(2, 6, 8, dtype=torch.float64), randn(2, 6, 3, dtype=torch.float64)
    output, weights = attnkit.scaled_dot_product_attention(Q, K, V)
    want_out, want_w = naive_attention(Q, K, V)
    assert output.shape == (2, 4, 3) and weights.shape == (2, 4, 6)
    assert torch.allclose(output, want_out, atol=1e-12) and torch.allclose(weights, want_w, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.bool, torch.int64, torch.float32])
def test_tutorial_mask_hides_where_zero(dtype):
    Q = K = V = randn(1, 4, 8, dtype=torch.float64)
    mask01 = torch.tensor([[1, 1, 0, 0]]).to(dtype)
    _, weights = attnkit.scaled_dot_product_attention(Q, K, V, mask01)
    assert (weights[..., 2:] == 0).all()
    assert torch.allclose(weights.sum(-1), torch.ones(1, 4, dtype=torch.float64))


def test_padding_and_causal_masks_work_together():
    seq = torch.tensor([[7, 8, 9, 0], [5, 0, 0, 0]])
    pad = attnkit.create_padding_mask(seq)
    assert pad.shape == (2, 1, 1, 4) and pad.dtype == torch.bool
    assert pad[:, 0, 0].tolist() == [[True, True, True, False], [True, False, False, False]]
    causal = attnkit.create_causal_mask(4)
    assert causal.shape == (4, 4) and torch.equal(causal, torch.ones(4, 4, dtype=torch.bool).tril())
    Q = K = V = randn(2, 1, 4, 8, dtype=torch.float64)
    _, weights = attnkit.scaled_dot_product_attention(Q, K, V, pad & causal)
    # each query sees only real tokens at or before itself
    allowed = pad & causal
    assert (weights[~allowed.expand_as(weights)] == 0).all()
    assert torch.isfinite(weights).all()
    assert torch.allclose(weights[0, 0, 3].sum(), torch.tensor(1.0, dtype=torch.float64))


def test_fully_padded_row_is_zero_not_nan():
    Q = K = V = randn(1, 3, 4)
    out, weights = attnkit.scaled_dot_product_attention(Q, K, V, torch.zeros(3, 3))
    assert (out == 0).all() and (weights == 0).all()


def test_visualize_attention_writes_a_readable_png(tmp_path):
    pytest.importorskip("matplotlib")
    import matplotlib.image

    tokens = ["[CLS]", "今天", "天气", "很", "好", "[SEP]"]
    weights = torch.softmax(torch.randn(6, 6), dim=-1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # matplotlib warns "Glyph ... missing from font(s)"
        fig = attnkit.visualize_attention(weights, tokens, save_path=tmp_path / "a.png")
    image = matplotlib.image.imread(tmp_path / "a.png")
    assert image.shape[0] > 200 and image.shape[1] > 200
    assert image[..., :3].std() > 0.1  # not blank
    labels = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    assert labels == tokens


def test_visualize_attention_other_formats_and_cross_attention(tmp_path):
    pytest.importorskip("matplotlib")
    w = torch.softmax(torch.randn(1, 1, 3, 5), dim=-1)
    for ext in ("svg", "pdf"):
        attnkit.visualize_attention(w, ["a", "b", "c"], tmp_path / f"x.{ext}", key_tokens=list("vwxyz"))
        assert (tmp_path / f"x.{ext}").stat().st_size > 1000


def test_visualize_attention_bad_input(tmp_path):
    pytest.importorskip("matplotlib")
    with pytest.raises(ValueError, match=r"need 3 query tokens and 3 key tokens, but got 2 and 2"):
        attnkit.visualize_attention(torch.rand(3, 3), ["a", "b"], None)
    with pytest.raises(ValueError, match=r"one \(Lq, Lk\) matrix, but got shape \(2, 4, 3, 3\)"):
        attnkit.visualize_attention(torch.rand(2, 4, 3, 3), ["a", "b", "c"], None)
    with pytest.raises(TypeError, match="weights must be a torch.Tensor or numpy array"):
        attnkit.visualize_attention([[1.0]], ["a"], None)


def test_tutorial_example_runs_end_to_end(tmp_path):
    pytest.importorskip("matplotlib")
    run = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "tutorial.py"), "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stderr
    for line in ["split heads:  (2, 8, 10, 64)", "weights:      (2, 8, 10, 10)", "same as the mask objects: True",
                 "cross-attention (decoder -> encoder):   (2, 5, 64), weights (2, 4, 5, 7)"]:
        assert line in run.stdout
    assert (tmp_path / "attention.png").stat().st_size > 10_000


def test_public_api_names():
    for name in ["attention", "attention_weights", "masks", "scaled_dot_product_attention",
                 "MultiHeadAttention", "create_padding_mask", "create_causal_mask", "visualize_attention", "explain"]:
        assert name in attnkit.__all__ and hasattr(attnkit, name)
    for name in ["causal", "sliding_window", "prefix_lm", "document", "padding"]:
        assert callable(getattr(attnkit.masks, name))


def test_readme_quick_start_runs():
    text = (ROOT / "README.md").read_text()
    block = text.split("## Quick start", 1)[1].split("```python", 1)[1].split("```", 1)[0]
    namespace: dict = {}
    exec(compile(block, "README quick start", "exec"), namespace)
    assert namespace["out"].shape == (2, 8, 128, 64)
    assert namespace["weights"].shape == (2, 8, 10, 10)
