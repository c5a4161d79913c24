"""The audio of the speech recognizer (:mod:`attnkit.models.speech`): espeak-ng speech for the digit
task (voices, utterances, a dataset), WAV files, resampling, augmentation and log-mel features."""

from __future__ import annotations

import io
import math
import random
import shutil
import subprocess
import wave
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache

import numpy as np
import torch
import torch.nn.functional as F

from attnkit._types import PathLike
from attnkit._validate import AttnkitValueError, short

__all__ = [
    "OTHER_LANGUAGES",
    "TEST_ACCENTS",
    "TEST_VARIANTS",
    "TEST_VOICES",
    "TRAIN_ACCENTS",
    "TRAIN_VARIANTS",
    "TRAIN_VOICES",
    "augment",
    "augment_features",
    "dataset",
    "log_mel",
    "read_wav",
    "resample",
    "say",
    "spoken",
    "utterance",
    "warp_mels",
    "write_wav",
]


WEIGHTS = "speech_recognizer.safetensors"
SAMPLE_RATE = 16000
N_FFT, HOP, N_MELS = 400, 160, 64  # 25 ms windows every 10 ms
SUBSAMPLE = 4  # encoder frames are 40 ms apart
MAX_SECONDS = 30.0
PAD, BOS, EOS = 0, 1, 2
CHARS = list("0123456789")
WORDS = {
    "0": ("zero", "oh"),
    "1": ("one",),
    "2": ("two",),
    "3": ("three",),
    "4": ("four",),
    "5": ("five",),
    "6": ("six",),
    "7": ("seven",),
    "8": ("eight",),
    "9": ("nine",),
}

#: The held-out accents and variants: never used for training or model selection.
TEST_ACCENTS = ("en-gb-scotland", "en-gb-x-rp", "en-gb-x-gbclan", "en-gb-x-gbcwmd")
TEST_VARIANTS = ("m5", "m6", "m7", "f3", "f4")
TEST_VOICES = tuple((a, v) for a in TEST_ACCENTS for v in TEST_VARIANTS)
#: Training: the other English accents, with every other variant espeak-ng ships (the
#: numbered ones, klatt, and the named variants that sound like a person: no robots or whispers).
TRAIN_ACCENTS = ("en-us", "en-gb", "en-029", "en-us-nyc")
TRAIN_VARIANTS = (
    *("m1", "m2", "m3", "m4", "m8", "f1", "f2", "f5", "klatt", "klatt2", "klatt3", "klatt4"),
    *("Alex", "Alicia", "Andrea", "Andy", "Annie", "Denis", "Gene", "Hugo", "Jacky", "Lee", "Marco", "Mario"),
    *("Michael", "Mike", "adam", "anika", "aunty", "belinda", "benjamin", "boris", "caleb", "david", "ed"),
    *("edward", "grandma", "grandpa", "iven", "john", "linda", "max", "norbert", "pablo", "paul", "quincy"),
    *("rob", "robert", "shelby", "steph", "travis", "victor", "zac"),
)
#: Voices of other languages reading the English digit words (Latin script; no language of
#: the British Isles, whose accents are held out), with a few variants each.
OTHER_LANGUAGES = ("af", "de", "nl", "sv", "da", "nb", "fr-fr", "es", "it", "pt", "pl", "cs", "ro", "id")
TRAIN_VOICES = tuple((a, v) for a in TRAIN_ACCENTS for v in TRAIN_VARIANTS) + tuple(
    (a, v) for a in OTHER_LANGUAGES for v in ("m1", "m3", "f1", "f2", "klatt")
)


def _espeak() -> str:
    path = shutil.which("espeak-ng")
    if path is None:
        raise AttnkitValueError(
            "espeak-ng is not installed: it synthesises the speech this model is trained and tested on. "
            "Install Debian's package: apt-get install espeak-ng"
        )
    return path


