"""Hugging Face export: the folder carries a tokenizer that `transformers` loads and that encodes like
tnlg's (SentencePiece BPE and GPT-2 BPE), greedy generation from the folder alone matches
`tnlg generate`, and an export never deletes what it did not write."""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import unicodedata

import pytest
import torch

from tests.hf_reference import random_gpt2
from tnlg.cli import main
from tnlg.config import GPTConfig
from tnlg.data.tokenizer import GPT2BPETokenizer, load_tokenizer, train_sentencepiece
from tnlg.errors import UserError

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

FIXTURE_MODEL = os.path.join(os.path.dirname(__file__), "fixtures", "megatron_indexed") + "/shakespeare_spm_bpe2000.model"
TRICKY = ["", " ", "  ", "   ", "\n", "\n\n", "plain words", " leading space", "  two leading", "trailing ",
          "\n\nnewlines first\n", "tabs\tand  runs   of spaces ", "windows\r\nline\r\nends",
          "accents é à ü ß, CJK 中文 日本語, RTL שלום مرحبا", "emoji 🎭 👩‍👩‍👧 🇫🇷 🤖", "digits 0123456789 3.14159 1,000,000",
          "<unk> <s> </s> <pad> <|endoftext|> <0x41>", "▁already ▁escaped▁", "x▁▁y", "ＡＢＣ ﬁ ① ½", "\u00a0nbsp\u00a0 \u3000ideo",
          "zero\u200bwidth \x00 \x7f", "MiXeD CaSe!?;: (x) [y] {z} \"q\" 'q'", "To be, or not to be: that is the question."]
ALPHABET = ("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789      \n\n\t\r.,;:!?'\"-()"
            "éàüßñçÉ中文日本語한국어שלוםمرحبا🎭👩‍🇫🇷\u00a0\u200b\u3000▁ﬁ①½\u0301")


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one intra-op thread is faster


@pytest.fixture(scope="module")
def texts():
    """Every tricky string, 300 random unicode strings, lines and whole documents of the built-in corpus."""
    from tnlg.data.corpus import corpus_documents
    docs = [t for n, t in corpus_documents() if n.endswith(("hamlet_gut.txt", "paradise_lost_gut.txt"))]
    rng = random.Random(0)
    noise = ["".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 40))) for _ in range(300)]
    lines = [line for d in docs for line in d.split("\n")[:1500]]
    return TRICKY + noise + lines + [d[:60000] for d in docs]


def _export_tokenizer(tok, folder, seq=64):
    """The exported folder's tokenizer with special tokens' text split into characters, as tnlg encodes text
    (``split_special_tokens=True``; the folder's default matches them as single ids, as transformers does)."""
    from tnlg.data.hf_tokenizer import hf_tokenizer_files
    os.makedirs(folder)
    for name, data in hf_tokenizer_files(tok, seq).items():
        with open(os.path.join(folder, name), "wb") as f:
            f.write(data)
    return transformers.AutoTokenizer.from_pretrained(str(folder), split_special_tokens=True)


def _assert_same(tok, hf_tok, texts, decode=True):
    for text in texts:
        ids = tok.encode(text)
        assert hf_tok(text)["input_ids"] == ids, text[:200]
        if decode:
            assert hf_tok.decode(ids) == tok.decode(ids), text[:200]
    assert hf_tok(texts[:50])["input_ids"] == tok.encode_batch(texts[:50])  # batched, as generate() users call it


# ----------------------------------------------------------------------------- SentencePiece BPE

@pytest.mark.parametrize("model", ["builtin", FIXTURE_MODEL])
def test_sentencepiece_folder_encodes_like_tnlg(model, texts, tmp_path):
    if model != "builtin" and not os.path.isfile(model):
        pytest.skip("Megatron fixture model not present")
    tok = load_tokenizer(model)
    hf_tok = _export_tokenizer(tok, tmp_path / "tok")
    _assert_same(tok, hf_tok, texts)
    assert (hf_tok.eos_token_id, hf_tok.bos_token_id, hf_tok.eos_token) == (tok.eod_id, tok.eod_id, "</s>")
    assert hf_tok.unk_token_id == 0 and len(hf_tok) == tok.vocab_size
    assert hf_tok("</s>")["input_ids"] == tok.encode("</s>") != [tok.eod_id]  # split: text is text, as in tnlg
    default = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    assert default("</s>")["input_ids"] == [tok.eod_id]  # transformers' default: the special token's one id
    assert hf_tok.model_max_length == 64
    # the source model rides along: tnlg (and SentencePiece) load the folder too
    assert load_tokenizer(tmp_path / "tok").encode("Hello there") == tok.encode("Hello there")


