"""``DateTranslator``: a small encoder-decoder Transformer that writes dates as ISO ``YYYY-MM-DD``.

All three kinds of attention of the tutorial, in one model built from attnkit parts:

- the encoder's **bidirectional self-attention**: every input character sees every
  other real character (a padding mask hides the padding);
- the decoder's **causal self-attention**: each output character sees the ones
  before it (``masks.causal()``, with a :class:`~attnkit.nn.KVCache` when decoding);
- the decoder's **cross-attention**: each output character looks at the input
  characters; its weights are the alignment between input and output.

>>> model = DateTranslator.from_package()
>>> model.translate(["25th of March 2019", "2019年3月25日"])
['2019-03-25', '2019-03-25']
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from attnkit import masks
from attnkit._validate import AttnkitTypeError, AttnkitValueError, check_positive_int, short
from attnkit.models import dates
from attnkit.models._weights import ShippedWeights
from attnkit.models.training import Trainer, loop, warmup_cosine
from attnkit.nn import KVCache, MultiHeadAttention

PAD, UNK, BOS, EOS = 0, 1, 2, 3
SPECIALS = ["<pad>", "<unk>", "<s>", "</s>"]
SOURCE_CHARS = [chr(c) for c in range(32, 127)] + ["年", "月", "日"]
TARGET_CHARS = list("0123456789-")
WEIGHTS = "date_translator.safetensors"


class LayerConfig(Protocol):
    """What an encoder or decoder layer reads from a model's config."""

    @property
    def d_model(self) -> int: ...

    @property
    def num_heads(self) -> int: ...

    @property
    def d_ff(self) -> int: ...


@dataclass(frozen=True)
class Config:
    d_model: int = 128
    num_heads: int = 4
    encoder_layers: int = 2
    decoder_layers: int = 2
    d_ff: int = 256
    max_source_len: int = 48
    max_target_len: int = 12  # 10 characters, </s>, and room to spare


class FeedForward(nn.Sequential):
    def __init__(self, d_model: int, d_ff: int):
        super().__init__(nn.Linear(d_model, d_ff), nn.GELU(), nn.Linear(d_ff, d_model))


class EncoderLayer(nn.Module):
    """Pre-norm: bidirectional self-attention over the real characters, then a feed-forward."""

    def __init__(self, c: LayerConfig):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(c.d_model), nn.LayerNorm(c.d_model)
        self.self_attn = MultiHeadAttention(c.d_model, c.num_heads)
        self.ff = FeedForward(c.d_model, c.d_ff)

    def forward(self, x: torch.Tensor, padding: masks.Mask) -> torch.Tensor:
        x = x + self.self_attn(self.norm1(x), mask=padding)[0]
        return x + self.ff(self.norm2(x))


