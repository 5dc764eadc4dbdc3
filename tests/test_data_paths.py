"""Data paths: X.bin, X.idx and X all mean the dataset prefix X, in the options, in what a
checkpoint records and in its resume check (a moved copy with the same file sizes is the same data)."""

from __future__ import annotations

import argparse
import os
import re
import shutil

import pytest

from tests.tiny import tiny_options
from tnlg.checkpoint.compat import check_compatible, data_record
from tnlg.config import GPTConfig
from tnlg.data.gpt_dataset import normalize_data_path, parse_data_path
from tnlg.data.indexed import IndexedDataset, dataset_prefix
from tnlg.errors import UserError
from tnlg.commands.pretrain_args import resolve

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "megatron_indexed")
CFG = GPTConfig(num_layers=1, hidden_size=32, num_attention_heads=2, seq_length=16, vocab_size=2000)


def _copy(src_prefix, dst_prefix):
    for ext in (".bin", ".idx"):
        shutil.copyfile(src_prefix + ext, dst_prefix + ext)
    return dst_prefix


@pytest.fixture
def datasets(tmp_path):
    """Two datasets of different sizes, and a copy of the first one elsewhere."""
    a = _copy(os.path.join(FIXTURES, "shakespeare_spm_text_document"), str(tmp_path / "a_text_document"))
    os.mkdir(tmp_path / "moved")
    moved = _copy(a, str(tmp_path / "moved" / "a_text_document"))
    b = _copy(os.path.join(FIXTURES, "tiny_uint16_text_document"), str(tmp_path / "b_text_document"))
    return a, moved, b


def test_suffixes_mean_the_prefix(datasets):
    a, _, b = datasets
    assert dataset_prefix(a + ".bin") == dataset_prefix(a + ".idx") == dataset_prefix(a) == a
    assert dataset_prefix("corpus.binary") == "corpus.binary"  # only the two file suffixes are cut
    assert normalize_data_path([a + ".bin"]) == [a]
    assert normalize_data_path(f"0.7 {a}.idx 0.3 {b}") == ["0.7", a, "0.3", b]
    assert parse_data_path(["2", a + ".bin", "1", b + ".idx"]) == ([a, b], [2 / 3, 1 / 3])
    assert IndexedDataset(a + ".idx").path_prefix == a
    # the options record the prefix, whichever file was named
    o = resolve(argparse.Namespace(data_path=[a + ".bin"], tokenizer_model="builtin", train_iters=2), world_size=1)
    assert o.data.data_path == [a]
    assert data_record(o)["files"][0] == dict(prefix=os.path.realpath(a), idx_bytes=os.path.getsize(a + ".idx"),
                                              bin_bytes=os.path.getsize(a + ".bin"))


def _meta(record):
    return {"config": CFG.to_dict(), "options": {}, "data": record}


def _now(*data_path):
    return argparse.Namespace(data_path=normalize_data_path(list(data_path)))


def test_resume_check_accepts_the_same_data_under_another_name(datasets):
    a, moved, b = datasets
    saved = data_record(_now(a))
    check_compatible(_meta(saved), "ckpt", CFG, _now(a + ".bin"), None)
    check_compatible(_meta(saved), "ckpt", CFG, _now(moved + ".idx"), None)  # moved, same sizes
    # a run saved before paths were normalised recorded "a.bin", and no sizes (looked up at a.bin.idx)
    old = dict(files=[dict(prefix=os.path.realpath(a) + ".bin", idx_bytes=None, bin_bytes=None)], weights=None)
    check_compatible(_meta(old), "ckpt", CFG, _now(a), None)
    check_compatible(_meta(old), "ckpt", CFG, _now(a + ".bin"), None)


def test_resume_check_names_what_differs(datasets):
    a, moved, b = datasets
    saved = data_record(_now(a))
    with pytest.raises(UserError) as err:
        check_compatible(_meta(saved), "ckpt", CFG, _now(b), None)
    msg = str(err.value)
    idx, bin_ = os.path.getsize(a + ".idx"), os.path.getsize(a + ".bin")
    assert re.search(rf"--data-path {re.escape(os.path.realpath(a))} in the checkpoint \(\.idx {idx:,} \+ "
                     rf"\.bin {bin_:,} bytes\) vs {re.escape(os.path.realpath(b))} now", msg), msg
    assert "None" not in msg and "weights" not in msg
    # an old record without sizes cannot vouch for a moved copy, and says so
    old = dict(files=[dict(prefix=os.path.realpath(a) + ".bin", idx_bytes=None, bin_bytes=None)], weights=None)
    with pytest.raises(UserError, match="no file sizes recorded"):
        check_compatible(_meta(old), "ckpt", CFG, _now(moved), None)
    blend = data_record(_now("0.7", a, "0.3", b))
    with pytest.raises(UserError, match=r"--data-path weights \[0\.7, 0\.3\] in the checkpoint vs \[0\.5, 0\.5\]"):
        check_compatible(_meta(blend), "ckpt", CFG, _now("1", a, "1", b), None)
    with pytest.raises(UserError, match=r"names 2 dataset\(s\) in the checkpoint .* vs 1 now"):
        check_compatible(_meta(blend), "ckpt", CFG, _now(a), None)


def test_a_run_given_the_bin_file_resumes_from_the_prefix_and_a_moved_copy(tmp_path):
    """Train 2 iterations with --data-path X.bin, then resume with X (and from a moved copy of X)."""
    from tnlg.data.corpus import default_dataset
    from tnlg.training import train
    data = _copy(default_dataset()[0], str(tmp_path / "corpus_text_document"))
    flags = dict(num_layers=1, num_attention_heads=2, global_batch_size=2, lr=1e-3, log_interval=100, eval_iters=1,
                 save=str(tmp_path / "run"), save_interval=2)
    train(tiny_options(1, **flags, data_path=[data + ".bin"], train_iters=2))
    os.mkdir(tmp_path / "moved")
    moved = _copy(data, str(tmp_path / "moved" / "corpus_text_document"))
    for path, iters in ((data, 3), (moved + ".idx", 4)):
        summary = train(tiny_options(1, **flags, data_path=[path], train_iters=iters))
        assert len(summary["losses"]) == 1, summary  # resumed at iters - 1: one more iteration


def test_preprocess_output_prefix_named_by_a_file(tmp_path):
    """--output-prefix out/x.bin writes out/x_text_document.bin/.idx (not x.bin_text_document)."""
    from tnlg.data.preprocess import preprocess
    (tmp_path / "d.jsonl").write_text('{"text": "To be, or not to be"}\n', encoding="utf-8")
    s = preprocess([str(tmp_path / "d.jsonl")], str(tmp_path / "out" / "x.bin"), "builtin", progress=False)
    assert s["outputs"] == {"text": str(tmp_path / "out" / "x_text_document")}
    assert sorted(os.listdir(tmp_path / "out")) == ["x_text_document.bin", "x_text_document.idx",
                                                    "x_text_document.tnlg-tokenizer.json"]
