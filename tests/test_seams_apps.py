"""Regression tests of the applications' and the command line's defects from the review of
where features meet (F8 is in test_recommender.py, F24 in test_transformers.py)."""

from __future__ import annotations

import wave

import numpy as np
import pytest
import torch

from attnkit.cli import main


def test_f12_speech_recognizer_is_exported_like_the_other_models():
    import attnkit.models as models

    assert "SpeechRecognizer" in models.__all__
    from attnkit.models import SpeechRecognizer  # noqa: F401  (the README's import)


@pytest.mark.parametrize("batch_size", [0, -1, 2.5, "8", True])
def test_f13_batch_size_is_checked(batch_size):
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


def test_f13_numpy_integers_are_batch_sizes():
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


def test_f15_show_refuses_text_that_is_not_utf8(tmp_path, capsys):
    text = b"caf\xe9 au lait".decode("utf-8", "surrogateescape")  # how Python hands argv bytes over
    assert main(["show", text, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "not UTF-8" in err and "--file" in err and "Traceback" not in err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--length", "1e11"], "--length: must be a whole number"),
        (["--length", "100000000000"], "--length: must be at most 1,048,576"),
        (["--depth", "nan"], "--depth: must be in \\[0, 1\\]"),
        (["--depth", "2.0"], "--depth: must be in \\[0, 1\\]"),
        (["--depth", "-1"], "--depth: must be in \\[0, 1\\]"),
    ],
)
def test_f16_f17_show_length_and_depth_are_checked(tmp_path, capsys, args, message):
    with pytest.raises(SystemExit) as exit_:
        main(["show", "--model", "recall", *args, "--out", str(tmp_path)])
    assert exit_.value.code == 2
    import re

    assert re.search(message, capsys.readouterr().err)


def test_f18_caption_of_a_file_that_is_not_an_image(tmp_path, capsys):
    for name, data in (("fake.png", b"not an image"), ("fake.npy", b"\x93NUMPY garbage")):
        (tmp_path / name).write_bytes(data)
        assert main(["caption", "--image", str(tmp_path / name), "--out", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err
        assert "--image" in err and "Traceback" not in err


def test_f19_listen_to_a_truncated_stereo_wav(tmp_path, capsys):
    path = tmp_path / "cut.wav"
    with wave.open(str(path), "wb") as w:
        w.setnchannels(2)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes((np.random.default_rng(0).normal(0, 0.05, 2 * 16000) * 32767).astype("<i2").tobytes())
    path.write_bytes(path.read_bytes()[:-3])  # cut inside the last frame
    from attnkit.models.speech import read_wav

    samples, rate = read_wav(path)
    assert samples.shape == (2, 15999) and rate == 16000  # the cut frame is dropped
    assert main(["listen", str(path), "--out", str(tmp_path / "out")]) == 0
    empty = tmp_path / "empty.wav"
    empty.write_bytes(path.read_bytes()[:47])  # the header and 3 bytes: no whole frame
    assert main(["listen", str(empty), "--out", str(tmp_path / "out2")]) == 2
    assert "no complete sample" in capsys.readouterr().err


def test_f21_attention_page_is_bounded_whatever_the_token_text():
    from attnkit.viz.html import MAX_LABEL, attention_html

    page = attention_html(torch.rand(1, 1, 300, 300), ["x" * 1_000_000] * 300, title="t" * 10_000)
    assert len(page) < 1_000_000  # was 600 MB
    assert f"300 token labels longer than {MAX_LABEL} characters are cut" in page
