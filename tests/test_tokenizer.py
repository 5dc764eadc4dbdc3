"""Tokenizers: SentencePiece (fixture + built-in model), training defaults, GPT-2 BPE from local files."""

import json
import os
import shutil
import sys

import pytest

from tests.hf_reference import bytes_to_unicode
from tnlg.cli import main
from tnlg.data.corpus import TOKENIZER_MODEL, corpus_documents
from tnlg.data.tokenizer import (GPT2BPETokenizer, SentencePieceTokenizer, load_tokenizer,
                                 train_sentencepiece)
from tnlg.errors import UserError

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "megatron_indexed")
FIXTURE_MODEL = f"{FIXTURES}/shakespeare_spm_bpe2000.model"

TRICKY = ["plain words", " leading space", "  two leading", "\n\nnewlines first\n", "tabs\tand  runs   of spaces ",
          "windows\r\nline\r\nends", "accents é à ü, emoji 🎭, CJK 中文, RTL שלום", "", " ", "<unk> <s> </s> <|endoftext|>"]


def test_fixture_model_matches_megatron_ids():
    tok = load_tokenizer(FIXTURE_MODEL)
    assert isinstance(tok, SentencePieceTokenizer)
    assert (tok.vocab_size, tok.eod_id) == (2000, 2)
    expected = json.load(open(f"{FIXTURES}/shakespeare_spm_text_document.expected.json"))
    name, text = next((n, t) for n, t in corpus_documents() if n.endswith("alls_well_that_ends_well_gut.txt"))
    ids = tok.encode(text)
    assert ids[:50] == expected["first_3_sequences_first_50_tokens"][0]
    assert len(ids) + 1 == expected["sequence_lengths"][0]
    assert tok.decode(ids) == text


def test_builtin_model_round_trips_exactly():
    tok = load_tokenizer("builtin")
    assert tok.vocab_size == 4096 and tok.eod_id == 2 and tok.path == str(TOKENIZER_MODEL)
    for text in TRICKY:
        assert tok.decode(tok.encode(text)) == text, text
    assert tok.encode_batch(TRICKY) == [tok.encode(t) for t in TRICKY]
    moved = dict(tok.describe(), path="/elsewhere/site-packages/tnlg/data/corpus/x.model")
    assert moved["builtin"] and load_tokenizer(moved).path == tok.path  # a checkpoint from another install


def test_spec_reloads_and_detects_changed_files(tmp_path):
    model = tmp_path / "m.model"
    shutil.copy(FIXTURE_MODEL, model)
    tok = load_tokenizer(str(model))
    spec = json.loads(json.dumps(tok.describe()))  # as stored in a checkpoint
    assert spec["kind"] == "sentencepiece" and spec == tok.spec
    again = load_tokenizer(spec)
    assert again.encode("To be, or not to be") == tok.encode("To be, or not to be")
    shutil.copy(TOKENIZER_MODEL, model)  # same path, different contents
    with pytest.raises(UserError, match="changed since the spec was recorded"):
        load_tokenizer(spec)
    assert load_tokenizer(spec, check_sha256=False).vocab_size == 4096


def test_load_errors(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        load_tokenizer(tmp_path / "nope.model")
    with pytest.raises(UserError, match="unknown tokenizer kind"):
        load_tokenizer({"kind": "wordpiece", "path": "x"})
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="neither vocab.json"):
        load_tokenizer(tmp_path / "empty")
    bad = tmp_path / "bad.model"
    bad.write_bytes(b"not a model")
    with pytest.raises(UserError, match="not a SentencePiece model"):
        load_tokenizer(bad)


def test_train_tokenizer_cli_defaults_round_trip(tmp_path, capsys):
    docs = [t for n, t in corpus_documents() if "comedy_of_errors" in n or "sonnets" in n]
    (tmp_path / "a.txt").write_text(docs[0], encoding="utf-8", newline="")
    with open(tmp_path / "b.jsonl", "w", encoding="utf-8") as f:
        f.write(json.dumps({"text": docs[1]}) + "\n")
    rc = main(["train-tokenizer", "--input", str(tmp_path / "a.txt"), str(tmp_path / "b.jsonl"),
               "--vocab-size", "400", "--output-prefix", str(tmp_path / "tok" / "bpe400")])
    assert rc == 0 and "vocab 400" in capsys.readouterr().out
    tok = load_tokenizer(tmp_path / "tok" / "bpe400.model")
    assert tok.vocab_size == 400 and tok.eod_id == 2
    assert not list((tmp_path / "tok").glob("*.tmp-*"))
    for text in TRICKY + docs:
        assert tok.decode(tok.encode(text)) == text
    with pytest.raises(SystemExit):
        main(["train-tokenizer", "--help"])
    help_text = capsys.readouterr().out
    for word in ("identity", "remove_extra_whitespaces=False", "byte_fallback=True"):
        assert word in help_text