def read_wav(data: bytes | PathLike) -> tuple[np.ndarray, int]:
    """``(samples float32 in [-1, 1], sample_rate)`` of a 16-bit PCM WAV (a path or bytes); mono or
    the channels as ``(channels, T)``."""
    source = io.BytesIO(data) if isinstance(data, (bytes, bytearray)) else str(data)
    try:
        with wave.open(source, "rb") as w:
            rate, channels, width, frames = (
                w.getframerate(),
                w.getnchannels(),
                w.getsampwidth(),
                w.readframes(w.getnframes()),
            )
    except (wave.Error, EOFError) as err:
        raise AttnkitValueError(
            f"cannot read {short(str(data)) if not isinstance(data, bytes) else 'the audio'} as a WAV file: {err}."
        ) from None
    if width != 2:
        raise AttnkitValueError(f"attnkit reads 16-bit PCM WAV files, but this one has {8 * width}-bit samples.")
    if channels < 1 or rate < 1:
        raise AttnkitValueError(f"the WAV header says {channels} channels at {rate} Hz: the file is damaged.")
    whole = len(frames) // (channels * width) * channels * width  # a truncated file can end inside a frame
    if whole == 0:
        raise AttnkitValueError("the WAV file holds no complete sample (it is empty or cut short).")
    samples = np.frombuffer(frames[:whole], dtype="<i2").astype(np.float32) / 32768.0
    if channels > 1:
        samples = samples.reshape(-1, channels).T
    return samples, rate


def write_wav(path: PathLike, samples: np.ndarray, sample_rate: int = SAMPLE_RATE) -> None:
    """Write float samples in [-1, 1] as 16-bit mono PCM."""
    pcm = (np.clip(np.asarray(samples, dtype=np.float32), -1, 1) * 32767).astype("<i2")
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(sample_rate)
        w.writeframes(pcm.tobytes())


def resample(samples: np.ndarray, rate: int, target: int = SAMPLE_RATE) -> np.ndarray:
    """Resample with librosa (soxr, high quality)."""
    if rate == target:
        return samples.astype(np.float32)
    import librosa

    return librosa.resample(samples.astype(np.float32), orig_sr=rate, target_sr=target).astype(np.float32)


def spoken(digits: str, rng: random.Random) -> str:
    """The words of a digit string, "zero" or "oh" for 0 at random."""
    return " ".join(rng.choice(WORDS[d]) for d in digits)


def say(
    digits: str,
    accent: str = "en-us",
    variant: str = "m1",
    *,
    rate: int = 170,
    pitch: int = 50,
    gap: int = 0,
    rng: random.Random | None = None,
) -> np.ndarray:
    """Speech of a digit string by espeak-ng, 16 kHz float32."""
    if not digits or any(d not in WORDS for d in digits):
        raise AttnkitValueError(f"say takes a string of digits 0-9, but got {short(digits)}.")
    words = spoken(digits, rng or random.Random(0))
    cmd = [_espeak(), "-v", f"{accent}+{variant}", "-s", str(rate), "-p", str(pitch), "-g", str(gap), "--stdout", words]
    done = subprocess.run(cmd, capture_output=True, check=False)
    if done.returncode != 0 or not done.stdout:
        raise AttnkitValueError(
            f"espeak-ng failed for voice {accent}+{variant}: {done.stderr.decode(errors='replace')[:200]}"
        )
    samples, sr = read_wav(done.stdout)
    return resample(samples, sr)


def utterance(rng: random.Random, voices: Sequence[tuple[str, str]], *, max_digits: int = 7) -> tuple[np.ndarray, str]:
    """One random utterance: ``(samples at 16 kHz, digits)``."""
    n = rng.randint(1, max_digits)
    digits = "".join(rng.choice(CHARS) for _ in range(n))
    accent, variant = rng.choice(voices)
    samples = say(
        digits,
        accent,
        variant,
        rate=rng.randint(120, 220),
        pitch=rng.randint(0, 99),
        gap=rng.choice([0, 0, 1, 3, 6]),
        rng=rng,
    )
    return samples, digits


def dataset(
    n: int, voices: Sequence[tuple[str, str]], seed: int, *, workers: int = 4, progress: bool | None = False
) -> list[tuple[np.ndarray, str]]:
    """``n`` utterances of ``voices`` (seeded; espeak-ng runs in ``workers`` processes at a time)."""
    from tqdm.auto import tqdm

    _espeak()
    seeds = random.Random(seed)
    rngs = [random.Random(seeds.getrandbits(64)) for _ in range(n)]
    with ThreadPoolExecutor(workers) as pool:
        return list(
            tqdm(
                pool.map(lambda r: utterance(r, voices), rngs),
                total=n,
                desc="synthesising",
                unit="utt",
                disable=not progress,
            )
        )


