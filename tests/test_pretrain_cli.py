"""`tnlg pretrain` refuses bad input with one clear paragraph, before any process does work."""


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

    from tnlg.commands.pretrain_args import resolve
    cfg = tmp_path / "run.toml"
    cfg.write_text('num-layers = 3\nlr = 0.01\npreset = "gpt2-small"\ntrain-iters = 10\n')
    o = resolve(argparse.Namespace(config=str(cfg), lr=0.02), world_size=4)
    assert (o.model.num_layers, o.schedule.lr, o.model.hidden_size) == (3, 0.02, 768)   # preset < file < flags
    o = resolve(argparse.Namespace(preset="tnlg-17b", fp16=False, bf16=True), world_size=256)
    assert (o.schedule.lr, o.schedule.lr_warmup_iters, o.schedule.lr_decay_iters, o.schedule.global_batch_size,
            o.model.num_attention_heads) == \
        (1.5e-4, 3200, 500_000, 512, 28)
    from tnlg.errors import UserError
    if not torch.cuda.is_available():  # the recipe's fp16 is refused before any work on a CPU
        with pytest.raises(UserError, match="--fp16 needs a GPU"):
            resolve(argparse.Namespace(preset="tnlg-17b"), world_size=256)


def test_tp_above_heads(capsys):
    err = _err(capsys, ["--nproc-per-node", "8", "--tensor-model-parallel-size", "8"])
    assert "largest valid tensor-parallel size for attention is 4" in err


def test_help_states_mfu_formula(capsys):
    with pytest.raises(SystemExit):
        main(["pretrain", "--help"])
    out = capsys.readouterr().out
    assert "MFU" in out and "72 B s l h^2" in out


@pytest.mark.parametrize("argv,needle", [
    (["--accumulate-allreduce-grads-in-fp32"], "needs --bf16 or --fp16"),
    (["--bf16", "--accumulate-allreduce-grads-in-fp32", "--zero-stage", "2"], "stages 0 and 1"),
])
def test_precision_flag_errors(capsys, tmp_path, argv, needle):
    """Issue 11 bad input: refused before any process starts, nothing created."""
    err = _err(capsys, ["--nproc-per-node", "4", *argv, "--save", str(tmp_path / "s")])
    assert needle in err
    assert not (tmp_path / "s").exists()


def test_device_cuda_without_gpu_is_refused(capsys, tmp_path, monkeypatch):
    """Issue 11: --device cuda without a GPU is one clear paragraph before any process starts."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    err = _err(capsys, ["--nproc-per-node", "1", "--device", "cuda", "--save", str(tmp_path / "s")])
    assert "--device cuda" in err and "no CUDA GPU" in err
    assert not (tmp_path / "s").exists()


def test_one_process_uses_the_gpu_when_present(monkeypatch):
    """Issue 11: one process (no launcher, or torchrun with one process) picks CUDA when it is present
    (availability faked); --device cpu overrides; without a GPU it stays on the CPU."""
    from tnlg.parallel.state import init_parallel, pick_device
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    set_to = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: set_to.append(i))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert pick_device(None).type == "cuda" and pick_device("cpu").type == "cpu"
    assert init_parallel(1).device == torch.device("cuda", 0) and set_to == [0]
    monkeypatch.setenv("WORLD_SIZE", "1")  # torchrun --nproc-per-node 1
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert init_parallel(1).device == torch.device("cuda", 0)
    assert init_parallel(1, device="cpu").device == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert init_parallel(1).device == torch.device("cpu")


def test_default_process_count_is_one_per_gpu(monkeypatch):
    """Issue 11: without a launcher or --nproc-per-node, a machine with one GPU trains in one process on
    it (not 4 processes on one device); on CPUs the default stays 4."""
    from tnlg.commands.pretrain import default_nproc
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert default_nproc() == 1 and default_nproc("cpu") == 4
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert default_nproc() == 8
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert default_nproc() == 4
