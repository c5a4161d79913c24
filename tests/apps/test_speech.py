"""SpeechRecognizer: shipped weights on the example WAVs and on held-out voices, decoding,
batching, resampling, bad audio, training and the CLI."""

from __future__ import annotations

import os
import shutil
import wave

import numpy as np
import pytest
import torch

from attnkit.cli import main
from attnkit.models import speech, speech_audio
from attnkit.models.speech import SpeechRecognizer

HAVE_ESPEAK = shutil.which("espeak-ng") is not None


def needs_espeak():
    if not HAVE_ESPEAK:
        if os.environ.get("ATTNKIT_REQUIRE_ESPEAK"):
            pytest.fail("ATTNKIT_REQUIRE_ESPEAK is set but espeak-ng is not on PATH")
        pytest.skip("espeak-ng is not installed (apt-get install espeak-ng; .ci/run installs it)")


@pytest.fixture(scope="module")
def model():
    return SpeechRecognizer.from_package()


def test_shipped_examples_are_transcribed(model):
    found = speech.examples()
    assert len(found) >= 2
    for path, digits in found:
        samples, rate = speech.read_wav(path)
        assert os.path.getsize(path) < 80_000
        assert model.transcribe([samples], rate) == [digits]


def test_held_out_voices_sample(model):
    """A fixed sample of held-out voices: at least the floor the benchmark documents (the
    target of 95% is not reached; see the README's table)."""
    needs_espeak()
    items = speech.dataset(40, speech.TEST_VOICES, seed=777)
    texts = model.transcribe([w for w, _ in items], 16000)
    right = sum(t == d for t, (_, d) in zip(texts, items))
    assert right >= 32, list(zip(texts, [d for _, d in items]))  # 80%; the 500-utterance benchmark measures


def test_cached_decoding_equals_recomputation(model):
    samples, rate = speech.read_wav(speech.examples()[0][0])
    feats, lengths = model.features([samples], rate)
    ids = model.generate(feats, lengths)[0].tolist()
    # teacher-forced logits over the decoded prefix pick the same tokens
    target_in = torch.tensor([[speech.BOS] + ids[:-1]])
    with torch.no_grad():
        logits = model(feats, lengths, target_in)
    assert logits.argmax(-1)[0].tolist() == ids


def test_batching_different_lengths_equals_one_by_one(model):
    waves = [speech.read_wav(p)[0] for p, _ in speech.examples()]
    waves.append(np.concatenate([np.zeros(8000, np.float32), waves[0]]))  # longer, same words
    one = [model.transcribe([w], 16000)[0] for w in waves]
    assert model.transcribe(waves, 16000) == one


def _ctc_log_likelihood(logp, labels):
    """log p(labels | frames) by the CTC forward recursion, in float64 (blank = 0)."""
    logp = logp.double()
    ext = [0]
    for c in labels:
        ext += [c, 0]
    alpha = torch.full((len(ext),), float("-inf"), dtype=torch.float64)
    alpha[0] = logp[0, 0]
    if len(ext) > 1:
        alpha[1] = logp[0, ext[1]]
    for t in range(1, logp.shape[0]):
        prev = alpha.clone()
        for s in range(len(ext)):
            terms = [prev[s]] + ([prev[s - 1]] if s >= 1 else [])
            if s >= 2 and ext[s] != 0 and ext[s] != ext[s - 2]:
                terms.append(prev[s - 2])
            alpha[s] = torch.logsumexp(torch.stack(terms), 0) + logp[t, ext[s]]
    return torch.logsumexp(alpha[-2:], 0).item() if len(ext) > 1 else alpha[0].item()


