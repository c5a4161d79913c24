"""The attnkit command: one-line errors with exit code 2, arguments checked before a model loads."""

from __future__ import annotations

import pytest
import torch

from attnkit.cli import main


def _cli(*args):
    from attnkit.cli import main

    return main(list(args))


# regression: a finding of the adversarial review of the inputs (hardening)
def test_cli_gives_one_line_errors_and_exit_code_2(tmp_path, capsys):
    a_file = tmp_path / "file.txt"
    a_file.write_text("x")
    cases = [
        (["translate", "2019-03-25", "--out", str(a_file)], "is an existing file"),
        (["translate", "2019-03-25", "--out", str(a_file / "below")], "cannot create the --out folder"),
        (
            [
                "translate",
                "2019-03-25",
                "--weights",
                str(tmp_path / "missing.safetensors"),
                "--out",
                str(tmp_path / "o"),
            ],
            "is not a file",
        ),
        (
            ["translate", "2019-03-25", "--weights", str(a_file), "--out", str(tmp_path / "o")],
            "is not a DateTranslator weights file",
        ),
        (["translate", "", "--out", str(tmp_path / "o")], "'' is not a date attnkit can read: the text is empty"),
        (["translate", "hello world", "--out", str(tmp_path / "o")], "not a date in a supported format"),
    ]
    for args, message in cases:
        assert _cli(*args) == 2, args
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, err
    for bad in (["--batch-size", "0"], ["--steps", "0"]):
        with pytest.raises(SystemExit) as exit_info:
            _cli("train", "translator", *bad, "--out", str(tmp_path / "t"))
        assert exit_info.value.code == 2
        assert "must be >= 1, but got 0" in capsys.readouterr().err