def test_train_tokenizer_rejects_bad_vocab(tmp_path):
    (tmp_path / "a.txt").write_text("some text\n")
    with pytest.raises(UserError, match="--vocab-size"):
        train_sentencepiece([tmp_path / "a.txt"], 10, tmp_path / "x")


# ----------------------------------------------------------------------------- GPT-2 BPE

@pytest.fixture
def gpt2_files(tmp_path):
    alphabet = sorted(set(bytes_to_unicode().values()))
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("a", "n"), ("an", "d"), ("Ġ", "and"),
              ("o", "u"), ("Ġ", "b"), ("Ġb", "e")]
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    vocab["<|endoftext|>"] = len(vocab)
    d = tmp_path / "gpt2"
    d.mkdir()
    (d / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    (d / "merges.txt").write_text("#version: 0.2\n" .join(f"{a} {b}\n" for a, b in merges), encoding="utf-8")
    return d


def test_gpt2_bpe_round_trip_and_matches_transformers(gpt2_files):
    tok = load_tokenizer(gpt2_files)
    assert isinstance(tok, GPT2BPETokenizer)
    assert tok.vocab_size == 256 + 10 + 1 and tok.eod_id == tok.vocab_size - 1
    assert len(tok.encode(" the")) == 1 and len(tok.encode(" and the")) == 2
    transformers = pytest.importorskip("transformers")
    ref = transformers.GPT2Tokenizer(str(gpt2_files / "vocab.json"), str(gpt2_files / "merges.txt"))
    for text in TRICKY + ["The theme in the band and the bee's  knees."]:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        if "<|endoftext|>" not in text:
            assert ids == ref.encode(text), text
    # the spec round trip through a checkpoint and the vocab.json path form
    assert load_tokenizer(json.loads(json.dumps(tok.describe()))).encode("the band") == tok.encode("the band")
    assert load_tokenizer(gpt2_files / "vocab.json").vocab_size == tok.vocab_size


def test_gpt2_bpe_needs_tokenizers_with_clear_error(gpt2_files, monkeypatch):
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # import now raises ImportError
    with pytest.raises(UserError, match=r"pip install 'tnlg\[gpt2bpe\]'"):
        load_tokenizer(gpt2_files)


def test_gpt2_bpe_missing_files(tmp_path, gpt2_files):
    with pytest.raises(UserError, match="merges_file"):
        GPT2BPETokenizer(gpt2_files / "vocab.json", tmp_path / "nope.txt")


@pytest.mark.parametrize("workers", [1, 2])
def test_gpt2_bpe_preprocess_round_trip(tmp_path, gpt2_files, workers):
    from tnlg.data.indexed import IndexedDataset
    from tnlg.data.preprocess import preprocess
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in TRICKY if t))
    s = preprocess([path], tmp_path / "g", str(gpt2_files), append_eod=True, workers=workers, progress=False)
    ds, tok = IndexedDataset(s["outputs"]["text"]), load_tokenizer(gpt2_files)
    assert s["dtype"] == "uint16" and ds.num_documents == len([t for t in TRICKY if t])
    for d, text in enumerate(t for t in TRICKY if t):
        ids = ds.document(d).tolist()
        assert ids[-1] == tok.eod_id and tok.decode(ids[:-1]) == text


# ----------------------------------------------------------------------------- training GPT-2 byte-level BPE