def _train(tmp_path, name, **options):
    corpus = tmp_path / "train.txt"
    if not corpus.exists():
        from tnlg.data.corpus import corpus_documents
        corpus.write_text(next(t for n, t in corpus_documents() if n.endswith("hamlet_gut.txt"))[:200000])
    return load_tokenizer(train_sentencepiece([corpus], 600, tmp_path / name, **options))


def test_sentencepiece_settings_beyond_tnlg_defaults(texts, tmp_path):
    """spm_train's own defaults (NFKC, whitespace collapsing, no byte fallback: unknown runs are one <unk>),
    no dummy prefix with whitespace-only pieces, digits split, and user-defined / control symbols."""
    variants = {
        "spm_defaults": dict(normalization_rule_name="nmt_nfkc", remove_extra_whitespaces=True, byte_fallback=False),
        "nfkc_bytes": dict(normalization_rule_name="nmt_nfkc_cf", remove_extra_whitespaces=True, split_digits=True),
        "no_prefix": dict(add_dummy_prefix=False, allow_whitespace_only_pieces=True),
        "symbols": dict(user_defined_symbols=["<sep>", "[MASK]", "ab"], control_symbols=["<ctl>"]),
    }
    extra = ["<sep>start", "a <sep> b", "a<sep>b [MASK] <ctl> abab", "x ab y", " <sep> ", "<sep><sep>", "[MASK]<sep>ab",
             "tab\tab", "  ab  "]
    some = texts[:400] + texts[-3:]
    # tokenizers' Precompiled normaliser maps a whole grapheme cluster by the rule of its first character,
    # dropping what extends it (combining marks, ZWJ) (docs/hf.md); SentencePiece maps longest prefixes
    plain = [t for t in some if not any(unicodedata.combining(c) or c == "\u200d" for c in t)]
    for name, options in variants.items():
        tok = _train(tmp_path, name, **options)
        hf_tok = _export_tokenizer(tok, tmp_path / f"{name}_hf")
        _assert_same(tok, hf_tok, (plain if "nfkc" in str(options) else some) + extra)
        if name == "spm_defaults":
            assert tok.encode("x 中 y") == hf_tok("x 中 y")["input_ids"] and 0 in tok.encode("x 中 y")  # <unk>
    # the documented limitation: a text that is exactly one user-defined piece gets no lone dummy-prefix piece
    assert hf_tok("<sep>")["input_ids"] == tok.encode("<sep>")[1:]


def test_unsupported_sentencepiece_models_are_refused(tmp_path):
    from tnlg.data.hf_tokenizer import hf_tokenizer
    tok = _train(tmp_path, "unigram", model_type="unigram")
    with pytest.raises(UserError, match=r"unigram model .*--no-tokenizer"):
        hf_tokenizer(tok)


# ----------------------------------------------------------------------------- GPT-2 BPE

