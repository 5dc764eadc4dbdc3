"""Megatron checkpoint conversion refuses bad input with one clear paragraph and writes nothing.

The Megatron checkpoints here are written by tnlg's exporter from a small tnlg model (megatron-core
is not needed: these tests check the refusals, tests/test_megatron_checkpoint.py checks the numbers
against megatron-core), then damaged or given args of architectures tnlg does not model; and
one that is valid in an older file format (torch < 1.6, not a zip archive).
"""

import argparse
import datetime
import io
import os
import pickle
import shutil
import subprocess
import sys

import pytest
import torch

from tests.fresh_checkpoint import fresh_checkpoint
from tnlg.config import GPTConfig
from tnlg.errors import UserError
from tnlg.interop.megatron import checkpoint_to_megatron, megatron_to_checkpoint


@pytest.fixture(scope="module")
def tnlg_ckpt(tmp_path_factory):
    cfg = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=100)
    return fresh_checkpoint(str(tmp_path_factory.mktemp("tnlg") / "ckpt"), cfg)


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
    from tnlg.generation.loading import load_for_inference
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


@pytest.mark.parametrize("name,value", [("moe_router_num_groups", 8), ("multi_latent_attention", True), ("squared_relu", True),
                                        ("position_embedding_type", "yarn"), ("normalization", "LayerNorm1p"),
                                        ("rotary_seq_len_interpolation_factor", 4.0)])
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
    def __init__(self, command="echo unpickled"):
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


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
    with pytest.raises(UserError, match="--moe-grouped-gemm: the model has no experts"):
        checkpoint_to_megatron(tnlg_ckpt, str(dst), fmt="legacy", grouped_gemm=True)
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
    from tnlg.generation.loading import load_for_inference
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
    for rank in ("mp_rank_00", "mp_rank_01"):  # a buffer that is a list, not the dict of the states
        torch.save({"buckets_coalesced": True, 0: {(torch.float32, torch.float32): [torch.zeros(3)]}},
                   src / "iter_0000003" / rank / "distrib_optim.pt")
    refused(src, "distrib_optim.pt': its buffer holds a list, not megatron-core's dict of the states")


@pytest.mark.parametrize("name,value", [("ddp_num_buckets", "x"), ("data_parallel_size", "two"),
                                        ("ddp_bucket_size", 2.5), ("world_size", [2])])
def test_bucket_arguments_that_are_no_whole_numbers(megatron_ckpts, tmp_path, name, value):
    """The distributed optimizer's bucket layout comes from the saved args: a count or size that is no
    whole number is one paragraph naming it."""
    src = _copy(megatron_ckpts / "legacy", tmp_path / "src")

    def edit(state):
        args = state["args"]
        args.use_distributed_optimizer, args.overlap_grad_reduce = True, True
        if name == "world_size":
            args.data_parallel_size = None
        setattr(args, name, value)
        state["optimizer"] = dict(param_groups=[dict(step=1)])
    _edit_args(src, "legacy", edit)
    with pytest.raises(UserError, match=f"the saved args' {name} is {value!r}|the saved args' {name} is a list") as info:
        megatron_to_checkpoint(str(src), str(tmp_path / "out"), with_optimizer=True)
    assert "\n" not in str(info.value) and not (tmp_path / "out").exists()


def _with_adam_states(d):
    """Give the torch_dist fixture in ``d`` the model-space Adam states of a non-distributed optimizer
    (``optimizer.state.exp_avg.<key>``, ``exp_avg_sq``: each a copy of the weight's record and bytes, step 3)."""
    import copy
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata
    meta = _index(d)
    for key, md in list(meta.state_dict_metadata.items()):
        if not isinstance(md, TensorStorageMetadata):
            continue
        for kind in ("exp_avg", "exp_avg_sq"):
            meta.state_dict_metadata[f"optimizer.state.{kind}.{key}"] = copy.deepcopy(md)
            for k in [k for k in meta.storage_data if k.fqn == key]:
                meta.storage_data[MetadataIndex(f"optimizer.state.{kind}.{key}", k.offset)] = meta.storage_data[k]
    _save_index(d, meta)
    common = torch.load(d / "common.pt", weights_only=False)
    common["optimizer"] = dict(common_step=3)
    torch.save(common, d / "common.pt")


