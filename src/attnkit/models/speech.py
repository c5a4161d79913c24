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

import math
import random
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from importlib import resources
from numbers import Real

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from attnkit import masks
from attnkit._validate import AttnkitTypeError, AttnkitValueError, check_positive_int, short
from attnkit.models._weights import ShippedWeights
from attnkit.models.speech_audio import (  # the audio: re-exported where it has always been
    BOS,
    CHARS,
    EOS,
    HOP,
    MAX_SECONDS,
    N_FFT,
    N_MELS,
    OTHER_LANGUAGES,
    PAD,
    SAMPLE_RATE,
    SUBSAMPLE,
    TEST_ACCENTS,
    TEST_VARIANTS,
    TEST_VOICES,
    TEST_WARPS,
    TRAIN_ACCENTS,
    TRAIN_VARIANTS,
    TRAIN_VOICES,
    WEIGHTS,
    augment,
    augment_features,
    dataset,
    log_mel,
    read_wav,
    resample,
    say,
    utterance,
    warp_mels,
    write_wav,
)
from attnkit.models.training import Trainer, loop, warmup_times_cosine
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
    "write_wav",
    "resample",
    "log_mel",
    "utterance",
    "train",
    "evaluate",
    "examples",
    "WEIGHTS",
]


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
    start = time.perf_counter()
    torch.manual_seed(seed)
    rng = random.Random(seed)
    items = dataset(train_size, TRAIN_VOICES, seed, progress=progress)
    valid = dataset(valid_size, TRAIN_VOICES, seed + 1)
    model = SpeechRecognizer(config)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    trainer = Trainer(
        model, opt, torch.optim.lr_scheduler.LambdaLR(opt, warmup_times_cosine(steps, max(1, steps // 20)))
    )

    def work(step: int) -> dict:
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
        trainer.step(loss)
        return {"loss": f"{trainer.running:.3f}"}

    def check(step: int) -> dict:
        texts = model.transcribe([w for w, _ in valid], SAMPLE_RATE, warps=(1.0,))
        acc = sum(t == ref for t, (_, ref) in zip(texts, valid)) / len(valid)
        return {"step": step + 1, "loss": trainer.running, "valid_exact": acc}

    def describe(step: int, m: dict) -> str:
        exact = m["valid_exact"]
        return f"step {step + 1}: loss {m['loss']:.3f}, exact on training voices (held-back texts) {exact:.1%}"

    result = loop(
        trainer, steps, work, progress=progress, every=max(1, steps // 8), evaluate=check, best="valid_exact",
        ties=True, log=log, describe=describe,
    )  # fmt: skip
    record = {
        "steps": steps,
        "seed": seed,
        "batch_size": batch_size,
        "lr": lr,
        "train_size": train_size,
        "best_valid_exact": result.best if result.best is not None else -1.0,
        "seconds": round(time.perf_counter() - start, 1),
        "history": result.history,
    }
    return model, record