def augment(samples: np.ndarray, rng: random.Random) -> np.ndarray:
    """Speed (0.85-1.15), gain (0.2-1.5), silence at both ends and noise at 10-40 dB SNR."""
    speed = rng.uniform(0.85, 1.15)
    x = resample(samples, int(SAMPLE_RATE * speed)) if abs(speed - 1) > 0.01 else samples
    lead, tail = (np.zeros(rng.randint(0, 4000), np.float32) for _ in range(2))
    x = np.concatenate([lead, x, tail]) * rng.uniform(0.2, 1.5)
    power = float(np.mean(x**2)) + 1e-10
    snr = rng.uniform(10, 40)
    noise = np.random.default_rng(rng.getrandbits(32)).standard_normal(len(x)).astype(np.float32)
    return np.clip(x + noise * math.sqrt(power / 10 ** (snr / 10)), -1, 1).astype(np.float32)


@lru_cache(maxsize=1)
def _mel_filters() -> torch.Tensor:
    import librosa

    return torch.from_numpy(librosa.filters.mel(sr=SAMPLE_RATE, n_fft=N_FFT, n_mels=N_MELS)).float()  # (mels, bins)


def log_mel(samples: torch.Tensor) -> torch.Tensor:
    """``(frames, 64)`` log-mel features of 16 kHz samples, normalised per utterance and mel band
    (mean 0, variance 1: gain and channel differences cancel)."""
    window = torch.hann_window(N_FFT)
    spec = torch.stft(samples, N_FFT, HOP, window=window, return_complex=True).abs() ** 2  # (bins, frames)
    mel = torch.log(_mel_filters() @ spec + 1e-6).T  # (frames, mels)
    mel = mel - mel.mean(0, keepdim=True)
    return mel / (mel.std(0, keepdim=True, unbiased=False) + 1e-3) if mel.shape[0] > 1 else mel


def warp_mels(x: torch.Tensor, alpha: float) -> torch.Tensor:
    """``(..., T, 64)`` log-mel features with the mel axis stretched by ``alpha`` (a longer or
    shorter vocal tract: > 1 moves formants down, < 1 up), cropped or edge-padded to 64 bands."""
    if alpha == 1.0:
        return x
    width = max(8, round(N_MELS * alpha))
    lead = x.shape[:-1]
    warped = F.interpolate(x.reshape(1, -1, N_MELS), size=width, mode="linear", align_corners=False)
    warped = warped.reshape(*lead, width)
    if width >= N_MELS:
        return warped[..., :N_MELS]
    return torch.cat([warped, warped[..., -1:].expand(*lead, N_MELS - width)], -1)


def augment_features(feats: torch.Tensor, lengths: torch.Tensor, rng: random.Random) -> torch.Tensor:
    """Other voices, approximately: a warp of the mel axis by 0.8-1.25 (vocal tract length
    perturbation), a random spectral tilt, then SpecAugment (two bands of up to 8 mel bins and two stretches of up
    to 5% of the frames set to 0)."""
    out = feats.clone()
    for i, n in enumerate(lengths.tolist()):
        x = out[i, :n]  # (T, mels)
        x = warp_mels(x, rng.uniform(0.8, 1.25))
        x = x + rng.uniform(-0.5, 0.5) * torch.linspace(-1, 1, N_MELS)  # tilt: brighter or darker voices
        for _ in range(2):
            f = rng.randint(0, 8)
            f0 = rng.randint(0, N_MELS - f)
            x[:, f0 : f0 + f] = 0
            t = rng.randint(0, max(1, n // 20))
            t0 = rng.randint(0, max(0, n - t))
            x[t0 : t0 + t] = 0
        out[i, :n] = x
    return out


#: Vocal-tract warps of the mel axis decoded at test time and voted over (see
#: :meth:`SpeechRecognizer.decode_ensemble`), inside the training warps (0.8-1.25).
TEST_WARPS = (1.0, 0.9, 1.1)
