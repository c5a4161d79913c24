"""``attnkit listen``: spoken digits transcribed, and the stretch of audio each one was read from."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from attnkit.apps.report import say as note


def check(args: Any) -> None:
    """The arguments alone, before torch is imported or the model loaded."""
    from attnkit.apps.shipped import example_wavs
    from attnkit.errors import AttnkitValueError

    given = [x is not None for x in (args.file, args.say)] + [args.example is not None]
    if sum(given) != 1:
        raise AttnkitValueError('give FILE.wav, --say "4 0 7" or --example N (one of them).')
    if args.file is not None and not Path(args.file).is_file():
        raise AttnkitValueError(f"{args.file!r} is not a file: give a WAV file (16-bit PCM, any rate).")
    if args.example is not None and not 1 <= args.example <= len(example_wavs()):
        raise AttnkitValueError(f"--example must be 1..{len(example_wavs())}, but got {args.example}.")
    if args.say is not None and not "".join(args.say.split()).isdigit():
        raise AttnkitValueError(f'--say takes digits 0-9 and spaces, e.g. "4 0 7", but got {args.say!r}.')


def run(args: Any, out: Path) -> int:
    """Transcribe a WAV, a shipped example or digits said by espeak-ng; prints the text, writes the views."""
    import numpy as np

    from attnkit.models.speech import SpeechRecognizer, examples, read_wav, say, write_wav
    from attnkit.viz import save_html
    from attnkit.viz.html import waveform_overview
    from attnkit.viz.speech import attended_spans, speech_figure

    if args.say is not None:
        digits = "".join(args.say.split())
        samples, rate = say(digits, "en-gb-x-rp", "f3"), 16000
        write_wav(out / "said.wav", samples, rate)
        note(f"espeak-ng (en-gb-x-rp+f3, a held-out voice) said {digits}: {out / 'said.wav'}")
    else:
        path = args.file
        if args.example is not None:
            path, truth = examples()[args.example - 1]
            note(f"example {args.example}: {path} (spoken digits {truth})")
        samples, rate = read_wav(path)
        if samples.ndim > 1:
            note(f"note: {samples.shape[0]} channels: using their mean")
            samples = samples.mean(0)
    model = SpeechRecognizer.from_package()
    found = model.transcribe_with_attention(samples, rate)
    print(found["text"] if found["text"] else "(no digits heard)")
    last = found["attention"][-1].mean(0)  # (chars, frames): last layer, mean of heads
    written = [out / "listen.png", out / "listen.html"]
    speech_figure(
        samples,
        rate,
        found["features"],
        found["chars"],
        last,
        found["frame_times"],
        written[0],
        title=f"heard {found['text'] or '(nothing)'} (last decoder layer, mean of heads)",
    )
    frames = [f"{t:.2f}s" for t in found["frame_times"].tolist()]
    # the end token is no character of the transcript: it often rests on the first frames
    spans = [s for s in attended_spans(found["chars"], last, found["frame_times"]) if s[0] != "</s>"]
    save_html(
        written[1],
        found["attention"],
        found["chars"],
        key_tokens=frames,
        layer_names=[f"decoder layer {i} (cross)" for i in range(found["attention"].shape[0])],
        title=f"heard {found['text'] or '(nothing)'}",
        axes=("output character", "audio frame (40 ms)"),
        focus=(found["attention"].shape[0] - 1, None),
        overview=waveform_overview(
            f"heard {found['text'] or '(no digits)'}: each character over the stretch of audio it was read from",
            samples,
            rate,
            spans,
            note="Shaded: the frames where the last decoder layer's cross-attention (mean of heads) is at least "
            "half its peak for that character. The heatmap and model views show every layer and head.",
        ),
    )
    np.savez_compressed(
        out / "listen.npz",
        attention=found["attention"].numpy(),
        chars=np.array(found["chars"]),
        frame_times=found["frame_times"].numpy(),
    )
    for path in written:
        note(f"wrote {path}")
    return 0
