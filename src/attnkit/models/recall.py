"""RecallLM: a small decoder that finds a key-value pair anywhere in a long text.

The task (associative recall): filler words with key-value pairs scattered through
them (``... the k17 v42 of and ...``), then queries ``? k17`` whose answer is the
value that followed that key (``v42``). It is trained on texts of at most 1k tokens
and answers at 16k-32k. Two choices make that work:

- a *token shift*: each position's input also holds (a learned map of) the token
  before it, so the value ``v42`` carries "after k17" and one attention head can
  retrieve it by content, with no previous-token head to learn first;
- no positional encoding: causal attention alone, so nothing in a score depends on
  how far back the needle is (``Config.rotary_fraction`` > 0 adds RoPE to that share
  of each head's dimensions, for experiments).

It is built from :class:`attnkit.MultiHeadAttention` layers, so ``attnkit.capture``,
``attnkit show --model recall`` and the statistics of :mod:`attnkit.inspect` see into it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from attnkit import masks
from attnkit._validate import AttnkitTypeError, AttnkitValueError, short
from attnkit.models._weights import ShippedWeights
from attnkit.models.training import Trainer, loop, warmup_times_cosine
from attnkit.nn import KVCache, MultiHeadAttention, RotaryEmbedding, layer_budgets

__all__ = ["Config", "RecallLM", "Task", "accuracy", "compressed_recall", "make_batch", "train", "WEIGHTS"]

WEIGHTS = "recall_lm.safetensors"

FILLER = (
    "the of and to in is was that for on as with by at from his her an were are which this be or had "
    "not but it they one all their has there been if more when will would who so no out up into do "
    "than only other new some could time these two may then first any like now my over such our man"
).split()


@dataclass(frozen=True)
class Task:
    """The vocabulary: specials, filler words, keys ``k0..`` and values ``v0..``."""

    num_keys: int = 64
    num_values: int = 64

    @property
    def specials(self) -> list[str]:
        return ["<pad>", "<bos>", "?"]

    @property
    def tokens(self) -> list[str]:
        return (
            self.specials + FILLER + [f"k{i}" for i in range(self.num_keys)] + [f"v{i}" for i in range(self.num_values)]
        )

    @property
    def first_key(self) -> int:
        return len(self.specials) + len(FILLER)

    @property
    def first_value(self) -> int:
        return self.first_key + self.num_keys

    @property
    def vocab_size(self) -> int:
        return self.first_value + self.num_values

    QUERY = 2
    BOS = 1


def make_batch(
    n: int,
    length: int,
    *,
    pairs: int = 8,
    queries: int = 4,
    task: Task = Task(),
    generator: torch.Generator | None = None,
    depth: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens, targets)`` of ``n`` texts of ``length`` tokens; targets are -100 except answers.

    A text is ``<bos>``, filler with ``pairs`` key-value pairs (distinct keys) at random
    places, then ``queries`` queries ``? k v`` about some of the pairs (the answer ``v``
    is the target). ``depth`` in [0, 1] puts the first pair there (0 = the start) and
    asks about it first: the needle for accuracy by distance.
    """
    tail = 3 * queries
    body = length - 1 - tail
    if body < 2 * pairs or pairs < 1 or queries < 1 or queries > pairs:
        raise AttnkitValueError(
            f"a text of length {length} cannot hold {pairs} pairs and {queries} queries (need length >= "
            f"{1 + 2 * pairs + 3 * queries} and 1 <= queries <= pairs)."
        )
    g = generator
    tokens = torch.randint(len(task.specials), task.first_key, (n, length), generator=g)
    tokens[:, 0] = task.BOS
    targets = torch.full((n, length), -100, dtype=torch.long)
    slots = body // 2  # pair i may start at 1 + 2 * slot
    for row in range(n):
        keys = torch.randperm(task.num_keys, generator=g)[:pairs]
        values = torch.randint(0, task.num_values, (pairs,), generator=g)
        where = torch.randperm(slots, generator=g)[:pairs]
        asked = torch.randperm(pairs, generator=g)[:queries]
        if depth is not None:
            where[0] = min(slots - 1, int(depth * (slots - 1)))
            others = torch.randperm(slots - 1, generator=g)[: pairs - 1]
            where[1:] = others + (others >= where[0]).long()
            asked = torch.cat([torch.tensor([0]), torch.randperm(pairs - 1, generator=g)[: queries - 1] + 1])
        starts = 1 + 2 * where
        tokens[row, starts] = task.first_key + keys
        tokens[row, starts + 1] = task.first_value + values
        for j, p in enumerate(asked.tolist()):
            at = 1 + body + 3 * j
            tokens[row, at] = task.QUERY
            tokens[row, at + 1] = task.first_key + keys[p]
            tokens[row, at + 2] = task.first_value + values[p]
            targets[row, at + 1] = task.first_value + values[p]  # predicted at the key's position
    return tokens, targets


