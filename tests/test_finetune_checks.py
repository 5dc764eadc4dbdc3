"""``tnlg finetune`` checks everything before it writes anything, and speaks as itself.

Nothing written means no ``--save`` folder, no converted ``SAVE/base`` and no tokenized rows in the cache: a bad
row, a Hugging Face folder without a tokenizer, a model flag or a ``--save`` another job holds is one paragraph
first. What a run starts from is recorded in its ``--save``: a later launch whose ``--load`` is another model (or
the same folder rewritten) is refused, never trained from the other weights; and a ``--save`` holding a checkpoint
that records no fine-tuning start is not resumed in place of ``--load``. A fine-tuning run's stop line, resume
command, errors (also a worker's) and packing line name ``tnlg finetune`` and the chat template.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys

import pytest

from tnlg.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CFG = dict(num_layers=1, hidden_size=16, num_attention_heads=2, seq_length=32, hidden_dropout=0.0,
           attention_dropout=0.0)
RUN = ["--train-iters", "1", "--micro-batch-size", "1", "--global-batch-size", "2", "--eval-interval", "0",
       "--no-plot", "--peak-tflops", "1", "--sample-prompt", "", "--nproc-per-node", "1"]


def _hf_folder(path, seed: int):
    import torch
    import transformers
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, n_positions=32, vocab_size=4096,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                  eos_token_id=0)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(path)
    return path


@pytest.fixture()
def made(tmp_path, monkeypatch):
    """A tnlg checkpoint that records the built-in tokenizer, two Hugging Face folders of other weights, rows, and
    the tokenized rows' cache in the test's folder."""
    from tests.fresh_checkpoint import builtin_tokenizer_checkpoint, question_rows
    monkeypatch.setenv("TNLG_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    builtin_tokenizer_checkpoint(str(tmp_path / "ckpt"), **CFG)
    question_rows(tmp_path / "rows.jsonl", 4)
    return tmp_path


def _cached(tmp_path) -> list[str]:
    folder = tmp_path / "cache" / "sft"
    return sorted(os.listdir(folder)) if folder.is_dir() else []


def _refused(argv, capsys) -> str:
    capsys.readouterr()  # (what making the folders printed)
    status = main(argv)
    err = capsys.readouterr().err
    assert status == 2 and "Traceback" not in err, err
    return err


def test_a_bad_row_of_a_hugging_face_load_is_refused_before_anything_is_written(made, capsys):
    pytest.importorskip("transformers")
    bad = made / "bad.jsonl"
    lines = (made / "rows.jsonl").read_text().splitlines()
    bad.write_text("\n".join(lines[:2] + [json.dumps(dict(question="no prompt, no completion"))] + lines[2:]) + "\n")
    err = _refused(["finetune", "--load", str(_hf_folder(made / "hf", 0)), "--tokenizer-model", "builtin",
                    "--sft-data-path", str(bad), "--save", str(made / "ft"), *RUN], capsys)
    assert "bad.jsonl:3:" in err and err.startswith("tnlg finetune: error:"), err
    assert not (made / "ft").exists() and _cached(made) == []


def test_a_hugging_face_folder_without_a_tokenizer_is_refused_before_anything_is_written(made, capsys):
    pytest.importorskip("transformers")
    err = _refused(["finetune", "--load", str(_hf_folder(made / "hf", 0)), "--sft-data-path",
                    str(made / "rows.jsonl"), "--save", str(made / "ft"), *RUN], capsys)
    assert "records no tokenizer; give --tokenizer-model" in err, err
    assert not (made / "ft").exists() and _cached(made) == []


def test_a_save_another_job_holds_is_refused_before_the_rows_are_tokenized(made, capsys):
    from tnlg.checkpoint.files import lock_root
    held = lock_root(str(made / "ft"))  # (another job's lock: a second open file of this process conflicts)
    try:
        err = _refused(["finetune", "--load", str(made / "ckpt"), "--sft-data-path", str(made / "rows.jsonl"),
                        "--save", str(made / "ft"), *RUN[:-1], "2"], capsys)
    finally:
        held.close()
    assert "is in use by another tnlg job" in err, err
    assert _cached(made) == [] and sorted(os.listdir(made / "ft")) == [".tnlg-lock"]


def test_a_base_converted_from_an_unrecorded_source_is_refused(made, capsys):
    """``SAVE/base`` converted from folder A (by an earlier launch that stopped, or by hand), then a launch with
    ``--load B``: refused, never trained from A's weights."""
    pytest.importorskip("transformers")
    from tnlg.interop.hf_checkpoint import hf_to_checkpoint
    hf_to_checkpoint(str(_hf_folder(made / "a", 0)), str(made / "ft" / "base"))
    before = sorted(os.listdir(made / "ft"))
    err = _refused(["finetune", "--load", str(_hf_folder(made / "b", 1)), "--tokenizer-model", "builtin",
                    "--sft-data-path", str(made / "rows.jsonl"), "--save", str(made / "ft"), *RUN], capsys)
    assert f"{str(made / 'ft' / 'base')!r} holds a model converted by an earlier launch that records no source" in err
    assert sorted(os.listdir(made / "ft")) == before and _cached(made) == []


