"""``tnlg finetune`` from the command line: what it starts from, and the mistakes it refuses before any work."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tnlg.config import GPTConfig
from .fresh_checkpoint import fresh_checkpoint

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
    from tnlg.checkpoint.files import read_meta
    from tnlg.data.tokenizer import builtin_tokenizer_path
    from tnlg.data.tokenizer import load_tokenizer
    tok = load_tokenizer(builtin_tokenizer_path())
    iter_dir = fresh_checkpoint(str(tmp_path / "base"), GPTConfig(**CFG, vocab_size=tok.vocab_size))
    meta = read_meta(iter_dir)
    meta["tokenizer"] = tok.describe()
    with open(os.path.join(iter_dir, "meta.json"), "w") as f:
        json.dump(meta, f)
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps(dict(prompt=f"Question {i}?", completion=f" Answer {i}.")) + "\n"
                            for i in range(8)))
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
