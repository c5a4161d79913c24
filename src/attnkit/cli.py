"""The ``attnkit`` command (also ``python -m attnkit``): argparse subcommands only;
the work is done by the library."""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from attnkit.errors import AttnkitError, missing_extra


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _out_dir(path) -> Path:
    """The --out folder, created; a clear error when it names a file or cannot be made."""
    from attnkit._validate import AttnkitValueError

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


#: The longest recall text ``attnkit show --model recall --length`` generates (2**20 tokens: minutes on 2 cores).
MAX_LENGTH = 2**20


def _length(text: str) -> int:
    """argparse type: a token count in 1..MAX_LENGTH."""
    value = _positive(text)
    if value > MAX_LENGTH:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_LENGTH:,} tokens, but got {value:,}")
    return value


#: Optimizer steps of ``attnkit train speech`` per minute on 2 cores (batch 32), measured.
SPEECH_STEPS_PER_MINUTE = 230


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


def _capture(model, call, tokens, layers: int, heads: int, rows_text) -> dict:
    """Run ``call()`` under capture: full weights when they fit the page, else statistics and rows."""
    import torch

    import attnkit

    length = len(tokens)
    _say(f"running the model on {length:,} tokens ...")
    if _fits_full_view(length, layers, heads) and rows_text is None:
        with attnkit.capture(model) as cap, torch.no_grad():
            call()
        return {"kind": "full", "weights": cap.stack(), "tokens": tokens}
    rows = _rows(rows_text, length)
    with attnkit.capture(model, mode="stats", rows=rows) as cap, torch.no_grad():
        call()
    return {"kind": "long", "capture": cap, "tokens": tokens, "rows": rows}


def _warn_unknown(text: str, tokens, offsets, unknown: str | None, special, model_name: str) -> None:
    """Say which characters of ``text`` came out as the model's unknown token, and what to do."""
    if not unknown:
        return
    spans = [span for token, span in zip(tokens, offsets) if token == unknown and span[1] > span[0]]
    if not spans:
        return
    chars: list[str] = []
    for start, end in spans:
        chars.extend(c for c in text[start:end] if c not in chars and not c.isspace())
    shown = " ".join(chars[:20]) + (f" ... ({len(chars)} in all)" if len(chars) > 20 else "")
    words = sum(1 for t in tokens if t == unknown or t not in special)
    _say(
        f"warning: {len(spans)} of {words} tokens came out as {unknown} (characters not in {model_name}'s "
        f"vocabulary: {shown}); the model sees one placeholder for each. To look at this text, pass --model DIR with a "
        "local HuggingFace model whose vocabulary covers it (a folder holding config.json, the weights and "
        "the tokenizer, e.g. a Chinese BERT saved with save_pretrained)."
    )


def _run_minilm(text, rows_text=None) -> dict:
    """The packaged MiniLM on ``text`` (cut at its 512-token limit)."""
    from attnkit.models import MiniLM

    _say("loading all-MiniLM-L6-v2 (attnkit.models.MiniLM) ...")
    model = MiniLM.from_package()
    encoding = model.tokenizer.encode(text)
    if encoding.overflowing:  # the tokenizer cut the text at the model's limit
        end = encoding.offsets[-2][1] if len(encoding.offsets) > 1 else 0
        _say(
            f"note: all-MiniLM-L6-v2 reads at most {model.max_seq_length} tokens: showing the text up to "
            f"character {end} of {len(text)} ({len(text[:end].split())} of {len(text.split())} words)."
        )
    tokens = model.tokens(text)
    _warn_unknown(text, encoding.tokens, encoding.offsets, "[UNK]", ("[CLS]", "[SEP]"), "all-MiniLM-L6-v2")
    ids, lengths = model.tokenize([text])
    run = _capture(model, lambda: model(ids, lengths), tokens, 6, 12, rows_text)
    return {**run, "special": ("[CLS]", "[SEP]"), "title": text[:200]}


