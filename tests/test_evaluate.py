"""Zero-shot evaluation against an independent implementation on `transformers` logits.

The reference code here follows the definitions in docs/eval.md (Megatron's zero-shot tasks) but is
written differently from tnlg.eval: WikiText maps every target to the window that
scores it (instead of masking windows), LAMBADA runs one example at a time, and
the losses come from GPT2LMHeadModel with the same random weights.
"""

import json
import math
import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.hf_reference import bytes_to_unicode, random_gpt2
from tests.launched import json_here_and_on_two_processes
from tnlg.cli import main
from tnlg.config import GPTConfig
from tnlg.errors import UserError
from tnlg.eval.text import text_perplexity
from tnlg.eval import (build_eval_dataset, count_original_tokens, dataset_loss, lambada_accuracy, lambada_examples,
                       read_lambada_texts, read_wikitext, split_last_word, wikitext_detokenizer, wikitext_perplexity)
from tnlg.model import GPT
from tnlg.parallel.sharding import load_full_state_dict
from .pool import run_distributed

SEQ, STRIDE, VOCAB = 32, 8, 128
WORDS = ("the a of and to in game was it is he she his her war army city king river ship first new "
         "one two three year time world film series season album song team").split()
WORDS += [f"w{i}" for i in range(VOCAB - 1 - len(WORDS))]  # every id but the last is a word


class CharTokenizer:
    """One id per printable ASCII character (and newline); the end-of-document id is last."""

    def __init__(self):
        self.chars = [chr(c) for c in range(32, 127)] + ["\n"]
        self.index = {c: i for i, c in enumerate(self.chars)}

    def encode(self, text):
        return [self.index[c] for c in text]

    def decode(self, ids):
        return "".join(self.chars[i] for i in ids if i < len(self.chars))

    @property
    def vocab_size(self):
        return len(self.chars) + 1

    @property
    def eod_id(self):
        return len(self.chars)


class WordTokenizer:
    """One id per word of WORDS (whitespace-separated); " " + word encodes to that word alone."""

    def encode(self, text):
        return [WORDS.index(w) for w in text.split()]

    def decode(self, ids):
        return " ".join(WORDS[i] for i in ids)

    vocab_size = len(WORDS) + 1
    eod_id = len(WORDS)


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one intra-op thread is faster


def _hf_model(vocab=VOCAB, seq=SEQ, seed=0, std=0.1):
    return random_gpt2(vocab, seq, seed, std=std, bos_token_id=0, eos_token_id=0)


def _wikitext_raw(n_lines=6, seed=0):
    rng = random.Random(seed)
    lines = [" = " + " ".join(rng.choice(WORDS).title() for _ in range(3)) + " = \n", " \n"]
    for _ in range(n_lines):
        words = [rng.choice(WORDS) for _ in range(rng.randint(6, 14))]
        words.insert(3, "1 @,@ 000")
        words.insert(5, "state @-@ of")
        words.insert(len(words) - 2, ",")
        lines.append(" " + " ".join(words) + " . \n")
    return "".join(lines)


# ----------------------------------------------------------------------------- references

@torch.no_grad()
def ref_wikitext(hf, tokens, n_orig, seq=SEQ, stride=STRIDE):
    """Each target t (1..T-1) is scored by window k = 0 if t <= seq else ceil((t - seq) / stride)."""
    logp, total = {}, 0.0
    for t in range(1, len(tokens)):
        k = 0 if t <= seq else math.ceil((t - seq) / stride)
        start = k * stride
        if k not in logp:
            logp[k] = F.log_softmax(hf(torch.tensor([tokens[start:start + seq]])).logits[0].double(), -1)
        total -= float(logp[k][t - 1 - start, tokens[t]])
    n = len(tokens)
    val = total / (n - 1)
    return dict(total_loss=total, val_loss=val, ppl=math.exp(min(20, val)),
                adjusted_ppl=math.exp(min(20, val * (n - 1) / (n_orig - 1))))


@torch.no_grad()
def ref_lambada(hf, pairs):
    correct = 0
    for context, target in pairs:
        seq = torch.tensor([context + target])
        pred = hf(seq[:, :-1]).logits[0].argmax(-1)[len(context) - 1:]
        correct += int(pred.tolist() == target)
    return correct


