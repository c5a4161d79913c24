"""Shipped weights: one ``.safetensors`` file per model, its config and training record in the metadata."""

from __future__ import annotations

import json
from dataclasses import asdict
from importlib import resources
from pathlib import Path


class ShippedWeights:
    """``from_package``, ``load`` and ``save`` for a module built from one dataclass config.

    Subclasses set ``WEIGHTS`` (the file name in ``attnkit/models/weights``) and
    ``config_class``, and keep their config as ``self.config``.
    """

    WEIGHTS: str
    config_class: type

    @classmethod
    def from_package(cls):
        """The model with the weights shipped inside attnkit (see the README for how they were made)."""
        path = resources.files("attnkit.models") / "weights" / cls.WEIGHTS
        with resources.as_file(path) as file:
            return cls.load(file)

    @classmethod
    def load(cls, path):
        """Load weights written by :meth:`save` (a ``.safetensors`` file with its config)."""
        from safetensors import safe_open
        from safetensors.torch import load_file

        with safe_open(str(path), "pt") as f:
            metadata = f.metadata() or {}
        model = cls(cls.config_class(**json.loads(metadata.get("config", "{}"))))
        model.load_state_dict(load_file(str(path)))
        model.training_info = json.loads(metadata.get("training", "{}"))
        return model.eval()

    def save(self, path, training: dict | None = None) -> Path:
        """Write the weights, the config and ``training`` (a record of how they were made)."""
        from safetensors.torch import save_file

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        state = {k: v.contiguous() for k, v in self.state_dict().items()}
        metadata = {"config": json.dumps(asdict(self.config)), "training": json.dumps(training or {})}
        save_file(state, str(path), metadata=metadata)
        return path