def _run_recall(text, args) -> dict:
    """The shipped RecallLM on ``text`` (its vocabulary) or on a generated text of ``--length`` tokens."""
    import torch

    from attnkit.models.recall import RecallLM, make_batch

    _say("loading RecallLM (attnkit.models.RecallLM) ...")
    model = RecallLM.from_package()
    report, marks = [], {}
    if text is not None:
        ids = model.tokenize(text)
    else:
        g = torch.Generator().manual_seed(args.seed)
        tokens, targets = make_batch(1, args.length, pairs=8, queries=1, task=model.task, generator=g, depth=args.depth)
        at = int((targets[0] != -100).nonzero()[0])
        ids = tokens[0, : at + 1]  # ends with "? key": the model's turn
        asked = int(ids[-1])
        needle = int((ids[:-2] == asked).nonzero()[0])
        marks = {"needle": needle}
        truth = model.task.tokens[int(targets[0, at])]
        report.append(
            f"the text asks for {model.task.tokens[asked]}, stated at position {needle:,} "
            f"({at - needle:,} tokens before the question); the answer is {truth}"
        )
    words = model.tokens_of(ids)
    c = model.config
    run = _capture(model, lambda: model(ids[None]), words, c.num_layers, c.num_heads, args.rows)
    answer, p = model.answer(ids[None])[0]
    report.append(
        f"RecallLM answers: {answer or '(no query at the end: the text must end with ? k<number>)'}"
        + (f" (p={p:.2f})" if answer else "")
    )
    return {**run, "special": ("<bos>",), "title": f"RecallLM, {len(words):,} tokens", "marks": marks, "report": report}


def _run_checkpoint(path, text, rows_text=None) -> dict:
    """The same from a local HuggingFace checkpoint folder, run with attn_implementation='attnkit'."""
    from attnkit._validate import AttnkitValueError

    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise AttnkitValueError(
            f"--model must be 'recall' or a folder with a config.json (a saved checkpoint), but got {path!r}."
        )
    from transformers import AutoConfig, AutoModel, AutoTokenizer

    import attnkit.integrations.transformers  # noqa: F401  (registers "attnkit")

    config = AutoConfig.from_pretrained(folder)
    if getattr(config, "is_encoder_decoder", False):
        raise AttnkitValueError(
            f"attnkit show takes encoder or decoder checkpoints; {folder} holds an encoder-decoder "
            f"({config.model_type}). Use attnkit.capture in Python to look at it."
        )
    _say(f"loading {folder} (attn_implementation='attnkit') ...")
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
        model = AutoModel.from_pretrained(folder, attn_implementation="attnkit").eval()
    except OSError as err:
        raise AttnkitValueError(f"cannot load the checkpoint in {folder}: {str(err).splitlines()[0]}") from None
    attnkit.integrations.transformers.check_model(model)
    limit = getattr(tokenizer, "model_max_length", None)
    limit = limit if isinstance(limit, int) and limit < 1_000_000 else None
    encoded = tokenizer(text, return_tensors="pt", truncation=limit is not None, max_length=limit)
    if limit is not None and len(tokenizer(text)["input_ids"]) > limit:
        _say(f"note: {folder.name} reads at most {limit} tokens: showing the first {limit}.")
    tokens = tokenizer.convert_ids_to_tokens(encoded["input_ids"][0].tolist())
    if getattr(tokenizer, "is_fast", False):
        spans = tokenizer(text, return_offsets_mapping=True, truncation=limit is not None, max_length=limit)
        _warn_unknown(
            text, tokens, spans["offset_mapping"], tokenizer.unk_token, tokenizer.all_special_tokens, folder.name
        )
    layers = getattr(config, "num_hidden_layers", 1)
    heads = getattr(config, "num_attention_heads", 1)
    run = _capture(model, lambda: model(**encoded), tokens, layers, heads, rows_text)
    return {**run, "special": tuple(tokenizer.all_special_tokens), "title": text[:200]}


