"""``attnkit caption``: a caption of handwritten digits, and where each word looked."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from attnkit.apps.report import say


def _read_image(path):
    """A (8, 8n) image in [0, 16] from a .npy file (load_digits' scale) or a .png (0-1 or 0-255 grey)."""
    import numpy as np

    from attnkit._validate import AttnkitValueError

    file = Path(path)
    if not file.is_file():
        raise AttnkitValueError(f"--image {path!r} is not a file.")
    if file.suffix.lower() == ".npy":
        try:
            return np.load(file, allow_pickle=False).astype(np.float32)
        except (ValueError, TypeError, EOFError) as err:
            raise AttnkitValueError(f"--image {path!r} is not a numpy array file of numbers: {err}.") from None
    if file.suffix.lower() == ".png":
        import matplotlib.image

        try:
            pixels = matplotlib.image.imread(file)
        except (SyntaxError, ValueError, OSError) as err:  # Pillow reports a file that is not a PNG as SyntaxError
            raise AttnkitValueError(f"--image {path!r} is not a readable PNG image ({err}).") from None
        if pixels.ndim == 3:
            pixels = pixels[..., :3].mean(axis=-1)
        top = 255.0 if pixels.max() > 1.0 else 1.0
        return (pixels / top * 16.0).astype(np.float32)
    raise AttnkitValueError(f"--image must be a .npy or .png file, but got {path!r}.")


def _wanted(text: str) -> list[int]:
    """--digits "7,3,1" as a list of 1 to 8 digits."""
    from attnkit.errors import AttnkitValueError

    try:
        wanted = [int(d) for d in text.split(",")]
    except ValueError:
        raise AttnkitValueError(f"--digits must be digits 0-9 separated by commas, but got {text!r}.") from None
    if not wanted or not all(0 <= d <= 9 for d in wanted) or len(wanted) > 8:
        raise AttnkitValueError(f"--digits must be 1 to 8 digits 0-9 separated by commas, but got {text!r}.")
    return wanted


def check(args: Any) -> None:
    """The arguments alone, before torch is imported or the model loaded."""
    from attnkit.errors import AttnkitValueError

    if (args.digits is None) == (args.image is None):
        raise AttnkitValueError("give --digits (e.g. --digits 7,3,1) or --image FILE, one of them.")
    if args.digits is not None:
        _wanted(args.digits)
        return
    if not Path(args.image).is_file():
        raise AttnkitValueError(f"--image {args.image!r} is not a file.")
    if Path(args.image).suffix.lower() not in (".npy", ".png"):
        raise AttnkitValueError(f"--image must be a .npy or .png file, but got {args.image!r}.")


def run(args: Any, out: Path) -> int:
    """Caption ``args.digits`` (test-split images) or ``args.image``; prints it, writes the figure and page."""
    import random

    from attnkit.models.captioner import WORDS, DigitCaptioner, digits, split, strip_of
    from attnkit.viz.regions import region_figure, save_region_html

    if args.digits is not None:
        wanted = _wanted(args.digits)
        _, labels = digits()
        rng = random.Random(args.seed)
        pool = split("test").tolist()
        chosen = [rng.choice([i for i in pool if int(labels[i]) == d]) for d in wanted]
        image = strip_of(chosen)
        say(f"test-split digits {chosen} ({' '.join(WORDS[d] for d in wanted)})")
    else:
        image = _read_image(args.image)
    model = DigitCaptioner.from_package()
    result = model.caption_with_attention(image)
    words = result["words"]
    print(" ".join(words))
    last = result["weights"][-1].mean(0)  # (words, patches): last layer, mean of heads
    written = [out / "caption.png", out / "caption.html"]
    region_figure(
        result["image"], words, last, result["grid"], written[0], title=f"{' '.join(words)} (last layer, mean of heads)"
    )
    save_region_html(
        written[1],
        result["image"],
        words,
        result["weights"],
        result["grid"],
        layers=[f"decoder layer {i} (cross)" for i in range(len(result["weights"]))],
        title=" ".join(words),
    )
    for path in written:
        say(f"wrote {path}")
    return 0
