"""``SpeechRecognizer``: spoken digit strings to text, with attention aligning audio and text.

A small listen-attend-spell model built from attnkit parts: log-mel features, a
convolutional front end that subsamples time by 4, an encoder of bidirectional
self-attention over the audio frames (a padding mask hides each utterance's end),
and a character decoder with causal self-attention (a KV cache when decoding) and
cross-attention over the frames. The cross-attention weights show which stretch of
audio each digit was read from.

The data is real speech signal made here by Debian's ``espeak-ng``: digit strings of
1-7 digits ("zero" or "oh" for 0) in several accents and voices, at 120-220 words per
minute, with varied pitch, gaps, speed, gain and noise, and in training warped mel
bands and masked bands and stretches (other voices, approximately). Training
(:data:`TRAIN_VOICES`) uses the English accents en-us, en-gb, en-029 and en-us-nyc with
every espeak-ng voice variant except the held-out ones (m1-m4, m8, f1, f2, f5, klatt1-4
and the named variants), and 14 other languages' voices reading the English digit words;
:data:`TEST_VOICES` (the accents en-gb-scotland, en-gb-x-rp, en-gb-x-gbclan and
en-gb-x-gbcwmd with the variants m5-m7, f3-f4) are never used for training or model
selection. The loss is joint: cross-entropy of the attention decoder and CTC on the
encoder (it keeps the alignment monotonic); decoding rescores the hypotheses with both.

>>> model = SpeechRecognizer.from_package()
>>> model.transcribe([waveform], sample_rate=16000)  # doctest: +SKIP
['407']
"""

from __future__ import annotations

import io
import math
import random
import shutil
import subprocess
import time
import wave
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from numbers import Real

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from attnkit import masks
from attnkit._types import PathLike
from attnkit._validate import AttnkitTypeError, AttnkitValueError, check_positive_int, short
from attnkit.models._weights import ShippedWeights
from attnkit.models.translator import DecoderLayer, EncoderLayer, greedy_decode

__all__ = [
    "SpeechRecognizer",
    "Config",
    "TRAIN_VOICES",
    "TRAIN_ACCENTS",
    "TRAIN_VARIANTS",
    "OTHER_LANGUAGES",
    "TEST_VOICES",
    "TEST_ACCENTS",
    "TEST_VARIANTS",
    "say",
    "dataset",
    "read_wav",
    "train",
    "examples",
    "WEIGHTS",
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


# --- audio -----------------------------------------------------------------------------------


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


# --- the model -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    d_model: int = 128
    num_heads: int = 4
    encoder_layers: int = 3
    decoder_layers: int = 2
    d_ff: int = 320
    max_target_len: int = 10  # 7 digits, </s>, and room to spare
    ctc_weight: float = 0.3  # of the CTC loss in training, and of the CTC score when decoding


def _sinusoids(length: int, dim: int) -> torch.Tensor:
    pos = torch.arange(length, dtype=torch.float32)[:, None]
    freq = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32) * (-math.log(10000.0) / dim))
    out = torch.zeros(length, dim)
    out[:, 0::2], out[:, 1::2] = torch.sin(pos * freq), torch.cos(pos * freq)
    return out