def ref_split(tok, text, strict):
    if not strict:
        t = tok.encode(text)
        return t[:-1], t[-1:]
    last = text.split()[-1]
    return tok.encode(text[:text.rfind(last)].strip()), tok.encode(" " + last)


def ref_split_sentencepiece(sp, text):
    """Shortest tail of the whole text's pieces that spells the last word (ASCII text only)."""
    pieces, ids, last = sp.encode(text, out_type=str), sp.encode(text), text.split()[-1]
    for j in range(len(pieces) - 1, -1, -1):
        if "".join(pieces[j:]).replace("\u2581", " ").strip() == last:
            return ids[:j], ids[j:]
    raise AssertionError(text)


@torch.no_grad()
def _lambada_texts(hf, n=10, seed=1):
    """Word-level passages; every other one ends with the model's own argmax word (so some are correct)."""
    rng, tok, texts = random.Random(seed), WordTokenizer(), []
    for i in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randint(4, 12))]
        if i % 2 == 0:
            best = int(hf(torch.tensor([tok.encode(" ".join(words))])).logits[0, -1].argmax())
            words.append(WORDS[best] if best < len(WORDS) else rng.choice(WORDS))
        else:
            words.append(rng.choice(WORDS))
        texts.append(" ".join(words))
    return texts


def _tnlg_config(hf):
    c = hf.config
    return GPTConfig(num_layers=c.n_layer, hidden_size=c.n_embd, num_attention_heads=c.n_head,
                     seq_length=c.n_positions, vocab_size=c.vocab_size)


def _close(a, b, rel=1e-4):
    assert abs(a - b) <= rel * abs(b), (a, b)


# ----------------------------------------------------------------------------- API, TP 1 and 2

def _eval_body(ps, cfg, weights, tokens, n_orig, pairs):
    from tnlg.parallel.state import init_parallel

    out = []
    for layout in (ps, init_parallel(tensor_parallel_size=1) if ps.tp_size > 1 else None):
        if layout is None:
            continue
        model = GPT(cfg, layout)
        load_full_state_dict(model, weights, layout)
        wt = wikitext_perplexity(model, tokens, n_orig, stride=STRIDE, micro_batch_size=3, pad_id=0)
        la = lambada_accuracy(model, pairs, micro_batch_size=4)
        text = text_perplexity(model, _text_streams(tokens), ["a", "b", "c"], stride=STRIDE, micro_batch_size=3)
        out.append((layout.tp_size, layout.dp_size, wt, la, text))
    return out


def _text_streams(tokens):
    """Three files: one window, several windows, a few tokens (windows of files interleave over DP ranks)."""
    return [tokens[:SEQ], tokens, tokens[5:12]]


def _check_text(hf, tokens, got):
    totals = [ref_text_total(hf, s, SEQ, STRIDE) for s in _text_streams(tokens)]
    targets = sum(len(s) - 1 for s in _text_streams(tokens))
    _close(got["val_loss"], sum(totals) / targets)
    for f, total in zip(got["files"], totals):
        _close(f["total_loss"], total)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from tnlg.interop.hf import hf_to_tnlg_state_dict

    hf = _hf_model()
    cfg = _tnlg_config(hf)
    path = tmp_path_factory.mktemp("wiki") / "wiki.test.raw"
    path.write_text(_wikitext_raw())
    tokens, n_orig = read_wikitext(str(path), CharTokenizer(), "wikitext")
    texts = _lambada_texts(hf)
    return dict(hf=hf, cfg=cfg, weights=hf_to_tnlg_state_dict(hf.state_dict(), cfg), path=str(path),
                tokens=tokens, n_orig=n_orig, texts=texts)


def test_wikitext_reading_and_detokenizer(setup):
    raw = open(setup["path"]).read()
    assert setup["n_orig"] == len(raw.strip().split(" "))  # counted before detokenisation
    assert count_original_tokens("a b\nc  d") == 4  # single spaces only: "b\nc" is one word, "" counts
    detok = wikitext_detokenizer(raw)
    assert setup["tokens"] == CharTokenizer().encode(detok)
    assert " @-@ " not in detok and "state-of" in detok and "1,000" in detok and " . \n" not in detok
    assert wikitext_detokenizer(" = = Title = = \n") == " == Title ==\n"
    assert wikitext_detokenizer('he said " hello " ( yes ) it \'s') == "he said \"hello\" (yes) it's"


