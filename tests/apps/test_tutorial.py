"""The tutorial's names, with the tutorial's meaning and its mask bug fixed."""

import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from _oracle import naive_attention, randn

import attnkit

ROOT = Path(__file__).resolve().parents[2]


def test_scaled_dot_product_attention_returns_output_and_weights():
    Q, K, V = (
        randn(2, 4, 8, dtype=torch.float64),
        randn(2, 6, 8, dtype=torch.float64),
        randn(2, 6, 3, dtype=torch.float64),
    )
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
    with pytest.raises(ValueError, match=r"needs 3 query tokens and 3 key tokens, but got 2 and 2"):
        attnkit.visualize_attention(torch.rand(3, 3), ["a", "b"], None)
    with pytest.raises(
        ValueError, match=r"\(Lq, Lk\), \(B, Lq, Lk\) or \(B, H, Lq, Lk\), but got shape \(2, 2, 4, 3, 3\)"
    ):
        attnkit.visualize_attention(torch.rand(2, 2, 4, 3, 3), ["a", "b", "c"], None)
    with pytest.raises(ValueError, match=r"head=4 is out of range for weights of shape \(2, 4, 3, 3\), which hold 4"):
        attnkit.visualize_attention(torch.rand(2, 4, 3, 3), ["a", "b", "c"], None, head=4)
    with pytest.raises(TypeError, match="sample must be an int"):
        attnkit.visualize_attention(torch.rand(2, 3, 3), ["a", "b", "c"], None, sample=0.5)
    with pytest.raises(TypeError, match="tokens must be a list of strings"):
        attnkit.visualize_attention(torch.rand(3, 3), "abc", None)
    with pytest.raises(TypeError, match="weights must be a torch.Tensor or numpy array"):
        attnkit.visualize_attention([[1.0]], ["a"], None)


def test_visualize_attention_says_which_matrix_of_the_tutorials_example_does_not_fit():
    """The tutorial's heatmap example: weights (1, 8, 10, 10) with 6 tokens."""
    pytest.importorskip("matplotlib")
    tokens = ["[CLS]", "今天", "天气", "很", "好", "[SEP]"]
    want = (
        r"weights\[0, 0\] of weights \(1, 8, 10, 10\) is a 10 x 10 matrix: it needs 10 query "
        r"tokens and 10 key tokens, but got 6 and 6"
    )
    with pytest.raises(ValueError, match=want):
        attnkit.tutorial.visualize_attention(torch.rand(1, 8, 10, 10), tokens)


def test_visualize_attention_draws_the_first_sample_and_names_it():
    pytest.importorskip("matplotlib")
    weights = torch.softmax(torch.randn(2, 3, 4, 4), dim=-1)
    fig = attnkit.visualize_attention(weights, list("abcd"), None, sample=1, head=2)
    drawn = fig.axes[0].images[0].get_array()
    assert np.allclose(drawn, weights[1, 2].numpy())
    assert fig.axes[0].get_title() == "sample 1, head 2"
    fig = attnkit.tutorial.visualize_attention(weights[:, 0], list("abcd"), save_path=None)  # (B, Lq, Lk)
    assert np.allclose(fig.axes[0].images[0].get_array(), weights[0, 0].numpy())
    assert fig.axes[0].get_title() == "weights[0]"