# regression: a finding of the adversarial review of the inputs (hardening)
def test_show_says_what_it_cut_and_keeps_outputs_bounded(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    text = "word " * 1500
    assert _cli("show", text, "--out", str(tmp_path)) == 0
    err = capsys.readouterr().err
    assert "reads at most 256 tokens: showing the text up to character" in err and "of 1500 words" in err
    assert (tmp_path / "attention.npz").stat().st_size < 10_000_000
    assert (tmp_path / "attention.html").stat().st_size < 8_000_000


# regression: a finding of the adversarial review of the inputs (hardening)
def test_save_html_refuses_zero_tokens(tmp_path):
    from attnkit.viz import save_html

    with pytest.raises(ValueError, match="hold nothing to draw"):
        save_html(tmp_path / "a.html", torch.zeros(1, 1, 0, 0), [])


# regression: finding F15 of the review of the seams between features
def test_show_refuses_text_that_is_not_utf8(tmp_path, capsys):
    text = b"caf\xe9 au lait".decode("utf-8", "surrogateescape")  # how Python hands argv bytes over
    assert main(["show", text, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "not UTF-8" in err and "--file" in err and "Traceback" not in err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--length", "1e11"], "--length: must be a whole number"),
        (["--length", "100000000000"], "--length: must be at most 1,048,576"),
        (["--depth", "nan"], "--depth: must be in \\[0, 1\\]"),
        (["--depth", "2.0"], "--depth: must be in \\[0, 1\\]"),
        (["--depth", "-1"], "--depth: must be in \\[0, 1\\]"),
    ],
)
# regression: finding F16, F17 of the review of the seams between features
def test_show_length_and_depth_are_checked(tmp_path, capsys, args, message):
    with pytest.raises(SystemExit) as exit_:
        main(["show", "--model", "recall", *args, "--out", str(tmp_path)])
    assert exit_.value.code == 2
    import re

    assert re.search(message, capsys.readouterr().err)


@pytest.mark.parametrize(
    "args, message",
    [
        (["show", ""], "the text is empty"),
        (["show", "  \n "], "the text is empty"),
        (["show", "The cat sat.", "--layer", "6"], "--layer must be in 0..5 (this model has 6), but got 6"),
        (["show", "The cat sat.", "--head", "-1"], "--head must be in 0..11 (this model has 12), but got -1"),
        (["show", "The cat sat.", "--rows", "first"], "--rows must be comma-separated token positions"),
        (["show", "The cat sat.", "--rows", ","], "--rows names no position"),
        (["show", "--model", "recall", "--layer", "2"], "--layer must be in 0..1 (this model has 2), but got 2"),
    ],
)
def test_show_checks_its_arguments_before_loading_a_model(tmp_path, capsys, monkeypatch, args, message):
    """Each of these used to load and run the model first (about 11 s) or to run it on [CLS] [SEP]."""
    from attnkit.models.minilm import MiniLM
    from attnkit.models.recall import RecallLM

    def loaded(*_, **__):
        raise AssertionError("a model was loaded before the arguments were checked")

    monkeypatch.setattr(MiniLM, "from_package", classmethod(loaded))
    monkeypatch.setattr(RecallLM, "from_package", classmethod(loaded))
    assert main([*args, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err


#: Bad arguments of every command, each answered from the arguments alone: ``(args, what the error says)``.
BAD_ARGUMENTS = [
    (["recommend", "--user", "0"], "--user must be a MovieLens-100K user id (1 to 943)"),
    (["caption"], "give --digits"),
    (["caption", "--digits", "1,2,x"], "--digits must be digits 0-9"),
    (["caption", "--digits", "1,2,3,4,5,6,7,8,9"], "1 to 8 digits"),
    (["caption", "--image", "missing.npy"], "is not a file"),
    (["listen"], "give FILE.wav"),
    (["listen", "missing.wav"], "is not a file"),
    (["listen", "--example", "9"], "--example must be 1..3"),
    (["listen", "--say", "4a"], "--say takes digits 0-9 and spaces"),
    (["show"], "give a text to look at"),
    (["show", "--file", "missing.txt"], "is not a file"),
    (["show", "--length", "100", "hello"], "--length generates RecallLM's recall text: it needs --model recall"),
    (["show", "--depth", "0.5", "hello"], "--depth generates"),
    (["show", "--model", "recall", "--length", "100", "hello"], "not both"),
    (["show", "--model", "no-such-folder", "hello"], "a folder with a config.json"),
    (["show", "hello", "--layer", "9"], "--layer must be in 0..5"),
    (["show", "--model", "recall", "--head", "9"], "--head must be in 0..3"),
    (["show", "hello", "--rows", "x"], "--rows must be comma-separated"),
    (["translate", " "], "the text is empty"),
    (["translate", "1 May 2020", "--weights", "missing.safetensors"], "is not a file"),
]


def test_every_bad_argument_is_answered_before_torch_is_imported(tmp_path):
    """Each command checks its arguments with the standard library alone, before torch is imported or a
    model loaded (errors that need only the arguments took 13-27 s, after the model loaded): one fresh
    process runs every case and says whether torch was imported."""
    import json
    import subprocess
    import sys

    code = (
        "import json, sys, contextlib, io\n"
        "from attnkit.cli import main\n"
        "found = []\n"
        f"for args in {[a for a, _ in BAD_ARGUMENTS]!r}:\n"
        "    err = io.StringIO()\n"
        "    with contextlib.redirect_stderr(err):\n"
        "        rc = main(args + ['--out', 'out'])\n"
        "    found.append([rc, err.getvalue(), 'torch' in sys.modules])\n"
        "print(json.dumps(found))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    for (args, message), (rc, err, imported) in zip(BAD_ARGUMENTS, json.loads(done.stdout)):
        assert rc == 2 and message in err and "Traceback" not in err, (args, err)
        assert not imported, f"{args}: torch was imported before the error"


def test_train_takes_the_models_and_their_commands_names(tmp_path, monkeypatch):
    """The README names the applications by their commands: `attnkit train caption` trains the captioner."""
    from attnkit.apps import train as app
    from attnkit.cli import TRAINED, TRAINED_BY_COMMAND

    trained = []
    monkeypatch.setattr(app, "run", lambda args: trained.append((args.model, args.steps)) or 0)
    for name in [*TRAINED, *TRAINED_BY_COMMAND]:
        assert main(["train", name, "--out", str(tmp_path / name)]) == 0
    want = [(m, app.TRAIN_DEFAULTS[m][0]) for m in [*TRAINED, *TRAINED_BY_COMMAND.values()]]
    assert trained == want
    with pytest.raises(SystemExit):
        main(["train", "nothing"])


def test_seeds_are_whole_numbers_from_zero(tmp_path, capsys):
    for command in (["caption", "--digits", "1"], ["show", "--model", "recall"], ["train", "translator"]):
        with pytest.raises(SystemExit) as exit_:
            main([*command, "--seed", "-1", "--out", str(tmp_path)])
        assert exit_.value.code == 2 and "--seed: must be in 0..2**63-1, but got -1" in capsys.readouterr().err


def test_an_emoji_is_drawn_as_a_mark_without_a_glyph_warning(tmp_path, capsys):
    """matplotlib's fonts have no robot: the figure shows U+FFFD, and no "Glyph missing" warning with a
    file path reaches the user (the page keeps the emoji: the browser draws it)."""
    pytest.importorskip("matplotlib")
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main(["show", "I like \U0001f916 robots.", "--out", str(tmp_path)]) == 0
    assert not [w for w in caught if "Glyph" in str(w.message)], [str(w.message) for w in caught]
    assert "Glyph" not in capsys.readouterr().err
    assert "\U0001f916" in (tmp_path / "attention.html").read_text(encoding="utf-8")
