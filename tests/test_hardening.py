"""Regression tests for the defects adversarial testing found (one test per finding)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import naive_attention, randn

import attnkit
from attnkit import masks
from attnkit.nn import KVCache

KERNELS = ["auto", "tiled", "reference", "sdpa"]


def test_3d_bool_tensor_means_the_same_alone_and_combined():
    q, k, v = (randn(2, 2, 4, 8, dtype=torch.float64) for _ in range(3))
    t = torch.rand(2, 4, 4) > 0.3
    t[..., 0] = True
    alone = attnkit.attention(q, k, v, t)
    combined = attnkit.attention(q, k, v, masks.prefix_lm(4) & t)  # prefix_lm(4) allows everything here
    assert torch.allclose(alone, combined, atol=1e-12)
    want = naive_attention(q, k, v, t)[0]  # SDPA's rule: (2, 4, 4) is (H, Lq, Lk)
    assert torch.allclose(alone, want, atol=1e-12)


@pytest.mark.parametrize("scale", [0.0, -0.5])
def test_causal_with_zero_or_negative_scale_is_not_nan(scale):
    q, k, v = (randn(1, 2, 9, 8, dtype=torch.float64) for _ in range(3))
    want = naive_attention(q, k, v, torch.ones(9, 9, dtype=torch.bool).tril(), scale=scale)[0]
    for kernel in KERNELS:
        assert torch.allclose(attnkit.attention(q, k, v, masks.causal(), scale=scale, kernel=kernel), want, atol=1e-12)


def test_double_backward_through_the_tiled_kernel_raises_a_clear_error():
    q, k, v = (randn(1, 1, 80, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    out = attnkit.attention(q, k, v, masks.sliding_window(8), kernel="tiled")
    with pytest.raises(ValueError, match="first derivatives only.*kernel='reference'"):
        torch.autograd.grad(out.sum(), q, create_graph=True)
    out = attnkit.attention(q, k, v, masks.sliding_window(8), kernel="reference")  # the one that can
    (g,) = torch.autograd.grad(out.sum(), q, create_graph=True)
    g.square().sum().backward()
    assert torch.isfinite(k.grad).all()


def test_a_mask_reused_with_inputs_of_another_rank_gives_their_shape():
    m = masks.causal()
    assert attnkit.attention_weights(randn(1, 2, 5, 8), randn(1, 2, 7, 8), randn(1, 2, 7, 8), m).shape == (1, 2, 5, 7)
    assert attnkit.attention_weights(randn(5, 8), randn(7, 8), randn(7, 8), m).shape == (5, 7)


def test_a_mask_does_not_change_when_its_source_tensor_does():
    lengths = torch.tensor([3, 5])
    m = masks.padding(lengths)
    q, k, v = (randn(2, 1, 6, 8, dtype=torch.float64) for _ in range(3))
    before = attnkit.attention(q, k, v, m)
    lengths.numpy()[0] = 300  # no version bump
    assert torch.equal(attnkit.attention(q, k, v, m), before)


@pytest.mark.parametrize("kernel", KERNELS)
def test_nan_in_keys_and_values_no_query_attends_never_reaches_the_output(kernel):
    """What holds on every kernel: K/V rows hidden from every query are never read (or zeroed)."""
    q, k, v = (randn(2, 2, 150, 8, dtype=torch.float64) for _ in range(3))
    lengths = torch.tensor([150, 90])
    k[1, :, 90:] = float("nan")
    v[1, :, 90:] = float("inf")
    out = attnkit.attention(q, k, v, masks.padding(lengths) & masks.causal(), kernel=kernel)
    assert torch.isfinite(out).all()
    clean_k, clean_v = k.clone(), v.clone()
    clean_k[1, :, 90:], clean_v[1, :, 90:] = 0.0, 0.0
    assert torch.allclose(
        out,
        attnkit.attention(q, clean_k, clean_v, masks.padding(lengths) & masks.causal(), kernel="reference"),
        atol=1e-12,
    )


@pytest.mark.parametrize("kernel", KERNELS)
def test_fully_masked_rows_give_zero_and_zero_gradients_whatever_their_query_holds(kernel):
    length = 200
    allowed = torch.ones(length, length, dtype=torch.bool).tril()
    allowed[50:60] = False  # ten queries that may see nothing, inside partial tiles
    q = randn(1, 2, length, 8)
    q[:, :, 50:60] = float("nan")
    q.requires_grad_()
    k, v = (randn(1, 2, length, 8, requires_grad=True) for _ in range(2))
    out = attnkit.attention(q, k, v, allowed, kernel=kernel)
    assert (out[:, :, 50:60] == 0).all() and torch.isfinite(out).all()
    out.sum().backward()
    assert (q.grad[:, :, 50:60] == 0).all()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_float_masks_holding_plus_inf_or_nan_are_refused(bad):
    q = randn(1, 1, 4, 8)
    mask = torch.zeros(4, 4)
    mask[2, 1] = bad
    with pytest.raises(ValueError, match=r"holds (inf|nan) at \(2, 1\).*not NaN or \+inf"):
        attnkit.attention(q, q, q, mask)
    mask[2, 1] = float("-inf")  # -inf is "hidden"
    assert torch.isfinite(attnkit.attention(q, q, q, mask)).all()


@pytest.mark.parametrize("kernel", KERNELS)
def test_1d_and_0d_bool_masks_broadcast_like_sdpa(kernel):
    q, k, v = (randn(2, 2, 6, 8, dtype=torch.float64) for _ in range(3))
    keys = torch.tensor([True, True, False, True, False, True])
    assert torch.allclose(
        attnkit.attention(q, k, v, keys, kernel=kernel), naive_attention(q, k, v, keys[None])[0], atol=1e-12
    )
    assert torch.allclose(
        attnkit.attention(q, k, v, torch.tensor(True), kernel=kernel), naive_attention(q, k, v)[0], atol=1e-12
    )
    assert attnkit.attention_weights(q, k, v, keys)[..., 2].abs().max() == 0


def test_a_leading_1_mask_for_2d_inputs_is_accepted():
    q, k, v = (randn(6, 8, dtype=torch.float64) for _ in range(3))
    t = torch.ones(1, 6, 6, dtype=torch.bool).tril()
    assert torch.allclose(attnkit.attention(q, k, v, t), attnkit.attention(q, k, v, masks.causal()), atol=1e-12)


def test_bad_inputs_from_deep_inside_torch_now_have_clear_errors():
    q = randn(1, 2, 5, 8)
    with pytest.raises(ValueError, match="the padding mask holds a tensor on meta but q is on cpu"):
        attnkit.attention(q, q, q, masks.padding(torch.tensor([3], device="meta")))
    with pytest.raises(TypeError, match="lengths must be a sequence of ints"):
        masks.padding("34")
    with pytest.raises(TypeError, match="lengths must be a sequence of ints"):
        masks.padding(None)
    cache = KVCache(2, 2, 16, 8)
    with pytest.raises(TypeError, match="k must be a floating point tensor"):
        cache.append(torch.ones(2, 2, 3, 8, dtype=torch.long), torch.ones(2, 2, 3, 8, dtype=torch.long))
    with pytest.raises(TypeError, match="counts must hold integers"):
        cache.append(randn(2, 2, 3, 8), randn(2, 2, 3, 8), counts=torch.tensor([1.5, 2.9]))
    with pytest.raises(TypeError, match="counts must hold integers"):
        cache.append(randn(2, 2, 3, 8), randn(2, 2, 3, 8), counts=torch.tensor([True, False]))
    with pytest.raises(ValueError, match=r"k must have 4 dimensions \(B, Hkv, T, D\)"):
        cache.append(randn(2, 3, 8), randn(2, 3, 8))
    with pytest.raises(ValueError, match="v_dim must be >= 0"):
        KVCache(2, 2, 16, 8, v_dim=-3)
    mha = attnkit.MultiHeadAttention(16, 2)
    x = randn(2, 3, 16)
    with pytest.raises(ValueError, match="counts= .* pass it with cache="):
        mha(x, counts=torch.tensor([1, 2]))
    with pytest.raises(TypeError, match=r"kv must be the pair \(k, v\)"):
        mha(x, kv=(randn(2, 2, 3, 8),))
    with pytest.raises(TypeError, match="query must be a floating point tensor"):
        mha(torch.ones(2, 3, 16, dtype=torch.long))
    with pytest.raises(ValueError, match="batch=-7 is out of range"):
        masks.padding(torch.tensor([2, 3])).picture(4, 4, batch=-7)
    with pytest.raises(ValueError, match="batch=5 is out of range"):
        masks.padding(torch.tensor([2, 3])).picture(4, 4, batch=5)
    assert "prefix_len=3" in repr(masks.prefix_lm(np.int64(3)))
    bf16 = attnkit.MultiHeadAttention(16, 2, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match=r"KVCache\(..., dtype=torch.bfloat16\)"):
        bf16(x.bfloat16(), cache=KVCache(2, 2, 16, 8))


def test_error_messages_quote_at_most_about_80_characters_of_input():
    with pytest.raises(ValueError) as err:
        masks.causal(align="x" * 500)
    assert len(str(err.value)) < 200


def test_math_engine_dq_error_is_within_twice_sdpas():
    """The tiled math engine (here for Dv != D) against SDPA, both measured against float64."""
    import statistics

    import torch.nn.functional as F

    ratios = []
    mask = masks.sliding_window(32)
    dense = mask.materialize(512, 512)
    for seed in range(5):
        g = torch.Generator().manual_seed(seed)
        q, k = (torch.randn(1, 2, 512, 8, generator=g, dtype=torch.float64) for _ in range(2))
        v, grad = (torch.randn(1, 2, 512, 4, generator=g, dtype=torch.float64) for _ in range(2))

        def dq(fn, dtype):
            qq, kk, vv = (t.detach().to(dtype).clone().requires_grad_() for t in (q, k, v))
            fn(qq, kk, vv).backward(grad.to(dtype))
            return qq.grad.double()

        gold = dq(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, attn_mask=dense), torch.float64)
        sdpa = dq(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, attn_mask=dense), torch.float32)
        ours = dq(lambda a, b, c: attnkit.attention(a, b, c, mask, kernel="tiled"), torch.float32)
        ratios.append((ours - gold).abs().max().item() / (sdpa - gold).abs().max().item())
    assert statistics.median(ratios) <= 2.0 and max(ratios) <= 3.0, ratios


# --- the CLI and the page -------------------------------------------------------------------


def _cli(*args):
    from attnkit.cli import main

    return main(list(args))


def test_cli_gives_one_line_errors_and_exit_code_2(tmp_path, capsys):
    a_file = tmp_path / "file.txt"
    a_file.write_text("x")
    cases = [
        (["translate", "2019-03-25", "--out", str(a_file)], "is an existing file"),
        (["translate", "2019-03-25", "--out", str(a_file / "below")], "cannot create the --out folder"),
        (
            [
                "translate",
                "2019-03-25",
                "--weights",
                str(tmp_path / "missing.safetensors"),
                "--out",
                str(tmp_path / "o"),
            ],
            "is not a file",
        ),
        (
            ["translate", "2019-03-25", "--weights", str(a_file), "--out", str(tmp_path / "o")],
            "is not a DateTranslator weights file",
        ),
        (["translate", "", "--out", str(tmp_path / "o")], "'' is not a date attnkit can read: the text is empty"),
        (["translate", "hello world", "--out", str(tmp_path / "o")], "not a date in a supported format"),
    ]
    for args, message in cases:
        assert _cli(*args) == 2, args
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, err
    for bad in (["--batch-size", "0"], ["--steps", "0"]):
        with pytest.raises(SystemExit) as exit_info:
            _cli("train", "translator", *bad, "--out", str(tmp_path / "t"))
        assert exit_info.value.code == 2
        assert "must be >= 1, but got 0" in capsys.readouterr().err


def test_show_says_what_it_cut_and_keeps_outputs_bounded(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    text = "word " * 1500
    assert _cli("show", text, "--out", str(tmp_path)) == 0
    err = capsys.readouterr().err
    assert "reads at most 256 tokens: showing the text up to character" in err and "of 1500 words" in err
    assert (tmp_path / "attention.npz").stat().st_size < 10_000_000
    assert (tmp_path / "attention.html").stat().st_size < 8_000_000


def test_save_html_refuses_zero_tokens(tmp_path):
    from attnkit.viz import save_html

    with pytest.raises(ValueError, match="hold nothing to draw"):
        save_html(tmp_path / "a.html", torch.zeros(1, 1, 0, 0), [])


# --- the DateTranslator does not answer when it should not ----------------------------------


@pytest.fixture(scope="module")
def translator():
    from attnkit.models import DateTranslator

    return DateTranslator.from_package()


def test_translator_refuses_what_is_not_a_date(translator):
    texts = [
        "",
        "hello world",
        "31 February 2019",
        "2019-13-01",
        "32 March 2019",
        "25 March 1850",
        "25 March 2150",
        "1" * 48,
        "03/25/2019",
        "20190325",
        "Monday, March 26, 2019",
        "3th of May 2000",
    ]
    assert translator.translate(texts) == [None] * len(texts)
    reasons = {a.text: a.reason for a in translator.answers(texts)}
    assert reasons["31 February 2019"] == "there is no 31 February 2019"
    assert reasons["25 March 1850"].startswith("the year 1850 is outside 1900-2099")
    assert "is a Tuesday, not a monday" in reasons["Monday, March 26, 2019"]
    with pytest.raises(ValueError, match="'hello world' is not a date attnkit can read"):
        translator.translate(["25 March 2019", "hello world"], strict=True)


def test_translator_normalises_whitespace_and_case_and_reports_confidence(translator):
    assert translator.translate(["  25 March 2019  ", "25   MARCH   2019", "2019年3月25日"]) == ["2019-03-25"] * 3
    (answer,) = translator.answers(["25th of March 2019"])
    assert answer.iso == "2019-03-25" and 0.5 < answer.confidence <= 1.0 and answer.reason == ""


def test_translator_keeps_99_percent_of_valid_dates_and_rejects_99_percent_of_garbage(translator):
    import random
    import string

    from attnkit.models import dates

    pairs = dates.dataset(600, seed=321)
    out = translator.translate([t for t, _ in pairs])
    assert sum(o == iso for o, (_, iso) in zip(out, pairs)) / len(pairs) >= 0.99
    rng = random.Random(0)
    chars = string.ascii_letters + string.digits + string.punctuation + " 年月日"
    garbage = ["".join(rng.choice(chars) for _ in range(rng.randint(0, 40))) for _ in range(2000)]
    rejected = translator.translate(garbage)
    assert sum(r is None for r in rejected) / len(rejected) >= 0.99


@pytest.mark.parametrize("placeholder", ["{{data}}", "{{title}}", "{{style}}", "{{script}}"])
def test_page_fills_its_template_once(placeholder):
    from attnkit.viz import attention_html

    page = attention_html(torch.full((1, 1, 2, 2), 0.5), [placeholder, "b"], title=placeholder)
    head = page.split("</title>", 1)[0]
    assert head.endswith(f"<title>{placeholder}")  # the user's text, not a second substitution
    assert page.count('id="attnkit-data"') == 1 and len(head) < 300


def test_page_title_drops_bidi_and_control_characters():
    from attnkit.viz import attention_html

    page = attention_html(torch.full((1, 1, 1, 1), 1.0), ["x"], title="abc\u202edef\x07")
    assert "<title>abcdef</title>" in page


def test_kv_cache_counts_may_be_a_list():
    cache = KVCache(2, 2, 16, 8)
    cache.append(randn(2, 2, 3, 8), randn(2, 2, 3, 8), counts=[1, 2])
    assert cache.lengths.tolist() == [1, 2]


def test_inputs_with_two_batch_dims_line_padding_up_with_the_inner_one():
    """Masks broadcast from the right, like SDPA's: with q (B1, B2, H, L, D), a padding mask's
    batch axis is B2 (documented in attnkit.masks)."""
    q = randn(2, 3, 1, 5, 8)
    w = attnkit.attention_weights(q, q, q, masks.padding(torch.tensor([2, 4, 5])))
    for inner, n in enumerate([2, 4, 5]):
        assert (w[:, inner, :, :, n:] == 0).all() and torch.allclose(w[:, inner].sum(-1), torch.ones(2, 1, 5))


@pytest.mark.parametrize(
    ("name", "value"), [("dropout_p", torch.tensor([1, 2])), ("scale", []), ("kernel", torch.tensor([1]))]
)
def test_lean_path_leaves_bad_plain_arguments_to_the_checks(name, value):
    """Found by make fuzz: the lean path of repeated calls compared or hashed the arguments first
    (a tensor dropout_p raised PyTorch's 'ambiguous' error, a list scale 'unhashable')."""
    q = torch.randn(1, 2, 8, 4)
    with pytest.raises((ValueError, TypeError)) as err:
        attnkit.attention(q, q, q, **{name: value})
    assert isinstance(err.value, attnkit.AttnkitError), err.value