def _read_text(args) -> str | None:
    from attnkit._validate import AttnkitValueError

    if args.file is not None and args.text is not None:
        raise AttnkitValueError("give the text or --file FILE, not both.")
    if args.file is not None:
        try:
            return Path(args.file).read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise AttnkitValueError(f"--file {args.file!r} is not UTF-8 text.") from None
    if args.text is None and args.model != "recall":
        raise AttnkitValueError("give a text to look at (or --file FILE).")
    if args.text is not None:
        try:
            args.text.encode("utf-8")
        except UnicodeEncodeError as err:  # bytes the terminal's encoding could not decode (surrogate escapes)
            raise AttnkitValueError(
                f"the text holds a byte that is not UTF-8 at character {err.start} "
                f"({args.text[max(0, err.start - 10) : err.start].encode('utf-8', 'replace').decode()!r} before it): "
                "pass UTF-8 text, or put it in a UTF-8 file and use --file FILE."
            ) from None
    return args.text


def _rows(text, length: int) -> list[int]:
    """--rows "a,b,-1" as query rows in [0, length)."""
    from attnkit._validate import AttnkitValueError

    try:
        rows = [int(x) for x in (text or "-1").split(",") if x.strip()]
    except ValueError:
        raise AttnkitValueError(
            f"--rows must be comma-separated token positions, e.g. 0,-1, but got {text!r}."
        ) from None
    bad = [r for r in rows if not -length <= r < length]
    if bad or not rows:
        raise AttnkitValueError(f"--rows {text!r}: positions must be in {-length}..{length - 1} for {length} tokens.")
    return sorted({r % length for r in rows})


#: Inputs longer than this many tokens get the long view (statistics and chosen rows).
LONG_FROM = 1024


def _fits_full_view(length: int, layers: int, heads: int) -> bool:
    """Whether every layer's full weights fit the interactive page (else: the long view)."""
    from attnkit.viz.html import MAX_CELLS

    return length <= LONG_FROM and layers * heads * length * length <= MAX_CELLS


def show(args: argparse.Namespace) -> int:
    import numpy as np

    from attnkit.inspect.summary import summarize
    from attnkit.viz import attention_grid, save_html, visualize_attention

    out = _out_dir(args.out)  # before the model runs: a bad --out fails fast
    text = _read_text(args)
    if args.model == "recall":
        run = _run_recall(text, args)
    elif args.model is None:
        run = _run_minilm(text, args.rows)
    else:
        run = _run_checkpoint(args.model, text, args.rows)
    if run["kind"] == "long":
        return _write_long(out, run)
    weights, tokens, special = run["weights"], run["tokens"], run["special"]
    layers, heads = weights.shape[:2]  # (layers, heads, L, L)
    for name, value, limit in (("--layer", args.layer, layers), ("--head", args.head, heads)):
        if value is not None and not 0 <= value < limit:
            raise SystemExit(f"attnkit show: {name} must be in 0..{limit - 1}, but got {value}.")

    title = run.get("title") or text
    written = [
        save_html(
            out / "attention.html", weights, tokens, layer_names=[f"layer {i}" for i in range(layers)], title=title
        )
    ]
    _say("drawing the figures ...")
    attention_grid(weights, out / "attention.png", tokens=tokens, title=title)
    written.append(out / "attention.png")
    picked = []
    if args.layer is not None or args.head is not None:
        wanted_layers = [args.layer] if args.layer is not None else range(layers)
        wanted_heads = [args.head] if args.head is not None else range(heads)
        picked = [(layer, head) for layer in wanted_layers for head in wanted_heads]
    for layer, head in picked:
        path = out / f"attention_layer{layer}_head{head}.png"
        visualize_attention(weights[layer, head], tokens, path, title=f"layer {layer}, head {head}")
        written.append(path)
    # float16 halves the file (weights in [0, 1] keep 3 significant digits)
    np.savez_compressed(
        out / "attention.npz",
        tokens=np.array(tokens),
        weights=weights.numpy().astype(np.float16),
        layers=np.array([f"layer {i}" for i in range(layers)]),
    )
    written.append(out / "attention.npz")

    if len(tokens) <= 300:
        print(f"tokens ({len(tokens)}): {' '.join(tokens)}")
        print()
    print(summarize(weights, tokens, special=special))
    for line in run.get("report", []):
        print(line)
    print()
    for path in written:
        print(f"wrote {path}")
    return 0


