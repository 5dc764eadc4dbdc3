"""Megatron .bin/.idx: the fixtures read exactly as Megatron read them; our writer reproduces them;
every kind of corrupt file gets its own clear error."""

import hashlib
import json
import os
import shutil
import struct

import numpy as np
import pytest

from tnlg.cli import main
from tnlg.data.indexed import IndexedDataset, IndexedDatasetBuilder, best_dtype
from tnlg.errors import UserError

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "megatron_indexed")
NAMES = ["tiny_uint16_text_document", "tiny_int32_text_document", "shakespeare_spm_text_document"]


def _expected(name):
    with open(f"{FIXTURES}/{name}.expected.json") as f:
        return json.load(f)


def _sha(path):
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


@pytest.mark.parametrize("name", NAMES)
def test_fixture_reads_as_expected(name):
    e = _expected(name)
    ds = IndexedDataset(f"{FIXTURES}/{name}")
    assert ds.dtype.name == e["dtype"] and ds.dtype_code == e["dtype_code"] and ds.dtype.itemsize == e["dtype_itemsize"]
    assert len(ds) == e["num_sequences"] and ds.num_documents == e["num_documents"]
    assert len(ds.document_indices) == e["document_count_field_in_idx"]
    assert ds.document_indices.tolist() == e["document_indices"]
    assert ds.sequence_lengths.tolist() == e["sequence_lengths"]
    assert ds.sequence_pointers.tolist() == e["sequence_pointers"]
    assert ds.num_tokens == e["total_tokens"] and ds.bin_size == e["bin_size_bytes"]
    assert open(f"{FIXTURES}/{name}.idx", "rb").read(34).hex() == e["idx_header_34_bytes_hex"]
    if "sequences" in e:
        assert [ds[i].tolist() for i in range(len(ds))] == e["sequences"]
        assert [ds.get(i).tolist() for i in range(len(ds))] == e["sequences"]
    else:
        for i, first in enumerate(e["first_3_sequences_first_50_tokens"]):
            assert ds.get(i, 0, 50).tolist() == first
        assert [int(ds[i][-1]) for i in range(len(ds))] == e["last_token_of_each_sequence"]
    # partial reads and whole documents
    assert ds.get(len(ds) - 1, 1, 2).tolist() == ds[len(ds) - 1][1:3].tolist()
    for d in range(ds.num_documents):
        a, b = e["document_indices"][d], e["document_indices"][d + 1]
        assert ds.document(d).tolist() == np.concatenate([ds[i] for i in range(a, b)]).tolist()
    assert ds.get(0, 0, 0).size == 0
    with pytest.raises(IndexError):
        ds.get(0, 0, e["sequence_lengths"][0] + 1)


def test_writer_reproduces_tiny_fixtures_byte_for_byte(tmp_path):
    import torch
    b = IndexedDatasetBuilder(tmp_path / "u16.bin", dtype=np.uint16)
    for i in range(5):
        b.add_item(torch.tensor(list(range(i * 10, i * 10 + 3 + 2 * i))))
        b.end_document()
    b.finalize(tmp_path / "u16.idx")
    b = IndexedDatasetBuilder(tmp_path / "i32.bin", dtype=np.int32)
    seqs = _expected("tiny_int32_text_document")["sequences"]
    for s in seqs[:2]:
        b.add_item(s)
        b.end_document()
    for s in seqs[2:5]:
        b.add_item(np.array(s))
    b.end_document()
    b.add_document(seqs[5], lengths=[5])
    b.finalize(tmp_path / "i32.idx")
    for ours, name in (("u16", NAMES[0]), ("i32", NAMES[1])):
        e = _expected(name)
        assert _sha(tmp_path / f"{ours}.bin") == e["bin_sha256"]
        assert _sha(tmp_path / f"{ours}.idx") == e["idx_sha256"]
    assert sorted(os.listdir(tmp_path)) == ["i32.bin", "i32.idx", "u16.bin", "u16.idx"]  # no temporaries left


