"""DigitCaptioner: image captioning with attention over image regions, on real handwritten digits.

The tutorial's second use of attention: a decoder writes one word per digit of a
strip of handwritten digits (``seven three one``) while its cross-attention looks at
the image regions (patches) of the digit it names.

Data: scikit-learn's ``load_digits()``, 1,797 real 8 x 8 digits (values 0-16). A
sample is a strip of digits side by side, an ``8 x 8n`` image. Digits whose index is
a multiple of 5 form the test split; training never sees them.

>>> model = DigitCaptioner.from_package()
>>> model.caption([strip_of([0, 5, 10])])   # three test-split digits
['zero five zero']
"""

from __future__ import annotations

import functools
import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from attnkit import masks
from attnkit._types import ArrayLike
from attnkit._validate import AttnkitTypeError, AttnkitValueError, check_positive_int
from attnkit.models._weights import ShippedWeights
from attnkit.models.training import Trainer, loop, warmup_cosine
from attnkit.models.translator import DecoderLayer, EncoderLayer
from attnkit.nn import KVCache

WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
PAD, BOS, EOS = 0, 1, 2
VOCAB = ["<pad>", "<s>", "</s>", *WORDS]
WEIGHTS = "digit_captioner.safetensors"
MAX_DIGITS = 8
PATCH = 4  # 4 x 4 pixel patches: a digit is 2 x 2 patches


@dataclass(frozen=True)
class Config:
    d_model: int = 96
    num_heads: int = 4
    encoder_layers: int = 2
    decoder_layers: int = 2
    d_ff: int = 192
    max_words: int = MAX_DIGITS + 2  # the words, </s>, and room to spare


# --- the data ---------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def digits() -> tuple[torch.Tensor, torch.Tensor]:
    """All of scikit-learn's digits: ``images (1797, 8, 8)`` float32 in [0, 16] and ``labels (1797,)``."""
    from sklearn.datasets import load_digits

    data = load_digits()
    return torch.tensor(data.images, dtype=torch.float32), torch.tensor(data.target, dtype=torch.long)


def split(name: str) -> torch.Tensor:
    """Indices of the ``"train"`` or ``"test"`` split: the test split is every index divisible by 5."""
    if name not in ("train", "test"):
        raise AttnkitValueError(f"split must be 'train' or 'test', but got {name!r}.")
    index = torch.arange(len(digits()[1]))
    return index[index % 5 == 0] if name == "test" else index[index % 5 != 0]


def strip_of(indices: Sequence[int]) -> torch.Tensor:
    """The ``(8, 8n)`` image of the digits at ``indices`` side by side (like ``np.hstack``)."""
    images, _ = digits()
    return torch.cat([images[i] for i in indices], dim=1)


def caption_of(indices: Sequence[int]) -> str:
    """The true caption of the digits at ``indices``: one English word per digit."""
    _, labels = digits()
    return " ".join(WORDS[int(labels[i])] for i in indices)


@functools.lru_cache(maxsize=2)
def _pool(split_name: str) -> tuple[int, ...]:
    return tuple(split(split_name).tolist())


def sample(
    rng: random.Random, split_name: str, lengths: tuple[int, int] = (1, MAX_DIGITS)
) -> tuple[list[int], torch.Tensor, str]:
    """A random strip from one split: ``(digit indices, image, caption)``."""
    pool = _pool(split_name)
    n = rng.randint(*lengths)
    chosen = [rng.choice(pool) for _ in range(n)]
    return chosen, strip_of(chosen), caption_of(chosen)


def augment(image: torch.Tensor, rng: random.Random) -> torch.Tensor:
    """Shift each digit by up to one pixel, scale its ink, add a little noise (training only)."""
    out = torch.zeros_like(image)
    for start in range(0, image.shape[1], 8):
        digit = image[:, start : start + 8]
        dy, dx = rng.randint(-1, 1), rng.randint(-1, 1)
        shifted = torch.roll(digit, shifts=(dy, dx), dims=(0, 1))
        if dy:
            shifted[(0 if dy > 0 else -1), :] = 0
        if dx:
            shifted[:, (0 if dx > 0 else -1)] = 0
        out[:, start : start + 8] = shifted * rng.uniform(0.75, 1.25)
    noise = torch.randn(out.shape, generator=torch.Generator().manual_seed(rng.randrange(2**31))) * 0.5
    return (out + noise).clamp(0, 16)