def test_tutorial_example_runs_end_to_end(tmp_path):
    pytest.importorskip("matplotlib")
    script = ROOT / "examples" / "tutorial.py"
    assert "from attnkit.tutorial import *" in script.read_text()
    run = subprocess.run(
        [sys.executable, str(script), "--out", str(tmp_path)], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr
    for line in [
        "Attention shape: torch.Size([2, 8, 10, 10])",
        "same as softmax(QK^T / sqrt(d_k)) V: True",
        "split heads: (2, 8, 10, 64)",
        "weights:     (2, 8, 10, 10)",
        "same as the causal mask: True",
        "nothing after the diagonal: True",
        "no weight on padding: True",
        "is a 10 x 10 matrix: it needs 10 query tokens",
        "cross-attention:         (2, 5, 512), weights (2, 8, 5, 7)",
    ]:
        assert line in run.stdout
    assert (tmp_path / "attention.png").stat().st_size > 10_000


def test_public_api_names():
    for name in [
        "attention",
        "attention_weights",
        "masks",
        "scaled_dot_product_attention",
        "MultiHeadAttention",
        "create_padding_mask",
        "create_causal_mask",
        "visualize_attention",
        "explain",
    ]:
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


# --- attnkit.tutorial: the tutorial's names, signatures, attributes and return values ---


class PlainTutorialMHA(torch.nn.Module):
    """The tutorial's multi-head attention written out plainly: W_q..W_o, view/permute, the formula."""

    def __init__(self, d_model, num_heads):
        super().__init__()
        self.num_heads, self.d_k = num_heads, d_model // num_heads
        self.W_q, self.W_k, self.W_v, self.W_o = (torch.nn.Linear(d_model, d_model) for _ in range(4))

    def forward(self, query, key, value, mask=None):
        b = query.size(0)
        split = lambda x: x.view(b, -1, self.num_heads, self.d_k).permute(0, 2, 1, 3)  # noqa: E731
        Q, K, V = split(self.W_q(query)), split(self.W_k(key)), split(self.W_v(value))
        scores = Q @ K.transpose(-2, -1) / self.d_k**0.5
        if mask is not None:
            scores = scores.masked_fill(mask == 0, float("-inf"))
        weights = torch.softmax(scores, dim=-1)
        out = (weights @ V).permute(0, 2, 1, 3).contiguous().view(b, -1, self.num_heads * self.d_k)
        return self.W_o(out), weights


def test_star_import_gives_the_tutorials_names():
    namespace: dict = {}
    exec("from attnkit.tutorial import *", namespace)
    names = {
        "scaled_dot_product_attention",
        "MultiHeadAttention",
        "create_padding_mask",
        "create_causal_mask",
        "causal_mask_attention",
        "visualize_attention",
    }
    assert names <= set(namespace)
    for name in names - {"MultiHeadAttention", "causal_mask_attention"}:
        assert getattr(attnkit, name) is namespace[name]  # the top-level names are aliases
    assert attnkit.MultiHeadAttention is not namespace["MultiHeadAttention"]
    assert issubclass(namespace["MultiHeadAttention"], attnkit.MultiHeadAttention)


def test_tutorial_mha_has_the_tutorials_attributes():
    mha = attnkit.tutorial.MultiHeadAttention(512, 8)
    assert (mha.d_model, mha.num_heads, mha.d_k) == (512, 8, 64)
    for name in ["W_q", "W_k", "W_v", "W_o"]:
        layer = getattr(mha, name)
        assert isinstance(layer, torch.nn.Linear) and (layer.in_features, layer.out_features) == (512, 512)
    assert isinstance(mha.dropout, torch.nn.Dropout) and mha.dropout.p == 0.1  # the tutorial's default
    assert mha.q_proj is mha.W_q and mha.out_proj is mha.W_o  # one set of weights, two names
    assert sorted(mha.state_dict()) == sorted(PlainTutorialMHA(512, 8).state_dict())
    assert sum(p.numel() for p in mha.parameters()) == 4 * (512 * 512 + 512)
    with pytest.raises(ValueError, match="d_model must be divisible by num_heads"):
        attnkit.tutorial.MultiHeadAttention(10, 3)


@pytest.mark.parametrize("masked", [False, True])
def test_tutorial_mha_equals_the_plain_tutorial_code(masked):
    torch.manual_seed(1)
    plain = PlainTutorialMHA(32, 4).double()
    mha = attnkit.tutorial.MultiHeadAttention(32, 4, dtype=torch.float64).eval()
    mha.load_state_dict(plain.state_dict())  # the tutorial's state dict loads as it is
    x = torch.randn(2, 5, 32, dtype=torch.float64)
    mask = attnkit.tutorial.create_padding_mask(torch.tensor([[4, 5, 6, 0, 0], [1, 2, 3, 4, 5]])) if masked else None
    out, weights = mha(x, x, x, mask)
    want_out, want_w = plain(x, x, x, mask)
    assert weights.shape == (2, 4, 5, 5)
    assert torch.allclose(out, want_out, atol=1e-12) and torch.allclose(weights, want_w, atol=1e-12)
    # cross-attention with keyword arguments, as the tutorial calls it
    memory = torch.randn(2, 7, 32, dtype=torch.float64)
    out, weights = mha(query=x, key=memory, value=memory, mask=None)
    want_out, want_w = plain(x, memory, memory)
    assert weights.shape == (2, 4, 5, 7) and torch.allclose(out, want_out, atol=1e-12)
    assert torch.allclose(weights, want_w, atol=1e-12)


def test_tutorial_mha_takes_01_float_masks_and_mask_objects():
    mha = attnkit.tutorial.MultiHeadAttention(16, 2, dtype=torch.float64).eval()
    x = torch.randn(2, 4, 16, dtype=torch.float64)
    as_float = attnkit.tutorial.create_causal_mask(4).double()  # 1 = may attend, 0 = hidden
    out_float, w_float = mha(x, x, x, as_float)
    out_obj, w_obj = mha(x, x, x, attnkit.masks.causal())
    assert torch.allclose(out_float, out_obj, atol=1e-12) and torch.allclose(w_float, w_obj, atol=1e-12)
    assert (w_float.triu(1) == 0).all()
    with pytest.raises(TypeError, match="mask must be a tensor"):
        mha(x, x, x, [[1, 0]])


def test_tutorial_mha_fully_masked_row_is_zero_not_nan():
    mha = attnkit.tutorial.MultiHeadAttention(16, 2, dtype=torch.float64).eval()
    x = torch.randn(1, 3, 16, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[1, 1, 1], [0, 0, 0], [1, 0, 0]])  # query 1 may see nothing
    out, weights = mha(x, x, x, mask)
    assert (weights[:, :, 1] == 0).all() and torch.isfinite(out).all()
    assert torch.allclose(out[0, 1], mha.W_o.bias)  # attention gives 0, W_o adds its bias
    out.sum().backward()
    assert torch.isfinite(x.grad).all()


