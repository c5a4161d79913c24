"""Shipped weights: one ``.safetensors`` file per model, its config and training record in the metadata."""

from __future__ import annotations

import json
from dataclasses import asdict
from importlib import resources
from pathlib import Path
from typing import Any, TypeVar

from torch import nn

from attnkit._types import PathLike

M = TypeVar("M", bound="ShippedWeights")


class ShippedWeights(nn.Module):
    """``from_package``, ``load`` and ``save`` for a module built from one dataclass config.

    Subclasses set ``WEIGHTS`` (the file name in ``attnkit/models/weights``) and
    ``config_class``, and keep their config as ``self.config``.
    """

    WEIGHTS: str
    config_class: type
    config: Any
    training_info: dict

    @classmethod
    def from_package(cls: type[M]) -> M:
        """The model with the weights shipped inside attnkit (see the README for how they were made)."""
        path = resources.files("attnkit.models") / "weights" / cls.WEIGHTS
        with resources.as_file(path) as file:
            return cls.load(file)

    @classmethod
    def packaged_config(cls) -> Any:
        """The config of the shipped weights, read from their metadata (no weights loaded)."""
        from safetensors import safe_open

        path = resources.files("attnkit.models") / "weights" / cls.WEIGHTS
        with resources.as_file(path) as file, safe_open(str(file), "pt") as f:
            metadata = f.metadata() or {}
        return cls.config_class(**json.loads(metadata.get("config", "{}")))

    @classmethod
    def load(cls: type[M], path: PathLike) -> M:
        """Load weights written by :meth:`save` (a ``.safetensors`` file with its config)."""
        from safetensors import safe_open
        from safetensors.torch import load_file

        with safe_open(str(path), "pt") as f:
            metadata = f.metadata() or {}
        model = cls(cls.config_class(**json.loads(metadata.get("config", "{}"))))
        model.load_state_dict(load_file(str(path)))
        model.training_info = json.loads(metadata.get("training", "{}"))
        return model.eval()

    def save(self, path: PathLike, training: dict | None = None) -> Path:
        """Write the weights, the config and ``training`` (a record of how they were made)."""
        from safetensors.torch import save_file

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        state = {k: v.contiguous() for k, v in self.state_dict().items()}
        metadata = {"config": json.dumps(asdict(self.config)), "training": json.dumps(training or {})}
        save_file(state, str(path), metadata=metadata)
        return path
