"""KV cache, the date translator's three kinds of attention, its accuracy, training and CLI."""

from __future__ import annotations

import datetime
import random
import re
import subprocess
import sys

import pytest
import torch
from _oracle import randn

import attnkit
from attnkit import masks
from attnkit.models import dates, translator
from attnkit.models.translator import BOS, DateTranslator
from attnkit.nn import KVCache

# --- KV cache ------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [1, 3, 7])
def test_cached_decoding_equals_recomputation(chunk):
    mha = attnkit.MultiHeadAttention(32, 4, num_kv_heads=2).eval()
    x = randn(2, 20, 32)
    full = mha(x, mask=masks.causal())[0]
    cache = KVCache(2, 2, 32, 8)
    pieces = [mha(x[:, s : s + chunk], mask=masks.causal(), cache=cache)[0] for s in range(0, 20, chunk)]
    assert torch.allclose(torch.cat(pieces, dim=1), full, atol=1e-5)
    assert cache.lengths.tolist() == [20, 20]


def test_cached_decoding_with_mixed_lengths():
    mha = attnkit.MultiHeadAttention(32, 4).eval()
    lengths = [9, 5, 2]
    xs = [randn(1, n + 4, 32) for n in lengths]  # prompt, then 4 decoded tokens each
    want = [mha(x, mask=masks.causal())[0][0] for x in xs]  # each sequence alone, no padding
    cache = KVCache(3, 4, 16, 8)
    prompt = torch.zeros(3, max(lengths), 32)
    for b, n in enumerate(lengths):
        prompt[b, :n] = xs[b][0, :n]
    out = mha(prompt, mask=masks.causal(), cache=cache, counts=torch.tensor(lengths))[0]
    for b, n in enumerate(lengths):
        assert torch.allclose(out[b, :n], want[b][:n], atol=1e-5)
    for step in range(4):
        token = torch.stack([xs[b][0, n + step] for b, n in enumerate(lengths)])[:, None]  # (3, 1, 32)
        out = mha(token, mask=masks.causal(), cache=cache)[0]
        for b, n in enumerate(lengths):
            assert torch.allclose(out[b, 0], want[b][n + step], atol=1e-5)
    assert cache.lengths.tolist() == [13, 9, 6]


def test_cache_capacity_error_and_reset():
    cache = KVCache(2, 1, 4, 8)
    cache.append(torch.randn(2, 1, 3, 8), torch.randn(2, 1, 3, 8), counts=torch.tensor([3, 1]))
    with pytest.raises(
        ValueError, match=r"capacity exceeded: sequence 0 holds 3 entries and 2 more do not fit in max_len=4"
    ):
        cache.append(torch.randn(2, 1, 2, 8), torch.randn(2, 1, 2, 8))
    assert cache.lengths.tolist() == [3, 1]  # a refused append stores nothing
    with pytest.raises(ValueError, match=r"the cache holds keys \(2, 1, 4, 8\)"):
        cache.append(torch.randn(2, 2, 1, 8), torch.randn(2, 2, 1, 8))
    cache.reset()
    assert cache.lengths.tolist() == [0, 0]
    cache.append(torch.randn(2, 1, 4, 8), torch.randn(2, 1, 4, 8))
    assert cache.lengths.tolist() == [4, 4]


def test_cache_stores_what_was_appended():
    cache = KVCache(2, 2, 8, 4)
    k, v = torch.randn(2, 2, 3, 4), torch.randn(2, 2, 3, 4)
    cache.append(k, v, counts=torch.tensor([3, 2]))
    keys, values = cache.stored()
    assert torch.equal(keys[0], k[0]) and torch.equal(keys[1, :, :2], k[1, :, :2]) and (keys[1, :, 2] == 0).all()
    assert torch.equal(values[0], v[0])


