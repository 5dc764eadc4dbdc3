"""Parquet files and `datasets` folders as inputs of `tnlg preprocess` and `tnlg train-tokenizer`:
the same documents give byte-identical .bin/.idx files as JSON Lines; bad tables are one clear error."""

import hashlib
import json

import pytest

from tnlg.cli import main
from tnlg.data.preprocess import preprocess
from tnlg.errors import UserError

try:  # optional (tnlg[parquet]): without it every test here skips, naming the install command
    import pyarrow as pa
    import pyarrow.parquet as pq
except ImportError:
    pa = pq = None

pytestmark = pytest.mark.needs_package("pyarrow")

# the documents (empty ones too: skipped alike) and a second text column
DOCS = ["First document.\nWith two lines.\n", "  leading spaces, trailing spaces  ", "", "\n\n\nnewlines first",
        "tabs\tand\r\nwindows line ends\r\n", "accents é à ü, emoji 🎭, CJK 中文 ", "x", "a" * 5000,
        "<unk> </s> literal specials"] * 3
TITLES = [f"title {i}" for i in range(len(DOCS))]


def _sha(path):
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def _jsonl(path, keys=("text",)):
    with open(path, "w", encoding="utf-8") as f:
        for d, t in zip(DOCS, TITLES):
            row = {"text": d, "title": t, "id": 7}
            f.write(json.dumps({k: row[k] for k in (*keys, "id")}, ensure_ascii=False) + "\n")
    return str(path)


def _table():
    return pa.table({"id": list(range(len(DOCS))), "text": DOCS, "title": TITLES})


def _parquet(path, row_group_size=4, large=False):
    table = _table()
    if large:
        table = table.cast(pa.schema([("id", pa.int64()), ("text", pa.large_string()), ("title", pa.string())]))
    pq.write_table(table, path, row_group_size=row_group_size)
    assert pq.ParquetFile(path).num_row_groups > 1 or row_group_size >= len(DOCS)
    return str(path)


def _datasets_folder(path):
    import datasets
    ds = datasets.Dataset.from_dict({"id": list(range(len(DOCS))), "text": DOCS, "title": TITLES})
    ds.save_to_disk(str(path), num_shards=2)  # two Arrow files
    return str(path)


def _outputs(s):
    return {k: (_sha(p + ".bin"), _sha(p + ".idx")) for k, p in s["outputs"].items()}


@pytest.mark.needs_package("datasets")
@pytest.mark.parametrize("workers", [1, 2])
def test_parquet_and_datasets_folder_match_jsonl_byte_for_byte(tmp_path, workers):
    keys = ["text", "title"]
    ref = preprocess([_jsonl(tmp_path / "d.jsonl", keys)], tmp_path / "ref" / "c", "builtin", json_keys=keys,
                     append_eod=True, progress=False)
    inputs = {"parquet": _parquet(tmp_path / "d.parquet"), "large_string": _parquet(tmp_path / "l.parquet", 5, True),
              "datasets": _datasets_folder(tmp_path / "ds")}
    for name, path in inputs.items():
        # small chunks: a row group is cut into several tasks, and tasks cross row groups in order
        s = preprocess([path], tmp_path / name / "c", "builtin", json_keys=keys, append_eod=True,
                       workers=workers, progress=False, chunk_bytes=2000)
        assert _outputs(s) == _outputs(ref), name
        assert (s["documents"], s["tokens"], s["empty_documents_skipped"]) == \
               (ref["documents"], ref["tokens"], ref["empty_documents_skipped"]) == (len(DOCS), ref["tokens"], 3)


def test_tokenizer_training_reads_tables_like_jsonl(tmp_path):
    from tnlg.data.tokenizer import train_sentencepiece
    a = train_sentencepiece([_jsonl(tmp_path / "d.jsonl")], 300, tmp_path / "a")
    b = train_sentencepiece([_parquet(tmp_path / "d.parquet")], 300, tmp_path / "b")
    assert open(a, "rb").read() == open(b, "rb").read()


def test_bad_tables_are_one_clear_error_and_write_nothing(tmp_path, capsys):
    out = tmp_path / "out"
    path = _parquet(tmp_path / "d.parquet")
    cases = [([path], ["content"], r"Parquet file .*d\.parquet' has no column 'content'; its columns are "
                                   r"\['id', 'text', 'title'\] \(its text columns: \['text', 'title'\]\)"),
             ([path], ["id"], "column 'id' of Parquet file .* holds int64, not text")]
    nulls = tmp_path / "nulls.parquet"
    pq.write_table(pa.table({"text": ["a", None, "c"]}), nulls)
    cases.append(([str(nulls)], ["text"], r"nulls\.parquet:row 1: no value \(null\) in column 'text'"))
    empty = tmp_path / "empty.parquet"
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), empty)
    cases.append(([str(empty)], ["text"], "has no documents"))
    (tmp_path / "folder").mkdir()
    cases.append(([str(tmp_path / "folder")], ["text"], "not one written by `datasets` `save_to_disk`"))
    (tmp_path / "broken.parquet").write_bytes(b"not parquet at all")
    cases.append(([str(tmp_path / "broken.parquet")], ["text"], "is not a Parquet file pyarrow can read"))
    good = [_jsonl(tmp_path / "ok.jsonl")]  # checked first and fine: still nothing is written
    for inputs, keys, match in cases:
        with pytest.raises(UserError, match=match):
            preprocess((good if keys == ["text"] else []) + inputs, out / "c", "builtin", json_keys=keys,
                       progress=False)
        assert not out.exists()
    # the CLI: one paragraph on stderr, exit status 2
    assert main(["preprocess", "--input", path, "--output-prefix", str(out / "c"), "--tokenizer-model", "builtin",
                 "--json-keys", "body"]) == 2
    err = capsys.readouterr().err
    assert "has no column 'body'; its columns are ['id', 'text', 'title']" in err and "Traceback" not in err
    assert not out.exists()


