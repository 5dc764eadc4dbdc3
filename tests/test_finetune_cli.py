"""``tnlg finetune`` from the command line: what it starts from, and the mistakes it refuses before any work."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CFG = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=32, hidden_dropout=0.0,
           attention_dropout=0.0)


def _tnlg(*argv, cwd):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "tnlg", *map(str, argv)], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


@pytest.fixture()
def base(tmp_path):
    """A tnlg checkpoint of the built-in tokenizer's vocabulary that records the tokenizer, and fine-tuning rows."""
    from tests.fresh_checkpoint import builtin_tokenizer_checkpoint, question_rows
    builtin_tokenizer_checkpoint(str(tmp_path / "base"), **CFG)
    rows = question_rows(tmp_path / "rows.jsonl", 8)
    return tmp_path / "base", rows


def _paragraph(proc) -> str:
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc.stderr


def test_a_model_flag_that_disagrees_with_the_checkpoint_is_refused_before_anything_is_written(base, tmp_path):
    ckpt, rows = base
    err = _paragraph(_tnlg("finetune", "--load", ckpt, "--sft-data-path", rows, "--hidden-size", 48,
                           "--train-iters", 2, "--save", tmp_path / "ft", "--nproc-per-node", 1, cwd=tmp_path))
    assert "--hidden-size 48 given, the checkpoint's is 32" in err and "drop these flags" in err, err
    assert not (tmp_path / "ft").exists()


def test_without_load_or_rows_it_says_what_it_needs(base, tmp_path):
    ckpt, rows = base
    err = _paragraph(_tnlg("finetune", "--sft-data-path", rows, "--train-iters", 2, cwd=tmp_path))
    assert "needs --load" in err
    err = _paragraph(_tnlg("finetune", "--load", ckpt, "--train-iters", 2, cwd=tmp_path))
    assert "needs --sft-data-path" in err
    err = _paragraph(_tnlg("pretrain", "--finetune", "--sft-data-path", rows, "--tokenizer-model", "builtin",
                           "--train-iters", 2, cwd=tmp_path))
    assert "--finetune starts from the weights of a checkpoint, but no --load is given" in err
    assert not (tmp_path / "runs").exists()


def test_use_checkpoint_args_is_refused_with_what_to_do_instead(base, tmp_path):
    ckpt, rows = base
    err = _paragraph(_tnlg("finetune", "--load", ckpt, "--sft-data-path", rows, "--use-checkpoint-args",
                           "--train-iters", 2, cwd=tmp_path))
    assert "To resume a fine-tuning run, give the same command again" in err
    assert not (tmp_path / "runs").exists()


def _losses(folder):
    return [json.loads(line)["loss"] for line in (folder / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_a_megatron_checkpoint_fine_tunes_as_the_tnlg_checkpoint_it_was_exported_from(base, tmp_path):
    """`--load` of a Megatron-LM checkpoint is converted into SAVE/base before the run and trains exactly as the
    tnlg checkpoint it came from."""
    ckpt, rows = base
    meg = tmp_path / "megatron"
    proc = _tnlg("convert", "--from", ckpt, "--to", "megatron", meg, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    common = ["--sft-data-path", rows, "--train-iters", 3, "--micro-batch-size", 2, "--global-batch-size", 4,
              "--nproc-per-node", 1, "--eval-interval", 0, "--no-plot", "--lr", "1e-3", "--peak-tflops", 1]
    for name, load in (("from-tnlg", ckpt), ("from-megatron", meg)):
        extra = ["--tokenizer-model", "builtin"] if name == "from-megatron" else []
        proc = _tnlg("finetune", "--load", load, *extra, *common, "--save", tmp_path / name, cwd=tmp_path)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "converted --load" in proc.stdout and (tmp_path / "from-megatron" / "base").is_dir()
    assert _losses(tmp_path / "from-megatron") == pytest.approx(_losses(tmp_path / "from-tnlg"), abs=1e-6)


def test_a_bad_row_is_one_paragraph_before_any_worker_starts(base, tmp_path):
    ckpt, rows = base
    bad = tmp_path / "bad.jsonl"
    bad.write_text(rows.read_text() + json.dumps(dict(prompt="no completion here")) + "\n")
    proc = _tnlg("finetune", "--load", ckpt, "--sft-data-path", bad, "--train-iters", 2, "--save", tmp_path / "ft",
                 "--nproc-per-node", 2, cwd=tmp_path)
    err = _paragraph(proc)
    assert "bad.jsonl:9:" in err and "without a completion" in err and err.startswith("tnlg finetune: error:"), err
    assert "rank" not in err.lower() and "launch" not in proc.stdout.lower(), proc.stdout + err
    assert not (tmp_path / "ft").exists()