def test_warp_ensemble_keeps_the_best_jointly_scored_hypothesis(model):
    """Candidates: each warp's greedy decoding and CTC best path; score: (1 - w) x the
    decoder's log p + w x the CTC log-likelihood, summed over the warped inputs; both scores
    recomputed here by hand (teacher forcing, and the CTC forward recursion in float64)."""
    waves = [speech.read_wav(p)[0] for p, _ in speech.examples()]
    feats, lengths = model.features(waves, 16000)
    warps = (1.0, 0.8, 1.25)
    w = model.config.ctc_weight
    assert 0 < w < 1
    with torch.no_grad():
        assert torch.equal(model.decode_ensemble(feats, lengths, warps=(1.0,)), model.generate(feats, lengths))
        chosen = model.decode_ensemble(feats, lengths, warps=warps)
        for row in range(len(waves)):
            n = lengths[row : row + 1]
            one = feats[row : row + 1, : int(n)]
            encoded = [model.encode(speech.warp_mels(one, a), n) for a in warps]
            texts = [model.text_of(model.generate(speech.warp_mels(one, a), n)[0].tolist()) for a in warps]
            texts += [model.text_of(model.ctc_greedy(memory, n)[0].tolist()) for memory, _ in encoded]
            score = {}
            for text in texts:
                ids = [speech.BOS] + [model.vocab.index(c) for c in text] + [speech.EOS]
                total = 0.0
                for memory, padding in encoded:
                    attention = (
                        model.decode(torch.tensor([ids[:-1]]), memory, padding)
                        .log_softmax(-1)[0, torch.arange(len(ids) - 1), ids[1:]]
                        .sum()
                        .item()
                    )
                    frames = int(model.encoded_lengths(n)[0])
                    ctc = _ctc_log_likelihood(model.ctc_log_probs(memory)[:frames, 0], [int(c) + 1 for c in text])
                    total += (1 - w) * attention + w * ctc
                score[text] = total
            got = model.text_of(chosen[row].tolist())
            assert got in texts and score[got] >= max(score.values()) - 1e-3, (got, score)


def test_ctc_best_path_merges_repeats_and_drops_blanks(model, monkeypatch):
    # frames: 3 3 blank 3 7 7 blank -> digits "3", "3", "7" (classes are digit + 1)
    path = [4, 4, 0, 4, 8, 8, 0]
    logp = torch.full((len(path), 1, 11), -10.0)
    logp[torch.arange(len(path)), 0, torch.tensor(path)] = 0.0
    monkeypatch.setattr(model, "ctc_log_probs", lambda memory: logp)
    ids = model.ctc_greedy(torch.zeros(1, len(path), 8), torch.tensor([4 * len(path)]))
    assert model.text_of(ids[0].tolist()) == "337" and ids[0, -1].item() == speech.EOS


def test_training_and_held_out_voices_never_meet():
    train_accents = {a for a, _ in speech.TRAIN_VOICES}
    train_variants = {v for _, v in speech.TRAIN_VOICES}
    assert not train_accents & set(speech.TEST_ACCENTS)
    assert not train_variants & set(speech.TEST_VARIANTS)
    assert {"en-us", "en-gb", "en-029", "en-us-nyc"} <= train_accents and len(speech.TRAIN_VOICES) > 200
    assert set(speech.TEST_VOICES) == {(a, v) for a in speech.TEST_ACCENTS for v in speech.TEST_VARIANTS}


def test_warps_are_checked(model):
    feats, lengths = model.features([speech.read_wav(speech.examples()[0][0])[0]], 16000)
    for bad in ((), (0.1,), (1.0, 3.0)):
        with pytest.raises(ValueError, match="warps must be factors between 0.5 and 2.0"):
            model.decode_ensemble(feats, lengths, warps=bad)
    x = torch.randn(2, 30, 64)
    assert speech.warp_mels(x, 1.0) is x
    for a in (0.85, 1.2):
        y = speech.warp_mels(x, a)
        assert y.shape == x.shape and torch.isfinite(y).all()
    # stretching by a moves band b's content to band about a * b
    ramp = torch.arange(64.0).expand(1, 64)
    assert abs(speech.warp_mels(ramp, 1.25)[0, 40].item() - 40 / 1.25) < 1.0


def test_resampling(model):
    samples, rate = speech.read_wav(speech.examples()[0][0])
    truth = speech.examples()[0][1]
    for target in (8000, 22050, 44100):
        other = speech.resample(samples, rate, target)
        assert model.transcribe([other], target) == [truth]
    assert model.transcribe([torch.from_numpy(samples)], rate) == [truth]  # tensors too


