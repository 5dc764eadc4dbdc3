"""Megatron checkpoint conversion refuses bad input with one clear paragraph and writes nothing.

The Megatron checkpoints here are written by tnlg's exporter from a small tnlg model (megatron-core
is not needed: these tests check the refusals, tests/test_megatron_checkpoint.py checks the numbers
against megatron-core), then damaged or given args of architectures tnlg does not model; and
one that is valid in an older file format (torch < 1.6, not a zip archive).
"""

import os
import subprocess
import sys

import pytest
import torch

from tnlg.checkpoint.files import FORMAT
from tnlg.checkpoint.reshard import slice_full, targets_for
from tnlg.checkpoint.saving import write_offline
from tnlg.config import GPTConfig
from tnlg.errors import UserError
from tnlg.interop.megatron import checkpoint_to_megatron, megatron_to_checkpoint
from tnlg.model import GPT
from tnlg.parallel.sharding import full_state_dict
from tnlg.parallel.state import ParallelState


@pytest.fixture(scope="module")
def tnlg_ckpt(tmp_path_factory):
    cfg = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=100)
    full = full_state_dict(GPT(cfg), ParallelState.single())
    meta = dict(format=FORMAT, iteration=3, consumed_samples=0, config=cfg.to_dict(), options={}, data=None,
                tokenizer=None, layout=dict(param_dtype="float32"), optimizer=dict(present=False), schedule=None)
    root = tmp_path_factory.mktemp("tnlg") / "ckpt"
    targets = targets_for(cfg, 1, 0)
    return write_offline(str(root), meta, 1, lambda r, names: ({n: slice_full(full[n], targets[n]) for n in names},
                                                                None))


@pytest.fixture(scope="module")
def megatron_ckpts(tnlg_ckpt, tmp_path_factory):
    root = tmp_path_factory.mktemp("megatron")
    for fmt in ("legacy", "torch_dist"):
        checkpoint_to_megatron(tnlg_ckpt, str(root / fmt), fmt=fmt, tp=2)
    return root


def _copy(src, dst):
    import shutil
    shutil.copytree(src, dst)
    return dst


def _refused(src, tmp_path, match):
    dst = tmp_path / "out"
    with pytest.raises(UserError, match=match) as info:
        megatron_to_checkpoint(str(src), str(dst))
    assert not dst.exists(), "a refused conversion wrote to the destination"
    assert "\n" not in str(info.value)
    return str(info.value)


def test_round_trip_of_the_fixture_is_valid(tnlg_ckpt, megatron_ckpts, tmp_path):
    """The inputs of the refusals below are valid before they are damaged: exported and imported
    again, the same weights, vocabulary (the exported args' vocab_size drops the padding rows of
    TP 2) and iteration."""
    from tnlg.checkpoint.loading import load_for_inference
    from tnlg.checkpoint.files import read_meta
    original = dict(load_for_inference(tnlg_ckpt)[0].named_parameters())
    for fmt in ("legacy", "torch_dist"):
        path = megatron_to_checkpoint(str(megatron_ckpts / fmt), str(tmp_path / fmt))
        model = load_for_inference(path)[0]
        assert model.config.vocab_size == 100 and read_meta(path)["iteration"] == 3
        for name, p in model.named_parameters():
            assert torch.equal(p, original[name]), name


def test_not_a_megatron_checkpoint(tnlg_ckpt, tmp_path):
    (tmp_path / "empty").mkdir()
    _refused(tmp_path / "empty", tmp_path, "is not a Megatron-LM checkpoint")
    _refused(os.path.dirname(tnlg_ckpt), tmp_path, "is a tnlg checkpoint, not a Megatron-LM one")
    _refused(tmp_path / "nowhere", tmp_path, "is not a directory")


def test_missing_rank_file(megatron_ckpts, tmp_path):
    src = _copy(megatron_ckpts / "legacy", tmp_path / "src")
    os.remove(src / "iter_0000003" / "mp_rank_01" / "model_optim_rng.pt")
    msg = _refused(src, tmp_path, "mp_rank_01/model_optim_rng.pt' is missing")
    assert "TP=2 x PP=1" in msg