# --- the model ---------------------------------------------------------------------------------


def check_image(image: ArrayLike, index: int = 0) -> torch.Tensor:
    """A float32 ``(8, 8n)`` tensor from an array or tensor, with clear errors."""
    import numpy as np

    where = f"images[{index}]"
    if isinstance(image, np.ndarray):
        image = torch.from_numpy(np.asarray(image, dtype=np.float32))
    if not isinstance(image, torch.Tensor):
        raise AttnkitTypeError(f"{where} must be a 2-D numpy array or tensor, but got {type(image).__name__}.")
    if image.device.type == "meta" or not (
        image.is_floating_point() or image.dtype in (torch.uint8, torch.int16, torch.int32, torch.int64)
    ):
        what = "a meta tensor (it holds no values)" if image.device.type == "meta" else f"dtype {image.dtype}"
        raise AttnkitTypeError(f"{where} must hold pixel values as a real-valued tensor, but got {what}.")
    if image.dim() != 2 or image.shape[0] != 8 or image.shape[1] == 0 or image.shape[1] % 8:
        raise AttnkitValueError(
            f"{where} must have shape (8, 8n): n digits of 8 x 8 side by side, as np.hstack of "
            f"load_digits().images gives, but got {tuple(image.shape)}."
        )
    n = image.shape[1] // 8
    if n > MAX_DIGITS:
        raise AttnkitValueError(f"{where} holds {n} digits; the model reads at most {MAX_DIGITS}.")
    image = image.detach().to("cpu", torch.float32)
    if not torch.isfinite(image).all() or image.min() < 0 or image.max() > 16:
        raise AttnkitValueError(
            f"{where} must hold values in [0, 16] (load_digits' scale), but got values in "
            f"[{image.min().item():g}, {image.max().item():g}]."
        )
    return image


