"""``attnkit show``: a model's attention on a text, as an interactive page, figures and arrays.

The packaged all-MiniLM-L6-v2, the shipped RecallLM, or a local HuggingFace checkpoint run through
``attn_implementation="attnkit"``; short inputs get every layer's full weights, long ones the long
view (exact statistics per layer and head and the chosen rows' weights, no ``L x L`` matrix).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from attnkit.apps.report import say


def _capture(model, call, tokens, layers: int, heads: int, rows_text) -> dict:
    """Run ``call()`` under capture: full weights when they fit the page, else statistics and rows."""
    import torch

    import attnkit

    length = len(tokens)
    say(f"running the model on {length:,} tokens ...")
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
    say(
        f"warning: {len(spans)} of {words} tokens came out as {unknown} (characters not in {model_name}'s "
        f"vocabulary: {shown}); the model sees one placeholder for each. To look at this text, pass --model DIR with a "
        "local HuggingFace model whose vocabulary covers it (a folder holding config.json, the weights and "
        "the tokenizer, e.g. a Chinese BERT saved with save_pretrained)."
    )


def _run_minilm(text, rows_text=None) -> dict:
    """The packaged MiniLM on ``text`` (cut at its 512-token limit)."""
    from attnkit.models import MiniLM

    say("loading all-MiniLM-L6-v2 (attnkit.models.MiniLM) ...")
    model = MiniLM.from_package()
    encoding = model.tokenizer.encode(text)
    if encoding.overflowing:  # the tokenizer cut the text at the model's limit
        end = encoding.offsets[-2][1] if len(encoding.offsets) > 1 else 0
        say(
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

    say("loading RecallLM (attnkit.models.RecallLM) ...")
    model = RecallLM.from_package()
    report, marks = [], {}
    if text is not None:
        ids = model.tokenize(text)
    else:
        g = torch.Generator().manual_seed(args.seed)
        # one token more than asked: the text ends with "? key", the model's turn, and is --length tokens long
        tokens, targets = make_batch(
            1, args.length + 1, pairs=8, queries=1, task=model.task, generator=g, depth=args.depth
        )
        at = int((targets[0] != -100).nonzero()[0])
        ids = tokens[0, : at + 1]
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
    say(f"loading {folder} (attn_implementation='attnkit') ...")
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
        say(f"note: {folder.name} reads at most {limit} tokens: showing the first {limit}.")
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


def _layers_and_heads(model: str | None) -> tuple[int, int]:
    """The model's layers and heads, read from its config (nothing loaded or run; the standard library
    only, except for a checkpoint whose config.json does not say them plainly)."""
    from attnkit.apps.shipped import checkpoint_layers_and_heads, weights_config

    if model == "recall":
        c = weights_config("recall_lm.safetensors")
        return c["num_layers"], c["num_heads"]
    if model is None:
        return MINILM_LAYERS, MINILM_HEADS
    found = checkpoint_layers_and_heads(Path(model))
    if found is not None:
        return found
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model)
    return getattr(config, "num_hidden_layers", 1), getattr(config, "num_attention_heads", 1)


#: all-MiniLM-L6-v2's layers and heads (attnkit.models.MiniLM)
MINILM_LAYERS, MINILM_HEADS = 6, 12


#: ``attnkit show``'s options that generate RecallLM's recall text, and their defaults.
GENERATED = {"length": 4096, "depth": 0.02, "seed": 0}


def check(args: Any) -> None:
    """The arguments alone, before torch is imported or a model loaded (well under a second): options
    that do not apply are refused, --model's folder, --layer and --head against the model's config,
    --rows' form. Then the defaults of the generated text's options are filled in."""
    from attnkit.errors import AttnkitValueError

    given = [f"--{name}" for name in GENERATED if getattr(args, name) is not None]
    if given and args.model != "recall":
        what = f"{given[0]} generates" if len(given) == 1 else f"{', '.join(given)} generate"
        raise AttnkitValueError(
            f"{what} RecallLM's recall text: it needs --model recall (e.g. attnkit show --model recall "
            f"{given[0]} ...), or give a text to look at instead."
        )
    if given and (args.text is not None or args.file is not None):
        raise AttnkitValueError(
            f"{', '.join(given)} set the text RecallLM generates: give a text (or --file), or {given[0]}, not both."
        )
    for name, default in GENERATED.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    if args.model not in (None, "recall") and not (Path(args.model) / "config.json").is_file():
        raise AttnkitValueError(
            f"--model must be 'recall' or a folder with a config.json (a saved checkpoint), but got {args.model!r}."
        )
    if args.layer is None and args.head is None and args.rows is None:
        return
    layers, heads = _layers_and_heads(args.model)
    for name, value, limit in (("--layer", args.layer, layers), ("--head", args.head, heads)):
        if value is not None and not 0 <= value < limit:
            raise AttnkitValueError(f"{name} must be in 0..{limit - 1} (this model has {limit}), but got {value}.")
    if args.rows is not None:
        _rows(args.rows, None)


def _rows(text, length: int | None) -> list[int]:
    """--rows "a,b,-1" as query rows in [0, length) (``length`` None: only the form is checked)."""
    from attnkit.errors import AttnkitValueError

    try:
        rows = [int(x) for x in (text or "-1").split(",") if x.strip()]
    except ValueError:
        raise AttnkitValueError(
            f"--rows must be comma-separated token positions, e.g. 0,-1, but got {text!r}."
        ) from None
    if not rows:
        raise AttnkitValueError("--rows names no position: give comma-separated token positions, e.g. 0,-1.")
    if length is None:
        return rows
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


def run(args: Any, out: Path, text: str | None) -> int:
    """Run ``attnkit show`` on ``text`` (or, for RecallLM, a generated text) with the command's options
    ``args``, writing into ``out``; prints the summary and returns the exit code."""
    import numpy as np

    from attnkit.inspect.summary import notable_heads, summarize
    from attnkit.viz import attention_grid, save_html, visualize_attention
    from attnkit.viz.heatmap import heads_figure

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

    title = run.get("title") or text
    written = [
        save_html(
            out / "attention.html", weights, tokens, layer_names=[f"layer {i}" for i in range(layers)], title=title
        )
    ]
    say("drawing the figures ...")
    picks = notable_heads(weights, tokens, special) if weights.shape[-2] == weights.shape[-1] else []
    if picks:  # three heads at a size their token labels read at, before the grid of every head
        heads_figure(weights, picks, tokens, out / "attention_heads.png")
        written.append(out / "attention_heads.png")
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
    say(f"{len(tokens):,} tokens: writing the long view (statistics, and the weights of rows {rows}) ...")
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