def test_a_save_started_from_another_model_is_refused(made, capsys):
    """A run from folder A saved in ``--save``; then ``--load B`` with that ``--save``, and A itself rewritten
    with other weights: each refused in one paragraph naming the model the run started from."""
    pytest.importorskip("transformers")
    a = _hf_folder(made / "a", 0)
    common = ["--tokenizer-model", "builtin", "--sft-data-path", str(made / "rows.jsonl"), "--save",
              str(made / "ft"), *RUN]
    assert main(["finetune", "--load", str(a), *common]) == 0
    capsys.readouterr()
    assert (made / "ft" / "finetune_from.json").is_file() and (made / "ft" / "base").is_dir()
    err = _refused(["finetune", "--load", str(_hf_folder(made / "b", 1)), *common], capsys)
    assert "belongs to a fine-tuning run that started from the Hugging Face folder" in err and str(a) in err, err
    assert ": another model." in err, err
    _hf_folder(a, 2)  # the same folder, other weights
    err = _refused(["finetune", "--load", str(a), *common], capsys)
    assert "the same folder, whose weight files changed since" in err, err


def test_a_save_holding_a_checkpoint_of_another_run_is_not_resumed_in_place_of_load(made, capsys):
    from tests.fresh_checkpoint import fresh_checkpoint
    from tnlg.config import GPTConfig
    fresh_checkpoint(str(made / "other"), GPTConfig(**CFG, vocab_size=4096))
    err = _refused(["finetune", "--load", str(made / "ckpt"), "--sft-data-path", str(made / "rows.jsonl"),
                    "--save", str(made / "other"), *RUN], capsys)
    assert "holds a checkpoint (iteration 3) that records no fine-tuning start" in err, err
    assert not (made / "other" / "finetune_from.json").exists() and _cached(made) == []


def test_a_stopped_fine_tuning_run_names_its_own_command_and_template_and_resumes_with_it(made, capsys):
    chat = made / "chat.jsonl"
    chat.write_text("".join(json.dumps(dict(messages=[dict(role="user", content=f"Hi {i}"),
                                                      dict(role="assistant", content=f"Hello {i}.")])) + "\n"
                            for i in range(4)))
    argv = ["finetune", "--load", str(made / "ckpt"), "--sft-data-path", str(chat), "--save", str(made / "ft"),
            *RUN[2:], "--train-iters", "2", "--exit-interval", "1"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "tnlg finetune: stopped after iteration 1 of 2 (--exit-interval 1)" in out, out
    assert "conversations rendered with the built-in chat template" in out, out
    resume = out.split("Resume with: ", 1)[1].splitlines()[0]
    assert resume.startswith("tnlg finetune ") and "tnlg pretrain" not in out, out
    assert main(shlex.split(resume)[1:]) == 0
    out = capsys.readouterr().out
    assert "at iteration 1" in out and "saved checkpoint at iteration 2" in out and "tnlg pretrain" not in out, out


def test_a_workers_error_names_tnlg_finetune(made):
    env = dict(os.environ, TNLG_TEST_USER_ERROR="1",
               PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "tests", "fault_injection"), ROOT,
                                           os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "tnlg", "finetune", "--load", str(made / "ckpt"), "--sft-data-path",
                           str(made / "rows.jsonl"), "--save", str(made / "ft"), *RUN[:-1], "2"], cwd=made, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "injected: the data of rank 1 cannot be read" in proc.stderr, proc.stderr
    assert proc.stderr.startswith("tnlg finetune: error"), proc.stderr