def test_non_finite_adam_states_or_weights_are_refused_naming_the_tensor(megatron_ckpts, tmp_path):
    """--with-optimizer on Adam moments holding NaN or inf is one paragraph naming the state and the
    tensor, and so is a weight holding them; nothing is written. The same checkpoint with finite states
    converts."""
    src, d = _dist(megatron_ckpts, tmp_path, "finite")
    _with_adam_states(d)
    assert os.path.isdir(megatron_to_checkpoint(str(src), str(tmp_path / "ok"), with_optimizer=True))
    for name, state in (("moment", "exp_avg_sq"), ("first_moment", "exp_avg"), ("weight", None)):
        src, d = _dist(megatron_ckpts, tmp_path, name)
        _with_adam_states(d)
        bad = torch.ones(32)
        bad[3], bad[7] = float("nan"), float("inf")
        _set_chunks(d, _LN_F if state is None else f"optimizer.state.{state}.{_LN_F}", [((0,), (32,), bad)])
        kind = "" if state is None else f"Adam state {state} of "
        with pytest.raises(UserError, match=f"the {kind}{_LN_F} \\(tnlg's transformer.ln_f.weight\\) holds NaN or infinite "
                                            "values") as info:
            megatron_to_checkpoint(str(src), str(tmp_path / "out"), with_optimizer=True)
        assert "\n" not in str(info.value) and not (tmp_path / "out").exists()


# --------------------------------------------------------------------------- hostile files: the torch_dist index

_LN_F = "decoder.final_layernorm.weight"  # 32 elements: the tensor the chunk edits below rewrite


def _dist(megatron_ckpts, tmp_path, name="src"):
    """A copy of the torch_dist fixture and its iteration folder."""
    src = _copy(megatron_ckpts / "torch_dist", tmp_path / name)
    return src, src / "iter_0000003"


def _index(d):
    with open(d / ".metadata", "rb") as f:
        return pickle.load(f)  # the fixture's own index (the importer never unpickles like this)


def _save_index(d, meta):
    with open(d / ".metadata", "wb") as f:
        pickle.dump(meta, f)


