"""``attnkit train``: any shipped model trained from scratch, seeded, and saved with a record of
the run (the command that reproduces it, the numbers it reached)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from attnkit.apps.report import say

#: Optimizer steps of ``attnkit train speech`` per minute on 2 cores (batch 32), measured.
SPEECH_STEPS_PER_MINUTE = 230


#: ``attnkit train MODEL``: default (steps, batch size); the recommender's steps are epochs.
TRAIN_DEFAULTS = {
    "translator": (1500, 128),
    "captioner": (4000, 96),
    "recommender": (120, 128),
    "recall": (5000, 32),
    "speech": (9200, 32),  # = --minutes 40; the shipped weights
}


def command_of(args: Any) -> str:
    """The command that reproduces a training run (recorded with the weights)."""
    return f"attnkit train {args.model} --steps {args.steps} --seed {args.seed} --batch-size {args.batch_size}"


def save_trained(args: Any, model: Any, record: dict, path: Path, summary: str) -> int:
    """Record the command with the weights, write them to ``path`` and print ``summary``."""
    record["command"] = command_of(args)
    written = model.save(path, training=record)
    print(summary)
    print(f"wrote {written}")
    return 0


def run(args: Any) -> int:
    """Train ``args.model`` with the command's options; prints what it reached and where it wrote."""
    if args.model == "captioner":
        return captioner(args)
    if args.model == "recommender":
        return recommender(args)
    if args.model == "recall":
        return recall(args)
    if args.model == "speech":
        return speech(args)
    from attnkit.models.translator import WEIGHTS
    from attnkit.models.translator import train as train_translator

    Path(args.out)
    say(f"training DateTranslator: {args.steps} steps, seed {args.seed}, batch {args.batch_size}")
    model, record = train_translator(args.steps, seed=args.seed, batch_size=args.batch_size)
    return save_trained(
        args,
        model,
        record,
        Path(args.out) / WEIGHTS,
        f"exact match on 1000 fresh dates: {record['exact_match_1000']:.1%} "
        f"(final loss {record['final_loss']:.4f}, {record['seconds']:.0f} s)",
    )


def captioner(args: Any) -> int:
    from attnkit.models.captioner import WEIGHTS
    from attnkit.models.captioner import train as train_captioner

    out, steps, batch_size = Path(args.out), args.steps, args.batch_size
    say(f"training DigitCaptioner: {steps} steps, seed {args.seed}, batch {batch_size}")
    model, record = train_captioner(steps, seed=args.seed, batch_size=batch_size)
    return save_trained(
        args,
        model,
        record,
        out / WEIGHTS,
        f"test split, 500 strips of 2-6 digits: {record['test_exact']:.1%} exact captions, "
        f"{record['test_word_accuracy']:.1%} words, {record['test_alignment']:.1%} aligned "
        f"({record['seconds']:.0f} s of training)",
    )


def speech(args: Any) -> int:
    from attnkit.models.speech import TEST_VOICES, TRAIN_VOICES, WEIGHTS, dataset, evaluate
    from attnkit.models.speech import train as train_speech

    out, steps, batch_size = Path(args.out), args.steps, args.batch_size
    say(
        f"training SpeechRecognizer: {steps} steps, seed {args.seed}, batch {batch_size}, on espeak-ng speech "
        f"({len(TRAIN_VOICES)} training voices: accents en-us, en-gb, en-029, en-us-nyc with every variant "
        "but the held-out ones, and other languages' voices reading the English words)"
    )
    model, record = train_speech(steps, seed=args.seed, batch_size=batch_size, log=say)
    say("scoring 100 utterances of held-out voices ...")
    h = record["held_out_100"] = evaluate(model, dataset(100, TEST_VOICES, 10_000))
    return save_trained(
        args,
        model,
        record,
        out / WEIGHTS,
        f"held-out voices, 100 utterances: {h['exact']:.1%} exact, CER {h['cer']:.1%}, "
        f"{h['monotonic']:.0%} monotonic alignments ({record['seconds']:.0f} s); "
        "benchmarks/speech.py scores 500",
    )


def recall(args: Any) -> int:
    from attnkit.models.recall import WEIGHTS, accuracy
    from attnkit.models.recall import train as train_recall

    out, steps, batch_size = Path(args.out), args.steps, args.batch_size
    say(f"training RecallLM: {steps} steps, seed {args.seed}, batch {batch_size}, texts of 64 growing to 1024 tokens")
    model, record = train_recall(steps, seed=args.seed, batch_size=batch_size, log=say)
    record["accuracy_1024"] = accuracy(model, 1024, n=200, seed=1)
    return save_trained(
        args,
        model,
        record,
        out / WEIGHTS,
        f"first-query accuracy on 200 fresh texts of 1024 tokens: {record['accuracy_1024']:.1%} "
        f"({record['seconds']:.0f} s of training); benchmarks/long_context.py measures 4k-32k",
    )


def recommender(args: Any) -> int:
    from attnkit.models.recommender import WEIGHTS
    from attnkit.models.recommender import train as train_recommender

    out, epochs, batch_size = Path(args.out), args.steps, args.batch_size
    say(f"training SASRec on MovieLens-100K: {epochs} epochs, seed {args.seed}, batch {batch_size}")
    model, record = train_recommender(epochs, seed=args.seed, batch_size=batch_size, log=say)
    return save_trained(
        args,
        model,
        record,
        out / WEIGHTS,
        f"test: HR@10 {record['test_HR@10']:.3f}, NDCG@10 {record['test_NDCG@10']:.3f} "
        f"(best validation NDCG@10 {record['best_valid_NDCG@10']:.3f}, {record['seconds']:.0f} s)",
    )
