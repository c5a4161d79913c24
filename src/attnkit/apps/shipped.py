"""What the command line knows of the shipped models and data without loading them (standard library
only: the checks of ``attnkit``'s arguments run before torch is imported, in well under a second)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

__all__ = ["MOVIELENS_USERS", "checkpoint_layers_and_heads", "example_wavs", "weights_config"]

#: attnkit.models' package data, found beside this package (importing attnkit.models imports torch).
MODELS = Path(__file__).resolve().parents[1] / "models"

#: MovieLens-100K's users, ids 1..943 (every one has a held-out last item).
MOVIELENS_USERS = 943


def weights_config(file_name: str) -> dict:
    """The ``config`` a shipped ``.safetensors`` file holds in its metadata, read from the header only
    (eight bytes of length, then JSON)."""
    with open(MODELS / "weights" / file_name, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    return json.loads(header.get("__metadata__", {}).get("config", "{}"))


def example_wavs() -> list[str]:
    """The shipped example WAVs' names, in the order ``attnkit listen --example N`` counts them."""
    return sorted(entry.name for entry in (MODELS / "audio").iterdir() if entry.name.endswith(".wav"))


def checkpoint_layers_and_heads(folder: Path) -> tuple[int, int] | None:
    """A HuggingFace checkpoint's layers and heads from its config.json (its text model's, for a
    composite one), or None where the file does not say them plainly."""
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    for part in (config, config.get("text_config") or {}):
        layers, heads = part.get("num_hidden_layers"), part.get("num_attention_heads")
        if isinstance(layers, int) and isinstance(heads, int):
            return layers, heads
    return None