def _torch_bytes(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _set_chunks(d, key, pieces, dtype=None):
    """Make ``pieces`` (``(offsets, sizes, object saved as the chunk)``) the chunks of ``key``, appended to
    the data file; ``dtype``: the element type the index then gives the key."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
    meta = _index(d)
    md = meta.state_dict_metadata[key]
    for k in [k for k in meta.storage_data if k.fqn == key]:
        del meta.storage_data[k]
    md.chunks = []
    data = d / "__0_0.distcp"
    for offsets, sizes, obj in pieces:
        payload, start = _torch_bytes(obj), data.stat().st_size
        with open(data, "ab") as f:
            f.write(payload)
        md.chunks.append(ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)))
        meta.storage_data[MetadataIndex(key, torch.Size(offsets))] = _StorageInfo("__0_0.distcp", start, len(payload))
    if dtype is not None:
        md.properties.dtype = dtype
    _save_index(d, meta)


def _weight(megatron_ckpts, key):
    """The fixture's tensor ``key`` as the importer reads it (a valid checkpoint)."""
    from tnlg.interop.megatron.args import MegatronLayout
    from tnlg.interop.megatron.torch_dist import TorchDistSource
    source = TorchDistSource(str(megatron_ckpts / "torch_dist" / "iter_0000003"), MegatronLayout(2, 1, 128, 3, 3.0))
    md = source.meta.state_dict_metadata[key]
    return source.region(key, [0] * len(md.size), list(md.size))


def test_index_names_no_file_outside_the_checkpoint(megatron_ckpts, tmp_path):
    """A data file the index names is a plain name inside the folder: '../' (to a valid data file outside),
    an absolute path and a symbolic link leading out are refused, and the message says nothing of the
    outside file (not its size, not whether it exists)."""
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    shutil.copy(megatron_ckpts / "torch_dist" / "iter_0000003" / "__0_0.distcp", outside / "other.distcp")
    size = str((outside / "other.distcp").stat().st_size)
    for case, name in (("up", "../../elsewhere/other.distcp"), ("absolute", str(outside / "other.distcp"))):
        src, d = _dist(megatron_ckpts, tmp_path, case)
        meta = _index(d)
        for info in meta.storage_data.values():
            info.relative_path = name
        _save_index(d, meta)
        os.remove(d / "__0_0.distcp")
        msg = _refused(src, tmp_path, "not a plain file name inside the checkpoint's folder")
        assert size not in msg and "missing" not in msg and "truncated" not in msg, msg
    src, d = _dist(megatron_ckpts, tmp_path, "link")
    os.remove(d / "__0_0.distcp")
    os.symlink(outside / "other.distcp", d / "__0_0.distcp")
    msg = _refused(src, tmp_path, "no symbolic link leading out")
    assert size not in msg and str(outside) not in msg, msg


def test_overlapping_chunks_count_as_their_union(megatron_ckpts, tmp_path):
    """Coverage is the union of the chunks: twice rows 0-15 of the 32 leaves rows 16-31 uncovered (refused,
    not written as uninitialised memory); rows 0-19 and 12-31 overlap and cover it all (read, the same
    values as the valid checkpoint)."""
    full = _weight(megatron_ckpts, _LN_F)
    src, d = _dist(megatron_ckpts, tmp_path, "holes")
    _set_chunks(d, _LN_F, [((0,), (16,), full[:16].clone()), ((0,), (16,), full[:16].clone())])
    _refused(src, tmp_path, "chunks of 'decoder.final_layernorm.weight' leave part of its \\[32\\] elements uncovered")
    src, d = _dist(megatron_ckpts, tmp_path, "overlap")
    _set_chunks(d, _LN_F, [((0,), (20,), full[:20].clone()), ((12,), (20,), full[12:].clone())])
    from tnlg.generation.loading import load_for_inference
    model = load_for_inference(megatron_to_checkpoint(str(src), str(tmp_path / "out")))[0]
    assert torch.equal(dict(model.named_parameters())["transformer.ln_f.weight"], full)


def _edit_index(megatron_ckpts, tmp_path, name, edit):
    src, d = _dist(megatron_ckpts, tmp_path, name)
    meta = _index(d)
    edit(meta)
    _save_index(d, meta)
    return src


def _chunk_of(meta, key):
    return next(v for k, v in meta.storage_data.items() if k.fqn == key)


@pytest.mark.parametrize("case,match", [
    ("an int", "holds a int, not a torch.distributed.checkpoint Metadata"),
    ("2^34 rows", r"declared of size \[17179869184, 32\].*more than the \d+ bytes of all its data files"),
    ("bool", "the element type torch.bool; the weights and Adam states of a Megatron GPT are floating point"),
    ("int64", "gives 'decoder.final_layernorm.weight' the element type torch.int64; the weights and Adam states"),
    ("int64 everywhere", "the chunk of 'embedding.word_embeddings.weight' at \\[0, 0\\] needs 65536 bytes"),
    ("wrong rank", "the chunk of 'decoder.final_layernorm.weight' at \\[0\\] has no storage entry"),
    ("outside its tensor", "a chunk of 'decoder.final_layernorm.weight' \\(size \\[32\\]\\) is not a box inside it"),
    ("short storage", "needs 128 bytes for its elements, its storage has 100"),
])
def test_a_damaged_index_is_one_paragraph(megatron_ckpts, tmp_path, case, match):
    """Values of the index that are not an index's: each is named, before anything is read by it."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    def edit(meta):
        mds = meta.state_dict_metadata
        if case == "2^34 rows":
            mds["embedding.word_embeddings.weight"].size = torch.Size([2 ** 34, 32])
        elif case in ("bool", "int64 everywhere"):
            for md in mds.values():
                if hasattr(md, "properties"):
                    md.properties.dtype = getattr(torch, case.split()[0])
        elif case == "wrong rank":  # its storage recorded under another shard's offsets
            key = next(k for k in meta.storage_data if k.fqn == _LN_F)
            meta.storage_data[MetadataIndex(_LN_F, torch.Size([16]))] = meta.storage_data.pop(key)
        elif case == "outside its tensor":  # its storage moved along
            mds[_LN_F].chunks[0].offsets = torch.Size([8])
            key = next(k for k in meta.storage_data if k.fqn == _LN_F)
            meta.storage_data[MetadataIndex(_LN_F, torch.Size([8]))] = meta.storage_data.pop(key)
        elif case == "short storage":
            _chunk_of(meta, _LN_F).length = 100
    src = _edit_index(megatron_ckpts, tmp_path, case.replace(" ", "_"), edit)
    if case == "an int":
        _save_index(src / "iter_0000003", 5)
    if case == "int64":  # a consistent index and chunk, of integers
        full = _weight(megatron_ckpts, _LN_F)
        _set_chunks(src / "iter_0000003", _LN_F, [((0,), (32,), full.to(torch.int64))], dtype=torch.int64)
    _refused(src, tmp_path, match)


def _shared_record(meta, keys: int, copies: int, chunk_type=None, distinct: bool = False):
    """``keys`` extra keys sharing one record (one tensor of 4 elements) whose chunk list repeats one chunk
    ``copies`` times (``distinct``: ``copies`` equal chunk objects), each key with a storage entry (all one
    shared record of the fixture's bytes): a pickle of O(keys + copies) bytes."""
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex, TensorProperties,
                                                       TensorStorageMetadata)
    make = chunk_type or ChunkStorageMetadata
    offsets, sizes = torch.Size([0]), torch.Size([4])
    one = make(offsets=offsets, sizes=sizes)
    chunks = [make(offsets=offsets, sizes=sizes) for _ in range(copies)] if distinct else [one] * copies
    md = TensorStorageMetadata(properties=TensorProperties(dtype=torch.float32), size=sizes, chunks=chunks)
    info = _chunk_of(meta, _LN_F)  # 32 float32 elements: room for 4
    for i in range(keys):
        meta.state_dict_metadata[f"shared.{i}"] = md
        meta.storage_data[MetadataIndex(f"shared.{i}", offsets)] = info
    return meta


_SHARED = """
import resource, sys, time
from tnlg.errors import UserError
from tnlg.interop.megatron import megatron_to_checkpoint
resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))
start = time.perf_counter()
try:
    megatron_to_checkpoint(sys.argv[1], sys.argv[2])
    outcome = "converted"
except UserError as exc:
    outcome = "refused: " + str(exc)
print(f"{time.perf_counter() - start:.2f} {outcome}")
"""


def test_an_index_of_keys_sharing_one_record_of_repeated_chunks_is_read_in_linear_time(megatron_ckpts, tmp_path):
    """8,000 keys share one record whose chunk list repeats one chunk 40,000 times (an index under 1 MB;
    checked key by key and chunk by chunk that is 3.2 x 10^8 chunk checks): converted or refused within
    10 s under a 2 GiB address-space cap, in a child process."""
    src, d = _dist(megatron_ckpts, tmp_path)
    _save_index(d, _shared_record(_index(d), 8_000, 40_000))
    assert (d / ".metadata").stat().st_size < 1 << 20
    r = subprocess.run([sys.executable, "-c", _SHARED, str(src), str(tmp_path / "out")], capture_output=True,
                       text=True, timeout=300, env=dict(os.environ, PYTHONPATH=os.getcwd()))
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-2000:]
    seconds, outcome = r.stdout.split(" ", 1)
    assert float(seconds) < 10 and outcome.strip() == "converted", r.stdout


