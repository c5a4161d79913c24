"""Every bad input of TESTING.md raises ValueError/TypeError naming the values."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _oracle import randn

import attnkit
from attnkit import masks
from attnkit.nn import KVCache


def t(*shape, dtype=torch.float32):
    return torch.randn(*shape).to(dtype)


q4 = t(2, 4, 5, 8)
k4 = t(2, 4, 6, 8)
v4 = t(2, 4, 6, 8)

BAD = [
    ((t(8), t(8), t(8)), {}, ValueError, r"at least 2 dimensions .* got shape \(8,\)"),
    ((q4, t(4, 6, 8), v4), {}, ValueError, r"same number of dimensions, but got q: \(2, 4, 5, 8\), k: \(4, 6, 8\)"),
    ((q4, t(2, 4, 6, 16), t(2, 4, 6, 16)), {}, ValueError, r"same head dimension D, but got q: .*D=8.* k: .*D=16"),
    ((q4, k4, t(2, 4, 7, 8)), {}, ValueError, r"same length Lk, but got k: .*Lk=6.* v: .*Lk=7"),
    ((q4, k4.double(), v4), {}, TypeError, r"same dtype, but got q: torch.float32, k: torch.float64"),
    ((q4.long(), k4.long(), v4.long()), {}, TypeError, r"floating point .* got torch.int64"),
    (
        (q4, t(2, 3, 6, 8), t(2, 3, 6, 8)),
        {},
        ValueError,
        r"Hq=4 heads and k/v have Hkv=3, but Hq must be a multiple of Hkv",
    ),
    (
        (q4, t(3, 4, 6, 8), t(3, 4, 6, 8)),
        {},
        ValueError,
        r"same batch sizes, but got q: \(2, 4, 5, 8\) and k: \(3, 4, 6, 8\)",
    ),
    ((q4, k4, t(2, 2, 6, 8)), {}, ValueError, r"k and v must have the same batch and head sizes"),
    (
        (q4, k4, v4),
        {"mask": torch.ones(5, 7, dtype=torch.bool)},
        ValueError,
        r"mask of shape \(5, 7\) does not broadcast .* \(2, 4, 5, 6\)",
    ),
    (
        (q4, k4, v4),
        {"mask": torch.ones(3, 4, 5, 6, dtype=torch.bool)},
        ValueError,
        r"mask of shape \(3, 4, 5, 6\) does not broadcast",
    ),
    ((q4, k4, v4), {"mask": torch.ones(2, 2, 4, 5, 6, dtype=torch.bool)}, ValueError, r"does not broadcast"),
    (
        (q4, k4, v4),
        {"mask": torch.ones(5, 6, dtype=torch.int64)},
        TypeError,
        r"mask must be bool .* got torch.int64. Use a bool mask",
    ),
    (
        (q4, k4, v4),
        {"mask": torch.ones(5, 6, dtype=torch.float64)},
        TypeError,
        r"query's dtype torch.float32, but got torch.float64. Cast it",
    ),
    ((q4, k4, v4), {"mask": [[True]]}, TypeError, r"mask must be None, a bool tensor .* got list"),
    ((q4, k4, v4), {"dropout_p": 1.0}, ValueError, r"dropout_p must be in \[0, 1\), but got dropout_p=1.0"),
    ((q4, k4, v4), {"dropout_p": -0.1}, ValueError, r"dropout_p must be in \[0, 1\), but got dropout_p=-0.1"),
    ((q4, k4, v4), {"scale": float("nan")}, ValueError, r"scale must be finite, but got nan"),
    ((q4, k4, v4), {"scale": "0.5"}, TypeError, r"scale must be a real number or None, but got '0.5'"),
    (
        (q4, k4, v4),
        {"kernel": "flash"},
        ValueError,
        r"kernel must be 'auto', a registered kernel's name .* but got 'flash'",
    ),
    (
        (q4, k4, v4),
        {"mask": masks.document(torch.zeros(7, dtype=torch.long))},
        ValueError,
        r"built for sequences of length L=7 but is used with Lq=5, Lk=6",
    ),
    ((q4, k4, v4), {"mask": masks.padding([3, 9])}, ValueError, r"length 9 but the keys have only Lk=6"),
    (
        (q4, k4, v4),
        {"mask": masks.padding([3, 4, 5])},
        ValueError,
        r"padding\(lengths=\[3, 4, 5\]\) of shape \(3, 1, 5, 6\) does not broadcast",
    ),
    (
        (t(4, 5, 8), t(4, 6, 8), t(4, 6, 8)),
        {"mask": masks.padding([3, 4])},
        ValueError,
        r"of shape \(2, 1, 5, 6\) does not broadcast to the attention matrix",
    ),
    (("q", k4, v4), {}, TypeError, r"q must be a torch.Tensor, but got str"),
]


@pytest.mark.parametrize("args,kwargs,exc,match", BAD)
def test_bad_input_raises_a_clear_error(args, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        attnkit.attention(*args, **kwargs)
    if "dropout_p" not in kwargs and "kernel" not in kwargs:
        with pytest.raises(exc, match=match):
            attnkit.attention_weights(*args, **kwargs)


def test_errors_belong_to_one_family():
    with pytest.raises(attnkit.AttnkitError):
        attnkit.attention(q4, k4, t(2, 4, 7, 8))
    with pytest.raises(attnkit.AttnkitError):
        attnkit.attention(q4, k4.double(), v4)


def test_devices_that_differ_on_meta():
    with pytest.raises(ValueError, match=r"same device, but got q: cpu, k: meta"):
        attnkit.attention(q4, k4.to("meta"), v4)
    with pytest.raises(ValueError, match=r"mask must be on the query's device cpu, but got meta"):
        attnkit.attention(q4, k4, v4, torch.ones(5, 6, dtype=torch.bool, device="meta"))


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        (
            {"d_model": 10, "num_heads": 3},
            ValueError,
            r"d_model must be divisible by num_heads, but got d_model=10 and num_heads=3",
        ),
        (
            {"d_model": 16, "num_heads": 4, "num_kv_heads": 3},
            ValueError,
            r"multiple of num_kv_heads, but got num_heads=4 and num_kv_heads=3",
        ),
        (
            {"d_model": 16, "num_heads": 4, "dropout": 1.5},
            ValueError,
            r"dropout must be in \[0, 1\), but got dropout=1.5",
        ),
        ({"d_model": 16, "num_heads": 0}, ValueError, r"num_heads must be positive, but got num_heads=0"),
        ({"d_model": 16.0, "num_heads": 4}, TypeError, r"d_model must be an int, but got 16.0"),
    ],
)
def test_bad_module_arguments(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        attnkit.MultiHeadAttention(**kwargs)


def test_bad_module_inputs():
    mha = attnkit.MultiHeadAttention(16, 4)
    with pytest.raises(ValueError, match=r"query must have shape \(B, L, 16\) or \(L, 16\), but got \(2, 5, 12\)"):
        mha(t(2, 5, 12))
    with pytest.raises(ValueError, match=r"key and value must have the same batch size and length"):
        mha(t(2, 5, 16), t(2, 6, 16), t(2, 7, 16))
    with pytest.raises(ValueError, match=r"query and key must have the same batch size"):
        mha(t(2, 5, 16), t(3, 6, 16))
    with pytest.raises(ValueError, match=r"does not broadcast"):
        mha(t(2, 5, 16), mask=torch.ones(4, 4, dtype=torch.bool))


# regression: a finding of the adversarial review of the inputs (hardening)
@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_float_masks_holding_plus_inf_or_nan_are_refused(bad):
    q = randn(1, 1, 4, 8)
    mask = torch.zeros(4, 4)
    mask[2, 1] = bad
    with pytest.raises(ValueError, match=r"holds (inf|nan) at \(2, 1\).*not NaN or \+inf"):
        attnkit.attention(q, q, q, mask)
    mask[2, 1] = float("-inf")  # -inf is "hidden"
    assert torch.isfinite(attnkit.attention(q, q, q, mask)).all()


# regression: a finding of the adversarial review of the inputs (hardening)
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


# regression: a finding of the adversarial review of the inputs (hardening)
def test_error_messages_quote_at_most_about_80_characters_of_input():
    with pytest.raises(ValueError) as err:
        masks.causal(align="x" * 500)
    assert len(str(err.value)) < 200


@pytest.mark.parametrize(
    ("name", "value"), [("dropout_p", torch.tensor([1, 2])), ("scale", []), ("kernel", torch.tensor([1]))]
)
# regression: a finding of the adversarial review of the inputs (hardening)
def test_lean_path_leaves_bad_plain_arguments_to_the_checks(name, value):
    """Found by make fuzz: the lean path of repeated calls compared or hashed the arguments first
    (a tensor dropout_p raised PyTorch's 'ambiguous' error, a list scale 'unhashable')."""
    q = torch.randn(1, 2, 8, 4)
    with pytest.raises((ValueError, TypeError)) as err:
        attnkit.attention(q, q, q, **{name: value})
    assert isinstance(err.value, attnkit.AttnkitError), err.value


def test_rows_and_heads_take_numpy_integers_and_refuse_huge_ones():
    np = pytest.importorskip("numpy")
    q = randn(1, 2, 5, 8)
    full = attnkit.attention_weights(q, q, q)
    torch.testing.assert_close(attnkit.attention_weights(q, q, q, rows=np.int64(3)), full[:, :, 3:4])
    torch.testing.assert_close(attnkit.attention_weights(q, q, q, heads=[np.int32(1)]), full[:, 1:2])
    with pytest.raises(ValueError, match=r"rows=\[100000000000000000000\] is out of range for 5"):
        attnkit.attention_weights(q, q, q, rows=[10**20])
    with pytest.raises(TypeError, match="rows must hold integer indices"):
        attnkit.attention_weights(q, q, q, rows=[1.5])


def test_prepare_on_the_meta_device_is_refused_clearly():
    with pytest.raises(ValueError, match="cannot make a PreparedMask on the meta device"):
        attnkit.prepare(masks.padding([3]), 8, 8, device="meta")
