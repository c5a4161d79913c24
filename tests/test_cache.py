"""TODO"""

from __future__ import annotations

import sys

from _oracle import randn

import attnkit
from attnkit import masks


def test_implicit_cache_is_bounded():
    prep = sys.modules["attnkit.prepare"]

    prep.clear_cache()
    q = randn(1, 1, 300, 8)
    for i in range(prep.IMPLICIT_CACHE_SIZE + 5):
        attnkit.attention(q, q, q, masks.sliding_window(i + 1))
    assert len(prep._implicit) == prep.IMPLICIT_CACHE_SIZE