def test_the_index_check_reads_each_chunk_object_once(megatron_ckpts, tmp_path):
    """The work of the index check grows with the index, not with keys x chunks: the chunk objects read
    (their offsets looked up) for 10 times as many keys and chunks grow 10-fold at most (a check of
    every chunk of every key grows 100-fold), whether the list repeats one chunk or holds equal ones."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
    from tnlg.interop.megatron.torch_dist_index import check_index

    class Counted(ChunkStorageMetadata):
        reads = 0

        def __getattribute__(self, name):
            if name == "offsets":
                Counted.reads += 1
            return super().__getattribute__(name)

    _, d = _dist(megatron_ckpts, tmp_path)
    for distinct in (False, True):
        reads = []
        for n in (100, 1000):
            meta = _shared_record(_index(d), n, n, Counted, distinct)
            Counted.reads = 0
            _, _, chunks = check_index(meta, str(d), "idx")
            assert chunks[f"shared.{n - 1}"] == (((0,), (4,)),)  # one distinct chunk
            reads.append(Counted.reads)
        assert reads[0] <= 2 * 100 + 1 and reads[1] <= 10 * reads[0] + 10, (distinct, reads)


@pytest.mark.parametrize("case,match", [
    ("a list", "the chunk at \\(0,\\) in '__0_0.distcp' holds a list, the index gives a torch.float32 tensor"),
    ("int64", "holds a torch.int64 tensor of shape \\(32,\\), the index gives a torch.float32 tensor"),
    ("zeros", "cannot be read .*damaged or truncated"),
])
def test_a_damaged_chunk_is_one_paragraph_and_leaves_no_debris(megatron_ckpts, tmp_path, case, match):
    """A chunk that is not its tensor (a list; int64 where the index says float32: not cast; bytes
    zeroed) fails while the checkpoint is written: one paragraph, no debris (no DST/iter_N.tmp, no
    .tnlg-save, no temporary file), and the same command on a repaired source then works."""
    full = _weight(megatron_ckpts, _LN_F)
    src, d = _dist(megatron_ckpts, tmp_path)
    if case == "zeros":
        meta = _index(d)
        info = _chunk_of(meta, "decoder.final_layernorm.bias")  # the last tensor read
        with open(d / "__0_0.distcp", "r+b") as f:
            f.seek(info.offset)
            f.write(b"\0" * info.length)
    else:
        _set_chunks(d, _LN_F, [((0,), (32,), [1, 2] if case == "a list" else full.to(torch.int64))])
    _refused(src, tmp_path, match)
    shutil.rmtree(src)
    _copy(megatron_ckpts / "torch_dist", src)
    assert os.path.isdir(megatron_to_checkpoint(str(src), str(tmp_path / "out")))


def test_code_in_an_old_format_file_or_a_chunk_is_called_that(megatron_ckpts, tmp_path):
    """os.system in a torch < 1.6 (not zip) rank file or in a .distcp chunk: the message says the file asks
    to run code, never torch's advice to load it without weights_only; nothing ran."""
    marker = tmp_path / "ran"
    src = _copy(megatron_ckpts / "legacy", tmp_path / "old")
    for rank in ("mp_rank_00", "mp_rank_01"):
        path = src / "iter_0000003" / rank / "model_optim_rng.pt"
        state = torch.load(path, weights_only=False)
        state["payload"] = _Evil(f"touch {marker}")
        torch.save(state, path, _use_new_zipfile_serialization=False)
    for msg in (_refused(src, tmp_path, "asks to run code when it is unpickled \\(it calls posix.system\\)"),):
        assert "weights_only" not in msg and "damaged" not in msg, msg
    src, d = _dist(megatron_ckpts, tmp_path, "chunk")
    _set_chunks(d, _LN_F, [((0,), (32,), _Evil(f"touch {marker}"))])
    msg = _refused(src, tmp_path, "torch_dist data file .* asks to run code when it is unpickled")
    assert "weights_only" not in msg and "damaged" not in msg, msg
    assert not marker.exists()


