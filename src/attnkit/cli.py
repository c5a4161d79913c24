"""The ``attnkit`` command (also ``python -m attnkit``): argparse subcommands only;
the work is done by the library."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from attnkit._validate import AttnkitError


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def show(args) -> int:
    import numpy as np

    import attnkit
    from attnkit.inspect.summary import summarize
    from attnkit.models import MiniLM
    from attnkit.viz import attention_grid, save_html, visualize_attention

    _say("loading all-MiniLM-L6-v2 (attnkit.models.MiniLM) ...")
    model = MiniLM.from_package()
    tokens = model.tokens(args.text)
    ids, lengths = model.tokenize([args.text])
    layers, heads = len(model.layers), model.layers[0].attention.num_heads
    for name, value, limit in (("--layer", args.layer, layers), ("--head", args.head, heads)):
        if value is not None and not 0 <= value < limit:
            raise SystemExit(f"attnkit show: {name} must be in 0..{limit - 1}, but got {value}.")
    _say(f"running the model on {len(tokens)} tokens ...")
    with attnkit.capture(model) as cap:
        model(ids, lengths)
    weights = cap.stack()  # (layers, heads, L, L)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    written = [save_html(out / "attention.html", weights, tokens, layer_names=[f"layer {i}" for i in range(layers)], title=args.text)]
    _say("drawing the figures ...")
    attention_grid(weights, out / "attention.png", tokens=tokens, title=args.text)
    written.append(out / "attention.png")
    picked = [
        (layer, head)
        for layer in ([args.layer] if args.layer is not None else range(layers))
        for head in ([args.head] if args.head is not None else range(heads))
    ] if args.layer is not None or args.head is not None else []
    for layer, head in picked:
        path = out / f"attention_layer{layer}_head{head}.png"
        visualize_attention(weights[layer, head], tokens, path, title=f"layer {layer}, head {head}")
        written.append(path)
    np.savez_compressed(out / "attention.npz", tokens=np.array(tokens), weights=weights.numpy(), layers=np.array(cap.names))
    written.append(out / "attention.npz")

    print(f"tokens ({len(tokens)}): {' '.join(tokens)}")
    print()
    print(summarize(weights, tokens))
    print()
    for path in written:
        print(f"wrote {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="attnkit", description="Exact attention you can see into.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser(
        "show",
        help="run all-MiniLM-L6-v2 on a text and write its attention as HTML, PNG and NPZ",
        description="Run all-MiniLM-L6-v2 (built from attnkit parts) on TEXT and write "
        "attention.html (interactive), attention.png (every layer and head), attention.npz "
        "(tokens and weights) and, with --layer/--head, one PNG per head.",
    )
    p.add_argument("text", help="the sentence to look at")
    p.add_argument("--out", default="attention", help="output folder (default: ./attention)")
    p.add_argument("--layer", type=int, help="draw the heads of this layer as PNGs (0-based)")
    p.add_argument("--head", type=int, help="draw this head (of --layer, or of every layer) as PNG")
    p.set_defaults(run=show)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (AttnkitError, ModuleNotFoundError) as err:
        print(f"attnkit {args.command}: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