def test_split_heads_takes_the_batch_size():
    mha = attnkit.tutorial.MultiHeadAttention(24, 3)
    x = torch.randn(2, 5, 24)
    heads = mha.split_heads(x, 2)
    assert heads.shape == (2, 3, 5, 8)  # (batch, heads, seq, d_k)
    assert torch.equal(heads, x.view(2, 5, 3, 8).permute(0, 2, 1, 3))
    with pytest.raises(ValueError, match=r"takes the batch size, x.size\(0\) = 2, but got batch_size=3"):
        mha.split_heads(x, 3)
    with pytest.raises(ValueError, match=r"expects x of shape \(batch_size, seq, 24\)"):
        mha.split_heads(torch.randn(2, 5, 12), 2)
    assert attnkit.MultiHeadAttention.split_heads(x, 3).shape == (2, 3, 5, 8)  # the fast class keeps its API


def test_tutorial_mha_applies_dropout_in_training_and_returns_weights_before_it():
    torch.manual_seed(0)
    mha = attnkit.tutorial.MultiHeadAttention(32, 4, dropout=0.5)
    x = torch.randn(2, 6, 32)
    out_eval, w_eval = mha.eval()(x, x, x)
    out_train, w_train = mha.train()(x, x, x)
    assert not torch.allclose(out_train, out_eval, atol=1e-3)
    assert torch.allclose(w_train, w_eval, atol=1e-6)
    mha.dropout.p = 0.0  # the nn.Dropout's p is what the kernel uses
    assert torch.allclose(mha(x, x, x)[0], out_eval, atol=1e-6)


def test_conversion_both_ways_keeps_the_outputs():
    torch.manual_seed(2)
    tut = attnkit.tutorial.MultiHeadAttention(32, 4, dtype=torch.float64).eval()
    x = torch.randn(2, 5, 32, dtype=torch.float64)
    out, weights = tut(x, x, x)
    fast = tut.to_attnkit()
    assert type(fast) is attnkit.MultiHeadAttention and not fast.training
    fast_out, fast_w = fast(x, need_weights=True)
    assert torch.allclose(fast_out, out, atol=1e-12) and torch.allclose(fast_w, weights, atol=1e-12)
    fast.q_proj.weight.data.zero_()  # a copy, not shared
    assert not torch.equal(tut.W_q.weight, fast.q_proj.weight)
    back = attnkit.tutorial.MultiHeadAttention.from_attnkit(tut.to_attnkit())
    assert torch.allclose(back(x, x, x)[0], out, atol=1e-12)
    # either class loads either layout
    plain = PlainTutorialMHA(32, 4).double()
    fast = attnkit.MultiHeadAttention(32, 4, dtype=torch.float64)
    fast.load_state_dict(plain.state_dict())
    assert torch.allclose(fast(x)[0], plain(x, x, x)[0], atol=1e-12)
    tut.load_state_dict(fast.state_dict())
    assert torch.allclose(tut(x, x, x)[0], plain(x, x, x)[0], atol=1e-12)
    with pytest.raises(ValueError, match="num_kv_heads == num_heads"):
        attnkit.tutorial.MultiHeadAttention.from_attnkit(attnkit.MultiHeadAttention(32, 4, num_kv_heads=2))
    with pytest.raises(TypeError, match="expects an attnkit.MultiHeadAttention"):
        attnkit.tutorial.MultiHeadAttention.from_attnkit(torch.nn.Linear(2, 2))


def test_causal_mask_attention_equals_the_causal_mask():
    Q, K, V = (randn(2, 3, 6, 8, dtype=torch.float64) for _ in range(3))
    out, weights = attnkit.tutorial.causal_mask_attention(Q, K, V)
    want_out, want_w = attnkit.tutorial.scaled_dot_product_attention(Q, K, V, attnkit.tutorial.create_causal_mask(6))
    assert out.shape == (2, 3, 6, 8) and weights.shape == (2, 3, 6, 6)
    assert torch.allclose(out, want_out, atol=1e-12) and torch.allclose(weights, want_w, atol=1e-12)
    plain_out, plain_w = naive_attention(Q, K, V, torch.ones(6, 6, dtype=torch.bool).tril())
    assert torch.allclose(out, plain_out, atol=1e-12) and torch.allclose(weights, plain_w, atol=1e-12)