def test_missing_data_file_of_torch_dist(megatron_ckpts, tmp_path):
    src = _copy(megatron_ckpts / "torch_dist", tmp_path / "src")
    os.remove(src / "iter_0000003" / "__0_0.distcp")
    _refused(src, tmp_path, "__0_0.distcp.*is missing")


def _edit_args(src, fmt, edit):
    d = src / "iter_0000003"
    paths = [d / "common.pt"] if fmt == "torch_dist" else [d / n / "model_optim_rng.pt" for n in os.listdir(d)]
    for path in paths:
        state = torch.load(path, weights_only=False)
        edit(state)
        torch.save(state, path)


@pytest.mark.parametrize("fmt", ["legacy", "torch_dist"])
def test_missing_args(megatron_ckpts, fmt, tmp_path):
    src = _copy(megatron_ckpts / fmt, tmp_path / "no_args")
    _edit_args(src, fmt, lambda s: s.pop("args"))
    _refused(src, tmp_path, "has no saved 'args'")
    src = _copy(megatron_ckpts / fmt, tmp_path / "no_layers")
    _edit_args(src, fmt, lambda s: delattr(s["args"], "num_layers"))
    _refused(src, tmp_path, "no 'num_layers'")


@pytest.mark.parametrize("name,value", [("swiglu", True), ("position_embedding_type", "rope"),
                                        ("normalization", "RMSNorm"), ("num_experts", 8),
                                        ("group_query_attention", True), ("add_bias_linear", False)])
def test_unsupported_architecture_names_the_argument(megatron_ckpts, name, value, tmp_path):
    src = _copy(megatron_ckpts / "torch_dist", tmp_path / "src")
    _edit_args(src, "torch_dist", lambda s: setattr(s["args"], name, value))
    _refused(src, tmp_path, f"{name}={value!r}.*which tnlg does not model")


def test_truncated_files(megatron_ckpts, tmp_path):
    src = _copy(megatron_ckpts / "legacy", tmp_path / "legacy")
    path = src / "iter_0000003" / "mp_rank_01" / "model_optim_rng.pt"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    _refused(src, tmp_path, "damaged|truncated")
    src = _copy(megatron_ckpts / "torch_dist", tmp_path / "dist")
    path = src / "iter_0000003" / "__0_0.distcp"
    path.write_bytes(path.read_bytes()[:-100])
    _refused(src, tmp_path, "is truncated")
    src = _copy(megatron_ckpts / "torch_dist", tmp_path / "index")
    path = src / "iter_0000003" / ".metadata"
    path.write_bytes(path.read_bytes()[:200])
    _refused(src, tmp_path, "damaged or truncated")


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo unpickled",))


def test_a_file_that_would_run_code_is_refused(megatron_ckpts, tmp_path):
    src = _copy(megatron_ckpts / "legacy", tmp_path / "src")
    _edit_args(src, "legacy", lambda s: s.update(payload=_Evil()))
    _refused(src, tmp_path, "posix.system|does not unpickle")


def test_export_at_a_layout_megatron_cannot_take(tnlg_ckpt, tmp_path):
    dst = tmp_path / "out"
    with pytest.raises(UserError, match=r"num_attention_heads \(4\) to be a multiple of tensor_model_parallel_size "
                                        r"\(3\); valid TP sizes for this model: \[1, 2, 4\]"):
        checkpoint_to_megatron(tnlg_ckpt, str(dst), tp=3)
    with pytest.raises(UserError, match=r"2 layers do not split evenly into 3 pipeline stages"):
        checkpoint_to_megatron(tnlg_ckpt, str(dst), pp=3)
    with pytest.raises(UserError, match="--format 'zarr'"):
        checkpoint_to_megatron(tnlg_ckpt, str(dst), fmt="zarr")
    assert not dst.exists()
    (dst / "x").mkdir(parents=True)
    with pytest.raises(UserError, match="already exists and is not empty"):
        checkpoint_to_megatron(tnlg_ckpt, str(dst))
    assert os.listdir(dst) == ["x"]