def _gpt2_folder(folder, texts, vocab_size=600):
    """A small GPT-2-style byte-level BPE (vocab.json + merges.txt, <|endoftext|> last), trained here."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    t.train_from_iterator(texts, trainer)
    os.makedirs(folder)
    t.model.save(str(folder))
    vocab = json.loads((folder / "vocab.json").read_text(encoding="utf-8"))
    vocab["<|endoftext|>"] = len(vocab)
    (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    return folder


def test_gpt2_bpe_folder_encodes_like_tnlg(texts, tmp_path):
    tok = load_tokenizer(_gpt2_folder(tmp_path / "gpt2", texts[-2:]))
    assert isinstance(tok, GPT2BPETokenizer) and tok.eod_id == tok.vocab_size - 1
    hf_tok = _export_tokenizer(tok, tmp_path / "tok")
    _assert_same(tok, hf_tok, texts)
    assert (hf_tok.eos_token, hf_tok.eos_token_id, hf_tok.bos_token_id) == ("<|endoftext|>", tok.eod_id, tok.eod_id)
    assert hf_tok("<|endoftext|>")["input_ids"] == tok.encode("<|endoftext|>") != [tok.eod_id]
    default = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    assert default("<|endoftext|>")["input_ids"] == [tok.eod_id]
    assert {"vocab.json", "merges.txt"} <= set(os.listdir(tmp_path / "tok"))  # what tnlg eval/generate read


# ----------------------------------------------------------------------------- generation from the folder alone

def _hf_model(vocab, seq=64, seed=0):
    return random_gpt2(vocab, seq, seed)


def _tnlg_generate(ckpt, prompts, new, extra=()):
    argv = ["generate", "--checkpoint", ckpt, "--greedy", "--max-new-tokens", str(new), "--json", *extra]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(argv + [f"--prompt={p}" for p in prompts]) == 0
    return json.loads(out.getvalue().strip().splitlines()[-1])["results"]


@pytest.mark.parametrize("kind", ["sentencepiece", "gpt2bpe"])
def test_exported_folder_alone_reproduces_tnlg_generate(kind, texts, tmp_path, capfd, monkeypatch):
    """tnlg checkpoint -> `tnlg generate` greedy; `tnlg convert --to hf`; then AutoTokenizer +
    GPT2LMHeadModel.generate from that folder give the same tokens and text, and the export
    printed no transformers warning (bos/eos are the EOD id, inside the vocabulary). docs/hf.md's snippet,
    run as written on that folder, prints exactly `tnlg generate`'s text (it dropped the first space)."""
    tokenizer = "builtin" if kind == "sentencepiece" else str(_gpt2_folder(tmp_path / "gpt2", texts[-2:]))
    tok = load_tokenizer(tokenizer)
    hf_in, ckpt, out = str(tmp_path / "hf_in"), str(tmp_path / "ckpt"), str(tmp_path / "gpt-out")
    _hf_model(tok.vocab_size + 3).save_pretrained(hf_in)  # a vocabulary larger than the tokenizer's is fine
    assert main(["convert", "--from", "hf", hf_in, "--to", ckpt, "--tokenizer-model", tokenizer]) == 0
    prompts = ["To be, or not to be", "  O Romeo,\nRomeo!", "Of Man's first disobedience 🎭"]
    new = 24
    want = _tnlg_generate(ckpt, prompts, new)
    capfd.readouterr()
    assert main(["convert", "--from", ckpt, "--to", "hf", out]) == 0
    err = capfd.readouterr().err
    assert "bos_token_id" not in err and "eos_token_id" not in err and "warn" not in err.lower(), err

    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    hf = transformers.GPT2LMHeadModel.from_pretrained(out).eval()
    assert hf.config.bos_token_id == hf.config.eos_token_id == hf.generation_config.eos_token_id == tok.eod_id
    with torch.no_grad():
        for prompt, ref in zip(prompts, want):
            enc = hf_tok(prompt, return_tensors="pt")
            assert enc["input_ids"][0].tolist() == tok.encode(prompt)
            ids = hf.generate(**enc, max_new_tokens=new, do_sample=False)[0, enc["input_ids"].shape[1]:].tolist()
            assert ids == ref["tokens"], prompt
            body = ids[:-1] if ids and ids[-1] == tok.eod_id else ids
            # the continuation is the rest of the whole sequence's decoding, as tnlg generate prints it
            assert hf_tok.decode(enc["input_ids"][0].tolist() + body) == prompt + ref["text"]
    assert len(set(sum((r["tokens"] for r in want), []))) > 5  # not one token repeated
    readme = (__import__("pathlib").Path(__file__).parent.parent / "docs" / "hf.md").read_text()
    snippet = next(s for s in __import__("re").findall(r"```python\n(.*?)```", readme, __import__("re").S)
                   if "AutoTokenizer.from_pretrained(\"gpt-out/\")" in s)
    # its prompt, or one whose continuation starts with a space (where decoding the new ids alone goes wrong)
    candidates = ["To be, or not to be", "The", "And so", "Now is the winter", "What", "O", "My lord"]
    runs = _tnlg_generate(ckpt, candidates, 40)
    prompt, text = next(((p, r["text"]) for p, r in zip(candidates, runs) if r["text"].startswith(" ")),
                        (candidates[0], runs[0]["text"]))
    assert kind != "sentencepiece" or text.startswith(" ")
    monkeypatch.chdir(tmp_path)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), torch.no_grad():
        exec(compile(snippet.replace('"To be, or not to be"', json.dumps(prompt)), "docs/hf.md", "exec"), {})
    assert printed.getvalue() == text + "\n"
    # and tnlg reads the folder back: GPT-2 BPE through vocab.json + merges.txt, SentencePiece through tokenizer.model
    again = _tnlg_generate(out, prompts, new, [] if kind == "gpt2bpe" else ["--tokenizer-model", out])
    assert [r["tokens"] for r in again] == [r["tokens"] for r in want]


