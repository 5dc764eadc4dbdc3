"""`tnlg pretrain` refuses bad input with one clear paragraph, before any process does work, and creates
nothing."""

import os

import pytest
import torch

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
                        "--train-iters", "2", "--save", str(tmp_path / "s")])
    assert "nope" in err
    assert not (tmp_path / "s").exists()


def test_corrupt_data(capsys, tmp_path, corpus):
    prefix = tmp_path / "bad_text_document"
    with open(corpus[0] + ".idx", "rb") as f:
        (tmp_path / "bad_text_document.idx").write_bytes(b"NOTMAGIC!" + f.read()[9:])
    with open(corpus[0] + ".bin", "rb") as f:
        (tmp_path / "bad_text_document.bin").write_bytes(f.read())
    err = _err(capsys, ["--nproc-per-node", "1", "--tensor-model-parallel-size", "1",
                        "--data-path", str(prefix), "--tokenizer-model", corpus[1], "--train-iters", "2",
                        "--save", str(tmp_path / "s")])
    assert "magic" in err.lower()
    assert not (tmp_path / "s").exists()


def test_fp16_on_cpu(capsys, tmp_path):
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


def test_tp_above_heads(capsys):
    err = _err(capsys, ["--nproc-per-node", "8", "--tensor-model-parallel-size", "8"])
    assert "largest valid tensor-parallel size for attention is 4" in err


@pytest.mark.parametrize("argv,needle", [
    (["--accumulate-allreduce-grads-in-fp32"], "needs --bf16 or --fp16"),
    (["--bf16", "--accumulate-allreduce-grads-in-fp32", "--zero-stage", "2"], "stages 0 and 1"),
])
def test_precision_flag_errors(capsys, tmp_path, argv, needle):
    """Precision flags that do not go together are refused before any process starts, nothing created."""
    err = _err(capsys, ["--nproc-per-node", "4", *argv, "--save", str(tmp_path / "s")])
    assert needle in err
    assert not (tmp_path / "s").exists()


def test_device_cuda_without_gpu_is_refused(capsys, tmp_path, monkeypatch):
    """--device cuda without a GPU is one clear paragraph before any process starts."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    err = _err(capsys, ["--nproc-per-node", "1", "--device", "cuda", "--save", str(tmp_path / "s")])
    assert "--device cuda" in err and "no CUDA GPU" in err
    assert not (tmp_path / "s").exists()


def test_load_root_not_writable_is_refused_before_start(tmp_path, capsys):
    """Saving back into an unwritable --load root fails before any work, not at the end of training."""
    if os.geteuid() == 0:
        pytest.skip("root can write anywhere")
    root = tmp_path / "ro"
    root.mkdir()
    root.chmod(0o500)
    try:
        assert main(["pretrain", "--nproc-per-node", "1", "--load", str(root)]) == 2
        assert "not writable" in capsys.readouterr().err
    finally:
        root.chmod(0o700)


@pytest.mark.parametrize("argv,needle", [
    (["--group-query-attention", "--num-query-groups", "3"], "num_query_groups=3 (--num-query-groups) does not divide"),
    (["--swiglu", "--ffn-hidden-size", "3", "--nproc-per-node", "4", "--tensor-model-parallel-size", "4"],
     "larger than ffn_hidden_size=3 (--ffn-hidden-size: with --swiglu the width of each of the gate and up"),
    (["--position-embedding-type", "rope", "--rotary-percent", "0"], "--rotary-percent must be in (0, 1], got 0.0"),
    (["--position-embedding-type", "rope", "--rotary-percent", "1.5"], "--rotary-percent must be in (0, 1], got 1.5"),
    (["--position-embedding-type", "learned_absolute", "--rotary-base", "500000"],
     "but position_embedding_type='learned_absolute'; give --position-embedding-type rope"),
    (["--position-embedding-type", "none", "--rotary-percent", "0.5"], "but position_embedding_type='none'"),
    (["--rope-scaling-type", "llama3", "--rope-scaling-factor", "8"], "rope_scaling_type='llama3' "
     "(--rope-scaling-type) scales rotary embeddings, but position_embedding_type='learned_absolute'"),
    (["--position-embedding-type", "rope", "--rope-scaling-factor", "8"], "rope_scaling_factor set a rope scaling, "
     "but rope_scaling_type is 'none'"),
    (["--position-embedding-type", "rope", "--rope-scaling-type", "llama3", "--rope-low-freq-factor", "4"],
     "llama3 rope needs rope_high_freq_factor (4.0) greater than rope_low_freq_factor (4.0)"),
], ids=["groups-not-dividing-heads", "swiglu-ffn-below-tp", "rotary-percent-0", "rotary-percent-1.5",
        "rotary-base-with-learned-positions", "rotary-percent-without-positions", "rope-scaling-without-rope",
        "rope-factor-without-scaling", "llama3-frequency-factors"])
def test_llama_flag_errors(capsys, tmp_path, argv, needle):
    """The Llama family's flags: one paragraph naming the value and what is valid, before any process
    starts, nothing created."""
    err = _err(capsys, ["--nproc-per-node", "1", *argv, "--train-iters", "1", "--save", str(tmp_path / "s")])
    assert needle in err, err
    assert len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "s").exists()