def test_a_fine_tuning_run_logs_about_twenty_lines_unless_told(made):
    from tnlg.cli import build_parser
    from tnlg.commands.finetune import options
    parser = build_parser(only="finetune")

    def interval(*extra):
        args = parser.parse_args(["finetune", "--load", str(made / "ckpt"), "--sft-data-path",
                                  str(made / "rows.jsonl"), "--save", str(made / "ft"), *extra])
        return options(args).logging.log_interval

    assert interval("--train-iters", "400") == 20 and interval("--train-iters", "45") == 2
    assert interval("--train-iters", "7") == 1 and interval("--train-iters", "400", "--log-interval", "7") == 7
    (made / "run.toml").write_text("train-iters = 400\nlog-interval = 3\n")
    assert interval("--config", str(made / "run.toml")) == 3
    words = " ".join(parser._subparsers._group_actions[0].choices["finetune"].format_help().split())
    assert "--train-iters / 20, at least 1: about 20 lines a run" in words, words


def test_the_workers_get_a_switch_given_in_its_negative_spelling(made):
    """The workers parse the arguments again: ``--no-calculate-per-token-loss`` (fine-tuning's default is on)
    reaches them."""
    from tnlg.cli import build_parser
    from tnlg.commands.finetune import add_arguments, options
    from tnlg.runtime.launch import argv_of
    parser = build_parser(only="finetune")
    args = parser.parse_args(["finetune", "--load", str(made / "ckpt"), "--sft-data-path", str(made / "rows.jsonl"),
                              "--save", str(made / "ft"), "--train-iters", "4", "--no-calculate-per-token-loss"])
    argv = argv_of(add_arguments, args)
    assert "--no-calculate-per-token-loss" in argv, argv
    again = parser.parse_args(["finetune", *argv])
    assert vars(again) == vars(args)
    assert not options(again).schedule.calculate_per_token_loss


def test_a_conversion_killed_midway_is_converted_again(made):
    """A launch killed while it converted ``--load`` into ``SAVE/base`` leaves its folder in progress there (and
    the start's record): the next launch with the same ``--load`` converts again, whole."""
    pytest.importorskip("transformers")
    import shutil

    from tnlg.checkpoint.files import make_save_dir, resolve
    from tnlg.cli import build_parser
    from tnlg.commands.finetune import options
    argv = ["finetune", "--load", str(_hf_folder(made / "a", 0)), "--tokenizer-model", "builtin", "--sft-data-path",
            str(made / "rows.jsonl"), "--save", str(made / "ft"), "--train-iters", "1"]
    options(build_parser(only="finetune").parse_args(argv))
    base = made / "ft" / "base"
    shutil.rmtree(base)
    base.mkdir()
    make_save_dir(str(base / "iter_0000000.tmp"))  # (what the killed conversion left)
    o = options(build_parser(only="finetune").parse_args(argv))
    assert o.checkpoint.load == str(base) and resolve(str(base)) == str(base / "iter_0000000")
    assert sorted(os.listdir(base)) == ["iter_0000000", "latest_checkpointed_iteration.txt"]