# ----------------------------------------------------------------------------- convert options and errors

@pytest.fixture
def checkpoints(tmp_path):
    """A weights-only checkpoint without a tokenizer and one recording the built-in tokenizer."""
    hf_in = str(tmp_path / "hf_in")
    _hf_model(4096, seq=16).save_pretrained(hf_in)
    bare, with_tok = str(tmp_path / "bare"), str(tmp_path / "with_tok")
    assert main(["convert", "--from", "hf", hf_in, "--to", bare]) == 0
    assert main(["convert", "--from", "hf", hf_in, "--to", with_tok, "--tokenizer-model", "builtin"]) == 0
    return dict(bare=bare, with_tok=with_tok, root=tmp_path)


def test_convert_to_hf_tokenizer_options(checkpoints, capsys):
    root = checkpoints["root"]
    capsys.readouterr()
    assert main(["convert", "--from", checkpoints["bare"], "--to", "hf", str(root / "a")]) == 0
    assert "records no tokenizer" in capsys.readouterr().err
    assert not (root / "a" / "tokenizer.json").exists()
    assert json.loads((root / "a" / "config.json").read_text())["eos_token_id"] is None
    assert main(["convert", "--from", checkpoints["bare"], "--to", "hf", str(root / "b"),
                 "--tokenizer-model", "builtin"]) == 0
    assert transformers.AutoTokenizer.from_pretrained(str(root / "b")).eos_token_id == 2
    assert json.loads((root / "b" / "config.json").read_text())["eos_token_id"] == 2
    assert main(["convert", "--from", checkpoints["with_tok"], "--to", "hf", str(root / "c"), "--no-tokenizer"]) == 0
    assert "tokenizer" not in capsys.readouterr().err
    assert sorted(os.listdir(root / "c")) == ["config.json", "generation_config.json", "model.safetensors"]


def test_convert_to_hf_tokenizer_errors(checkpoints, tmp_path, capsys):
    _hf_model(300, seq=16).save_pretrained(str(tmp_path / "hf_small"))
    small = str(tmp_path / "small")
    assert main(["convert", "--from", "hf", str(tmp_path / "hf_small"), "--to", small]) == 0
    for argv, match in (
            (["--from", checkpoints["with_tok"], "--to", "hf", str(tmp_path / "o"), "--no-tokenizer",
              "--tokenizer-model", "builtin"], "--no-tokenizer is for --to hf, without --tokenizer-model"),
            (["--from", checkpoints["with_tok"], "--to", str(tmp_path / "o"), "--no-tokenizer"], "is for --to hf"),
            (["--from", small, "--to", "hf", str(tmp_path / "o"), "--tokenizer-model", "builtin"],
             "4096 tokens but the model's vocabulary has 300"),
            (["--from", checkpoints["bare"], "--to", "hf", str(tmp_path / "o"), "--tokenizer-model",
              str(tmp_path / "missing.model")], "does not exist.*--no-tokenizer")):
        assert main(["convert", *argv]) == 2, argv
        assert __import__("re").search(match, capsys.readouterr().err), (argv, match)
        assert not (tmp_path / "o").exists()
    assert not [n for n in os.listdir(tmp_path) if ".tmp-" in n]