class DecoderLayer(nn.Module):
    """Pre-norm: causal self-attention, cross-attention to the encoder, a feed-forward."""

    def __init__(self, c: LayerConfig):
        super().__init__()
        self.norm1, self.norm2, self.norm3 = (nn.LayerNorm(c.d_model) for _ in range(3))
        self.self_attn = MultiHeadAttention(c.d_model, c.num_heads)
        self.cross_attn = MultiHeadAttention(c.d_model, c.num_heads)
        self.ff = FeedForward(c.d_model, c.d_ff)

    def forward(
        self,
        y: torch.Tensor,
        memory_kv: tuple[torch.Tensor, torch.Tensor],
        source_padding: masks.Mask,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        """``y: (B, T, d)``; ``memory_kv`` from ``cross_attn.project_kv(memory)``."""
        y = y + self.self_attn(self.norm1(y), mask=masks.causal(), cache=cache)[0]
        y = y + self.cross_attn(self.norm2(y), mask=source_padding, kv=memory_kv)[0]
        return y + self.ff(self.norm3(y))


@torch.no_grad()
def greedy_decode(
    model: Any, embed: nn.Embedding, memory: torch.Tensor, padding: masks.Mask, *, bos: int, eos: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy decoding with a KV cache per :class:`DecoderLayer` of ``model.decoder``.

    ``model`` holds ``decoder``, ``target_pos``, ``decoder_norm``, ``head`` and a ``config``
    with ``num_heads``, ``d_model`` and ``max_target_len``; ``embed`` embeds its target
    tokens. Returns ``(tokens (B, T) after BOS, log_prob (B,))``: each sequence's summed
    log-probability of its chosen tokens up to and including ``eos``.
    """
    b = memory.shape[0]
    memory_kv = [layer.cross_attn.project_kv(memory) for layer in model.decoder]  # once per source
    c = model.config
    caches = KVCache.for_layers(
        len(model.decoder),
        b,
        c.num_heads,
        c.max_target_len,
        c.d_model // c.num_heads,
        device=memory.device,
        dtype=memory.dtype,
    )
    token = torch.full((b, 1), bos, dtype=torch.long, device=memory.device)
    out = []
    done = torch.zeros(b, dtype=torch.bool, device=memory.device)
    log_prob = torch.zeros(b, device=memory.device)
    for step in range(c.max_target_len - 1):
        y = embed(token) + model.target_pos.weight[step]
        for layer, cache, kv in zip(model.decoder, caches, memory_kv):
            y = layer(y, kv, padding, cache=cache)
        logits = model.head(model.decoder_norm(y))[:, 0]  # (B, vocab)
        token = logits.argmax(-1, keepdim=True)  # (B, 1)
        chosen = torch.log_softmax(logits.float(), -1).gather(1, token)[:, 0]
        log_prob += torch.where(done, 0.0, chosen)  # sequences already ended add nothing
        out.append(token)
        done |= token[:, 0] == eos
        if done.all():
            break
    return torch.cat(out, dim=1), log_prob


@dataclass(frozen=True)
class DateAnswer:
    """One text's answer: ``iso`` (None when refused), ``confidence`` in [0, 1], ``reason``."""

    text: str
    iso: str | None
    confidence: float
    reason: str


class DateTranslator(ShippedWeights, nn.Module):
    """Characters of a date in, ``YYYY-MM-DD`` out."""

    WEIGHTS = WEIGHTS
    config_class = Config

    def __init__(self, config: Config = Config()):
        super().__init__()
        c = self.config = config
        self.source_vocab = {ch: i for i, ch in enumerate(SPECIALS + SOURCE_CHARS)}
        self.target_vocab = SPECIALS + TARGET_CHARS
        self.source_embed = nn.Embedding(len(self.source_vocab), c.d_model)
        self.source_pos = nn.Embedding(c.max_source_len, c.d_model)
        self.target_embed = nn.Embedding(len(self.target_vocab), c.d_model)
        self.target_pos = nn.Embedding(c.max_target_len, c.d_model)
        self.encoder = nn.ModuleList(EncoderLayer(c) for _ in range(c.encoder_layers))
        self.encoder_norm = nn.LayerNorm(c.d_model)
        self.decoder = nn.ModuleList(DecoderLayer(c) for _ in range(c.decoder_layers))
        self.decoder_norm = nn.LayerNorm(c.d_model)
        self.head = nn.Linear(c.d_model, len(self.target_vocab))

    # --- characters ------------------------------------------------------------------------

    def source_tokens(self, text: str) -> list[str]:
        return list(text)

    def encode_source(self, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """``ids: (B, L)`` padded with PAD and ``lengths: (B,)``."""
        if isinstance(texts, str) or not all(isinstance(t, str) for t in texts):
            raise AttnkitTypeError("texts must be a list of str.")
        limit = self.config.max_source_len
        too_long = [t for t in texts if len(t) > limit]
        if too_long:
            raise AttnkitValueError(
                f"inputs hold at most {limit} characters, but got {len(too_long[0])}: {too_long[0]!r}."
            )
        lengths = torch.tensor([len(t) for t in texts], dtype=torch.long)
        width = max((len(t) for t in texts), default=0)
        ids = torch.full((len(texts), max(1, width)), PAD, dtype=torch.long)
        for row, text in enumerate(texts):
            ids[row, : len(text)] = torch.tensor([self.source_vocab.get(ch, UNK) for ch in text], dtype=torch.long)
        return ids, lengths

    def encode_target(self, isos: list[str]) -> torch.Tensor:
        """``(B, 11)``: the characters of each ISO date and EOS."""
        index = {ch: i for i, ch in enumerate(self.target_vocab)}
        return torch.tensor([[index[ch] for ch in iso] + [EOS] for iso in isos], dtype=torch.long)

    def decode_target(self, ids: Iterable[int]) -> str:
        """The text of target token ids, up to EOS."""
        chars = []
        for i in ids:
            if i == EOS:
                break
            if i >= len(SPECIALS):
                chars.append(self.target_vocab[i])
        return "".join(chars)

    # --- the network -----------------------------------------------------------------------

    def encode(self, source: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, masks.Mask]:
        """Encoder states ``(B, Ls, d)`` and the source padding mask."""
        padding = masks.padding(lengths)
        x = self.source_embed(source) + self.source_pos(torch.arange(source.shape[1], device=source.device))[None]
        for layer in self.encoder:
            x = layer(x, padding)
        return self.encoder_norm(x), padding

    def decode(self, target_in: torch.Tensor, memory: torch.Tensor, padding: masks.Mask) -> torch.Tensor:
        """Teacher-forced logits ``(B, T, vocab)`` for decoder inputs ``target_in: (B, T)``."""
        y = (
            self.target_embed(target_in)
            + self.target_pos(torch.arange(target_in.shape[1], device=target_in.device))[None]
        )
        for layer in self.decoder:
            y = layer(y, layer.cross_attn.project_kv(memory), padding)  # type: ignore[union-attr, operator]
        return self.head(self.decoder_norm(y))

    def forward(self, source: torch.Tensor, lengths: torch.Tensor, target_in: torch.Tensor) -> torch.Tensor:
        memory, padding = self.encode(source, lengths)
        return self.decode(target_in, memory, padding)

    @torch.no_grad()
    def generate(
        self, source: torch.Tensor, lengths: torch.Tensor, *, return_log_prob: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Greedy decoding with a KV cache per decoder layer; ``(B, T)`` token ids after BOS.

        With ``return_log_prob``, also each sequence's log-probability ``(B,)`` (the sum of
        its chosen tokens' log-probabilities up to and including EOS).
        """
        tokens, log_prob = greedy_decode(self, self.target_embed, *self.encode(source, lengths), bos=BOS, eos=EOS)
        return (tokens, log_prob) if return_log_prob else tokens

    def answers(self, texts: list[str], batch_size: int = 256) -> list[DateAnswer]:
        """For each text, the model's ISO answer when it can be trusted, its confidence and why not.

        Each text is normalised (whitespace collapsed, lower case) and read by
        :func:`attnkit.models.dates.read`: a text that is not a date in a supported
        format, names a day that does not exist, a year outside 1900-2099, or a wrong
        weekday gets ``iso=None`` and the reason, without running the model. The
        others are decoded greedily in batches; ``confidence`` is the probability of
        the decoded sequence, and an answer that is not the date the text names (a
        model mistake) is also refused (``iso=None``).
        """
        if isinstance(texts, str) or not all(isinstance(t, str) for t in texts):
            raise AttnkitTypeError("texts must be a list of str; wrap a single text in a list.")
        batch_size = check_positive_int(batch_size, "batch_size")
        readings = [dates.read(t) for t in texts]
        runnable = [i for i, (date, _) in enumerate(readings) if date is not None]
        decoded: dict[int, tuple[str, float]] = {}
        for start in range(0, len(runnable), batch_size):
            chunk = runnable[start : start + batch_size]
            source, lengths = self.encode_source([dates.normalize(texts[i]) for i in chunk])
            ids, log_prob = self.generate(source, lengths, return_log_prob=True)
            for i, row, lp in zip(chunk, ids.tolist(), log_prob.exp().tolist()):
                decoded[i] = (self.decode_target(row), lp)
        results = []
        for i, (text, (date, why)) in enumerate(zip(texts, readings)):
            if date is None:
                results.append(DateAnswer(text, None, 0.0, why))
                continue
            output, confidence = decoded[i]
            if output != date.isoformat():
                why = f"the model answered {output!r}, which is not the date the text names"
                results.append(DateAnswer(text, None, confidence, why))
            else:
                results.append(DateAnswer(text, output, confidence, ""))
        return results

    def translate(self, texts: list[str], batch_size: int = 256, *, strict: bool = False) -> list[str | None]:
        """ISO dates for ``texts``; ``None`` for a text that is not a date the model can read.

        See :meth:`answers` for what is refused and why (and for the confidence).
        With ``strict=True`` a refusal raises ``ValueError`` naming the text and the reason.
        """
        results = self.answers(texts, batch_size)
        if strict:
            for answer in results:
                if answer.iso is None:
                    raise AttnkitValueError(f"{short(answer.text)} is not a date attnkit can read: {answer.reason}.")
        return [answer.iso for answer in results]

    @torch.no_grad()
    def translate_with_attention(self, text: str) -> dict:
        """The ISO output and the cross-attention weights that produced it.

        Returns ``{"output": str, "weights": (layers, heads, L_out, L_in), "output_tokens":
        [...], "input_tokens": [...]}``; output token i is the character predicted by
        decoder query i (the last one is ``</s>``).
        """
        import attnkit

        if not isinstance(text, str):
            raise AttnkitTypeError(f"text must be a str, but got {type(text).__name__}.")
        date, why = dates.read(text)
        if date is None:
            raise AttnkitValueError(f"{short(text)} is not a date attnkit can read: {why}.")
        text = dates.normalize(text)
        source, lengths = self.encode_source([text])
        ids = self.generate(source, lengths)[0].tolist()
        if EOS in ids:
            ids = ids[: ids.index(EOS) + 1]
        target_in = torch.tensor([[BOS] + ids[:-1]])
        with attnkit.capture(self) as cap:
            self(source, lengths, target_in)
        cross = [w[0] for w, name in zip(cap.weights, cap.names) if name.endswith("cross_attn")]
        return {
            "output": self.decode_target(ids),
            "weights": torch.stack(cross),
            "output_tokens": [self.target_vocab[i] for i in ids],
            "input_tokens": self.source_tokens(text),
        }


# --- training ------------------------------------------------------------------------------


def batch(
    model: DateTranslator, rng: random.Random, size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``size`` fresh training pairs: source ids, source lengths, decoder inputs and targets."""
    pairs = [dates.sample(rng) for _ in range(size)]
    source, lengths = model.encode_source([t for t, _ in pairs])
    target = model.encode_target([iso for _, iso in pairs])
    target_in = torch.cat([torch.full((size, 1), BOS), target[:, :-1]], dim=1)
    return source, lengths, target_in, target


def exact_match(model: DateTranslator, pairs: list[tuple[str, str]]) -> float:
    predictions = model.translate([t for t, _ in pairs])
    return sum(p == iso for p, (_, iso) in zip(predictions, pairs)) / max(1, len(pairs))


def train(
    steps: int = 1500,
    *,
    seed: int = 0,
    batch_size: int = 128,
    lr: float = 2e-3,
    config: Config = Config(),
    progress: bool | None = True,
    log: Callable[[int, float, float], object] | None = None,
) -> tuple[DateTranslator, dict]:
    """Train a DateTranslator on freshly generated dates; reproducible from ``seed``.

    Returns the model (in eval mode) and a record of the run (steps, seed, final loss,
    exact match on 1000 fresh dates, seconds).
    """
    torch.manual_seed(seed)
    rng = random.Random(seed)
    model = DateTranslator(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(steps, max(1, steps // 20)))
    trainer = Trainer(model, optimizer, scheduler, clip=1.0)
    losses: list[float] = []
    shown: dict = {}

    def work(step: int) -> dict:
        source, lengths, target_in, target = batch(model, rng, batch_size)
        logits = model(source, lengths, target_in)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))
        losses.append(trainer.step(loss))
        if step % 25 == 0 or step == steps - 1:
            accuracy = (logits.argmax(-1) == target).all(dim=1).float().mean().item()
            shown.update(loss=losses[-1], acc=f"{accuracy:.1%}")
            if log is not None:
                log(step, losses[-1], accuracy)
        return shown

    result = loop(trainer, steps, work, progress=progress)
    record = {
        "steps": steps,
        "seed": seed,
        "batch_size": batch_size,
        "lr": lr,
        "first_loss": losses[0] if losses else None,
        "final_loss": sum(losses[-20:]) / max(1, len(losses[-20:])),
        "exact_match_1000": exact_match(model, dates.dataset(1000, seed + 1)),
        "seconds": result.seconds,
        "torch": torch.__version__,
    }
    return model, record