@pytest.mark.parametrize("strict", [False, True])
def test_lambada_split_rules(strict):
    tok = CharTokenizer()
    for text in ["He walked to the door", "a  b c.", "x y"]:
        assert split_last_word(tok, text, strict) == ref_split(tok, text, strict)
    context, target = split_last_word(tok, "He walked to the door", True)
    assert tok.decode(context) == "He walked to the" and tok.decode(target) == " door"


def test_eval_tp1_matches_transformers(setup):
    model = GPT(setup["cfg"])
    load_full_state_dict(model, setup["weights"], model.ps)
    ref = ref_wikitext(setup["hf"], setup["tokens"], setup["n_orig"])
    got = wikitext_perplexity(model, setup["tokens"], setup["n_orig"], stride=STRIDE, micro_batch_size=5)
    for key in ("total_loss", "val_loss", "ppl", "adjusted_ppl"):
        _close(got[key], ref[key])
    assert got["num_targets"] == len(setup["tokens"]) - 1 and got["windows"] > 10
    # stride = seq_length: no overlap, still every target once
    no_overlap = wikitext_perplexity(model, setup["tokens"], setup["n_orig"], stride=SEQ)
    _close(no_overlap["total_loss"], ref_wikitext(setup["hf"], setup["tokens"], setup["n_orig"], stride=SEQ)
           ["total_loss"])
    tok = WordTokenizer()
    for strict in (False, True):
        pairs, truncated = lambada_examples(setup["texts"], tok, strict, SEQ)
        assert pairs == [ref_split(tok, t, strict) for t in setup["texts"]] and truncated == 0
        got = lambada_accuracy(model, pairs, micro_batch_size=3)
        want = ref_lambada(setup["hf"], pairs)
        assert got["correct"] == want and want >= 3  # every other one ends with the argmax word
        assert got["accuracy"] == want / len(pairs)


def test_eval_tp2_and_dp2_match_transformers(setup):
    pairs, _ = lambada_examples(setup["texts"], WordTokenizer(), True, SEQ)
    ref = ref_wikitext(setup["hf"], setup["tokens"], setup["n_orig"])
    want = ref_lambada(setup["hf"], pairs)
    results = run_distributed(_eval_body, 2, 2, setup["cfg"], setup["weights"], setup["tokens"],
                              setup["n_orig"], pairs)
    layouts = set()
    for per_rank in results:
        for tp, dp, wt, la, text in per_rank:
            layouts.add((tp, dp))
            _check_text(setup["hf"], setup["tokens"], text)
            for key in ("total_loss", "val_loss", "ppl", "adjusted_ppl"):
                _close(wt[key], ref[key])
            assert la["correct"] == want and la["num_examples"] == len(pairs)
    assert layouts == {(2, 1), (1, 2)}


# ----------------------------------------------------------------------------- dataset loss

def _toy_dataset(tmp_path, docs: int, longest: int, seed: int) -> str:
    """A ``.bin``/``.idx`` dataset of ``docs`` random documents of 5 to ``longest`` tokens; its prefix."""
    from tnlg.data.indexed import IndexedDatasetBuilder

    rng = np.random.default_rng(seed)
    prefix = str(tmp_path / "toy_text_document")
    with IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16) as b:
        for _ in range(docs):
            doc = rng.integers(0, VOCAB - 1, int(rng.integers(5, longest)))
            b.add_document(doc, [len(doc)])
        b.finalize(prefix + ".idx")
    return prefix