# --------------------------------------------------------------------------- hostile files: args and rank files

@pytest.mark.parametrize("fmt,edit,match", [
    ("torch_dist", lambda s: setattr(s["args"], "tensor_model_parallel_size", "two"),
     "tensor_model_parallel_size is 'two', not a whole number from 1 to 65536"),
    ("legacy", lambda s: setattr(s["args"], "tensor_model_parallel_size", -2),
     "tensor_model_parallel_size is -2, not a whole number from 1 to 65536"),
    ("torch_dist", lambda s: s.update(iteration="abc"), "iteration is 'abc', not a whole number from 0"),
    ("legacy", lambda s: s.update(iteration=-5), "iteration is -5, not a whole number from 0"),
    ("torch_dist", lambda s: s.update(checkpoint_version="x"), "checkpoint_version is 'x', not a number"),
    ("legacy", lambda s: setattr(s["args"], "consumed_train_samples", "lots"),
     "consumed_train_samples is 'lots', not a whole number from 0"),
    ("torch_dist", lambda s: setattr(s["args"], "num_layers", 3), "args give num_layers=3 but its files hold 2 layers"),
    ("legacy", lambda s: setattr(s["args"], "num_layers", 4), "args give num_layers=4 but its files hold 2 layers"),
])
def test_saved_args_and_counters_of_the_wrong_kind(megatron_ckpts, tmp_path, fmt, edit, match):
    src = _copy(megatron_ckpts / fmt, tmp_path / "src")
    _edit_args(src, fmt, edit)
    _refused(src, tmp_path, match)


