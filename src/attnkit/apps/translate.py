"""``attnkit translate``: a date written as ISO YYYY-MM-DD, and the cross-attention alignment."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from attnkit.apps.report import say


def _shown(chars):
    """Characters as figure labels: a visible mark for the space."""
    return ["\u2423" if ch == " " else ch for ch in chars]


def check(args: Any) -> None:
    """The arguments alone, before torch is imported or the model loaded."""
    from attnkit.errors import AttnkitValueError

    if not args.text.strip():
        raise AttnkitValueError(
            f'{args.text!r} is not a date attnkit can read: the text is empty (e.g. "25th of March 2019").'
        )
    if args.weights is not None and not Path(args.weights).is_file():
        raise AttnkitValueError(
            f"--weights {args.weights!r} is not a file: give a .safetensors file written by attnkit train."
        )


def _load_translator(path, cls):
    from attnkit._validate import AttnkitValueError

    try:
        return cls.load(path)
    except Exception as err:  # safetensors, json and state-dict errors: all mean "not our weights"
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise AttnkitValueError(
            f"--weights {path!r} is not a DateTranslator weights file written by attnkit train ({first})."
        ) from None


def run(args: Any, out: Path) -> int:
    """Translate ``args.text``; prints the date, writes the alignment figures and page into ``out``."""
    from attnkit.models.translator import DateTranslator
    from attnkit.viz import attention_grid, save_html, visualize_attention

    model = _load_translator(args.weights, DateTranslator) if args.weights else DateTranslator.from_package()
    result = model.translate_with_attention(args.text)
    print(result["output"])
    weights = result["weights"]  # (layers, heads, L_out, L_in)
    inputs, outputs = _shown(result["input_tokens"]), result["output_tokens"]
    last = weights[-1].mean(dim=0)
    written = [out / "alignment.png", out / "alignment_grid.png", out / "alignment.html"]
    visualize_attention(
        last,
        outputs,
        written[0],
        key_tokens=inputs,
        xlabel="input character",
        ylabel="output character",
        title=f"{args.text} \u2192 {result['output']} (last layer, mean of heads)",
    )
    attention_grid(
        weights,
        written[1],
        tokens=outputs,
        key_tokens=inputs,
        title=f"cross-attention: {args.text} (rows: output, columns: input)",
    )
    save_html(
        written[2],
        weights,
        outputs,
        key_tokens=inputs,
        layer_names=[f"decoder layer {i} (cross)" for i in range(len(weights))],
        title=f"{args.text} \u2192 {result['output']}",
        axes=("output character", "input character"),
        start="heatmap",
        focus=(len(weights) - 1, None),  # the alignment: last layer, mean of heads
    )
    for path in written:
        say(f"wrote {path}")
    return 0