@pytest.mark.needs_package("datasets")
def test_datasets_dict_folder_names_its_splits(tmp_path):
    import datasets
    ds = datasets.Dataset.from_dict({"text": ["a", "b"]})
    datasets.DatasetDict(train=ds, validation=ds).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(UserError, match=r"DatasetDict \(splits \['train', 'validation'\]\); pass one split's folder"):
        preprocess([str(tmp_path / "dd")], tmp_path / "out" / "c", "builtin", progress=False)
    s = preprocess([str(tmp_path / "dd" / "train")], tmp_path / "out" / "c", "builtin", progress=False)
    assert s["documents"] == 2


def test_without_pyarrow_a_table_input_says_how_to_install_it(tmp_path, monkeypatch):
    import builtins
    real_import = builtins.__import__

    def no_pyarrow(name, *args, **kwargs):
        if name == "pyarrow" or name.startswith("pyarrow."):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    path = _parquet(tmp_path / "d.parquet")
    monkeypatch.setattr(builtins, "__import__", no_pyarrow)
    with pytest.raises(UserError, match=r"optional `pyarrow` package, which is not installed: `pip install "
                                        r"'tnlg\[parquet\]'`"):
        preprocess([path], tmp_path / "out" / "c", "builtin", progress=False)
    assert not (tmp_path / "out").exists()


def _damaged_datasets_folders(tmp_path):
    """``(folder, expected message)`` for each way a `datasets` folder can be damaged or hostile."""
    import os
    import shutil
    src = _datasets_folder(tmp_path / "ds")
    state = json.loads(open(os.path.join(src, "state.json")).read())
    outside = tmp_path / "outside.arrow"  # a valid Arrow stream outside the folder: it must never be read
    shutil.copy(os.path.join(src, state["_data_files"][0]["filename"]), outside)

    def variant(name, text=None, change=None):
        folder = tmp_path / name
        shutil.copytree(src, folder)
        if change is not None:
            change(folder)
        if text is not None:
            (folder / "state.json").write_text(text)
        return str(folder)

    def names(*files):
        return json.dumps(dict(state, _data_files=[{"filename": f} for f in files]))

    def lacking(folder):  # the second file written from a table without the "title" column
        second = folder / state["_data_files"][1]["filename"]
        with pa.memory_map(str(second)) as source:
            table = pa.ipc.open_stream(source).read_all().drop_columns(["title"])
        with pa.OSFile(str(second), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)

    def link_out(folder):
        os.symlink(outside, folder / "link.arrow")

    rel = os.path.relpath(outside, tmp_path / "up")
    return [(variant("bad_json", "{not json"), r"state.json' is damaged: it is not JSON"),
            (variant("a_list", "[1, 2]"), r"state.json' is damaged: it holds a JSON list, not an object"),
            (variant("no_files", json.dumps(dict(state, _data_files=7))), r"its '_data_files' is 7, not a list"),
            (variant("no_name", json.dumps(dict(state, _data_files=[{"file": "x"}]))),
             r"entry 0 of '_data_files' \(\{\"file\": \"x\"\}\) has no 'filename'"),
            (variant("up", names(rel)), r"names a file outside its folder: the name '\.\./outside\.arrow'"),
            (variant("absolute", names(str(outside))), r"names a file outside its folder: the name '/"),
            (variant("link", names("link.arrow"), link_out), r"'link\.arrow' is a symbolic link to .*outside\.arrow"),
            (variant("deep", "[" * 100000 + "]" * 100000), r"nested deeper than any `datasets` file"),
            (variant("lacking", change=lacking), r"data-00001-of-00002\.arrow' of `datasets` folder .* has no "
                                                 r"column 'title'")]


def test_a_damaged_or_hostile_datasets_folder_is_one_clear_error_and_nothing_outside_is_read(tmp_path, capsys):
    """A bad state.json (not JSON, not an object, no file list, an entry without 'filename', nested 10^5
    deep), a file named outside the folder ('../', absolute, a symbolic link out) and a later file without
    one of the columns: each one paragraph naming the file and what is wrong, nothing written."""
    out = tmp_path / "out"
    folders = _damaged_datasets_folders(tmp_path)
    capsys.readouterr()  # (datasets' own progress bars while the folders were made)
    for folder, match in folders:
        with pytest.raises(UserError, match=match):
            preprocess([folder], out / "c", "builtin", json_keys=["text", "title"], progress=False)
        assert not out.exists()
        assert main(["preprocess", "--input", folder, "--output-prefix", str(out / "c"), "--tokenizer-model",
                     "builtin", "--json-keys", "text", "title"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "Traceback" not in err, err


def test_a_parquet_file_with_damaged_data_pages_is_one_clear_error(tmp_path):
    """The footer (schema, row groups) intact, the bytes of the first data page overwritten: the error names
    the file when its pages are read, before anything is written."""
    path = _parquet(tmp_path / "d.parquet")
    data = bytearray(open(path, "rb").read())
    data[4:200] = b"\xff" * 196  # after the magic "PAR1": page headers and compressed values
    open(path, "wb").write(bytes(data))
    assert pq.read_schema(path).names == ["id", "text", "title"]  # the footer still reads
    with pytest.raises(UserError, match=r"d\.parquet' is not a Parquet file pyarrow can read: .* It is damaged or "
                                        r"truncated; nothing was written\."):
        preprocess([path], tmp_path / "out" / "c", "builtin", progress=False)
    assert not (tmp_path / "out").exists()