def test_rank_files_without_floating_point_weights(megatron_ckpts, tmp_path):
    """Integer weights are refused, not cast to floats (one int64 tensor, or all of them)."""
    for case in ("one", "all"):
        src = _copy(megatron_ckpts / "legacy", tmp_path / case)

        def to_int(state, case=case):
            for name, value in state["model"].items():
                if isinstance(value, torch.Tensor) and (case == "all" or name.endswith("final_layernorm.bias")):
                    state["model"][name] = value.to(torch.int64)
        _edit_args(src, "legacy", to_int)
        _refused(src, tmp_path, "is a torch.int64 tensor; the weights and Adam states of a Megatron GPT are "
                                "floating-point tensors")


_BOMBS = r'''
import sys
from tnlg.errors import UserError
from tnlg.interop.megatron import megatron_to_checkpoint
for src, dst in zip(sys.argv[1::2], sys.argv[2::2]):
    try:
        megatron_to_checkpoint(src, dst)
        print("converted", src)
    except UserError as exc:
        print("refused:", str(exc).replace("\n", " "))
'''


def test_small_files_that_would_exhaust_memory(megatron_ckpts, tmp_path):
    """A rank file whose model is a 40-level shared dict graph (2^40 paths), a dict holding itself, and
    args of 10^7 layers: each one paragraph within seconds and a memory cap (in a child process)."""
    import resource
    sources = []
    for case in ("shared", "cycle", "layers"):
        src = _copy(megatron_ckpts / "legacy", tmp_path / case)

        def edit(state, case=case):
            if case == "shared":
                node = {"leaf": torch.zeros(1)}
                for _ in range(40):
                    node = {"a": node, "b": node}
                state["model"]["language_model"] = node
            elif case == "cycle":
                state["model"]["self"] = state["model"]
            else:
                state["args"].num_layers = 10 ** 7
        _edit_args(src, "legacy", edit)
        sources += [str(src), str(tmp_path / f"out_{case}")]

    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))
    r = subprocess.run([sys.executable, "-c", _BOMBS, *sources], capture_output=True, text=True, timeout=120,
                       preexec_fn=cap, env=dict(os.environ, PYTHONPATH=os.getcwd()))
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-2000:]
    lines = r.stdout.splitlines()
    assert len(lines) == 3 and all(line.startswith("refused:") for line in lines), r.stdout
    assert "nests dicts more than 16 deep" in lines[0] and "holds one dict in two places (or inside itself)" in lines[1]
    assert "num_layers is 10000000" in lines[2], lines[2]
    assert not any((tmp_path / f"out_{c}").exists() for c in ("shared", "cycle", "layers"))


class _EnumsByName(pickle.Pickler):
    """Pickles an enum member as ``getattr(cls, name)``, as Python 3.12+ (and some 3.11 builds, 3.11.2
    among them) do, whatever the Python running the test; ``_GetattrOf`` as a getattr of its choosing."""

    def reducer_override(self, obj):
        import enum
        if isinstance(obj, enum.Enum):
            return getattr, (type(obj), obj.name)
        if isinstance(obj, _GetattrOf):
            return getattr, (obj.cls, obj.name)
        return NotImplemented


class _GetattrOf:
    def __init__(self, cls, name):
        self.cls, self.name = cls, name


def _save_index_by_name(d, meta):
    with open(d / ".metadata", "wb") as f:
        _EnumsByName(f, protocol=4).dump(meta)


def test_an_index_that_pickles_enums_by_name_is_read(megatron_ckpts, tmp_path):
    """torch_dist indexes written where enums pickle by name (getattr of the index's own
    ``_MEM_FORMAT_ENCODING``) convert like the fixture; a getattr of anything else is refused as code."""
    from torch.distributed.checkpoint.metadata import Metadata
    src, d = _dist(megatron_ckpts, tmp_path)
    meta = _index(d)
    _save_index_by_name(d, meta)
    with open(d / ".metadata", "rb") as f:
        assert b"getattr" in f.read()  # the test would prove nothing if this pickled by value
    assert os.path.isdir(megatron_to_checkpoint(str(src), str(tmp_path / "ok")))
    for cls, name in ((Metadata, "__reduce__"), (torch.Size, "count")):
        src, d = _dist(megatron_ckpts, tmp_path, f"evil-{name}")
        meta = _index(d)
        meta.planner_data = _GetattrOf(cls, name)
        _save_index_by_name(d, meta)
        msg = _refused(src, tmp_path, r"asks to run code when it is unpickled \(it calls builtins\.getattr\)")
        assert "Nothing was written" in msg