def test_eval_samples_evaluates_exactly_n(setup, tmp_path, capsys):
    """``--eval-samples N`` evaluates exactly the first N samples of the seeded order (it used to build N
    samples' worth of whole passes and evaluate all of them: 1 and 64 both gave every sample)."""
    prefix = _toy_dataset(tmp_path, docs=10, longest=30, seed=1)
    hf_dir = tmp_path / "hf"
    setup["hf"].save_pretrained(hf_dir)
    one_pass = len(build_eval_dataset(prefix, SEQ, vocab_size=VOCAB, cache_dir=tmp_path / "cache"))
    model = GPT(setup["cfg"])
    load_full_state_dict(model, setup["weights"], model.ps)
    base = ["eval", "--task", "loss", "--checkpoint", str(hf_dir), "--input", prefix, "--json",
            "--data-cache-path", str(tmp_path / "cache")]
    for n in (1, 3, one_pass + 2):  # fewer than a pass, and into the second pass
        capsys.readouterr()
        assert main(base + ["--eval-samples", str(n)]) == 0
        res = json.loads(capsys.readouterr().out)
        assert res["num_samples"] == n
        ds = build_eval_dataset(prefix, SEQ, num_samples=n, vocab_size=VOCAB, cache_dir=tmp_path / "cache")
        want = dataset_loss(model, ds, micro_batch_size=2, max_samples=n)
        items = [ds[i] for i in range(n)]
        assert res["num_tokens"] == want["num_tokens"] == sum(int(it["loss_mask"].sum()) for it in items)
        _close(res["loss"], want["loss"])
    capsys.readouterr()
    assert main(base + ["--eval-samples", "-1"]) == 2
    assert "--eval-samples must be >= 0" in capsys.readouterr().err


def test_dataset_loss_matches_transformers(setup, tmp_path, capsys):
    prefix = _toy_dataset(tmp_path, docs=12, longest=40, seed=0)
    model = GPT(setup["cfg"])
    load_full_state_dict(model, setup["weights"], model.ps)
    ds = build_eval_dataset(prefix, SEQ, eod_id=VOCAB - 1, vocab_size=VOCAB)
    got = dataset_loss(model, ds, micro_batch_size=3)
    with torch.no_grad():
        items = [ds[i] for i in range(len(ds))]
        tokens = torch.stack([it["tokens"] for it in items])
        labels = torch.stack([it["labels"] for it in items])
        losses = F.cross_entropy(setup["hf"](tokens).logits.double().reshape(-1, VOCAB), labels.reshape(-1))
    assert got["num_samples"] == len(ds) > 3 and got["num_tokens"] == labels.numel()
    _close(got["loss"], float(losses))
    # the CLI gives the same figure; --task loss needs no tokenizer (the folder has none)
    hf_dir = tmp_path / "hf"
    setup["hf"].save_pretrained(hf_dir)
    capsys.readouterr()
    assert main(["eval", "--task", "loss", "--checkpoint", str(hf_dir), "--input", prefix, "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    _close(res["loss"], float(losses))
    assert res["num_samples"] == len(ds)
    # naming the .bin (or .idx) file means the same dataset, reported by its prefix
    assert main(["eval", "--task", "loss", "--checkpoint", str(hf_dir), "--input", prefix + ".bin", "--json"]) == 0
    by_file = json.loads(capsys.readouterr().out)
    assert (by_file["loss"], by_file["input"]) == (res["loss"], prefix)
    # a tokenizer with more ids than the model's embedding is refused
    text = tmp_path / "t.txt"
    text.write_text("some words here")
    assert main(["eval", "--task", "wikitext", "--checkpoint", str(hf_dir), "--input", str(text),
                 "--tokenizer-model", "builtin"]) == 2
    assert "4096 tokens but the model only 128" in capsys.readouterr().err


# ----------------------------------------------------------------------------- CLI

def _write_byte_bpe(folder):
    """A tiny GPT-2 byte-level BPE: 256 byte symbols, a few merges, <|endoftext|>."""
    table = bytes_to_unicode()
    vocab = {table[b]: b for b in range(256)}
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
    return len(vocab)


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    """An HF GPT-2 folder with a byte-level BPE tokenizer beside it, and the built-in SentencePiece model's
    4096 ids in the embedding (so either tokenizer fits)."""
    folder = tmp_path_factory.mktemp("hfbpe")
    _write_byte_bpe(folder)
    hf = _hf_model(vocab=4096, seq=64, seed=3)
    hf.save_pretrained(folder)
    return folder, hf


def _run_json(capsys, argv):
    capsys.readouterr()
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1
    return json.loads(out)


def test_cli_wikitext_and_lambada(hf_folder, tmp_path, capsys):
    from tnlg.data.tokenizer import load_tokenizer

    folder, hf = hf_folder
    raw = tmp_path / "wiki.valid.raw"
    raw.write_text(_wikitext_raw(n_lines=3, seed=5))
    bpe = load_tokenizer(str(folder))  # the folder's own tokenizer (no --tokenizer-model)
    res = _run_json(capsys, ["eval", "--task", "wikitext", "--checkpoint", str(folder), "--input", str(raw),
                             "--overlapping-eval", "16", "--detokenize", "wikitext", "--json"])
    tokens = bpe.encode(wikitext_detokenizer(raw.read_text()))
    n_orig = len(raw.read_text().strip().split(" "))
    ref = ref_wikitext(hf, tokens, n_orig, seq=64, stride=16)
    assert res["num_tokenized_tokens"] == len(tokens) and res["num_original_tokens"] == n_orig
    for key in ("val_loss", "ppl", "adjusted_ppl"):
        _close(res[key], ref[key])

    # LAMBADA, strict, GPT-2 BPE rule (Megatron's) and SentencePiece rule (--tokenizer-model builtin)
    sp = load_tokenizer("builtin")
    texts = ["The king said to his army that the war was over", "She came back to the city at night",
             "and then the river"]
    with torch.no_grad():  # one SentencePiece example that ends with the model's own argmax piece
        ids = sp.encode(texts[0])
        pieces = [sp.sp.id_to_piece(int(i)) for i in hf(torch.tensor([ids])).logits[0, -1].argsort(descending=True)]
        word = next(p for p in pieces if p.startswith("\u2581") and p[1:].isalpha())
    texts.append(texts[0] + " " + word[1:])
    lam = tmp_path / "lambada.jsonl"
    lam.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts) + "\n")
    res = _run_json(capsys, ["eval", "--task", "lambada", "--strict", "--checkpoint", str(folder),
                             "--input", str(lam), "--json"])
    pairs = [ref_split(bpe, t, True) for t in texts]
    assert res["num_examples"] == 4 and res["correct"] == ref_lambada(hf, pairs) and res["strict"] is True
    res = _run_json(capsys, ["eval", "--task", "lambada", "--strict", "--checkpoint", str(folder), "--input",
                             str(lam), "--tokenizer-model", "builtin", "--allow-other-tokenizer", "--json",
                             "--micro-batch-size", "3"])
    pairs = [ref_split_sentencepiece(sp.sp, t) for t in texts]
    assert pairs[-1][1] == sp.encode(" " + word[1:])[-1:] or len(pairs[-1][1]) == 1
    want = ref_lambada(hf, pairs)
    assert res["correct"] == want >= 1
    assert res["tensor_model_parallel_size"] == 1


