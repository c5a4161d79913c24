"""The ``attnkit`` command (also ``python -m attnkit``): argparse subcommands only. Each command
checks its arguments (``check`` of its :mod:`attnkit.apps` module: the standard library only, so a
bad argument is answered before torch is imported or a model loaded), makes its output folder and
calls the module's ``run``; errors come back as one line and exit code 2."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from attnkit.errors import AttnkitError, missing_extra


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _out_dir(path) -> Path:
    """The --out folder, created; a clear error when it names a file or cannot be made."""
    from attnkit.errors import AttnkitValueError

    out = Path(path)
    if out.exists() and not out.is_dir():
        raise AttnkitValueError(f"--out {str(out)!r} is an existing file; give a folder for the outputs.")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise AttnkitValueError(f"cannot create the --out folder {str(out)!r}: {err.strerror or err}.") from None
    if not os.access(out, os.W_OK):
        raise AttnkitValueError(f"cannot write into the --out folder {str(out)!r} (permission denied).")
    return out


def _positive(text: str) -> int:
    """argparse type: an int >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, but got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, but got {value}")
    return value


#: The models ``attnkit train`` trains, and the same by the command that runs each (the README's names).
TRAINED = ("translator", "captioner", "recommender", "recall", "speech")
TRAINED_BY_COMMAND = {"translate": "translator", "caption": "captioner", "recommend": "recommender", "listen": "speech"}

#: The longest recall text ``attnkit show --model recall --length`` generates (2**20 tokens: minutes on 2 cores).
MAX_LENGTH = 2**20


def _seed(text: str) -> int:
    """argparse type: a seed, an int >= 0 (torch.Generator's)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 0, but got {text!r}") from None
    if not 0 <= value < 2**63:
        raise argparse.ArgumentTypeError(f"must be in 0..2**63-1, but got {value}")
    return value


def _length(text: str) -> int:
    """argparse type: a token count in 1..MAX_LENGTH."""
    value = _positive(text)
    if value > MAX_LENGTH:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_LENGTH:,} tokens, but got {value:,}")
    return value


def _number_in(text: str, low: float, high: float, what: str, where: str) -> float:
    """``text`` as a float in [low, high] (nan refused), or an argparse error saying ``what``/``where``."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {what}, but got {text!r}") from None
    if not low <= value <= high:
        raise argparse.ArgumentTypeError(f"must be {where}, but got {text!r}")
    return value


def _minutes(text: str) -> float:
    """argparse type: a training time in minutes, 1 to 60."""
    return _number_in(text, 1.0, 60.0, "a number of minutes", "between 1 and 60 minutes")


def _fraction(text: str) -> float:
    """argparse type: a number in [0, 1]."""
    return _number_in(text, 0.0, 1.0, "a number in [0, 1]", "in [0, 1] (0 = start of the text, 1 = end)")


def _read_text(args) -> str | None:
    from attnkit.errors import AttnkitValueError

    if args.file is not None and args.text is not None:
        raise AttnkitValueError("give the text or --file FILE, not both.")
    if args.file is not None:
        if not Path(args.file).is_file():
            raise AttnkitValueError(f"--file {args.file!r} is not a file: give a UTF-8 text file.")
        try:
            text = Path(args.file).read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise AttnkitValueError(f"--file {args.file!r} is not UTF-8 text.") from None
        if not text.strip():
            raise AttnkitValueError(f"--file {args.file!r} holds no text (it is empty or only white space).")
        return text
    if args.text is None and args.model != "recall":
        raise AttnkitValueError("give a text to look at (or --file FILE).")
    if args.text is not None:
        if not args.text.strip():
            raise AttnkitValueError('the text is empty: give some words to look at, e.g. attnkit show "The cat sat."')
        try:
            args.text.encode("utf-8")
        except UnicodeEncodeError as err:  # bytes the terminal's encoding could not decode (surrogate escapes)
            raise AttnkitValueError(
                f"the text holds a byte that is not UTF-8 at character {err.start} "
                f"({args.text[max(0, err.start - 10) : err.start].encode('utf-8', 'replace').decode()!r} before it): "
                "pass UTF-8 text, or put it in a UTF-8 file and use --file FILE."
            ) from None
    return args.text


def show(args: argparse.Namespace) -> int:
    from attnkit.apps import show as app

    app.check(args)
    text = _read_text(args)
    return app.run(args, _out_dir(args.out), text)  # the folder before the model runs: a bad --out fails fast


def train(args: argparse.Namespace) -> int:
    from attnkit.apps import train as app

    args.out = _out_dir(args.out)
    return app.run(args)


def recommend(args: argparse.Namespace) -> int:
    from attnkit.apps import recommend as app

    app.check(args)
    return app.run(args, _out_dir(args.out))