class SpeechRecognizer(ShippedWeights, nn.Module):
    """Waveforms in, digit strings out (see the module docstring)."""

    WEIGHTS = WEIGHTS
    config_class = Config

    def __init__(self, config: Config = Config()):
        super().__init__()
        c = self.config = config
        self.frontend = nn.Sequential(
            nn.Conv1d(N_MELS, c.d_model, 3, stride=2, padding=1),
            nn.GELU(),
            nn.Conv1d(c.d_model, c.d_model, 3, stride=2, padding=1),
            nn.GELU(),
        )
        self.encoder = nn.ModuleList(EncoderLayer(c) for _ in range(c.encoder_layers))
        self.encoder_norm = nn.LayerNorm(c.d_model)
        self.vocab = ["<pad>", "<s>", "</s>"] + CHARS
        self.embed = nn.Embedding(len(self.vocab), c.d_model)
        self.target_pos = nn.Embedding(c.max_target_len, c.d_model)
        self.decoder = nn.ModuleList(DecoderLayer(c) for _ in range(c.decoder_layers))
        self.decoder_norm = nn.LayerNorm(c.d_model)
        self.head = nn.Linear(c.d_model, len(self.vocab))
        self.ctc_head = nn.Linear(c.d_model, 1 + len(CHARS))  # blank, then the digits
        self.training_info: dict = {}

    # --- inputs ------------------------------------------------------------------------------

    def features(
        self, waveforms: Sequence[np.ndarray | torch.Tensor], sample_rate: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(feats (B, T, 64), lengths (B,))`` from a list of mono waveforms at ``sample_rate``."""
        if isinstance(sample_rate, bool) or not isinstance(sample_rate, int) or not 4000 <= sample_rate <= 192000:
            raise AttnkitValueError(
                f"sample_rate must be an int between 4000 and 192000 Hz, but got {short(sample_rate)}."
            )
        if isinstance(waveforms, (np.ndarray, torch.Tensor)):
            raise AttnkitTypeError("waveforms must be a list of 1-D arrays (one per utterance); wrap one in a list.")
        feats = []
        for i, w in enumerate(waveforms):
            x = w.detach().cpu().numpy() if isinstance(w, torch.Tensor) else np.asarray(w)
            if not np.issubdtype(x.dtype, np.floating):
                raise AttnkitTypeError(
                    f"waveforms[{i}] holds {x.dtype}: pass float samples in [-1, 1] (int16 PCM / 32768.0)."
                )
            if x.ndim != 1:
                raise AttnkitValueError(
                    f"waveforms[{i}] has shape {x.shape}: pass mono samples (T,); for stereo average the channels, "
                    "e.g. x.mean(0)."
                )
            if x.size == 0:
                raise AttnkitValueError(f"waveforms[{i}] is empty: there is nothing to transcribe.")
            if not np.isfinite(x).all():
                raise AttnkitValueError(f"waveforms[{i}] holds NaN or Inf samples.")
            seconds = x.size / sample_rate
            if seconds > MAX_SECONDS:
                raise AttnkitValueError(
                    f"waveforms[{i}] lasts {seconds:.0f} s; this model reads digit strings of up to "
                    f"{MAX_SECONDS:.0f} s. "
                    "Cut long recordings into utterances first."
                )
            x = resample(x.astype(np.float32), sample_rate)
            x = np.concatenate([x, np.zeros(max(0, N_FFT - x.size), np.float32)])  # at least one frame
            feats.append(log_mel(torch.from_numpy(x)))
        if not feats:
            raise AttnkitValueError("waveforms is empty: pass at least one utterance.")
        lengths = torch.tensor([f.shape[0] for f in feats])
        return nn.utils.rnn.pad_sequence(feats, batch_first=True), lengths

    def frame_times(self, n: int) -> torch.Tensor:
        """Centre time in seconds of each of ``n`` encoder frames."""
        step = SUBSAMPLE * HOP / SAMPLE_RATE
        return torch.arange(n) * step + step / 2

    # --- the network -------------------------------------------------------------------------

    @staticmethod
    def encoded_lengths(lengths: torch.Tensor) -> torch.Tensor:
        """Encoder frames of each utterance: ``ceil(ceil(T / 2) / 2)`` (two stride-2 convolutions)."""
        return (((lengths + 1) // 2 + 1) // 2).clamp(min=1)

    def ctc_log_probs(self, memory: torch.Tensor) -> torch.Tensor:
        """``(T', B, 11)`` CTC log-probabilities of the encoder states (blank = 0, digit k = k + 1)."""
        return self.ctc_head(memory).log_softmax(-1).transpose(0, 1)

    def ctc_score(self, ids: torch.Tensor, memory: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """``(B,)`` CTC log-likelihood of the decoder token ids ``ids`` (up to the first EOS)."""
        digits = [[i - EOS for i in self._ids_of(row)] for row in ids.tolist()]
        flat = torch.tensor([d for row in digits for d in row], dtype=torch.long)
        target_lengths = torch.tensor([len(row) for row in digits])
        nll = F.ctc_loss(
            self.ctc_log_probs(memory),
            flat,
            self.encoded_lengths(lengths),
            target_lengths,
            reduction="none",
            zero_infinity=False,
        )
        return -nll

    def _ids_of(self, row: Iterable[int]) -> list[int]:
        out = []
        for i in row:
            if i == EOS:
                break
            if i > EOS:
                out.append(i)
        return out

    def ctc_greedy(self, memory: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """``(B, T)`` decoder token ids (ending with EOS) of the CTC best path: argmax per frame,
        repeats merged, blanks dropped."""
        best = self.ctc_log_probs(memory).argmax(-1).T  # (B, T')
        rows = []
        for row, n in zip(best.tolist(), self.encoded_lengths(lengths).tolist()):
            out, last = [], 0
            for k in row[:n]:
                if k != last and k != 0:
                    out.append(k + EOS)
                last = k
            rows.append(out[: self.config.max_target_len - 1] + [EOS])
        width = max(len(r) for r in rows)
        return torch.tensor([r + [PAD] * (width - len(r)) for r in rows], dtype=torch.long)

    def encode(self, feats: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, masks.Mask]:
        """Encoder states ``(B, T', d)`` (T' = ceil(T / 4)) and their padding mask."""
        x = self.frontend(feats.transpose(1, 2)).transpose(1, 2)  # (B, T', d)
        padding = masks.padding(self.encoded_lengths(lengths))
        x = x + _sinusoids(x.shape[1], x.shape[2]).to(x)[None]
        for layer in self.encoder:
            x = layer(x, padding)
        return self.encoder_norm(x), padding

    def decode(self, target_in: torch.Tensor, memory: torch.Tensor, padding: masks.Mask) -> torch.Tensor:
        y = self.embed(target_in) + self.target_pos(torch.arange(target_in.shape[1], device=target_in.device))[None]
        for layer in self.decoder:
            y = layer(y, layer.cross_attn.project_kv(memory), padding)  # type: ignore[union-attr, operator]
        return self.head(self.decoder_norm(y))

    def forward(self, feats: torch.Tensor, lengths: torch.Tensor, target_in: torch.Tensor) -> torch.Tensor:
        memory, padding = self.encode(feats, lengths)
        return self.decode(target_in, memory, padding)

    @torch.no_grad()
    def generate(self, feats: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Greedy decoding with a KV cache per decoder layer: ``(B, T)`` token ids after BOS."""
        return self._greedy(*self.encode(feats, lengths))

    def _greedy(self, memory, padding) -> torch.Tensor:
        return greedy_decode(self, self.embed, memory, padding, bos=BOS, eos=EOS)[0]

    @torch.no_grad()
    def decode_ensemble(
        self, feats: torch.Tensor, lengths: torch.Tensor, warps: Sequence[float] | None = None
    ) -> torch.Tensor:
        """Decoding over several vocal-tract warps of the input: ``(B, T)`` token ids.

        Each warp of the mel axis (:func:`warp_mels`) gives two hypotheses, the attention
        decoder's greedy one and the CTC best path; every hypothesis is then scored on all the
        warped inputs by the joint score ``(1 - w) log p_attention + w log p_CTC`` (``w =
        config.ctc_weight``; teacher forcing for the first), and the best one is kept. A voice
        unlike the training voices is read as the nearby voices the model knows; a digit
        dropped or doubled by the decoder costs it the CTC score, which follows the audio
        frame by frame. ``warps=(1.0,)`` is plain greedy decoding of the attention decoder.
        """
        if warps is not None and (
            isinstance(warps, (str, bytes))
            or not hasattr(warps, "__iter__")
            or not all(isinstance(a, Real) and not isinstance(a, bool) for a in warps)
        ):
            raise AttnkitTypeError(
                f"warps must be a sequence of numbers, e.g. (0.9, 1.0, 1.1), but got {short(warps)}."
            )
        warps = TEST_WARPS if warps is None else tuple(float(a) for a in warps)
        if not warps or not all(0.5 <= a <= 2.0 for a in warps):
            raise AttnkitValueError(
                f"warps must be factors between 0.5 and 2.0, e.g. (0.9, 1.0, 1.1), but got {warps}."
            )
        if len(warps) == 1:
            return self.generate(warp_mels(feats, warps[0]), lengths)
        encoded = [self.encode(warp_mels(feats, a), lengths) for a in warps]
        hyps = [self._greedy(memory, padding) for memory, padding in encoded]
        w = self.config.ctc_weight
        if w > 0:
            hyps += [self.ctc_greedy(memory, lengths) for memory, _ in encoded]
        width = max(h.shape[1] for h in hyps)
        hyps = [F.pad(h, (0, width - h.shape[1]), value=PAD) for h in hyps]

        def joint(h, memory, padding):
            score = self._log_prob(h, memory, padding)
            return score if w == 0 else (1 - w) * score + w * self.ctc_score(h, memory, lengths)

        scores = torch.stack([torch.stack([joint(h, m, p) for m, p in encoded]).sum(0) for h in hyps])
        best = scores.argmax(0)  # (B,): ties go to the first warp listed
        return torch.stack(hyps)[best, torch.arange(feats.shape[0])]

    def _log_prob(self, ids, memory, padding) -> torch.Tensor:
        """``(B,)`` log p(ids up to and with the first EOS | memory), by teacher forcing."""
        ids = ids.clone()
        ended = (ids == EOS).cumsum(1) > 0
        after = ended & ~(ended.cumsum(1) == 1)  # past the first EOS
        ids[after] = PAD
        target_in = torch.cat([torch.full_like(ids[:, :1], BOS), ids[:, :-1]], 1)
        logp = self.decode(target_in, memory, padding).log_softmax(-1).gather(-1, ids[..., None])[..., 0]
        return logp.masked_fill(ids == PAD, 0.0).sum(1)

    def text_of(self, ids: Iterable[int]) -> str:
        return "".join(self.vocab[i] for i in self._ids_of(ids))

    def transcribe(
        self,
        waveforms: Sequence[np.ndarray | torch.Tensor],
        sample_rate: int,
        batch_size: int = 32,
        *,
        warps: Sequence[float] | None = None,
    ) -> list[str]:
        """The digit string spoken in each waveform (mono float arrays/tensors in [-1, 1], any rate).

        ``warps``: the vocal-tract warps decoded and voted over (:meth:`decode_ensemble`;
        default :data:`TEST_WARPS`; ``(1.0,)`` for plain greedy decoding, 3x faster)."""
        batch_size = check_positive_int(batch_size, "batch_size")
        feats, lengths = self.features(waveforms, sample_rate)
        self.eval()
        texts = []
        for start in range(0, feats.shape[0], batch_size):
            f, n = feats[start : start + batch_size], lengths[start : start + batch_size]
            f = f[:, : int(n.max())]
            texts += [self.text_of(row) for row in self.decode_ensemble(f, n, warps).tolist()]
        return texts

    @torch.no_grad()
    def transcribe_with_attention(
        self, waveform: np.ndarray | torch.Tensor, sample_rate: int, *, warps: Sequence[float] | None = None
    ) -> dict:
        """The text and the cross-attention that produced it.

        Returns ``{"text", "chars": [... , "</s>"], "attention": (layers, heads, chars, frames),
        "frame_times": (frames,) seconds, "features": (T, 64) log-mel}``.
        """
        import attnkit

        feats, lengths = self.features([waveform], sample_rate)
        self.eval()
        ids = self.decode_ensemble(feats, lengths, warps)[0].tolist()
        if EOS in ids:
            ids = ids[: ids.index(EOS) + 1]
        target_in = torch.tensor([[BOS] + ids[:-1]])
        with attnkit.capture(self) as cap:
            self(feats, lengths, target_in)
        cross = torch.stack([w[0] for w, name in zip(cap.weights, cap.names) if name.endswith("cross_attn")])
        return {
            "text": self.text_of(ids),
            "chars": [self.vocab[i] for i in ids],
            "attention": cross,
            "frame_times": self.frame_times(cross.shape[-1]),
            "features": feats[0],
        }


def examples() -> list[tuple[str, str]]:
    """The shipped example WAVs: ``(path, digits)`` (the digits are in the file name)."""
    folder = resources.files("attnkit.models") / "audio"
    out = []
    for entry in sorted(folder.iterdir(), key=lambda p: p.name):
        if entry.name.endswith(".wav"):
            out.append((str(entry), entry.name.split("_")[0]))
    return out


# --- training and evaluation ---------------------------------------------------------------------


def _batch(model, items, rng, augmenting: bool):
    waves = [augment(w, rng) if augmenting else w for w, _ in items]
    feats, lengths = model.features(waves, SAMPLE_RATE)
    if augmenting:
        feats = augment_features(feats, lengths, rng)
    targets = [[BOS] + [model.vocab.index(ch) for ch in text] + [EOS] for _, text in items]
    width = max(len(t) for t in targets)
    ids = torch.full((len(items), width), PAD, dtype=torch.long)
    for row, t in enumerate(targets):
        ids[row, : len(t)] = torch.tensor(t)
    return feats, lengths, ids[:, :-1], ids[:, 1:]


def evaluate(
    model: SpeechRecognizer, items: Sequence[tuple[np.ndarray, str]], warps: Sequence[float] | None = None
) -> dict:
    """Exact-string accuracy, character error rate and monotonic alignments on ``items``
    (decoded over ``warps``, see :meth:`SpeechRecognizer.decode_ensemble`)."""
    texts = model.transcribe([w for w, _ in items], SAMPLE_RATE, warps=warps)
    exact = sum(t == ref for t, (_, ref) in zip(texts, items)) / len(items)
    errors = sum(_edit_distance(t, ref) for t, (_, ref) in zip(texts, items))
    cer = errors / max(1, sum(len(ref) for _, ref in items))
    monotonic = sum(alignment_is_monotonic(model, w, warps) for w, _ in items) / len(items)
    return {"exact": exact, "cer": cer, "monotonic": monotonic, "n": len(items)}


def alignment_is_monotonic(model: SpeechRecognizer, samples: np.ndarray, warps: Sequence[float] | None = None) -> bool:
    """Whether the attention peak's time never goes back over the output digits (last layer, mean of heads)."""
    found = model.transcribe_with_attention(samples, SAMPLE_RATE, warps=warps)
    weights = found["attention"][-1].mean(0)[: len(found["text"])]  # (digits, frames)
    peaks = weights.argmax(-1)
    return bool((peaks[1:] >= peaks[:-1]).all())


def _edit_distance(a: str, b: str) -> int:
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


def train(
    steps: int = 9200,
    *,
    seed: int = 0,
    batch_size: int = 32,
    lr: float = 1e-3,
    train_size: int = 10000,
    valid_size: int = 300,
    config: Config = Config(),
    progress: bool | None = True,
    log: Callable[[str], object] = print,
) -> tuple[SpeechRecognizer, dict]:
    """Synthesise ``train_size`` utterances of :data:`TRAIN_VOICES` and train (seeded); keep the
    weights with the best exact accuracy on ``valid_size`` more utterances of the training voices."""
    from tqdm.auto import tqdm

    start = time.perf_counter()
    torch.manual_seed(seed)
    rng = random.Random(seed)
    items = dataset(train_size, TRAIN_VOICES, seed, progress=progress)
    valid = dataset(valid_size, TRAIN_VOICES, seed + 1)
    model = SpeechRecognizer(config)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    warmup = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / steps)))
    )
    best, best_state, history, running = -1.0, None, [], None
    bar = tqdm(range(steps), desc="training", unit="step", disable=not progress)
    for step in bar:
        model.train()
        feats, lengths, target_in, target = _batch(model, rng.sample(items, batch_size), rng, augmenting=True)
        memory, padding = model.encode(feats, lengths)
        logits = model.decode(target_in, memory, padding)
        loss = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=PAD, label_smoothing=0.05
        )
        if config.ctc_weight > 0:  # joint CTC + attention: the encoder learns a monotonic alignment
            digits = target[(target > EOS)] - EOS  # flat digit labels 1..10
            ctc = F.ctc_loss(
                model.ctc_log_probs(memory),
                digits,
                model.encoded_lengths(lengths),
                (target > EOS).sum(1),
                zero_infinity=True,
            )
            loss = (1 - config.ctc_weight) * loss + config.ctc_weight * ctc
        opt.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        running = loss.item() if running is None else 0.98 * running + 0.02 * loss.item()
        bar.set_postfix(loss=f"{running:.3f}")
        if (step + 1) % max(1, steps // 8) == 0 or step == steps - 1:
            model.eval()
            texts = model.transcribe([w for w, _ in valid], SAMPLE_RATE, warps=(1.0,))
            acc = sum(t == ref for t, (_, ref) in zip(texts, valid)) / len(valid)
            history.append({"step": step + 1, "loss": running, "valid_exact": acc})
            if log is not None:
                log(f"step {step + 1}: loss {running:.3f}, exact on training voices (held-back texts) {acc:.1%}")
            if acc >= best:
                best, best_state = acc, {k: v.detach().clone() for k, v in model.state_dict().items()}
    if best_state is not None:
        model.load_state_dict(best_state)
    model.eval()
    record = {
        "steps": steps,
        "seed": seed,
        "batch_size": batch_size,
        "lr": lr,
        "train_size": train_size,
        "best_valid_exact": best,
        "seconds": round(time.perf_counter() - start, 1),
        "history": history,
    }
    return model, record
