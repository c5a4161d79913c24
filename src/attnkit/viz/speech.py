"""Speech and the attention that read it: waveform, spectrogram and characters x time, on one time axis."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from attnkit._types import ArrayLike, PathLike
from attnkit._validate import AttnkitValueError
from attnkit.viz.heatmap import as_array, new_figure

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def attended_spans(
    chars: Sequence[str], attention: ArrayLike, frame_times: ArrayLike, level: float = 0.5
) -> list[tuple[str, float, float]]:
    """``(char, start_s, end_s)`` for each output character: the run of frames around its
    attention peak where the weight is at least ``level`` x the peak (``attention: (chars, frames)``,
    ``frame_times``: each frame's centre in seconds)."""
    att = as_array(attention)
    times = as_array(frame_times)
    if att.ndim != 2 or att.shape != (len(chars), len(times)):
        raise AttnkitValueError(
            f"attention must be (chars, frames) = ({len(chars)}, {len(times)}), but got {tuple(att.shape)}."
        )
    step = float(times[1] - times[0]) if len(times) > 1 else 0.04
    spans = []
    for char, row in zip(chars, att):
        peak = int(row.argmax())
        a = b = peak
        while a > 0 and row[a - 1] >= level * row[peak]:
            a -= 1
        while b + 1 < len(row) and row[b + 1] >= level * row[peak]:
            b += 1
        spans.append((str(char), max(0.0, float(times[a]) - step / 2), float(times[b]) + step / 2))
    return spans


def speech_figure(
    samples: ArrayLike,
    sample_rate: int,
    features: ArrayLike,
    chars: Sequence[str],
    attention: ArrayLike,
    frame_times: ArrayLike,
    save_path: PathLike | None = None,
    *,
    title: str | None = None,
) -> Figure:
    """Three panels sharing the time axis: the waveform, the log-mel spectrogram, and the
    cross-attention of each output character over the audio frames (``attention: (chars, frames)``),
    with each character's peak marked. Returns the figure (saved when ``save_path`` is given)."""
    Figure = new_figure()
    samples = np.asarray(samples, dtype=np.float32)
    feats = as_array(features)  # (T, mels) at 100 frames/s
    att = as_array(attention)  # (chars, frames)
    times = as_array(frame_times)
    duration = len(samples) / sample_rate
    step = float(times[1] - times[0]) if len(times) > 1 else duration
    fig = Figure(figsize=(9, 2.2 + 0.35 * len(chars) + 3.2), layout="constrained")
    axes = fig.subplots(3, 1, sharex=True, gridspec_kw={"height_ratios": [1, 1.3, max(1.0, 0.35 * len(chars))]})
    axes[0].plot(np.arange(len(samples)) / sample_rate, samples, lw=0.5, color="#333")
    axes[0].set_ylabel("waveform")
    axes[1].imshow(
        feats.T, origin="lower", aspect="auto", cmap="magma", extent=(0, feats.shape[0] * 0.01, 0, feats.shape[1])
    )
    axes[1].set_ylabel("log-mel")
    axes[2].imshow(
        att,
        aspect="auto",
        cmap="viridis",
        interpolation="nearest",
        extent=(times[0] - step / 2, times[-1] + step / 2, len(chars) - 0.5, -0.5),
    )
    peaks = att.argmax(-1)
    axes[2].plot(times[peaks], np.arange(len(chars)), "w.", ms=6)
    axes[2].set_yticks(range(len(chars)))
    axes[2].set_yticklabels(chars)
    axes[2].set_ylabel("output")
    axes[2].set_xlabel("time (s)")
    axes[2].set_xlim(0, max(duration, times[-1] + step / 2))
    if title:
        fig.suptitle(title, fontsize=10)
    if save_path is not None:
        Path(save_path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(save_path, dpi=110)
    return fig