def caption(args: argparse.Namespace) -> int:
    from attnkit.apps import caption as app

    app.check(args)
    return app.run(args, _out_dir(args.out))


def listen(args: argparse.Namespace) -> int:
    from attnkit.apps import listen as app

    app.check(args)
    return app.run(args, _out_dir(args.out))


def translate(args: argparse.Namespace) -> int:
    from attnkit.apps import translate as app

    app.check(args)
    return app.run(args, _out_dir(args.out))


def build_parser() -> argparse.ArgumentParser:
    from attnkit import __version__
    from attnkit.apps.show import LONG_FROM
    from attnkit.apps.train import SPEECH_STEPS_PER_MINUTE

    parser = argparse.ArgumentParser(prog="attnkit", description="Exact attention you can see into.")
    parser.add_argument("--version", action="version", version=f"attnkit {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser(
        "show",
        help="run all-MiniLM-L6-v2 (or --model recall|DIR) on a text and write its attention as HTML, PNG and NPZ",
        description="Run all-MiniLM-L6-v2 (built from attnkit parts), the shipped RecallLM (--model recall), "
        "or any local HuggingFace encoder or decoder checkpoint (--model DIR) on TEXT and write attention.html "
        "(interactive), attention.png (every layer and head), attention.npz (tokens and weights) "
        "and, with --layer/--head, one PNG per head. Long inputs (over 1024 tokens, or --rows) get the long "
        "view instead: long.html, long_heads.png, long_keymass.png, long_rows.png and attention_stats.npz "
        "(exact statistics per layer and head, the mass each token receives, and the full weights of the "
        "chosen query rows), made without any L x L matrix.",
    )
    p.add_argument("text", nargs="?", help="the text to look at")
    p.add_argument("--file", help="read the text from this UTF-8 file (long texts welcome)")
    p.add_argument(
        "--model",
        help="'recall' (the shipped RecallLM) or a local checkpoint folder (config.json, "
        "weights, tokenizer) run through transformers with attn_implementation='attnkit'",
    )
    p.add_argument(
        "--length",
        type=_length,
        default=None,
        help=f"with --model recall and no text: generate a recall text of this many tokens (default 4096, "
        f"at most {MAX_LENGTH:,})",
    )
    p.add_argument(
        "--depth",
        type=_fraction,
        default=None,
        help="with --model recall and no text: where the asked pair sits, 0 = start of the text, 1 = end "
        "(default 0.02)",
    )
    p.add_argument(
        "--seed", type=_seed, default=None, help="with --model recall and no text: the generated text's seed (0)"
    )
    p.add_argument(
        "--rows",
        help="query positions whose full weights to keep, e.g. '0,-1' (default: the last token); "
        f"inputs over {LONG_FROM} tokens always get the long view",
    )
    p.add_argument("--out", default="attention", help="output folder (default: ./attention)")
    p.add_argument("--layer", type=int, help="draw the heads of this layer as PNGs (0-based)")
    p.add_argument("--head", type=int, help="draw this head (of --layer, or of every layer) as PNG")
    p.set_defaults(run=show)

    p = sub.add_parser(
        "train",
        help="train a model: translator, captioner, recommender, recall or speech, or name its command "
        "(translate, caption, recommend, listen) (seeded; 2.5-43 min on 2 cores)",
        description="Train one of the shipped models from scratch, seeded, with a progress bar, and save it as "
        "OUT/<model>.safetensors with a JSON record of the run. The defaults reproduce the shipped weights. "
        "Times on 2 CPU cores with the defaults: translator (the date normalizer, 1500 steps) about 2.5 min; "
        "captioner (the digit captioner, 4000 steps) about 5 min; recommender (SASRec on MovieLens-100K, "
        "120 epochs) about 6 min; recall (RecallLM, 5000 steps) about 7 min; speech (the spoken-digit "
        "recogniser, 9200 steps; needs espeak-ng) about 43 min: 42 of training, 1 of speech synthesis (--steps 4000: "
        "18 min, about as good on new voices, see the docs). A model may also be named by the command that runs "
        "it: translate, caption, recommend, listen. "
        "Fewer --steps trains faster and worse; each model's page in the docs says what its numbers mean.",
    )
    p.add_argument(
        "model",
        choices=[*TRAINED, *TRAINED_BY_COMMAND],
        help="which model: translator (or translate), captioner (caption), recommender (recommend), recall, "
        "speech (listen)",
    )
    p.add_argument(
        "--steps",
        type=_positive,
        default=None,
        help="optimizer steps (default 1500; captioner 4000; recall 5000; speech 9200); "
        "for the recommender, epochs (default 120)",
    )
    p.add_argument(
        "--minutes",
        type=_minutes,
        default=None,
        help=f"speech only: train for about this many minutes on 2 cores (1-60), i.e. "
        f"{SPEECH_STEPS_PER_MINUTE} steps a minute; the shipped weights took the default",
    )
    p.add_argument("--seed", type=_seed, default=0, help="seed of the data and the initial weights")
    p.add_argument("--batch-size", type=_positive, default=None, help="default 128; captioner 96; recall and speech 32")
    p.add_argument("--out", default=None, help="output folder (default: ./<model>)")
    p.set_defaults(run=train)

    p = sub.add_parser(
        "recommend",
        help="recommend movies to a MovieLens-100K user and draw which past movies the model attended to",
        description="Print a user's last movies and the top-k next movies from SASRec, and write "
        "recommend.png and recommend.html (the next-item query's attention over the history).",
    )
    p.add_argument("--user", type=int, required=True, help="a MovieLens-100K user id (1-943)")
    p.add_argument("-k", type=_positive, default=10, help="how many movies (default 10)")
    p.add_argument("--last", type=_positive, default=30, help="how many recent history items to draw (default 30)")
    p.add_argument("--out", default="recommend", help="output folder (default: ./recommend)")
    p.set_defaults(run=recommend)

    p = sub.add_parser(
        "listen",
        help="transcribe spoken digits and draw which stretch of audio each digit was read from",
        description="Transcribe FILE.wav (16-bit PCM, any rate; stereo is averaged), --example N (a shipped "
        "WAV) or --say DIGITS (synthesised by espeak-ng in a held-out voice) and write listen.png "
        "(waveform, spectrogram and the characters x time attention on one time axis), listen.html "
        "and listen.npz.",
    )
    p.add_argument("file", nargs="?", help="a WAV file")
    p.add_argument("--say", help='digits for espeak-ng to say, e.g. "4 0 7"')
    p.add_argument("--example", type=_positive, help="a shipped example WAV (1, 2 or 3)")
    p.add_argument("--out", default="listen", help="output folder (default: ./listen)")
    p.set_defaults(run=listen)

    p = sub.add_parser(
        "caption",
        help="caption a strip of 1-8 handwritten digits and draw where each word looked",
        description="Caption a strip of 1 to 8 test-split digits (--digits 7,3,1) or an image (--image "
        "FILE.npy|.png, 8 pixels high and 8n wide, n <= 8) and write caption.png (each word's cross-attention "
        "over the image) and caption.html. The model reads at most 8 digits.",
    )
    p.add_argument("--digits", help="1 to 8 digits 0-9 separated by commas, drawn from the test split")
    p.add_argument("--image", help="an (8, 8n) image with n <= 8 digits: .npy in [0, 16] or a grey .png")
    p.add_argument("--seed", type=_seed, default=0, help="which test-split images of those digits (default 0)")
    p.add_argument("--out", default="caption", help="output folder (default: ./caption)")
    p.set_defaults(run=caption)

    p = sub.add_parser(
        "translate",
        help="write a date as ISO YYYY-MM-DD and draw the cross-attention alignment",
        description="Print TEXT as an ISO date and write alignment.png (input x output characters, "
        "last layer, mean of heads), alignment_grid.png (every layer and head) and alignment.html.",
    )
    p.add_argument("text", help='a date, e.g. "25th of March 2019"')
    p.add_argument("--out", default="translation", help="output folder (default: ./translation)")
    p.add_argument("--weights", help="a .safetensors file from attnkit train (default: the shipped weights)")
    p.set_defaults(run=translate)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv:  # a bare `attnkit`: what it can do
        parser.print_help()
        return 0
    args = parser.parse_args(argv)
    if args.command == "train":  # the model by its command's name too, and defaults that depend on the model
        args.model = TRAINED_BY_COMMAND.get(args.model, args.model)
        from attnkit.apps.train import SPEECH_STEPS_PER_MINUTE, TRAIN_DEFAULTS

        steps, batch_size = TRAIN_DEFAULTS[args.model]
        if args.minutes is not None:
            if args.model != "speech" or args.steps is not None:
                parser.error("--minutes is for 'train speech' without --steps (it sets the steps)")
            args.steps = round(args.minutes * SPEECH_STEPS_PER_MINUTE)
        args.out = args.out or args.model
        args.steps = args.steps or steps
        args.batch_size = args.batch_size or batch_size
    try:
        return args.run(args)
    except ModuleNotFoundError as err:  # an optional dependency: say which extra installs it
        print(f"attnkit {args.command}: {missing_extra(err, f'attnkit {args.command}') or err}", file=sys.stderr)
        return 2
    except AttnkitError as err:
        print(f"attnkit {args.command}: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # a file system error the checks above did not foresee
        print(f"attnkit {args.command}: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
