"""Every bad input of TESTING.md raises ValueError/TypeError naming the values."""

import pytest
import torch

import attnkit
from attnkit import masks


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