def test_train_gpt2_bpe_is_read_alike_by_tnlg_preprocess_and_transformers(tmp_path, capsys):
    """`--model-type gpt2-bpe` writes vocab.json + merges.txt; transformers' GPT2TokenizerFast (Rust) and
    GPT2Tokenizer (its pure-Python GPT-2 BPE) give the ids tnlg encodes and `tnlg preprocess` writes."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    texts = [t[:20000] for _, t in list(corpus_documents())[:3]]
    inputs = []
    for i, t in enumerate(texts):
        inputs.append(str(tmp_path / f"doc{i}.txt"))
        with open(inputs[-1], "w", encoding="utf-8", newline="") as f:
            f.write(t)
    out = tmp_path / "tok"
    capsys.readouterr()
    assert main(["train-tokenizer", "--input", *inputs, "--vocab-size", "600", "--model-type", "gpt2-bpe",
                 "--output-prefix", str(out)]) == 0
    assert "vocab 600, eod id 599" in capsys.readouterr().out
    assert sorted(os.listdir(out)) == ["merges.txt", "vocab.json"]
    vocab = json.loads((out / "vocab.json").read_text(encoding="utf-8"))
    assert len(vocab) == 600 and vocab["<|endoftext|>"] == 599 and sorted(vocab.values()) == list(range(600))
    merges = (out / "merges.txt").read_text(encoding="utf-8").splitlines()
    assert merges[0] == "#version: 0.2" and len(merges) - 1 == 600 - 256 - 1
    tok = load_tokenizer(out)
    assert isinstance(tok, GPT2BPETokenizer) and tok.eod_id == 599
    fast = transformers.GPT2TokenizerFast.from_pretrained(str(out))
    slow = transformers.GPT2Tokenizer(str(out / "vocab.json"), str(out / "merges.txt"))
    probes = [t for t in TRICKY if "<|endoftext|>" not in t] + [texts[0][:3000], "ROMEO:\nBut soft, what light"]
    for text in probes:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert fast(text)["input_ids"] == ids == slow.encode(text), text[:40]
    assert len(tok.encode(" the")) == 1  # merges were learned
    # preprocess reads the folder; the .bin holds exactly transformers' ids
    from tnlg.data.indexed import IndexedDataset
    from tnlg.data.preprocess import preprocess
    s = preprocess(inputs, tmp_path / "data" / "c", str(out), append_eod=True, progress=False)
    ds = IndexedDataset(s["outputs"]["text"])
    for d, t in enumerate(texts):
        assert ds.document(d).tolist() == fast(t)["input_ids"] + [599]
    # the same inputs train the same files again (the trainer does not depend on the run)
    again = tmp_path / "again"
    assert main(["train-tokenizer", "--input", *inputs, "--vocab-size", "600", "--model-type", "gpt2-bpe",
                 "--output-prefix", str(again)]) == 0
    assert all((again / f).read_bytes() == (out / f).read_bytes() for f in ("vocab.json", "merges.txt"))


def test_train_gpt2_bpe_bad_input(tmp_path, capsys):
    pytest.importorskip("tokenizers")
    (tmp_path / "d.txt").write_text("some text to learn from", encoding="utf-8")
    (tmp_path / "file").write_text("x")
    for argv, match in [(["--vocab-size", "257"], "must be an integer >= 258 for gpt2-bpe"),
                        (["--vocab-size", "300", "--option", "character_coverage=1.0"],
                         "SentencePiece trainer option; --model-type gpt2-bpe takes none"),
                        (["--vocab-size", "300", "--output-prefix", str(tmp_path / "file")], "is a file")]:
        args = ["train-tokenizer", "--input", str(tmp_path / "d.txt"), "--model-type", "gpt2-bpe"]
        if "--output-prefix" not in argv:
            args += ["--output-prefix", str(tmp_path / "out")]
        assert main(args + argv) == 2
        assert match in capsys.readouterr().err
        assert not (tmp_path / "out").exists()


def test_train_tokenizer_notes_code_that_would_be_mostly_single_spaces(tmp_path, capsys):
    """On indented code the default SentencePiece options make a large share of the tokens the single-space
    piece; train-tokenizer says so, naming ``allow_whitespace_only_pieces``, which takes fewer tokens and still
    round-trips. Prose gets no note."""
    import glob

    import sentencepiece as spm
    files = []
    for path in sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py")))[:40]:  # the standard library
        files.append(tmp_path / (os.path.basename(path) + ".txt"))
        files[-1].write_text(open(path, encoding="utf-8", errors="replace").read())
    prose = tmp_path / "prose.txt"
    prose.write_text(max((t for _, t in corpus_documents()), key=len)[:300000])
    runs = {}
    for name, inputs, extra in (("code", files, []), ("code_ws", files, ["--option", "allow_whitespace_only_pieces=true"]),
                                ("prose", [prose], [])):
        capsys.readouterr()
        assert main(["train-tokenizer", "--input", *map(str, inputs), "--vocab-size", "1000", "--output-prefix",
                     str(tmp_path / name), *extra]) == 0
        runs[name] = capsys.readouterr().err
    assert "single-space piece" in runs["code"] and "--option allow_whitespace_only_pieces=true" in runs["code"]
    assert "note:" not in runs["code_ws"] and "note:" not in runs["prose"]
    texts = [f.read_text() for f in files]
    counts = {}
    for name in ("code", "code_ws"):
        sp = spm.SentencePieceProcessor(model_file=str(tmp_path / f"{name}.model"))
        assert all(sp.decode(sp.encode(t)) == t for t in texts)
        counts[name] = sum(len(sp.encode(t)) for t in texts)
    assert counts["code_ws"] < 0.8 * counts["code"], counts