def _write_long(out: Path, run: dict) -> int:
    """The long view: statistics per layer and head, key mass, the chosen rows' weights."""
    import numpy as np

    from attnkit.viz.long import long_figures, save_long_html

    cap, tokens, rows = run["capture"], run["tokens"], run["rows"]
    title = run.get("title") or f"{len(tokens):,} tokens"
    _say(f"{len(tokens):,} tokens: writing the long view (statistics, and the weights of rows {rows}) ...")
    written = [save_long_html(out / "long.html", cap.stats, tokens, rows, cap.weights, title=title)]
    written += long_figures(out, cap.stats, tokens, rows, cap.weights, title=title, marks=run.get("marks"))
    stacked: dict[str, Any] = {  # entropy in bits, as everywhere else
        name: np.stack([getattr(s, name)[0].numpy() for s in cap.stats]).astype(np.float32)
        for name in ("entropy_bits", "max_weight", "sink_mass", "mean_distance")
    }
    np.savez_compressed(
        out / "attention_stats.npz",
        tokens=np.array(tokens),
        rows=np.array(rows),
        received=np.stack([s.received[0].numpy() for s in cap.stats]).astype(np.float32),
        row_weights=np.stack([w[0].numpy() for w in cap.weights]).astype(np.float32),
        **stacked,
    )
    written.append(out / "attention_stats.npz")
    print(f"layer  head  entropy (bits)  first-token mass  mean distance   (means over {len(tokens):,} query rows)")
    for layer, st in enumerate(cap.stats):
        summary = st.head_summary()
        for head in range(len(summary["entropy"])):
            print(
                f"{layer:>5}  {head:>4}  {float(summary['entropy'][head]) / math.log(2):>14.2f}  "
                f"{float(summary['sink_mass'][head]):>16.1%}  {float(summary['mean_distance'][head]):>13,.0f}"
            )
    for line in run.get("report", []):
        print(line)
    print()
    for path in written:
        print(f"wrote {path}")
    return 0


def _command(args) -> str:
    """The command that reproduces a training run (recorded with the weights)."""
    return f"attnkit train {args.model} --steps {args.steps} --seed {args.seed} --batch-size {args.batch_size}"


def _save_trained(args, model, record, path: Path, summary: str) -> int:
    """Record the command with the weights, write them to ``path`` and print ``summary``."""
    record["command"] = _command(args)
    written = model.save(path, training=record)
    print(summary)
    print(f"wrote {written}")
    return 0


def train(args: argparse.Namespace) -> int:
    if args.model == "captioner":
        return _train_captioner(args)
    if args.model == "recommender":
        return _train_recommender(args)
    if args.model == "recall":
        return _train_recall(args)
    if args.model == "speech":
        return _train_speech(args)
    from attnkit.models.translator import WEIGHTS
    from attnkit.models.translator import train as train_translator

    _out_dir(args.out)
    _say(f"training DateTranslator: {args.steps} steps, seed {args.seed}, batch {args.batch_size}")
    model, record = train_translator(args.steps, seed=args.seed, batch_size=args.batch_size)
    return _save_trained(
        args,
        model,
        record,
        Path(args.out) / WEIGHTS,
        f"exact match on 1000 fresh dates: {record['exact_match_1000']:.1%} "
        f"(final loss {record['final_loss']:.4f}, {record['seconds']:.0f} s)",
    )


def _train_captioner(args) -> int:
    from attnkit.models.captioner import WEIGHTS
    from attnkit.models.captioner import train as train_captioner

    out, steps, batch_size = _out_dir(args.out), args.steps, args.batch_size
    _say(f"training DigitCaptioner: {steps} steps, seed {args.seed}, batch {batch_size}")
    model, record = train_captioner(steps, seed=args.seed, batch_size=batch_size)
    return _save_trained(
        args,
        model,
        record,
        out / WEIGHTS,
        f"test split, 500 strips of 2-6 digits: {record['test_exact']:.1%} exact captions, "
        f"{record['test_word_accuracy']:.1%} words, {record['test_alignment']:.1%} aligned "
        f"({record['seconds']:.0f} s of training)",
    )