def test_cross_attention_kv_is_computed_once():
    mha = attnkit.MultiHeadAttention(16, 2).eval()
    x, memory = randn(2, 3, 16), randn(2, 7, 16)
    kv = mha.project_kv(memory)
    assert torch.allclose(mha(x, kv=kv)[0], mha(x, memory, memory)[0], atol=1e-6)
    with pytest.raises(ValueError, match="not both"):
        mha(x, memory, kv=kv)


# --- the model -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model():
    return DateTranslator.from_package()


def greedy_without_cache(model, texts):
    source, lengths = model.encode_source(texts)
    target = torch.full((len(texts), 1), BOS)
    with torch.no_grad():
        for _ in range(model.config.max_target_len - 1):
            logits = model(source, lengths, target)
            target = torch.cat([target, logits[:, -1:].argmax(-1)], dim=1)
    return target[:, 1:]


def test_generate_with_cache_equals_recomputation(model):
    texts = ["25th of March 2019", "2019年3月25日", "Mon, 1 jan 1900"]
    with_cache = model.generate(*model.encode_source(texts))
    assert torch.equal(with_cache, greedy_without_cache(model, texts)[:, : with_cache.shape[1]])


def future_leaks(model) -> bool:
    """Whether a decoder position's logits change when later decoder inputs change."""
    source, lengths = model.encode_source(["25 March 2019"])
    a = torch.tensor([[BOS, 6, 5, 5, 7, 14, 4, 7, 14]])
    b = a.clone()
    b[0, 5:] = torch.tensor([4, 4, 4, 4])
    with torch.no_grad():
        la, lb = model(source, lengths, a), model(source, lengths, b)
    return not torch.allclose(la[:, :5], lb[:, :5], atol=1e-6)


def test_decoder_self_attention_is_causal(model, monkeypatch):
    assert not future_leaks(model)
    # the check itself must catch a decoder whose causal mask is gone
    monkeypatch.setattr(translator.masks, "causal", lambda *a, **k: None)
    assert future_leaks(model)


def test_encoder_ignores_padding_and_decoder_reads_the_source(model):
    source, lengths = model.encode_source(["25 March 2019", "1 May 2000"])
    target_in = torch.full((2, 1), BOS)
    with torch.no_grad():
        base = model(source, lengths, target_in)
        noisy = source.clone()
        noisy[1, lengths[1] :] = 40  # garbage where row 1 is padding
        assert torch.allclose(model(noisy, lengths, target_in), base, atol=1e-6)
        other = source.clone()
        other[0, :2] = torch.tensor([model.source_vocab["1"], model.source_vocab["7"]])
        assert not torch.allclose(model(other, lengths, target_in)[0], base[0], atol=1e-3)


def test_accuracy_on_fresh_dates_of_every_family(model):
    pairs = dates.dataset(500, seed=2026_11_29)
    predictions = model.translate([t for t, _ in pairs])
    right = [p == iso for p, (_, iso) in zip(predictions, pairs)]
    assert sum(right) / len(right) >= 0.99, [(t, p) for p, (t, iso), ok in zip(predictions, pairs, right) if not ok][
        :10
    ]
    families = {f: [] for f in dates.FAMILIES}
    for i, ok in enumerate(right):
        families[dates.FAMILIES[i % len(dates.FAMILIES)]].append(ok)
    assert all(sum(v) / len(v) >= 0.95 for v in families.values()), {f: sum(v) / len(v) for f, v in families.items()}


def test_translate_with_attention_shapes(model):
    result = model.translate_with_attention("25th of March 2019")
    assert result["output"] == "2019-03-25"
    w = result["weights"]
    assert w.shape == (2, 4, 11, len("25th of March 2019"))
    # the model reads the normalised text (lower case)
    assert result["output_tokens"][-1] == "</s>" and result["input_tokens"] == list("25th of march 2019")
    assert torch.allclose(w.sum(-1), torch.ones(2, 4, 11), atol=1e-5)


def test_training_smoke():
    model, record = translator.train(12, seed=1, batch_size=32, progress=False)
    assert record["final_loss"] < record["first_loss"]
    assert isinstance(model, DateTranslator) and not model.training