def test_cli_errors_are_one_paragraph(megatron_ckpts, tmp_path):
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    base = [sys.executable, "-m", "tnlg", "convert"]
    cases = [(["--from", "megatron", str(megatron_ckpts / "legacy"), "--to", str(tmp_path / "a"), "--with-optimizer"],
              "holds no optimizer state"),
             (["--from", "megatron", str(tmp_path), "--to", str(tmp_path / "b")], "is not a Megatron-LM checkpoint"),
             (["--from", "megatron", str(megatron_ckpts / "legacy"), "--to", str(tmp_path / "c"), "--pp", "2"],
              "--pipeline-model-parallel-size applies to --to megatron only: a tnlg checkpoint is one layout for "
              "every pipeline split")]
    for argv, match in cases:
        r = subprocess.run(base + argv, capture_output=True, text=True, env=env, timeout=120)
        assert r.returncode == 2 and match in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert sorted(os.listdir(tmp_path)) == []


def test_rank_files_of_torch_before_1_6_are_read(megatron_ckpts, tmp_path):
    """Older Megatron runs wrote non-zip pickles (no memory map): read whole, with the same results."""
    from tnlg.checkpoint.loading import load_for_inference
    src = _copy(megatron_ckpts / "legacy", tmp_path / "src")
    for rank in ("mp_rank_00", "mp_rank_01"):
        path = src / "iter_0000003" / rank / "model_optim_rng.pt"
        torch.save(torch.load(path, weights_only=False), path, _use_new_zipfile_serialization=False)
    old = load_for_inference(megatron_to_checkpoint(str(src), str(tmp_path / "old")))[0]
    new = load_for_inference(megatron_to_checkpoint(str(megatron_ckpts / "legacy"), str(tmp_path / "new")))[0]
    for (name, a), (_, b) in zip(old.named_parameters(), new.named_parameters()):
        assert torch.equal(a, b), name


def test_an_iteration_folder_or_a_release_checkpoint(megatron_ckpts, tmp_path):
    """The source may be one iter_* folder, or a root whose tracker file says 'release'."""
    from tnlg.checkpoint.files import read_meta
    path = megatron_to_checkpoint(str(megatron_ckpts / "torch_dist" / "iter_0000003"), str(tmp_path / "one"))
    assert read_meta(path)["iteration"] == 3
    src = _copy(megatron_ckpts / "legacy", tmp_path / "release")
    os.rename(src / "iter_0000003", src / "release")
    (src / "latest_checkpointed_iteration.txt").write_text("release")
    assert read_meta(megatron_to_checkpoint(str(src), str(tmp_path / "two")))["iteration"] == 3
    (src / "latest_checkpointed_iteration.txt").write_text("soon")
    _refused(src, tmp_path, "neither an iteration number nor 'release'")


def test_with_optimizer_refuses_what_it_cannot_read(megatron_ckpts, tmp_path):
    """--with-optimizer needs Adam state it reads: none at all (a weights-only save), a damaged
    distrib_optim.pt of the distributed optimizer, or a legacy optimizer entry whose param groups do not match the
    model, is one paragraph naming it; nothing is written."""
    def refused(src, match):
        dst = tmp_path / "out"
        with pytest.raises(UserError, match=match) as info:
            megatron_to_checkpoint(str(src), str(dst), with_optimizer=True)
        assert not dst.exists() and "\n" not in str(info.value)

    refused(megatron_ckpts / "torch_dist", "holds no optimizer state .*--no-save-optim")
    refused(megatron_ckpts / "legacy", "holds no optimizer state .*--no-save-optim")
    src = _copy(megatron_ckpts / "legacy", tmp_path / "legacy_optim")
    for rank in ("mp_rank_00", "mp_rank_01"):
        path = src / "iter_0000003" / rank / "model_optim_rng.pt"
        state = torch.load(path, weights_only=False)
        groups = [dict(wd_mult=1.0, params=[0, 1]), dict(wd_mult=0.0, params=[2])]
        state["optimizer"] = dict(state={0: dict(step=torch.tensor(1.0))}, param_groups=groups)
        torch.save(state, path)
    refused(src, "param group 0 has 2 parameters but the model has 10 of its kind")
    (src / "iter_0000003" / "mp_rank_00" / "distrib_optim.pt").write_bytes(b"")
    refused(src, "distrib_optim.pt' cannot be loaded .* damaged, truncated")