def _train_speech(args) -> int:
    from attnkit.models.speech import TEST_VOICES, TRAIN_VOICES, WEIGHTS, dataset, evaluate
    from attnkit.models.speech import train as train_speech

    out, steps, batch_size = _out_dir(args.out), args.steps, args.batch_size
    _say(
        f"training SpeechRecognizer: {steps} steps, seed {args.seed}, batch {batch_size}, on espeak-ng speech "
        f"({len(TRAIN_VOICES)} training voices: accents en-us, en-gb, en-029, en-us-nyc with every variant "
        "but the held-out ones, and other languages' voices reading the English words)"
    )
    model, record = train_speech(steps, seed=args.seed, batch_size=batch_size, log=_say)
    _say("scoring 100 utterances of held-out voices ...")
    h = record["held_out_100"] = evaluate(model, dataset(100, TEST_VOICES, 10_000))
    return _save_trained(
        args,
        model,
        record,
        out / WEIGHTS,
        f"held-out voices, 100 utterances: {h['exact']:.1%} exact, CER {h['cer']:.1%}, "
        f"{h['monotonic']:.0%} monotonic alignments ({record['seconds']:.0f} s); "
        "benchmarks/speech.py scores 500",
    )


def _train_recall(args) -> int:
    from attnkit.models.recall import WEIGHTS, accuracy
    from attnkit.models.recall import train as train_recall

    out, steps, batch_size = _out_dir(args.out), args.steps, args.batch_size
    _say(f"training RecallLM: {steps} steps, seed {args.seed}, batch {batch_size}, texts of 64 growing to 1024 tokens")
    model, record = train_recall(steps, seed=args.seed, batch_size=batch_size, log=_say)
    record["accuracy_1024"] = accuracy(model, 1024, n=200, seed=1)
    return _save_trained(
        args,
        model,
        record,
        out / WEIGHTS,
        f"first-query accuracy on 200 fresh texts of 1024 tokens: {record['accuracy_1024']:.1%} "
        f"({record['seconds']:.0f} s of training); benchmarks/long_context.py measures 4k-32k",
    )


def _train_recommender(args) -> int:
    from attnkit.models.recommender import WEIGHTS
    from attnkit.models.recommender import train as train_recommender

    out, epochs, batch_size = _out_dir(args.out), args.steps, args.batch_size
    _say(f"training SASRec on MovieLens-100K: {epochs} epochs, seed {args.seed}, batch {batch_size}")
    model, record = train_recommender(epochs, seed=args.seed, batch_size=batch_size, log=_say)
    return _save_trained(
        args,
        model,
        record,
        out / WEIGHTS,
        f"test: HR@10 {record['test_HR@10']:.3f}, NDCG@10 {record['test_NDCG@10']:.3f} "
        f"(best validation NDCG@10 {record['best_valid_NDCG@10']:.3f}, {record['seconds']:.0f} s)",
    )