def _expect_error(capsys, argv, *needles):
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    for needle in needles:
        assert needle in err, err
    return err


def test_cli_bad_inputs(hf_folder, tmp_path, capsys):
    folder, _ = hf_folder
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    base = ["eval", "--checkpoint", str(folder), "--input"]
    _expect_error(capsys, ["eval", "--task", "wikitext", *base[1:], str(empty)], "is empty")
    _expect_error(capsys, ["eval", "--task", "lambada", *base[1:], str(empty)], "is empty")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "one two three"}\n{"id": 7}\n')
    _expect_error(capsys, ["eval", "--task", "lambada", *base[1:], str(bad)], "bad.jsonl:2:", "no text")
    bad.write_text('{"text": "   "}\n')
    _expect_error(capsys, ["eval", "--task", "lambada", *base[1:], str(bad)], "bad.jsonl:1:", "no text")
    bad.write_text('{"text": "single"}\n')  # one word, one token: nothing to predict from
    _expect_error(capsys, ["eval", "--task", "lambada", "--strict", *base[1:], str(bad)], "no context")
    _expect_error(capsys, ["eval", "--task", "wikitext", *base[1:], str(tmp_path / "missing.txt")],
                  "does not exist")
    _expect_error(capsys, ["eval", "--task", "loss", *base[1:], str(tmp_path / "nothing")], "not found")
    text = tmp_path / "t.txt"
    text.write_text("some words here")
    _expect_error(capsys, ["eval", "--task", "wikitext", *base[1:], str(text), "--overlapping-eval", "65"],
                  "overlapping-eval")
    _expect_error(capsys, ["eval", "--task", "wikitext", *base[1:], str(text), "--tp", "2",
                           "--nproc-per-node", "3"], "--tensor-model-parallel-size 2 does not divide --nproc-per-node 3",
                  "Valid tensor-parallel sizes for 3 processes: [1, 3]")
    # no tokenizer anywhere: an HF folder without vocab.json + merges.txt and no --tokenizer-model
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        (bare / name).write_bytes((folder / name).read_bytes())
    _expect_error(capsys, ["eval", "--task", "wikitext", "--checkpoint", str(bare), "--input", str(text)],
                  "no tokenizer", "--tokenizer-model")
    with pytest.raises(UserError, match="stride"):
        wikitext_perplexity(GPT(GPTConfig(seq_length=8, vocab_size=50)), [1, 2, 3], 2, stride=9)
    with pytest.raises(UserError, match="at least 2"):
        wikitext_perplexity(GPT(GPTConfig(seq_length=8, vocab_size=50)), [1], 2)
    (tmp_path / "n.jsonl").write_text('"just a string"\n')
    with pytest.raises(UserError, match="no text"):
        read_lambada_texts(str(tmp_path / "n.jsonl"))