@dataclass
class Config:
    d_model: int = 64
    num_heads: int = 4
    num_layers: int = 2
    d_ff: int = 128
    rope_base: float = 10000.0
    rotary_fraction: float = 0.0  # no positional encoding: causal attention alone (see the module docstring)
    num_keys: int = 64
    num_values: int = 64


class _Block(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        head_dim = c.d_model // c.num_heads
        rotary_dims = int(head_dim * c.rotary_fraction) // 2 * 2
        self.norm1 = nn.LayerNorm(c.d_model)
        self.attn = MultiHeadAttention(
            c.d_model, c.num_heads, bias=False, rotary=RotaryEmbedding(head_dim, c.rope_base, rotary_dims)
        )
        self.norm2 = nn.LayerNorm(c.d_model)
        self.mlp = nn.Sequential(nn.Linear(c.d_model, c.d_ff), nn.GELU(), nn.Linear(c.d_ff, c.d_model))

    def forward(self, x, mask, cache=None):
        x = x + self.attn(self.norm1(x), mask=mask, cache=cache)[0]
        return x + self.mlp(self.norm2(x))


class RecallLM(ShippedWeights, nn.Module):
    """A causal decoder over :class:`Task`'s vocabulary (see the module docstring).

    ``forward(tokens: (B, L)) -> logits (B, L, vocab)``; :meth:`answer` reads the value
    it predicts after ``? key``; :meth:`tokenize` / :meth:`tokens_of` convert text.
    """

    WEIGHTS = WEIGHTS
    config_class = Config

    def __init__(self, config: Config = Config()):
        super().__init__()
        c = self.config = config
        self.task = Task(c.num_keys, c.num_values)
        self.embed = nn.Embedding(self.task.vocab_size, c.d_model)
        self.shift = nn.Linear(c.d_model, c.d_model, bias=False)  # the previous token, mixed in ("token shift")
        self.blocks = nn.ModuleList(_Block(c) for _ in range(c.num_layers))
        self.norm = nn.LayerNorm(c.d_model)
        self.head = nn.Linear(c.d_model, self.task.vocab_size, bias=False)
        self.training_info: dict = {}

    def _check(self, tokens) -> torch.Tensor:
        if not isinstance(tokens, torch.Tensor) or tokens.dtype not in (torch.int64, torch.int32):
            raise AttnkitTypeError(f"tokens must be an int64 tensor of token ids, but got {short(tokens)}.")
        if tokens.dim() == 1:
            tokens = tokens[None]
        if tokens.dim() != 2 or tokens.shape[1] == 0:
            raise AttnkitValueError(f"tokens must have shape (B, L) with L >= 1, but got {tuple(tokens.shape)}.")
        if bool(((tokens < 0) | (tokens >= self.task.vocab_size)).any()):
            raise AttnkitValueError(f"token ids must be in [0, {self.task.vocab_size}).")
        return tokens.long()

    def hidden(
        self, tokens: torch.Tensor, *, caches: list[KVCache] | None = None, before: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Final hidden states ``(B, L, d_model)``.

        With ``caches`` (one :class:`~attnkit.nn.KVCache` per layer, :meth:`new_caches`) the text
        goes on from what the caches hold: ``tokens`` are appended and attend over everything
        stored. ``before: (B,)`` is the token each sequence's previous call ended with (the token
        shift mixes it into the first new position); it is needed once the caches hold tokens.
        """
        tokens = self._check(tokens)
        x = self.embed(tokens)
        previous = F.pad(x[:, :-1], (0, 0, 1, 0))  # the first position has no predecessor here...
        if caches is not None:
            if not isinstance(caches, (list, tuple)) or len(caches) != len(self.blocks):
                raise AttnkitValueError(
                    f"caches must be a list of {len(self.blocks)} KVCache, one per layer (model.new_caches()), but "
                    f"got {short(caches)}."
                )
            if before is None and bool((caches[0].positions > 0).any()):
                raise AttnkitValueError(
                    "the caches hold earlier tokens: pass before=, the last token id of each sequence's previous "
                    "call (the token shift mixes it into the first new position)."
                )
        if before is not None:  # ...unless the text goes on from a previous call
            before = self._check(before.reshape(-1, 1))
            if before.shape[0] != tokens.shape[0]:
                raise AttnkitValueError(f"before must hold one token per sequence ({tokens.shape[0]}).")
            previous = torch.cat([self.embed(before), x[:, :-1]], dim=1)
        x = x + self.shift(previous)  # each position also sees the token before it
        mask = masks.causal()
        for i, block in enumerate(self.blocks):
            x = block(x, mask, None if caches is None else caches[i])
        return self.norm(x)

    def forward(
        self, tokens: torch.Tensor, *, caches: list[KVCache] | None = None, before: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self.head(self.hidden(tokens, caches=caches, before=before))

    def new_caches(self, batch_size: int, max_len: int) -> list[KVCache]:
        """One empty :class:`~attnkit.nn.KVCache` per layer for :meth:`hidden`'s ``caches=``."""
        c, ref = self.config, self.head.weight
        return KVCache.for_layers(
            len(self.blocks), batch_size, c.num_heads, max_len, c.d_model // c.num_heads,
            device=ref.device, dtype=ref.dtype,
        )  # fmt: skip

    @torch.no_grad()
    def answer(self, tokens: torch.Tensor) -> list[tuple[str, float]]:
        """The value predicted after each text's last token (a key after ``?``), with its probability.

        A text that does not end with ``? key`` gets ``("", 0.0)``: the model answers
        only queries.
        """
        tokens = self._check(tokens)
        probs = self.forward(tokens)[:, -1].float().softmax(-1)
        values = probs[:, self.task.first_value :]
        out = []
        for row, p in zip(tokens, values):
            asked = (
                row.shape[0] >= 2
                and int(row[-2]) == Task.QUERY
                and self.task.first_key <= int(row[-1]) < self.task.first_value
            )
            if not asked:
                out.append(("", 0.0))
                continue
            best = int(p.argmax())
            out.append((f"v{best}", float(p[best])))
        return out

    def tokenize(self, text: str) -> torch.Tensor:
        """Token ids ``(L,)`` of a text of this vocabulary's words (``<bos>`` is prepended)."""
        if not isinstance(text, str):
            raise AttnkitTypeError(f"tokenize takes a str of RecallLM's words, but got {short(text)}.")
        index = {t: i for i, t in enumerate(self.task.tokens)}
        words = text.split()
        unknown = [w for w in words if w not in index]
        if unknown:
            raise AttnkitValueError(
                f"RecallLM knows filler words, keys k0..k{self.task.num_keys - 1}, values "
                f"v0..v{self.task.num_values - 1} and '?'; not {short(unknown[:5])}."
            )
        return torch.tensor([Task.BOS] + [index[w] for w in words])

    def tokens_of(self, ids: Iterable[int] | torch.Tensor) -> list[str]:
        """The words of token ids."""
        return [self.task.tokens[int(i)] for i in ids]


@torch.no_grad()
def accuracy(
    model: RecallLM,
    length: int,
    n: int = 32,
    *,
    seed: int = 1,
    batch_size: int = 8,
    depth: float | None = None,
    pairs: int = 8,
) -> float:
    """Share of first queries answered right on ``n`` fresh texts of ``length`` tokens."""
    g = torch.Generator().manual_seed(seed)
    right = 0
    model.eval()
    for start in range(0, n, batch_size):
        m = min(batch_size, n - start)
        tokens, targets = make_batch(m, length, pairs=pairs, queries=1, task=model.task, generator=g, depth=depth)
        at = (targets != -100).float().argmax(-1)  # the answer's position
        hidden = model.hidden(tokens[:, : int(at.max()) + 1])
        logits = model.head(hidden[torch.arange(m), at])
        right += int((logits.argmax(-1) == targets[torch.arange(m), at]).sum())
    return right / n


#: Baselines for :func:`compressed_recall` besides the methods of :func:`attnkit.inspect.kv_scores`:
#: ``random`` keeps random entries, ``recent`` the latest ones (a window over the end of the text).
BASELINES = ("random", "recent")


@torch.no_grad()
def compressed_recall(
    model: RecallLM,
    length: int,
    *,
    keep: Iterable[float] = (0.5, 0.25),
    methods: Iterable[str] = ("snapkv", "tova", "observed", "random", "recent"),
    n: int = 32,
    seed: int = 1,
    batch_size: int = 8,
    pairs: int = 8,
    window: int = 64,
    budgets: str = "uniform",
    allocate: str = "sequence",
) -> dict:
    """First-query accuracy with the text's KV cache compressed, against the full cache.

    Each of ``n`` fresh texts of ``length`` tokens (:func:`make_batch`, one query) is read up to
    the question into per-layer caches (the prefill); every layer's keys are scored on the way by
    :func:`attnkit.inspect.kv_scores` (``window`` queries for SnapKV) or by a baseline
    (:data:`BASELINES`), each cache is compressed to each share of ``keep``
    (:meth:`KVCache.compress`; ``budgets="pyramid"`` spreads the share over the layers as
    :func:`attnkit.nn.layer_budgets` does; ``allocate="heads"`` spreads each layer's budget over
    its heads as AdaKV does, :meth:`KVCache.compress`), and the question ``? key`` is decoded over it. The question is
    not seen when the keys are scored (question-agnostic compression, as kvpress measures it).

    Returns ``{"full": accuracy, method: {keep: accuracy, ...}, ...}``.
    """
    from attnkit.inspect.kv import METHODS, kv_scores

    methods, keep = tuple(methods), tuple(keep)
    unknown = [m for m in methods if m not in METHODS + BASELINES]
    if unknown:
        raise AttnkitValueError(f"methods must be among {METHODS + BASELINES}, but got {short(unknown)}.")
    g = torch.Generator().manual_seed(seed)  # the texts: the same as accuracy()'s for this seed
    g_random = torch.Generator().manual_seed(seed + 1)  # the random baseline's scores
    right: dict = {"full": 0, **{m: dict.fromkeys(keep, 0) for m in methods}}
    model.eval()
    for first in range(0, n, batch_size):
        m = min(batch_size, n - first)
        tokens, targets = make_batch(m, length, pairs=pairs, queries=1, task=model.task, generator=g)
        at = int((targets[0] != -100).float().argmax())  # the key's position (the same in every text)
        context, question, answer = tokens[:, : at - 1], tokens[:, at - 1 : at + 1], targets[:, at]
        scores: list[dict[str, torch.Tensor]] = []

        def score(module, q, k, v, mask, kwargs):
            # the prefill fills empty caches with texts of one length: the call's mask is plain causal
            mods = {name: kwargs[name] for name in ("attn_bias", "softcap", "sinks")}
            found = {
                name: kv_scores(q, k, v, masks.causal(), method=name, window=window, **mods)
                for name in methods if name in METHODS
            }  # fmt: skip
            if "random" in methods:
                found["random"] = torch.rand(k.shape[:3], generator=g_random)
            if "recent" in methods:
                found["recent"] = torch.arange(k.shape[2], dtype=torch.float32).expand(k.shape[:3])
            scores.append(found)

        caches = model.new_caches(m, at + 1)
        layers = [block.attn for block in model.blocks if isinstance(block, _Block)]
        handles = [attn.register_attention_hook(score, with_kwargs=True) for attn in layers]
        try:
            model.hidden(context, caches=caches)
        finally:
            for handle in handles:
                handle.remove()

        def ask(compressed: list[KVCache]) -> int:
            logits = model(question, caches=compressed, before=context[:, -1])[:, -1]
            return int((logits.argmax(-1) == answer).sum())

        right["full"] += ask([c.clone() for c in caches])
        for name in methods:
            for share in keep:
                smaller = [c.clone() for c in caches]
                for cache, found, own in zip(smaller, scores, layer_budgets(share, len(caches), budgets)):
                    cache.compress(own, found[name], allocate=allocate)
                right[name][share] += ask(smaller)
    return {name: (hits / n if name == "full" else {s: h / n for s, h in hits.items()}) for name, hits in right.items()}


def _length_at(step: int, steps: int, lo: int, hi: int) -> int:
    """The curriculum: lengths grow from ``lo`` to ``hi`` over the first 60% of training."""
    frac = min(1.0, step / max(1, 0.6 * steps))
    return int(lo * (hi / lo) ** frac) // 16 * 16


def train(
    steps: int = 5000,
    *,
    seed: int = 0,
    batch_size: int = 32,
    lr: float = 2e-3,
    config: Config = Config(),
    min_length: int = 64,
    max_length: int = 1024,
    pairs: int = 16,
    queries: int = 8,
    progress: bool | None = True,
    log: Callable[[str], object] = print,
) -> tuple[RecallLM, dict]:
    """Train on texts of ``min_length`` growing to ``max_length`` tokens (seeded)."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    model = RecallLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.98))
    trainer = Trainer(
        model, opt, torch.optim.lr_scheduler.LambdaLR(opt, warmup_times_cosine(steps, max(1, steps // 20)))
    )

    def work(step: int) -> dict:
        length = _length_at(step, steps, min_length, max_length)
        n = max(4, min(batch_size, batch_size * 256 // length))  # at most batch_size x 256 tokens a step
        tokens, targets = make_batch(n, length, pairs=pairs, queries=queries, task=model.task, generator=g)
        logits = model(tokens)
        trainer.step(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)))
        return {"loss": f"{trainer.running:.3f}", "length": length}

    def check(step: int) -> dict:
        acc = accuracy(model, 256, n=64, seed=1000 + step)
        length = _length_at(step, steps, min_length, max_length)
        return {"step": step + 1, "loss": trainer.running, "length": length, "accuracy_256": acc}

    def describe(step: int, m: dict) -> str:
        at_256 = m["accuracy_256"]
        return f"step {step + 1}: loss {m['loss']:.3f}, length {m['length']}, accuracy at 256 tokens {at_256:.0%}"

    result = loop(
        trainer, steps, work, progress=progress, every=max(1, steps // 10), evaluate=check, last=False, log=log,
        describe=describe,
    )  # fmt: skip
    record = {
        "steps": steps,
        "seed": seed,
        "batch_size": batch_size,
        "lr": lr,
        "min_length": min_length,
        "max_length": max_length,
        "pairs": pairs,
        "queries": queries,
        "seconds": result.seconds,
        "history": result.history,
    }
    return model, record