def recommend(args: argparse.Namespace) -> int:
    from attnkit._validate import AttnkitValueError
    from attnkit.models import movielens
    from attnkit.models.recommender import SASRec
    from attnkit.viz import save_html, visualize_attention
    from attnkit.viz.html import bars_overview, cut_labels

    out = _out_dir(args.out)
    users = movielens.split().test
    if args.user not in users:
        raise AttnkitValueError(f"--user must be a MovieLens-100K user id (1 to {max(users)}), but got {args.user}.")
    history = movielens.history(args.user, "test")  # everything but the held-out last item
    names = movielens.titles()
    model = SASRec.from_package()
    top = model.recommend([history], k=args.k)[0]
    print(f"user {args.user}: the last {min(5, len(history))} of {len(history)} movies")
    for item in history[-5:]:
        print(f"  {names.get(item, item)}")
    print(f"top {args.k}:")
    for rank, item in enumerate(top, 1):
        print(f"  {rank:2d}. {names.get(item, item)}")
    explained = model.explain(history)
    shown = min(args.last, len(explained["items"]))
    weights = explained["weights"][..., -shown:]  # (layers, heads, shown)
    labels, _ = cut_labels(explained["titles"][-shown:], 40)
    drew_on = model.attribute(history, top)  # (k, n): each history item's part of each score
    items = []
    for item, row in zip(top, drew_on):
        best = row.topk(min(3, len(row)))
        items.append(
            (
                names.get(item, str(item)),
                [(explained["titles"][j], v) for v, j in zip(best.values.tolist(), best.indices.tolist()) if v > 0],
            )
        )
    overview = bars_overview(
        f"Top {len(top)} for user {args.user}, and the past movies each one drew on most",
        items,
        note=f"{len(history)} movies in the history. Each bar: how much that past movie raises the title's score "
        "through the last layer's attention (its weight times its value, read along the title's embedding). "
        "The heatmap and model views show the weights themselves.",
        captions=[
            "drew on most:" if bars else "no past movie raises it: the score comes from elsewhere" for _, bars in items
        ],
    )
    written = [out / "recommend.png", out / "recommend.html"]
    visualize_attention(
        weights.mean(1),
        [f"layer {i}" for i in range(len(weights))],
        written[0],
        key_tokens=labels,
        xlabel="history (oldest to newest)",
        ylabel="",
        title=f"user {args.user}: the next-item query's attention (mean of heads)",
    )
    save_html(
        written[1],
        weights[:, :, None, :],
        ["next item"],
        key_tokens=labels,
        layer_names=[f"layer {i}" for i in range(len(weights))],
        title=f"user {args.user}: attention over the history",
        axes=("query (the next item)", f"past movie (the last {shown}, oldest first)"),
        overview=overview,
        focus=(len(weights) - 1, None),
    )
    for path in written:
        _say(f"wrote {path}")
    return 0


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


def caption(args: argparse.Namespace) -> int:
    import random

    from attnkit._validate import AttnkitValueError
    from attnkit.models.captioner import WORDS, DigitCaptioner, digits, split, strip_of
    from attnkit.viz.regions import region_figure, save_region_html

    out = _out_dir(args.out)
    if (args.digits is None) == (args.image is None):
        raise AttnkitValueError("give --digits (e.g. --digits 7,3,1) or --image FILE, one of them.")
    if args.digits is not None:
        try:
            wanted = [int(d) for d in args.digits.split(",")]
        except ValueError:
            raise AttnkitValueError(
                f"--digits must be digits 0-9 separated by commas, but got {args.digits!r}."
            ) from None
        if not wanted or not all(0 <= d <= 9 for d in wanted) or len(wanted) > 8:
            raise AttnkitValueError(f"--digits must be 1 to 8 digits 0-9 separated by commas, but got {args.digits!r}.")
        _, labels = digits()
        rng = random.Random(args.seed)
        pool = split("test").tolist()
        chosen = [rng.choice([i for i in pool if int(labels[i]) == d]) for d in wanted]
        image = strip_of(chosen)
        _say(f"test-split digits {chosen} ({' '.join(WORDS[d] for d in wanted)})")
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
        _say(f"wrote {path}")
    return 0