def test_cli_tnlg_checkpoint(hf_folder, tmp_path, capsys):
    """A tnlg checkpoint (converted from the HF folder, tokenizer recorded) gives the HF folder's figures."""
    convert = pytest.importorskip("tnlg.interop.hf_checkpoint")
    folder, _ = hf_folder
    ckpt = tmp_path / "ckpt"
    convert.hf_to_checkpoint(str(folder), str(ckpt), tokenizer_model="builtin", tp_size=2)
    lam = tmp_path / "lambada.jsonl"
    lam.write_text("".join(json.dumps({"text": t}) + "\n" for t in ["The king said to his army", "and then the river"]))
    args = ["eval", "--task", "lambada", "--input", str(lam), "--json"]
    from_hf = _run_json(capsys, args + ["--checkpoint", str(folder), "--tokenizer-model", "builtin",
                                        "--allow-other-tokenizer"])  # (not the folder's byte BPE: on purpose)
    from_ckpt = _run_json(capsys, args + ["--checkpoint", str(ckpt)])  # its own tokenizer
    assert from_ckpt["correct"] == from_hf["correct"] and from_ckpt["num_examples"] == 2
    raw = tmp_path / "w.txt"
    raw.write_text(_wikitext_raw(n_lines=2, seed=9))
    args = ["eval", "--task", "wikitext", "--input", str(raw), "--json", "--tokenizer-model", "builtin"]
    a = _run_json(capsys, args + ["--checkpoint", str(folder), "--allow-other-tokenizer"])
    b = _run_json(capsys, args + ["--checkpoint", str(ckpt)])
    _close(b["val_loss"], a["val_loss"], rel=1e-5)


@pytest.mark.slow
def test_cli_eval_launches_processes(hf_folder, tmp_path, capfd):
    """--nproc-per-node 2 --tp 2 relaunches `tnlg eval`; rank 0 prints the one JSON object."""
    folder, _ = hf_folder
    raw = tmp_path / "w.txt"
    raw.write_text(_wikitext_raw(n_lines=4, seed=2))
    argv = ["eval", "--task", "wikitext", "--checkpoint", str(folder), "--input", str(raw), "--json"]
    one, two = json_here_and_on_two_processes(capfd, argv)
    _close(two["val_loss"], one["val_loss"], rel=1e-5)


# ----------------------------------------------------------------------------- text files

@torch.no_grad()
def ref_text_total(hf, tokens, seq, stride):
    """Summed loss of a file's T - 1 targets by plain torch cross-entropy: one forward over the
    whole file when it fits one window, else each target in the window that scores it."""
    if len(tokens) <= seq + 1:
        t = torch.tensor([tokens])
        return float(F.cross_entropy(hf(t[:, :-1]).logits[0].double(), t[0, 1:], reduction="sum"))
    return ref_wikitext(hf, tokens, 10, seq=seq, stride=stride)["total_loss"]


