"""The ``tnlg`` command itself: bare ``tnlg``, fast help, no abbreviations, errors with the subcommand's usage
(issue 15 item 9)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tnlg.cli import main


def test_bare_tnlg_prints_help_and_runs_nothing(capsys, monkeypatch):
    """issue 15 item 9: bare ``tnlg`` printed nothing and started the 300-iteration job."""
    import tnlg.train

    monkeypatch.setattr(tnlg.train, "run", lambda args: pytest.fail("bare `tnlg` must not run the job"))
    assert main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: tnlg") and "pretrain" in out and "tnlg pretrain" in out


@pytest.mark.parametrize("argv", [["--help"], ["pretrain", "--help"], []])
def test_help_does_not_import_torch(argv):
    """issue 15 item 9: ``tnlg --help`` took 2.8 s because ``import tnlg`` imported torch."""
    code = ("import sys\nfrom tnlg.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
            "print('torch' in sys.modules, file=sys.stderr)\n")
    proc = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120)
    assert proc.stdout.startswith("usage: tnlg")
    assert proc.stderr.strip().splitlines()[-1] == "False", proc.stderr


def test_package_names_still_resolve():
    import tnlg
    import tnlg.generate  # noqa: F401  (binds the submodule on the package; the function must stay)

    assert callable(tnlg.generate) and tnlg.GPT.__name__ == "GPT" and tnlg.GPTConfig.preset("tiny")
    with pytest.raises(AttributeError):
        tnlg.no_such_name  # noqa: B018


@pytest.mark.parametrize("argv,usage,bad", [
    (["pretrain", "--train-iter", "5"], "usage: tnlg pretrain", "--train-iter"),   # a prefix of --train-iters
    (["pretrain", "--no-such-flag"], "usage: tnlg pretrain", "--no-such-flag"),
    (["plan", "--prese", "tiny"], "usage: tnlg plan", "--prese"),
    (["data", "prepare", "--forc"], "usage: tnlg data prepare", "--forc"),            # nested subparser
    (["eval", "--task", "loss", "--input", "x", "--checkpoint", "y", "--eval-sample", "3"], "usage: tnlg eval",
     "--eval-sample"),
])
def test_unknown_or_abbreviated_flag_shows_the_subcommand_usage(capsys, argv, usage, bad):
    """issue 15 item 9: unknown flags showed the top-level usage; unambiguous prefixes were accepted."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(usage), err
    assert f"unrecognized arguments: {bad}" in err


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
