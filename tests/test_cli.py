"""The ``tnlg`` command itself: bare ``tnlg``, fast help, no abbreviations, parse errors in one line with the
closest valid names, and arguments taken from the list given to ``main`` (only the console entry reads
``sys.argv``)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.tiny import tiny_flags
from tnlg.cli import COMMANDS, build_parser, main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bare_tnlg_prints_help_and_runs_nothing(capsys, monkeypatch):
    """Bare ``tnlg`` prints the help and runs nothing (it used to print nothing and start the 300-iteration
    built-in job)."""
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
    (["pretrian"], "tnlg: error: argument COMMAND: invalid choice: 'pretrian' (choose from 'pretrain', 'finetune', 'demo', "
                   "'plan', 'train-tokenizer', 'preprocess', 'data', 'convert', 'checkpoint', 'eval', 'generate', "
                   "'serve'); "
                   "did you mean pretrain?"),
    (["data", "prepar"], "tnlg data: error: argument ACTION: invalid choice: 'prepar' (choose from 'prepare', "
                         "'info'); did you mean prepare?"),
    (["eval", "--task", "wikitxt"], "tnlg eval: error: argument --task: invalid choice: 'wikitxt' (choose from "
                                    "'wikitext', 'lambada', 'loss', 'text', 'generate', 'lm-eval'); "
                                    "did you mean wikitext?"),
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


def test_main_from_python_passes_its_own_list_to_the_workers(monkeypatch, tmp_path):
    """``main([...])`` with ``--nproc-per-node 2`` gives the workers the very list it was given and
    validated (it used to build their arguments from ``sys.argv``, here pytest's)."""
    import torch.distributed.launcher.api as launcher_api

    launched = []

    class FakeLaunch:
        def __init__(self, config, entrypoint):
            self.nproc = config.nproc_per_node

        def __call__(self, *args):
            launched.append(list(args))
            return {}

    monkeypatch.setattr(launcher_api, "elastic_launch", FakeLaunch)
    for var in ("OMP_NUM_THREADS", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"):  # the launcher sets them
        monkeypatch.setenv(var, os.environ.get(var, "1"))
    monkeypatch.setattr(sys, "argv", ["tnlg", "pretrain", "--train-iters", "99", "--lr", "0.5"])
    prompt = "-x y"  # a value that starts with '-' and holds a space
    given = ["--nproc-per-node", "2", *tiny_flags(train_iters=3, lr_warmup_iters=1, tensor_model_parallel_size=1,
                                                  save=str(tmp_path / "s"), sample_prompt=prompt)]
    assert main(["pretrain", *given]) == 0
    assert len(launched) == 1
    child = launched[0]
    assert child[:3] == ["-m", "tnlg", "pretrain"]
    assert "99" not in child and "0.5" not in child
    ns = build_parser(only="pretrain").parse_args(child[2:])
    want = build_parser(only="pretrain").parse_args(["pretrain", *given])
    assert vars(ns) == vars(want)  # the very options that were validated, nothing more or less


def test_only_the_console_entry_reads_sys_argv():
    """Only the console entry (``tnlg.cli``) reads ``sys.argv``: every other module takes its arguments from
    its caller, so ``main([...])`` called from Python means what it says."""
    import ast
    import pathlib
    package = pathlib.Path(ROOT) / "tnlg"
    for path in sorted(package.rglob("*.py")):
        if path.name == "cli.py" and path.parent == package:
            continue
        tree = ast.parse(path.read_text())
        reads = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr == "argv"
                 and isinstance(n.value, ast.Name) and n.value.id == "sys"]
        assert not reads, f"{path.relative_to(ROOT)} reads sys.argv at line(s) {reads}"


# (a phrase of a row of the README's capabilities table, the sub-command that row names, what that
# sub-command's one-line description in `tnlg --help` must say of it)
README_CAPABILITIES = [
    ("pretraining: ZeRO 0-3", "pretrain", "ZeRO 0-3"), ("pipeline parallelism: PP x TP x DP", "pretrain", "PP"),
    ("JSONL, text, Parquet and `datasets` folders", "preprocess", "Parquet or `datasets` folders"),
    ("Megatron `.bin/.idx`", "preprocess", "Megatron .bin/.idx"),
    ("Megatron-LM checkpoints in and out", "convert", "Megatron-LM"), ("HF", "convert", "Hugging Face"),
    ("resharding", "convert", "reshard"), ("WikiText ppl", "eval", "WikiText perplexity"),
    ("LAMBADA", "eval", "LAMBADA accuracy"), ("dataset loss", "eval", "dataset loss"),
    ("perplexity of any text files", "eval", "perplexity of text files"),
    ("generation scored with ROUGE-1/2/L", "eval", "generation scored with ROUGE"),
    ("TP x PP generation with a KV cache", "generate", "TP x PP text generation with a KV cache"),
    ("memory / FLOPs / layout planner", "plan", "memory, FLOPs and layout planner"),
    ("tokenizers (SentencePiece", "train-tokenizer", "SentencePiece"),
]


def test_help_describes_each_command_as_the_readmes_capabilities_table():
    """Each row of the README's capabilities table and the one-line description of the sub-command it names
    say the same thing (pipelines in pretrain, Parquet in preprocess, Megatron in convert, text in eval)."""
    import pathlib
    from tnlg.cli import COMMANDS
    readme = (pathlib.Path(__file__).parent.parent / "README.md").read_text()
    table = readme.split("## Contents", 1)[1].split("\n\n", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line][1:]
    for phrase, command, said in README_CAPABILITIES:
        row = next((r for r in rows if phrase in r), None)
        assert row is not None, f"no row of the README's capabilities table says {phrase!r}"
        assert f"tnlg {command}" in row, f"the README's row with {phrase!r} does not name tnlg {command}: {row}"
        assert said in COMMANDS[command][1], f"tnlg {command}'s description lacks {said!r}: {COMMANDS[command][1]}"
    named = {c for r in rows for c in COMMANDS if f"`tnlg {c}" in r or f"tnlg {c}`" in r or f", {c}" in r}
    assert named >= {"pretrain", "preprocess", "convert", "eval", "generate", "plan", "train-tokenizer", "data"}


def test_convert_help_names_every_hugging_face_class_it_reads_and_writes(capsys):
    """``tnlg convert --help`` names each Hugging Face class the interop reads and writes (it said GPT-2 only,
    while Llama and Qwen2 folders convert both ways)."""
    from tnlg.interop.families import FAMILIES
    with pytest.raises(SystemExit):
        main(["convert", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for family in FAMILIES.values():
        assert family.model_class in out, family.model_class
    assert "Hugging Face GPT-2 folders" not in out