def test_cli_text_perplexity_of_several_files(hf_folder, tmp_path, capsys):
    """--task text: token-weighted perplexity over files (each file its own stream), each file's own
    figures, no word-level figure; against plain torch cross-entropy on transformers' logits."""
    from tnlg.data.tokenizer import load_tokenizer
    folder, hf = hf_folder
    sp = load_tokenizer("builtin")
    texts = ["To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer\n" * 3,
             "Of Man's first disobedience, and the fruit", "A short one."]
    paths = []
    for i, t in enumerate(texts):
        paths.append(str(tmp_path / f"f{i}.txt"))
        with open(paths[-1], "w", encoding="utf-8") as f:
            f.write(t)
    streams = [sp.encode(t) for t in texts]
    assert len(streams[0]) > 64 + 1 >= len(streams[1])  # one file needs several windows
    res = _run_json(capsys, ["eval", "--task", "text", "--checkpoint", str(folder), "--tokenizer-model", "builtin",
                             "--allow-other-tokenizer", "--input", *paths, "--overlapping-eval", "16",
                             "--micro-batch-size", "3", "--json"])
    totals = [ref_text_total(hf, s, 64, 16) for s in streams]
    targets = sum(len(s) - 1 for s in streams)
    _close(res["val_loss"], sum(totals) / targets)
    _close(res["ppl"], math.exp(sum(totals) / targets))
    assert res["num_targets"] == targets and res["num_files"] == 3 and "adjusted_ppl" not in res
    assert [f["path"] for f in res["files"]] == paths and res["input"] == paths
    for f, s, total in zip(res["files"], streams, totals):
        assert f["num_targets"] == len(s) - 1
        _close(f["val_loss"], total / (len(s) - 1))
    # the table names every file's perplexity; the files may follow the options without --input
    capsys.readouterr()
    assert main(["eval", "--task", "text", "--checkpoint", str(folder), "--tokenizer-model", "builtin",
                 "--allow-other-tokenizer", *paths]) == 0
    out = capsys.readouterr().out
    assert all(p in out for p in paths) and "adjusted_ppl" not in out
    # bad input: a one-token file, several files for a one-file task
    one = tmp_path / "one.txt"
    one.write_text("a")
    _expect_error(capsys, ["eval", "--task", "text", "--checkpoint", str(folder), "--tokenizer-model", "builtin",
                           "--allow-other-tokenizer", "--input", paths[0], str(one)], "one.txt", "needs at least 2")
    _expect_error(capsys, ["eval", "--task", "wikitext", "--checkpoint", str(folder), "--input", *paths],
                  "--task wikitext evaluates one --input, got 3", "--task text takes several files")
    _expect_error(capsys, ["eval", "--task", "text", "--checkpoint", str(folder)], "--task text needs an input")


def test_cli_wikitext_labels_adjusted_ppl_and_warns_off_wikitext(hf_folder, tmp_path, capsys):
    folder, _ = hf_folder
    wiki = tmp_path / "wiki.valid.raw"
    wiki.write_text(_wikitext_raw(n_lines=3, seed=5))
    plain = tmp_path / "plain.txt"
    plain.write_text("The king said to his army\nthat the war was over.\nShe came back to the city.\n")
    res = _run_json(capsys, ["eval", "--task", "wikitext", "--checkpoint", str(folder), "--input", str(wiki),
                             "--json"])
    assert res["caveat"] is None and res["adjusted_ppl_divides_by"] == 'T_orig = len(raw.strip().split(" ")) - 1'
    res = _run_json(capsys, ["eval", "--task", "wikitext", "--checkpoint", str(folder), "--input", str(plain),
                             "--json"])
    assert "does not look like WikiText" in res["caveat"] and "--task text" in res["caveat"]
    capsys.readouterr()
    assert main(["eval", "--task", "wikitext", "--checkpoint", str(folder), "--input", str(plain)]) == 0
    out = capsys.readouterr().out
    words = len(plain.read_text().strip().split(" "))
    assert f"adjusted_ppl (per word: / {words - 1:,} = T_orig - 1)" in out
    assert f'num_original_tokens (T_orig) {words} (T_orig = len(raw.strip().split(" ")))' in " ".join(out.split())
    assert "note: " in out and "does not look like WikiText" in out