class _PickledAsGetattr:
    """Stands for an enum member as Python 3.12+ and some 3.11 builds pickle it: ``getattr(cls, name)``
    (Megatron's ``args`` hold enums such as ``AttnBackend``); here on ``datetime.timezone``, a skipped module."""

    def __reduce__(self):
        return (getattr, (datetime.timezone, "utc"))


class _GetattrOnAClass:
    def __reduce__(self):
        return (getattr, (argparse.Namespace, "__init__"))


def test_an_enum_pickled_as_getattr_loads_inert_and_any_other_getattr_is_refused(tmp_path):
    """A legacy Megatron file written under Python 3.11.2 pickles its args' enums through
    ``builtins.getattr``; it loads (the member an inert record, the weights intact), while a getattr on
    anything but an inert record is refused as code."""
    from tnlg.interop.megatron.safe_load import load_pt
    path = tmp_path / "model_optim_rng.pt"
    torch.save({"args": argparse.Namespace(attention_backend=_PickledAsGetattr()), "w": torch.ones(3)}, path)
    loaded = load_pt(str(path), "Megatron checkpoint file")
    assert torch.equal(loaded["w"], torch.ones(3)) and "skipped" in repr(loaded["args"].attention_backend)
    torch.save({"x": _GetattrOnAClass()}, path)
    with pytest.raises(UserError, match="asks to run code"):
        load_pt(str(path), "Megatron checkpoint file")


@pytest.mark.parametrize("fmt", ["legacy", "torch_dist"])
def test_a_full_disk_during_an_export_is_one_paragraph_and_leaves_nothing(tnlg_ckpt, tmp_path, fmt):
    """`tnlg convert --to megatron` onto a 64 kB tmpfs: the model does not fit. torch's zip writer (each legacy
    rank file, torch_dist's common.pt) reports a failed write as a RuntimeError without errno; the export
    raises the OSError (ENOSPC) instead, which the command says in one paragraph, and removes its temporary
    folder."""
    from tests.tmpfs import mount_tmpfs, unmount
    mnt = tmp_path / "small"
    mount_tmpfs(mnt, "64k")
    try:
        r = subprocess.run([sys.executable, "-m", "tnlg", "convert", "--from", tnlg_ckpt, "--to", "megatron",
                            str(mnt / "out"), "--format", fmt], capture_output=True, text=True, timeout=120,
                           env=dict(os.environ, PYTHONPATH=os.getcwd()))
        assert r.returncode == 2 and "No space left on device (errno 28)" in r.stderr, r.stderr[-3000:]
        assert "Traceback" not in r.stderr and r.stderr.strip().count("\n") == 0, r.stderr[-3000:]
        assert os.listdir(mnt) == []
    finally:
        unmount(mnt)


def test_torch_files_report_the_write_that_failed(tmp_path):
    """The writer under both exports, on a tmpfs of 64 kB: the OSError with its path, where torch.save on the
    same path raises a RuntimeError (the defect this guards against, shown to still be torch's)."""
    from tests.tmpfs import mount_tmpfs, unmount
    from tnlg.checkpoint import torch_file
    mnt = tmp_path / "small"
    mount_tmpfs(mnt, "64k")
    state = {"w": torch.zeros(100_000)}
    try:
        with pytest.raises(RuntimeError, match="unexpected pos"):
            torch.save(state, str(mnt / "torch.pt"))
        os.remove(mnt / "torch.pt")  # torch leaves its partial file
        with pytest.raises(OSError, match="No space left on device") as info:
            torch_file.save(state, str(mnt / "ours.pt"))
        assert info.value.filename == str(mnt / "ours.pt") and os.listdir(mnt) == []  # no partial file left
        small = {"w": torch.arange(10)}
        torch_file.save(small, str(mnt / "ours.pt"))  # and a file that fits loads back
        assert torch.equal(torch.load(str(mnt / "ours.pt"), weights_only=True)["w"], small["w"])
    finally:
        unmount(mnt)
