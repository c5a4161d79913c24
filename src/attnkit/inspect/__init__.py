"""Seeing into attention: capture the weights of any model built from attnkit layers."""

from attnkit.inspect.capture import Capture, capture

__all__ = ["Capture", "capture"]