def listen(args: argparse.Namespace) -> int:
    import numpy as np

    from attnkit._validate import AttnkitValueError
    from attnkit.models.speech import SpeechRecognizer, examples, read_wav, say, write_wav
    from attnkit.viz import save_html
    from attnkit.viz.html import waveform_overview
    from attnkit.viz.speech import attended_spans, speech_figure

    out = _out_dir(args.out)
    given = [x is not None for x in (args.file, args.say)] + [args.example is not None]
    if sum(given) != 1:
        raise AttnkitValueError('give FILE.wav, --say "4 0 7" or --example N (one of them).')
    if args.say is not None:
        digits = "".join(args.say.split())
        samples, rate = say(digits, "en-gb-x-rp", "f3"), 16000
        write_wav(out / "said.wav", samples, rate)
        _say(f"espeak-ng (en-gb-x-rp+f3, a held-out voice) said {digits}: {out / 'said.wav'}")
    else:
        path = args.file
        if args.example is not None:
            shipped = examples()
            if not 1 <= args.example <= len(shipped):
                raise AttnkitValueError(f"--example must be 1..{len(shipped)}, but got {args.example}.")
            path, truth = shipped[args.example - 1]
            _say(f"example {args.example}: {path} (spoken digits {truth})")
        samples, rate = read_wav(path)
        if samples.ndim > 1:
            _say(f"note: {samples.shape[0]} channels: using their mean")
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
        _say(f"wrote {path}")
    return 0


def _shown(chars):
    """Characters as figure labels: a visible mark for the space."""
    return ["\u2423" if ch == " " else ch for ch in chars]


def _load_translator(path, cls):
    from attnkit._validate import AttnkitValueError

    if not Path(path).is_file():
        raise AttnkitValueError(f"--weights {path!r} is not a file: give a .safetensors file written by attnkit train.")
    try:
        return cls.load(path)
    except Exception as err:  # safetensors, json and state-dict errors: all mean "not our weights"
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise AttnkitValueError(
            f"--weights {path!r} is not a DateTranslator weights file written by attnkit train ({first})."
        ) from None


def translate(args: argparse.Namespace) -> int:
    from attnkit.models.translator import DateTranslator
    from attnkit.viz import attention_grid, save_html, visualize_attention

    out = _out_dir(args.out)
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
        _say(f"wrote {path}")
    return 0


#: ``attnkit train MODEL``: default (steps, batch size); the recommender's steps are epochs.
TRAIN_DEFAULTS = {
    "translator": (1500, 128),
    "captioner": (4000, 96),
    "recommender": (120, 128),
    "recall": (5000, 32),
    "speech": (9200, 32),  # = --minutes 40; the shipped weights
}


def build_parser() -> argparse.ArgumentParser:
    from attnkit import __version__

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
        default=4096,
        help=f"with --model recall and no text: generate a recall text of this many tokens (default 4096, "
        f"at most {MAX_LENGTH:,})",
    )
    p.add_argument(
        "--depth",
        type=_fraction,
        default=0.02,
        help="with --length: where the asked pair sits, 0 = start of the text, 1 = end (default 0.02)",
    )
    p.add_argument("--seed", type=int, default=0, help="with --length: the generated text's seed")
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
        help="train a model: translator, captioner, recommender, recall or speech (seeded; 2.5-42 min on 2 cores)",
        description="Train one of the shipped models from scratch, seeded, with a progress bar, and save it as "
        "OUT/<model>.safetensors with a JSON record of the run. The defaults reproduce the shipped weights. "
        "Times on 2 CPU cores with the defaults: translator (the date normalizer, 1500 steps) about 2.5 min; "
        "captioner (the digit captioner, 4000 steps) about 5 min; recommender (SASRec on MovieLens-100K, "
        "120 epochs) about 6 min; recall (RecallLM, 5000 steps) about 7 min; speech (the spoken-digit "
        "recogniser, 9200 steps; needs espeak-ng) about 42 min plus 1 min of speech synthesis (--steps 4000: "
        "18 min, about as good on new voices, see the docs). "
        "Fewer --steps trains faster and worse; each model's page in the docs says what its numbers mean.",
    )
    p.add_argument(
        "model",
        choices=["translator", "captioner", "recommender", "recall", "speech"],
        help="which model: translator, captioner, recommender, recall or speech",
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
    p.add_argument("--seed", type=int, default=0, help="seed of the data and the initial weights")
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
    p.add_argument("--seed", type=int, default=0, help="which test-split images of those digits (default 0)")
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
    if args.command == "train":  # defaults that depend on the model
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