def test_convert_to_hf_without_tokenizers_refuses_before_writing(checkpoints, tmp_path):
    """The base install has neither transformers nor tokenizers: an export from a checkpoint that records a
    SentencePiece tokenizer is refused in one paragraph naming the install command, before anything is written
    (it used to convert the model, then end in a ModuleNotFoundError traceback). The missing package is
    simulated by a sitecustomize of this test's own that makes ``import tokenizers`` fail."""
    import subprocess
    import sys

    from tnlg.runtime.spawn import checkout_env
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text("import sys\nsys.modules['tokenizers'] = None  # import tokenizers fails\n")
    env = checkout_env()
    env["PYTHONPATH"] = os.pathsep.join([str(shim), env.get("PYTHONPATH", "")])
    out_dir = tmp_path / "exported"
    for extra in ([], ["--no-tokenizer"]):  # transformers' GPT-2 class does not import without it either
        done = subprocess.run([sys.executable, "-m", "tnlg", "convert", "--from", checkpoints["with_tok"], "--to", "hf",
                               str(out_dir), *extra], env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 2, done.stderr
        assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
        assert "tokenizers" in done.stderr and 'pip install "transformers>=4.40" "tokenizers>=0.15"' in done.stderr
        assert not out_dir.exists() and not [n for n in os.listdir(tmp_path) if ".tmp-" in n]


# ----------------------------------------------------------------------------- never delete

def _tiny_model(vocab=4096):
    from tnlg.model import GPT
    from tnlg.parallel.state import ParallelState
    cfg = GPTConfig(num_layers=1, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=vocab)
    return GPT(cfg, ParallelState.single())


def test_to_hf_refuses_a_non_empty_folder_and_keeps_its_files(tmp_path):
    """to_hf(model, folder) refuses a non-empty folder and keeps its files (it used to shutil.rmtree an
    existing folder, files it never wrote included)."""
    from tnlg.interop.hf import to_hf
    model = _tiny_model()
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    (out / "sub").mkdir()
    (out / "sub" / "data.bin").write_bytes(b"\x00\x01")
    with pytest.raises(UserError, match=r"'.*mine' already exists and is not empty"):
        to_hf(model, str(out))
    assert (out / "notes.txt").read_text() == "keep me" and (out / "sub" / "data.bin").read_bytes() == b"\x00\x01"
    assert sorted(os.listdir(out)) == ["notes.txt", "sub"]
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(UserError, match="not empty"):
        to_hf(model, str(tmp_path / "a_file"))
    assert (tmp_path / "a_file").read_text() == "x"
    # an empty folder, or a new one (parents created), is fine; nothing is left beside it
    (tmp_path / "empty").mkdir()
    to_hf(model, str(tmp_path / "empty"))
    to_hf(model, str(tmp_path / "new" / "deeper"))
    for d in (tmp_path / "empty", tmp_path / "new" / "deeper"):
        assert sorted(os.listdir(d)) == ["config.json", "generation_config.json", "model.safetensors"]
    assert not [n for n in os.listdir(tmp_path) if ".tmp-" in n]
    with pytest.raises(UserError, match="not empty"):  # the second export to the same folder is refused too
        to_hf(model, str(tmp_path / "empty"))


def test_to_hf_failed_write_removes_only_its_temporary_folder(tmp_path, monkeypatch):
    from tnlg.interop.hf import to_hf
    model = _tiny_model()

    def broken(self, path, **kwargs):
        with open(os.path.join(path, "config.json"), "w") as f:
            f.write("{")
        raise OSError("disk full")

    monkeypatch.setattr(transformers.GPT2LMHeadModel, "save_pretrained", broken)
    (tmp_path / "neighbour.txt").write_text("keep")
    with pytest.raises(OSError, match="disk full"):
        to_hf(model, str(tmp_path / "out"))
    assert sorted(os.listdir(tmp_path)) == ["neighbour.txt"]


def test_to_hf_with_tokenizer(tmp_path):
    from tnlg.interop.hf import to_hf
    model = _tiny_model()
    to_hf(model, str(tmp_path / "out"), tokenizer="builtin")
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "out"))
    assert hf_tok("Hello world")["input_ids"] == load_tokenizer("builtin").encode("Hello world")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["bos_token_id"] == config["eos_token_id"] == 2
    with pytest.raises(UserError, match="4096 tokens but the model only 100"):
        to_hf(_tiny_model(vocab=100), str(tmp_path / "small"), tokenizer="builtin")
    assert not (tmp_path / "small").exists()