def test_builder_is_atomic_and_checks_range(tmp_path):
    with pytest.raises(UserError, match="do not fit uint16"):
        with IndexedDatasetBuilder(tmp_path / "x.bin", dtype=np.uint16) as b:
            b.add_item([1, 2, 3])
            b.add_item(np.array([70000], dtype=np.int64))
    assert os.listdir(tmp_path) == []
    b = IndexedDatasetBuilder(tmp_path / "y.bin", dtype=np.uint16)
    b.add_documents(np.arange(10), [3, 7])
    assert os.listdir(tmp_path) == [f"y.bin.tmp-{os.getpid()}"]  # nothing under the final names yet
    b.finalize(tmp_path / "y.idx")
    ds = IndexedDataset(tmp_path / "y")
    assert ds.document_indices.tolist() == [0, 1, 2] and ds[1].tolist() == list(range(3, 10))
    assert best_dtype(65499) is np.uint16 and best_dtype(65500) is np.int32 and best_dtype(None) is np.int32


# ----------------------------------------------------------------------------- corrupt files

@pytest.fixture
def copy(tmp_path):
    def _copy(name="tiny_int32_text_document"):
        for ext in (".bin", ".idx"):
            shutil.copy(f"{FIXTURES}/{name}{ext}", tmp_path / f"d{ext}")
        return tmp_path / "d"
    return _copy


def _patch(path, offset, data):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def test_missing_partner_files(copy, tmp_path):
    p = copy()
    os.remove(f"{p}.bin")
    with pytest.raises(UserError, match=r"incomplete: .*d\.idx' exists but its partner .*d\.bin' is missing"):
        IndexedDataset(p)
    p = copy()
    os.remove(f"{p}.idx")
    with pytest.raises(UserError, match=r"partner .*d\.idx' is missing"):
        IndexedDataset(p)
    with pytest.raises(UserError, match="neither"):
        IndexedDataset(tmp_path / "nothing")


def test_wrong_magic(copy):
    p = copy()
    _patch(f"{p}.idx", 0, b"TNTIDX\x00\x00")
    with pytest.raises(UserError, match="magic"):
        IndexedDataset(p)


def test_unknown_version(copy):
    p = copy()
    _patch(f"{p}.idx", 9, struct.pack("<Q", 2))
    with pytest.raises(UserError, match="index version 2; only version 1"):
        IndexedDataset(p)


def test_unknown_dtype_code(copy):
    p = copy()
    _patch(f"{p}.idx", 17, struct.pack("<B", 9))
    with pytest.raises(UserError, match=r"dtype code 9; valid codes are 1 \(uint8\)"):
        IndexedDataset(p)


@pytest.mark.parametrize("how", ["truncated", "extra", "count"])
def test_counts_do_not_match_idx_size(copy, how):
    p = copy()
    idx = open(f"{p}.idx", "rb").read()
    if how == "truncated":
        idx = idx[:-8]
    elif how == "extra":
        idx = idx + b"\x00" * 3
    else:
        idx = idx[:18] + struct.pack("<Q", 7) + idx[26:]
    open(f"{p}.idx", "wb").write(idx)
    with pytest.raises(UserError, match=r"claims \d+ sequences and \d+ document indices, which need"):
        IndexedDataset(p)
    open(f"{p}.idx", "wb").write(idx[:20])
    with pytest.raises(UserError, match="shorter than the 34-byte header"):
        IndexedDataset(p)


def test_bin_shorter_than_pointers(copy):
    p = copy()
    data = open(f"{p}.bin", "rb").read()
    open(f"{p}.bin", "wb").write(data[:-4])
    with pytest.raises(UserError, match=r"is 96 bytes but its index needs 100: sequence 5"):
        IndexedDataset(p)


def test_bad_document_indices(copy):
    p = copy()
    e = _expected("tiny_int32_text_document")
    off = 34 + 6 * 4 + 6 * 8
    _patch(f"{p}.idx", off + 8 * 2, struct.pack("<q", 0))  # 0 1 0 5 6: decreasing
    with pytest.raises(UserError, match="document indices"):
        IndexedDataset(p)
    assert e["document_indices"] == [0, 1, 2, 5, 6]


def test_cli_info(capsys):
    assert main(["data", "info", f"{FIXTURES}/shakespeare_spm_text_document",
                 "--tokenizer-model", f"{FIXTURES}/shakespeare_spm_bpe2000.model"]) == 0
    out = capsys.readouterr().out
    assert "uint16 (code 8), 5 sequences, 5 documents, 250728 tokens" in out and "ALL'S WELL" in out
    assert main(["data", "info", "/nonexistent/prefix"]) == 2
    assert "no indexed dataset" in capsys.readouterr().err


# ----------------------------------------------------------------------------- memory at corpus scale