def test_bad_audio_gets_clear_errors(model):
    ok = np.zeros(1600, np.float32)
    cases = [
        ([np.zeros(0, np.float32)], 16000, ValueError, "empty"),
        ([np.full(1600, np.nan, np.float32)], 16000, ValueError, "NaN"),
        ([np.zeros((2, 1600), np.float32)], 16000, ValueError, "mono"),
        ([np.zeros(1600, np.int16)], 16000, TypeError, "float samples"),
        ([np.zeros(16000 * 600, np.float32)], 16000, ValueError, "600 s"),
        ([ok], 100, ValueError, "sample_rate"),
        (ok, 16000, TypeError, "list"),
        ([], 16000, ValueError, "at least one"),
    ]
    for waves, rate, error, needle in cases:
        with pytest.raises(error, match=needle):
            model.transcribe(waves, rate)
    with pytest.raises(ValueError, match="WAV"):
        speech.read_wav(b"not a wav")


def test_alignment_is_monotonic_on_the_examples(model):
    for path, digits in speech.examples():
        samples, rate = speech.read_wav(path)
        found = model.transcribe_with_attention(samples, rate)
        assert found["text"] == digits
        assert found["attention"].shape[:2] == (model.config.decoder_layers, model.config.num_heads)
        assert (
            found["attention"].shape[2] == len(digits) + 1
            and found["frame_times"].shape[0] == found["attention"].shape[3]
        )
        assert speech.alignment_is_monotonic(model, samples)


def test_training_smoke():
    needs_espeak()
    trained, record = speech.train(steps=3, batch_size=4, train_size=8, valid_size=4, progress=False, log=None)
    assert record["steps"] == 3 and record["history"] and isinstance(trained, SpeechRecognizer)


def test_missing_espeak_is_named(monkeypatch):
    monkeypatch.setattr(speech_audio.shutil, "which", lambda name: None)
    with pytest.raises(ValueError, match="apt-get install espeak-ng"):
        speech.say("407")


def test_listen_cli_end_to_end(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from attnkit.cli import main

    assert main(["listen", "--example", "1", "--out", str(tmp_path / "a")]) == 0
    assert capsys.readouterr().out.strip() == speech.examples()[0][1]
    for name in ("listen.png", "listen.html", "listen.npz"):
        assert (tmp_path / "a" / name).is_file()
    path = speech.examples()[1][0]
    assert main(["listen", path, "--out", str(tmp_path / "b")]) == 0
    assert main(["listen", "--out", str(tmp_path / "c")]) == 2
    assert main(["listen", str(tmp_path / "missing.wav"), "--out", str(tmp_path / "d")]) == 2
    if HAVE_ESPEAK:
        assert main(["listen", "--say", "4 0 7", "--out", str(tmp_path / "e")]) == 0


def test_train_minutes_sets_the_steps(monkeypatch, capsys):
    from attnkit import cli
    from attnkit.apps import train

    seen = {}
    monkeypatch.setattr(train, "speech", lambda args: seen.setdefault("steps", args.steps) and 0)
    assert cli.main(["train", "speech", "--minutes", "2"]) == 0
    assert seen["steps"] == 2 * train.SPEECH_STEPS_PER_MINUTE
    for bad in (["train", "translator", "--minutes", "2"], ["train", "speech", "--minutes", "2", "--steps", "9"]):
        with pytest.raises(SystemExit):
            cli.main(bad)
        assert "--minutes is for 'train speech'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["train", "speech", "--minutes", "90"])
    assert "between 1 and 60 minutes" in capsys.readouterr().err


# regression: finding F12 of the review of the seams between features
def test_speech_recognizer_is_exported_like_the_other_models():
    import attnkit.models as models

    assert "SpeechRecognizer" in models.__all__
    from attnkit.models import SpeechRecognizer  # noqa: F401  (the README's import)


# regression: finding F19 of the review of the seams between features
def test_listen_to_a_truncated_stereo_wav(tmp_path, capsys):
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
