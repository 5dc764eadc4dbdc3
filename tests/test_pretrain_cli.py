"""`tnlg pretrain` refuses bad input with one clear paragraph, before any process does work."""

import os

import pytest

from tnlg.cli import main


@pytest.fixture
def corpus():
    from tnlg.data.corpus import default_dataset
    return default_dataset()


def _err(capsys, argv):
    status = main(["pretrain", *argv])
    err = capsys.readouterr().err
    assert status == 2, err
    assert "Traceback" not in err
    return err


def test_global_batch_not_divisible(capsys, tmp_path):
    err = _err(capsys, ["--nproc-per-node", "4", "--global-batch-size", "10", "--micro-batch-size", "4",
                        "--save", str(tmp_path / "s")])
    assert "--global-batch-size 10" in err and "micro" in err
    assert not (tmp_path / "s").exists()


def test_tp_not_dividing_world(capsys, tmp_path):
    err = _err(capsys, ["--nproc-per-node", "4", "--tensor-model-parallel-size", "3",
                        "--save", str(tmp_path / "s")])
    assert "does not divide the 4 processes" in err and "[1, 2, 4]" in err
    assert not (tmp_path / "s").exists()


def test_missing_data_path(capsys, tmp_path, corpus):
    err = _err(capsys, ["--nproc-per-node", "1", "--tensor-model-parallel-size", "1",
                        "--data-path", str(tmp_path / "nope"), "--tokenizer-model", corpus[1],
                        "--save", str(tmp_path / "s")])
    assert "nope" in err
    assert not (tmp_path / "s").exists()


def test_corrupt_data(capsys, tmp_path, corpus):
    prefix = tmp_path / "bad_text_document"
    with open(corpus[0] + ".idx", "rb") as f:
        (tmp_path / "bad_text_document.idx").write_bytes(b"NOTMAGIC!" + f.read()[9:])
    with open(corpus[0] + ".bin", "rb") as f:
        (tmp_path / "bad_text_document.bin").write_bytes(f.read())
    err = _err(capsys, ["--nproc-per-node", "1", "--tensor-model-parallel-size", "1",
                        "--data-path", str(prefix), "--tokenizer-model", corpus[1], "--save", str(tmp_path / "s")])
    assert "magic" in err.lower()
    assert not (tmp_path / "s").exists()


def test_fp16_on_cpu(capsys, tmp_path):
    import torch
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: --fp16 is allowed")
    err = _err(capsys, ["--fp16", "--save", str(tmp_path / "s")])
    assert "--fp16 needs a GPU" in err and "--bf16" in err
    assert not (tmp_path / "s").exists()


def test_unknown_config_key(capsys, tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("num_layers: 2\nlearning_rate: 0.1\n")
    err = _err(capsys, ["--config", str(cfg), "--save", str(tmp_path / "s")])
    assert "unknown key 'learning_rate'" in err and "lr" in err
    assert not (tmp_path / "s").exists()


def test_config_file_and_flag_precedence(tmp_path):
    import argparse

    from tnlg.train_args import resolve
    cfg = tmp_path / "run.toml"
    cfg.write_text('num-layers = 3\nlr = 0.01\npreset = "gpt2-small"\n')
    o = resolve(argparse.Namespace(config=str(cfg), lr=0.02), world_size=4)
    assert (o.num_layers, o.lr, o.hidden_size) == (3, 0.02, 768)   # preset < file < flags
    o = resolve(argparse.Namespace(preset="tnlg-17b"), world_size=256)
    assert (o.lr, o.lr_warmup_iters, o.lr_decay_iters, o.global_batch_size, o.num_attention_heads) == \
        (1.5e-4, 3200, 500_000, 512, 28)


def test_tp_above_heads(capsys):
    err = _err(capsys, ["--nproc-per-node", "8", "--tensor-model-parallel-size", "8"])
    assert "largest valid tensor-parallel size for attention is 4" in err


def test_help_states_mfu_formula(capsys):
    with pytest.raises(SystemExit):
        main(["pretrain", "--help"])
    out = capsys.readouterr().out
    assert "MFU" in out and "72 B s l h^2" in out
