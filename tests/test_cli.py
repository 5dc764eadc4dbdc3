"""The ``tnlg`` command itself: bare ``tnlg``, fast help, no abbreviations, errors with the subcommand's usage
(issue 15 item 9)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tnlg.cli import COMMANDS, main


def test_bare_tnlg_prints_help_and_runs_nothing(capsys, monkeypatch):
    """issue 15 item 9: bare ``tnlg`` printed nothing and started the 300-iteration job."""
    import tnlg.commands.pretrain

    monkeypatch.setattr(tnlg.commands.pretrain, "run", lambda args: pytest.fail("bare `tnlg` must not run the job"))
    assert main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: tnlg") and "pretrain" in out and "tnlg pretrain" in out


@pytest.mark.parametrize("argv", [["--help"], []] + [[name, "--help"] for name in COMMANDS])
def test_help_does_not_import_torch(argv):
    """``tnlg --help`` and every ``tnlg COMMAND --help`` answer without importing torch (which costs
    seconds): ``import tnlg`` and every command module are torch-free at import."""
    code = ("import sys\nfrom tnlg.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
            "print('torch' in sys.modules, file=sys.stderr)\n")
    proc = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120)
    assert proc.stdout.startswith("usage: tnlg")
    assert proc.stderr.strip().splitlines()[-1] == "False", proc.stderr


def test_package_names_still_resolve():
    import tnlg
    import tnlg.generation  # noqa: F401

    assert callable(tnlg.generate) and tnlg.GPT.__name__ == "GPT" and tnlg.GPTConfig.preset("tiny")
    with pytest.raises(AttributeError):
        tnlg.no_such_name  # noqa: B018


@pytest.mark.parametrize("argv,error", [
    # a mistyped flag: the closest valid flag of that subcommand (an abbreviation is mistyped too)
    (["pretrain", "--hiden-size", "128"], "tnlg pretrain: error: unrecognized arguments: --hiden-size 128; "
                                          "did you mean --hidden-size?"),
    (["pretrain", "--train-iter", "5"], "tnlg pretrain: error: unrecognized arguments: --train-iter 5; "
                                        "did you mean --train-iters?"),
    (["pretrain", "--train-iter=5", "--lrr", "3"], "tnlg pretrain: error: unrecognized arguments: --train-iter=5 "
                                                   "--lrr 3; did you mean --train-iters for --train-iter, --lr for "
                                                   "--lrr?"),
    (["plan", "--prese", "tiny"], "tnlg plan: error: unrecognized arguments: --prese tiny; did you mean --preset?"),
    (["data", "prepare", "--forc"], "tnlg data prepare: error: unrecognized argument: --forc; did you mean "
                                    "--force?"),                                               # nested subparser
    (["eval", "--task", "loss", "--input", "x", "--checkpoint", "y", "--eval-sample=3"],
     "tnlg eval: error: unrecognized argument: --eval-sample=3; did you mean --eval-samples?"),
    (["train-tokenizer", "--input", "a.txt", "--output-prefix", "tok", "--vocab-sise", "64"],
     "tnlg train-tokenizer: error: unrecognized argument: --vocab-sise; did you mean --vocab-size?"),
    # a flag too far from every valid one: no guess
    (["pretrain", "--no-such-flag"], "tnlg pretrain: error: unrecognized argument: --no-such-flag"),
    # a mistyped flag that left a required one missing is reported as the typo, not as the missing flag
    (["generate", "--checkpoin", "x"], "tnlg generate: error: unrecognized argument: --checkpoin; did you mean "
                                       "--checkpoint?"),
    (["convert", "--form", "hf", "--to", "tnlg"], "tnlg convert: error: unrecognized argument: --form; did you "
                                                  "mean --format or --from?"),
    (["preprocess", "--workerz", "2"], "tnlg preprocess: error: unrecognized argument: --workerz; did you mean "
                                       "--workers?"),
    # a mistyped subcommand or choice: the closest valid ones
    (["pretrian"], "tnlg: error: argument COMMAND: invalid choice: 'pretrian' (choose from 'pretrain', 'demo', "
                   "'plan', 'train-tokenizer', 'preprocess', 'data', 'convert', 'checkpoint', 'eval', 'generate'); "
                   "did you mean pretrain?"),
    (["data", "prepar"], "tnlg data: error: argument ACTION: invalid choice: 'prepar' (choose from 'prepare', "
                         "'info'); did you mean prepare?"),
    (["eval", "--task", "wikitxt"], "tnlg eval: error: argument --task: invalid choice: 'wikitxt' (choose from "
                                    "'wikitext', 'lambada', 'loss', 'text'); did you mean wikitext?"),
    # other parse errors: the same two lines, no usage block
    (["pretrain", "--hidden-size", "abc"], "tnlg pretrain: error: argument --hidden-size: invalid int value: "
                                           "'abc'"),
])
def test_a_parse_error_is_one_line_with_the_closest_flags_and_a_hint(capsys, argv, error):
    """A mistyped flag printed the subcommand's whole usage (40 lines for pretrain) before the one line that
    mattered, with no suggestion; now: that line, the closest valid names, and where the options are."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    prog = error.split(": error:")[0]
    assert capsys.readouterr().err.splitlines() == [error, f"Run `{prog} --help` for its options."]


def test_a_mistyped_pretrain_flag_is_reported_without_importing_torch():
    """The error path of ``tnlg pretrain`` is as fast as its --help: no torch import."""
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "tnlg", "pretrain", "--hiden-size", "128"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "did you mean --hidden-size?" in proc.stderr
    imported = [line.split("|")[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")]
    assert "tnlg.cli" in imported and not any(name.split(".")[0] == "torch" for name in imported)


def test_tests_keep_caches_in_temporary_folders():
    """issue 15 item 9: the suite left ~100 index-cache files in ~/.cache/tnlg (built-in corpus runs write
    their index caches next to the corpus). tests/conftest.py points TNLG_CACHE at a session folder."""
    import os
    from pathlib import Path

    from tnlg.data.corpus import default_cache_dir, default_dataset

    home_cache = Path.home() / ".cache" / "tnlg"
    assert os.environ.get("TNLG_CACHE") and default_cache_dir() != home_cache
    prefix, _tokenizer = default_dataset()  # (the tokenizer model ships with the package)
    assert Path(prefix).is_relative_to(default_cache_dir())
    assert not Path(prefix).is_relative_to(home_cache)
