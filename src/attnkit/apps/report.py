"""How the commands report: progress and notes on stderr (their results go to stdout)."""

from __future__ import annotations

import sys

__all__ = ["say"]


def say(message: str) -> None:
    """A line of progress or a note, on stderr at once."""
    print(message, file=sys.stderr, flush=True)