def test_save_and_load_round_trip(tmp_path, model):
    path = model.save(tmp_path / "m.safetensors", training={"steps": 1})
    again = DateTranslator.load(path)
    assert again.training_info == {"steps": 1}
    for (name, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), name


def test_bad_inputs(model):
    assert model.translate(["x" * 60]) == [None]  # not a date: refused before the model
    with pytest.raises(ValueError, match="at most 48 characters"):
        model.encode_source(["x" * 60])
    with pytest.raises(TypeError, match="list of str"):
        model.translate("25 March 2019")


# --- data ----------------------------------------------------------------------------------


def test_every_family_renders_its_date():
    rng = random.Random(7)
    for family in dates.FAMILIES:
        for _ in range(50):
            date = dates.random_date(rng)
            text = dates.render(date, family, rng)
            assert str(date.year) in text and 1900 <= date.year <= 2099
            if family == "weekday":
                assert dates.WEEKDAYS[date.weekday()][:3].lower() in text.lower()
            if family == "iso":
                assert text == date.isoformat()
            if family == "chinese":
                assert re.fullmatch(r"\d{4}年\d{1,2}月\d{1,2}日", text)


def test_dataset_is_reproducible():
    assert dates.dataset(20, seed=3) == dates.dataset(20, seed=3)
    assert all(datetime.date.fromisoformat(iso) for _, iso in dates.dataset(100, seed=4))


# --- CLI -------------------------------------------------------------------------------------


def test_translate_cli_end_to_end(tmp_path):
    pytest.importorskip("matplotlib")
    run = subprocess.run(
        [sys.executable, "-m", "attnkit", "translate", "25th of March 2019", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "2019-03-25"
    for name in ["alignment.png", "alignment_grid.png", "alignment.html"]:
        assert (tmp_path / name).stat().st_size > 5000, name


@pytest.fixture(scope="module")
def date_translator():
    from attnkit.models import DateTranslator

    return DateTranslator.from_package()


# regression: a finding of the adversarial review of the inputs (hardening)
def test_translator_refuses_what_is_not_a_date(date_translator):
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
    assert date_translator.translate(texts) == [None] * len(texts)
    reasons = {a.text: a.reason for a in date_translator.answers(texts)}
    assert reasons["31 February 2019"] == "there is no 31 February 2019"
    assert reasons["25 March 1850"].startswith("the year 1850 is outside 1900-2099")
    assert "is a Tuesday, not a monday" in reasons["Monday, March 26, 2019"]
    with pytest.raises(ValueError, match="'hello world' is not a date attnkit can read"):
        date_translator.translate(["25 March 2019", "hello world"], strict=True)


# regression: a finding of the adversarial review of the inputs (hardening)
def test_translator_normalises_whitespace_and_case_and_reports_confidence(date_translator):
    assert date_translator.translate(["  25 March 2019  ", "25   MARCH   2019", "2019年3月25日"]) == ["2019-03-25"] * 3
    (answer,) = date_translator.answers(["25th of March 2019"])
    assert answer.iso == "2019-03-25" and 0.5 < answer.confidence <= 1.0 and answer.reason == ""


# regression: a finding of the adversarial review of the inputs (hardening)
def test_translator_keeps_99_percent_of_valid_dates_and_rejects_99_percent_of_garbage(date_translator):
    import random
    import string

    from attnkit.models import dates

    pairs = dates.dataset(600, seed=321)
    out = date_translator.translate([t for t, _ in pairs])
    assert sum(o == iso for o, (_, iso) in zip(out, pairs)) / len(pairs) >= 0.99
    rng = random.Random(0)
    chars = string.ascii_letters + string.digits + string.punctuation + " 年月日"
    garbage = ["".join(rng.choice(chars) for _ in range(rng.randint(0, 40))) for _ in range(2000)]
    rejected = date_translator.translate(garbage)
    assert sum(r is None for r in rejected) / len(rejected) >= 0.99