def _write_synthetic(prefix, n):
    """An index of ``n`` one-token documents (uint16), written directly; the .bin is a sparse file."""
    with open(f"{prefix}.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, 8, n, n + 1))
        np.ones(n, dtype=np.int32).tofile(f)
        (np.arange(n, dtype=np.int64) * 2).tofile(f)
        np.arange(n + 1, dtype=np.int64).tofile(f)
    with open(f"{prefix}.bin", "wb") as f:
        f.truncate(2 * n)


def _anonymous_bytes():
    """Private anonymous memory of this process (heap; not the page cache of mapped files)."""
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("Anonymous:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no Anonymous line")


def test_index_is_memory_mapped_not_read(tmp_path, copy):
    """Opening a dataset maps the .idx instead of reading it (no per-rank copy of a
    GB-sized index), the GPT dataset's per-document views add nothing either, and the cache key does
    not hash the whole index."""
    import mmap

    from tnlg.data import gpt_dataset as gd

    ds = IndexedDataset(copy())
    for arr in (ds.sequence_lengths, ds.sequence_pointers, ds.document_indices):
        assert not arr.flags.owndata and not arr.flags.writeable
        base = arr.base.obj if isinstance(arr.base, memoryview) else arr.base  # numpy 2 wraps it in a memoryview
        assert isinstance(base, mmap.mmap), type(base)
    assert ds.one_sequence_per_document is False and ds.contiguous is True  # the fixture has a 3-sequence doc

    if not os.path.exists("/proc/self/smaps_rollup"):
        pytest.skip("needs Linux /proc/self/smaps_rollup to measure private memory")
    n = 2_000_000
    prefix = str(tmp_path / "big")
    _write_synthetic(prefix, n)
    idx_bytes = os.path.getsize(f"{prefix}.idx")  # 40 MB
    from tnlg.parallel.heap import release_freed_memory
    release_freed_memory()
    before = _anonymous_bytes()
    big = IndexedDataset(prefix)
    units = gd._units_of(big)
    key = big.fingerprint()
    release_freed_memory()
    grown = _anonymous_bytes() - before
    assert grown < 0.1 * idx_bytes, f"opening a {idx_bytes / 2**20:.0f} MiB index took {grown / 2**20:.1f} MiB"
    assert big.one_sequence_per_document and units.are_documents and len(units) == n
    assert big.document(n - 1).size == 1 and int(big.sequence_pointers[n - 1]) == 2 * (n - 1)
    # the fingerprint changes with the contents (and their modification time), not with reopening
    assert IndexedDataset(prefix).fingerprint() == key
    _write_synthetic(prefix, n - 1)
    assert IndexedDataset(prefix).fingerprint() != key


def test_gpt_dataset_pickles_without_its_arrays(tmp_path):
    """A GPT dataset sent to a DataLoader worker reopens its maps by path
    instead of pickling O(documents) arrays."""
    import pickle

    from tnlg.data.gpt_dataset import GPTDataset

    prefix = str(tmp_path / "big")
    _write_synthetic(prefix, 200_000)
    ds = GPTDataset(IndexedDataset(prefix), "train", 0, 200_000, seq_length=64, num_samples=100, seed=1)
    blob = pickle.dumps(ds)
    assert len(blob) < 20_000, len(blob)
    again = pickle.loads(blob)
    assert len(again) == len(ds) and all(again[i]["tokens"].tolist() == ds[i]["tokens"].tolist()
                                         for i in range(0, len(ds), 97))


def test_a_prefix_naming_no_dataset_lists_the_datasets_in_its_folder(tmp_path):
    """``--data-path data/py`` beside ``data/py_text_document.bin/.idx`` names that prefix (and only whole
    pairs); a folder without pairs or one that does not exist says so."""
    import re
    for name in ("py_text_document.bin", "py_text_document.idx", "lonely.bin", "other_text_document.idx",
                 "other_text_document.bin"):
        (tmp_path / name).write_bytes(b"")
    want = f"Datasets in {str(tmp_path)!r}: {str(tmp_path / 'other_text_document')!r}, " \
           f"{str(tmp_path / 'py_text_document')!r}."
    with pytest.raises(UserError, match=re.escape(want)):
        IndexedDataset(str(tmp_path / "py"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="holds no dataset"):
        IndexedDataset(str(tmp_path / "empty" / "py"))
    with pytest.raises(UserError, match="does not exist"):
        IndexedDataset(str(tmp_path / "absent" / "py"))