def patchify(images: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(B, P, 16)`` patches, ``(B, P)`` patch columns, and ``(B,)`` patch counts.

    Patches are 4 x 4 pixels, ordered column by column (top then bottom), so the
    patches of a narrower image are a prefix and padding goes at the end.
    """
    counts = torch.tensor([2 * (img.shape[1] // PATCH) for img in images])
    width = int(counts.max())
    patches = torch.zeros(len(images), width, PATCH * PATCH)
    for row, img in enumerate(images):
        cols = img.shape[1] // PATCH
        grid = img.reshape(2, PATCH, cols, PATCH).permute(2, 0, 1, 3)  # (cols, 2 rows, 4, 4)
        patches[row, : 2 * cols] = grid.reshape(2 * cols, PATCH * PATCH) / 16.0
    column = torch.arange(width) // 2
    return patches, column.expand(len(images), -1), counts


class DigitCaptioner(ShippedWeights, nn.Module):
    """Patches of a strip of digits in, one word per digit out."""

    WEIGHTS = WEIGHTS
    config_class = Config

    def __init__(self, config: Config = Config()):
        super().__init__()
        c = self.config = config
        self.patch_embed = nn.Linear(PATCH * PATCH, c.d_model)
        self.row_embed = nn.Embedding(2, c.d_model)  # 2-D positions: the patch's row ...
        self.col_embed = nn.Embedding(2 * MAX_DIGITS, c.d_model)  # ... and column
        self.word_embed = nn.Embedding(len(VOCAB), c.d_model)
        self.word_pos = nn.Embedding(c.max_words, c.d_model)
        self.encoder = nn.ModuleList(EncoderLayer(c) for _ in range(c.encoder_layers))
        self.encoder_norm = nn.LayerNorm(c.d_model)
        self.decoder = nn.ModuleList(DecoderLayer(c) for _ in range(c.decoder_layers))
        self.decoder_norm = nn.LayerNorm(c.d_model)
        self.head = nn.Linear(c.d_model, len(VOCAB))

    # --- the network ------------------------------------------------------------------------

    def encode(self, images: list[torch.Tensor]) -> tuple[torch.Tensor, masks.Mask]:
        """Patch states ``(B, P, d)`` and the padding mask of the patches."""
        patches, column, counts = patchify(images)
        rows = torch.arange(patches.shape[1]) % 2
        x = self.patch_embed(patches) + self.row_embed(rows)[None] + self.col_embed(column)
        padding = masks.padding(counts)
        for layer in self.encoder:
            x = layer(x, padding)
        return self.encoder_norm(x), padding

    def decode(self, words_in: torch.Tensor, memory: torch.Tensor, padding: masks.Mask) -> torch.Tensor:
        """Teacher-forced logits ``(B, T, vocab)``."""
        y = self.word_embed(words_in) + self.word_pos(torch.arange(words_in.shape[1]))[None]
        for layer in self.decoder:
            y = layer(y, layer.cross_attn.project_kv(memory), padding)  # type: ignore[union-attr, operator]
        return self.head(self.decoder_norm(y))

    def forward(self, images: list[torch.Tensor], words_in: torch.Tensor) -> torch.Tensor:
        memory, padding = self.encode(images)
        return self.decode(words_in, memory, padding)

    @torch.no_grad()
    def generate(self, images: list[torch.Tensor]) -> torch.Tensor:
        """Greedy decoding with a KV cache per decoder layer: ``(B, T)`` word ids after ``<s>``."""
        memory, padding = self.encode(images)
        b, c = memory.shape[0], self.config
        memory_kv = [layer.cross_attn.project_kv(memory) for layer in self.decoder]  # type: ignore[union-attr, operator]
        caches = KVCache.for_layers(
            len(self.decoder), b, c.num_heads, c.max_words, c.d_model // c.num_heads, dtype=memory.dtype
        )
        token = torch.full((b, 1), BOS, dtype=torch.long)
        out, done = [], torch.zeros(b, dtype=torch.bool)
        for step in range(c.max_words - 1):
            y = self.word_embed(token) + self.word_pos.weight[step]
            for layer, cache, kv in zip(self.decoder, caches, memory_kv):
                y = layer(y, kv, padding, cache=cache)
            token = self.head(self.decoder_norm(y)).argmax(-1)
            out.append(token)
            done |= token[:, 0] == EOS
            if done.all():
                break
        return torch.cat(out, dim=1)

    @staticmethod
    def words_of(ids: Sequence[int]) -> list[str]:
        words = []
        for i in ids:
            if i == EOS:
                break
            if i >= 3:
                words.append(VOCAB[i])
        return words

    def caption(self, images: Sequence[ArrayLike], batch_size: int = 256) -> list[str]:
        """One caption per image: ``images`` is a list of ``(8, 8n)`` arrays or tensors in [0, 16], n <= 8."""
        if isinstance(images, torch.Tensor) and images.dim() == 2 or not isinstance(images, (list, tuple)):
            raise AttnkitTypeError("caption takes a list of images; wrap a single image in a list.")
        batch_size = check_positive_int(batch_size, "batch_size")
        checked = [check_image(img, i) for i, img in enumerate(images)]
        captions = []
        for start in range(0, len(checked), batch_size):
            ids = self.generate(checked[start : start + batch_size])
            captions += [" ".join(self.words_of(row)) for row in ids.tolist()]
        return captions

    @torch.no_grad()
    def caption_with_attention(self, image: ArrayLike) -> dict:
        """The words and the cross-attention that wrote them.

        Returns ``{"words": [...], "weights": (layers, heads, words, patches), "grid": (2, cols),
        "patch_columns": (patches,)}``: word i is predicted by decoder query i; patch p covers
        rows ``4 * (p % 2)`` to ``+4`` and columns ``4 * (p // 2)`` to ``+4`` of the image.
        """
        import attnkit

        image = check_image(image)
        ids = self.generate([image])[0].tolist()
        words = self.words_of(ids)
        words_in = torch.tensor([[BOS] + [VOCAB.index(w) for w in words]])
        with attnkit.capture(self) as cap:
            self([image], words_in)
        cross = torch.stack([w[0] for w, name in zip(cap.weights, cap.names) if name.endswith("cross_attn")])
        cols = image.shape[1] // PATCH
        return {
            "words": words,
            "weights": cross[:, :, : len(words)],  # the query that wrote </s> is left out
            "grid": (2, cols),
            "patch_columns": (torch.arange(2 * cols) // 2) * PATCH,
            "image": image,
        }


# --- training ---------------------------------------------------------------------------------


def batch(
    rng: random.Random, size: int, *, augmented: bool = True
) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """``size`` training strips: images, decoder inputs (BOS first) and targets (EOS last, padded)."""
    images, targets = [], []
    for _ in range(size):
        _, image, caption = sample(rng, "train")
        images.append(augment(image, rng) if augmented else image)
        targets.append([VOCAB.index(w) for w in caption.split()] + [EOS])
    width = max(len(t) for t in targets)
    target = torch.tensor([t + [PAD] * (width - len(t)) for t in targets])
    words_in = torch.cat([torch.full((size, 1), BOS), target[:, :-1]], dim=1)
    return images, words_in, target


def evaluate(
    model: DigitCaptioner, n: int = 1000, seed: int = 0, lengths: tuple[int, int] = (2, 6), aligned_strips: int = 200
) -> dict:
    """Exact captions, word accuracy and alignment on ``n`` test-split strips of 2-6 digits.

    Alignment: the share of correctly named digits whose largest cross-attention weight
    (last layer, mean of heads) falls on a patch inside that digit's 8 columns.
    """
    rng = random.Random(seed)
    strips = [sample(rng, "test", lengths) for _ in range(n)]
    captions = model.caption([image for _, image, _ in strips])
    exact = sum(c == truth for c, (_, _, truth) in zip(captions, strips))
    words_right = words_total = aligned = aligned_total = 0
    for index, (_chosen, image, truth) in enumerate(strips):
        got, want = captions[index].split(), truth.split()
        words_total += len(want)
        words_right += sum(g == w for g, w in zip(got, want))
        if index < aligned_strips:  # alignment needs one more forward per strip
            result = model.caption_with_attention(image)
            attention = result["weights"][-1].mean(0)  # (words, patches)
            for i, (g, w) in enumerate(zip(result["words"], want)):
                if g != w:
                    continue
                column = int(result["patch_columns"][int(attention[i].argmax())])
                aligned += 8 * i <= column < 8 * (i + 1)
                aligned_total += 1
    return {
        "exact": exact / n,
        "word_accuracy": words_right / words_total,
        "alignment": aligned / max(1, aligned_total),
        "strips": n,
    }


def train(
    steps: int = 3000,
    *,
    seed: int = 0,
    batch_size: int = 96,
    lr: float = 2e-3,
    config: Config = Config(),
    progress: bool | None = True,
) -> tuple[DigitCaptioner, dict]:
    """Train a DigitCaptioner on augmented train-split strips; reproducible from ``seed``."""
    torch.manual_seed(seed)
    rng = random.Random(seed)
    model = DigitCaptioner(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(steps, max(1, steps // 20)))
    trainer = Trainer(model, optimizer, scheduler, clip=1.0)
    losses: list[float] = []

    def work(step: int) -> dict:
        images, words_in, target = batch(rng, batch_size)
        logits = model(images, words_in)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=PAD)
        losses.append(trainer.step(loss))
        return {"loss": losses[-1]}

    result = loop(trainer, steps, work, progress=progress)
    record = {
        "steps": steps,
        "seed": seed,
        "batch_size": batch_size,
        "lr": lr,
        "first_loss": losses[0] if losses else None,
        "final_loss": sum(losses[-20:]) / max(1, len(losses[-20:])),
        "seconds": result.seconds,
        "torch": torch.__version__,
    }
    record.update({f"test_{k}": v for k, v in evaluate(model, 500, seed=seed + 1).items()})
    return model, record
