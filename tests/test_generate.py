"""Generation against `transformers` generate (greedy, same weights) and seeded sampling across TP sizes."""

import json
import re
import sys
from pathlib import Path

import pytest
import torch

from tests.hf_reference import random_gpt2
from tests.launched import json_here_and_on_two_processes
import tnlg
from tnlg.cli import main
from tnlg.config import GPTConfig
from tnlg.errors import UserError
from tnlg.generation import generate_ids
from tnlg.model import GPT
from tnlg.interop.hf import from_hf
from tnlg.parallel.sharding import load_full_state_dict
from .pool import run_distributed

VOCAB, SEQ, EOD = 100, 48, 99
PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [3], [40, 2, 40, 2, 40, 2, 7, 77]]
NEW = 12
SAMPLING = [dict(top_k=10, temperature=0.8), dict(top_p=0.9), dict(top_k=20, top_p=0.8, temperature=1.3)]


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one intra-op thread is faster


class CharTokenizer:
    """Lower-case letters, space and a few marks; the end-of-document id is last."""

    chars = "abcdefghijklmnopqrstuvwxyz .,'"

    def encode(self, text):
        return [self.chars.index(c) for c in text]

    def decode(self, ids):  # the end-of-document id decodes to nothing, as SentencePiece's eos does
        return "".join(self.chars[i] for i in ids if i != self.eod_id)

    vocab_size = len(chars) + 1
    eod_id = len(chars)


def _hf_model(vocab=VOCAB, seq=SEQ, seed=0, n_embd=32, n_head=4, n_layer=2):
    return random_gpt2(vocab, seq, seed, n_embd=n_embd, n_head=n_head, n_layer=n_layer, bos_token_id=EOD,
                       eos_token_id=EOD, pad_token_id=0)


@torch.no_grad()
def _hf_greedy(hf, prompts, new=NEW):
    """transformers' greedy generate, one prompt at a time and as one left-padded batch."""
    alone = []
    for p in prompts:
        out = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                          max_new_tokens=new, do_sample=False, pad_token_id=0, eos_token_id=EOD)
        alone.append(_until_eod(out[0, len(p):].tolist()))
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    out = hf.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0,
                      eos_token_id=EOD)
    return alone, [_until_eod(row[width:].tolist()) for row in out]


def _until_eod(ids):
    """transformers pads a finished row after EOS; tnlg stops it (the EOD id stays last)."""
    return ids[:ids.index(EOD) + 1] if EOD in ids else ids


def _gen_body(ps, cfg, weights):
    """Greedy (batch, alone, no cache) and seeded sampling at this layout and at TP 2 x DP 2."""
    from tnlg.parallel.state import init_parallel

    out = {}
    layouts = [ps] + ([init_parallel(tensor_parallel_size=2)] if ps.tp_size == 4 else [])
    for layout in layouts:
        model = GPT(cfg, layout)
        load_full_state_dict(model, weights, layout)
        res = dict(batch=generate_ids(model, PROMPTS, NEW, greedy=True, eod_id=EOD),
                   alone=[generate_ids(model, [p], NEW, greedy=True, eod_id=EOD)[0] for p in PROMPTS],
                   no_cache=generate_ids(model, PROMPTS, NEW, greedy=True, eod_id=EOD, use_cache=False),
                   sampled=[generate_ids(model, PROMPTS, NEW, seed=3, eod_id=EOD, **kw) for kw in SAMPLING])
        out[layout.tp_size] = res
    return out


@pytest.fixture(scope="module")
def ref():
    from tnlg.interop.hf import hf_to_tnlg_state_dict

    hf = _hf_model()
    cfg = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=SEQ, vocab_size=VOCAB)
    alone, batch = _hf_greedy(hf, PROMPTS)
    return dict(hf=hf, cfg=cfg, weights=hf_to_tnlg_state_dict(hf.state_dict(), cfg), alone=alone, batch=batch)


def _check_greedy(res, ref):
    assert ref["batch"] == ref["alone"]  # transformers itself: left padding does not change a row
    assert res["alone"] == ref["alone"]
    assert res["batch"] == ref["batch"]
    assert res["no_cache"] == ref["batch"]


def test_tp1_matches_transformers_and_sampling_is_reproducible(ref):
    model = from_hf(ref["hf"])
    res = _gen_body(model.ps, ref["cfg"], ref["weights"])[1]
    _check_greedy(res, ref)
    assert any(len(set(r)) > 2 for r in ref["batch"])  # not a degenerate repetition everywhere
    for kw, sampled in zip(SAMPLING, res["sampled"]):
        assert generate_ids(model, PROMPTS, NEW, seed=3, eod_id=EOD, **kw) == sampled  # reproducible
        assert generate_ids(model, PROMPTS, NEW, seed=4, eod_id=EOD, **kw) != sampled
        # prompt i draws from seed + i: alone it continues the same way as in the batch
        assert generate_ids(model, PROMPTS[1:2], NEW, seed=4, eod_id=EOD, **kw)[0] == sampled[1]
    # with top_k = 1 sampling is greedy
    assert generate_ids(model, PROMPTS, NEW, top_k=1, seed=0, eod_id=EOD) == res["batch"]
    ref["tp1"] = res


def test_tp2_tp4_match_transformers_and_tp1(ref):
    if "tp1" not in ref:
        pytest.skip("needs test_tp1_matches_transformers_and_sampling_is_reproducible")
    results = run_distributed(_gen_body, 4, 4, ref["cfg"], ref["weights"])
    for rank_result in results:
        assert sorted(rank_result) == [2, 4]
        for tp, res in rank_result.items():
            _check_greedy(res, ref)
            assert res["sampled"] == ref["tp1"]["sampled"], f"sampling differs at TP={tp}"


@pytest.mark.slow
def test_uneven_heads_match_transformers():
    """6 heads at TP 4 (split 2, 2, 1, 1) generate exactly what transformers does."""
    from tnlg.interop.hf import hf_to_tnlg_state_dict

    hf = _hf_model(n_embd=36, n_head=6, seed=5)
    cfg = GPTConfig(num_layers=2, hidden_size=36, num_attention_heads=6, seq_length=SEQ, vocab_size=VOCAB)
    alone, batch = _hf_greedy(hf, PROMPTS)
    ref = dict(alone=alone, batch=batch)
    weights = hf_to_tnlg_state_dict(hf.state_dict(), cfg)
    tp1 = _gen_body(GPT(cfg).ps, cfg, weights)[1]
    _check_greedy(tp1, ref)
    for rank_result in run_distributed(_gen_body, 4, 4, cfg, weights):
        for tp, res in rank_result.items():
            _check_greedy(res, ref)
            assert res["sampled"] == tp1["sampled"], f"sampling differs at TP={tp}"


def test_text_api_and_stop_at_eod():
    torch.manual_seed(0)
    tok = CharTokenizer()
    model = GPT(GPTConfig(num_layers=1, hidden_size=32, num_attention_heads=2, seq_length=32,
                          vocab_size=tok.vocab_size, init_method_std=0.5, seed=7))
    prompts = ["the cat", "", "a"]
    texts = tnlg.generate(model, tok, prompts, max_new_tokens=10, top_k=5, seed=11)
    ids = generate_ids(model, [tok.encode("the cat"), [tok.eod_id], tok.encode("a")], 10, top_k=5, seed=11,
                       eod_id=tok.eod_id)
    assert texts == [tok.decode(i[:-1] if i and i[-1] == tok.eod_id else i) for i in ids]
    assert tnlg.generate(model, tok, "the cat", max_new_tokens=10, top_k=5, seed=11) == texts[:1]
    # stop_at_eod: once a row emits EOD it ends there; without it, rows run to max_new_tokens
    stopped = generate_ids(model, [[1, 2]] * 6, 20, temperature=3.0, seed=0, eod_id=tok.eod_id)
    assert any(r[-1] == tok.eod_id and len(r) < 20 for r in stopped)
    assert all(tok.eod_id not in r[:-1] for r in stopped)
    full = generate_ids(model, [[1, 2]] * 6, 20, temperature=3.0, seed=0, eod_id=tok.eod_id, stop_at_eod=False)
    assert all(len(r) == 20 for r in full)
    assert [f[:len(s)] for f, s in zip(full, stopped)] == stopped
    # the end of the model's positions ends generation (with a warning)
    with pytest.warns(UserWarning, match="max_position_embeddings=32"):
        long = generate_ids(model, [[1] * 30], 10, greedy=True)
    assert len(long[0]) == 2


def test_bad_inputs():
    model = GPT(GPTConfig(num_layers=1, hidden_size=32, num_attention_heads=2, seq_length=16, vocab_size=50))
    with pytest.raises(UserError, match="longer than the model's seq_length=16"):
        generate_ids(model, [[1, 2], [3] * 17], 4)
    for kw, msg in [(dict(temperature=-1.0), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_k=-2), "top_k"),
                    (dict(max_new_tokens=-1), "max_new_tokens")]:
        args = dict(max_new_tokens=4) | kw
        with pytest.raises(UserError, match=msg):
            generate_ids(model, [[1, 2]], **args)
    with pytest.raises(UserError, match="no tokens"):
        generate_ids(model, [[]], 4)
    with pytest.raises(UserError, match="outside the vocabulary"):
        generate_ids(model, [[1, 50]], 4)
    with pytest.raises(UserError, match="non-empty list"):
        generate_ids(model, [], 4)
    from tnlg.generation import SamplingOptions
    for bad in ("ab", (1, 2.5), 7):
        with pytest.raises(UserError, match="stop_ids must be a sequence of token ids"):
            SamplingOptions(4, stop_ids=bad)
    assert SamplingOptions(4, temperature=0.0).argmax and SamplingOptions(4, stop_ids=[3]).stop_ids == (3,)


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    """An HF GPT-2 folder with the built-in SentencePiece model's 4096 ids (no tokenizer files inside)."""
    folder = tmp_path_factory.mktemp("hfgen")
    hf = _hf_model(vocab=4096, seq=64, seed=2)
    hf.save_pretrained(folder)
    return folder, hf


def test_cli_generate(hf_folder, tmp_path, capsys):
    from tnlg.data.tokenizer import load_tokenizer

    folder, hf = hf_folder
    sp = load_tokenizer("builtin")
    prompts = ["To be, or not to be", "Of man's first disobedience"]
    pfile = tmp_path / "prompts.txt"
    pfile.write_text("\n".join(prompts) + "\n\n")
    capsys.readouterr()
    assert main(["generate", "--checkpoint", str(folder), "--tokenizer-model", "builtin", "--prompts-file",
                 str(pfile), "--greedy", "--max-new-tokens", "6", "--json"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1
    res = json.loads(out)
    assert [r["prompt"] for r in res["results"]] == prompts
    for r in res["results"]:
        ids = sp.encode(r["prompt"])
        want = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                           max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=sp.eod_id)
        assert r["tokens"] == _until_eod_id(want[0, len(ids):].tolist(), sp.eod_id)
        # the continuation is the rest of the whole sequence's decoding (the prompt's ids first)
        assert r["prompt"] + r["text"] == sp.decode(ids + [t for t in r["tokens"] if t != sp.eod_id])
    # plain output: prompt + continuation
    assert main(["generate", "--checkpoint", str(folder), "--tokenizer-model", "builtin", "--prompt", prompts[0],
                 "--top-k", "5", "--max-new-tokens", "4"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith(prompts[0])
    assert main(["generate", "--checkpoint", str(folder), "--tokenizer-model", "builtin", "--prompt", prompts[0],
                 "--top-k", "5", "--max-new-tokens", "4", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)["results"][0]
    assert printed.split("\n" + "-" * 40)[0] == prompts[0] + r["text"]
    # errors: a prompt longer than seq_length (64), no tokenizer anywhere, an empty prompts file
    capsys.readouterr()
    assert main(["generate", "--checkpoint", str(folder), "--tokenizer-model", "builtin", "--prompt",
                 "word " * 100]) == 2
    assert "longer than the model's seq_length=64" in capsys.readouterr().err
    assert main(["generate", "--checkpoint", str(folder), "--prompt", "hello"]) == 2
    assert "no tokenizer" in capsys.readouterr().err
    (tmp_path / "empty.txt").write_text("\n")
    assert main(["generate", "--checkpoint", str(folder), "--tokenizer-model", "builtin", "--prompts-file",
                 str(tmp_path / "empty.txt")]) == 2
    assert "is empty" in capsys.readouterr().err


def _until_eod_id(ids, eod):
    return ids[:ids.index(eod) + 1] if eod in ids else ids


@pytest.mark.slow
def test_cli_generate_launches_processes(hf_folder, capfd):
    """--nproc-per-node 2 --tp 2 relaunches the command on two processes; rank 0 prints one JSON object."""
    folder, _ = hf_folder
    argv = ["generate", "--checkpoint", str(folder), "--tokenizer-model", "builtin", "--prompt", "To be",
            "--prompt", "Of man", "--prompt", "Sing", "--top-k", "8", "--seed", "5", "--max-new-tokens", "5", "--json"]
    one, two = json_here_and_on_two_processes(capfd, argv)
    assert [r["tokens"] for r in two["results"]] == [r["tokens"] for r in one["results"]]
    assert main(argv + ["--nproc-per-node", "2"]) == 0  # TP 1 x DP 2: prompts split over the two
    dp = json.loads(capfd.readouterr().out)
    assert dp["data_parallel_size"] == 2 and dp["results"] == one["results"]


def test_cli_generate_tnlg_checkpoint(hf_folder, tmp_path, capsys):
    """A tnlg checkpoint converted from the HF folder (tokenizer recorded) generates the same tokens."""
    convert = pytest.importorskip("tnlg.interop.hf_checkpoint")
    folder, _ = hf_folder
    ckpt = tmp_path / "ckpt"
    convert.hf_to_checkpoint(str(folder), str(ckpt), tokenizer_model="builtin")
    argv = ["generate", "--prompt", "To be, or not", "--prompt", "Sing", "--top-p", "0.9", "--seed", "2",
            "--max-new-tokens", "6", "--json"]
    capsys.readouterr()
    assert main(argv + ["--checkpoint", str(folder), "--tokenizer-model", "builtin"]) == 0
    a = json.loads(capsys.readouterr().out)
    assert main(argv + ["--checkpoint", str(ckpt)]) == 0
    b = json.loads(capsys.readouterr().out)
    assert a["results"] == b["results"]
    from tnlg.generation.loading import checkpoint_seq_length
    assert checkpoint_seq_length(str(ckpt)) == checkpoint_seq_length(str(folder)) == 64
    assert main(["generate", "--checkpoint", str(ckpt), "--prompt", "word " * 100]) == 2
    assert "longer than the model's seq_length=64" in capsys.readouterr().err


# ----------------------------------------------------------------------------- decoding the continuation

SPM_MODEL = Path(__file__).parent / "fixtures" / "megatron_indexed" / "shakespeare_spm_bpe2000.model"
# prompts ending mid-word, after a word, at a space, after two spaces and after a newline; one empty
DECODE_PROMPTS = ["Return a new list o", "Return a new list of", "Return a new list of ", "To be,  ", "KING:\n", ""]


def _gpt2_bpe_folder(folder):
    """A small GPT-2-style byte-level BPE (vocab.json + merges.txt, <|endoftext|> last) trained with
    `tokenizers` on Shakespeare-like text."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    texts = ["Return a new list of the things that were, and are, and shall be. " * 3,
             "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer",
             "KING:\nWhat news? The café is open; naïve words, é à ü."]
    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=400, show_progress=False,
                                                     initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    folder.mkdir()
    t.model.save(str(folder))
    vocab = json.loads((folder / "vocab.json").read_text(encoding="utf-8"))
    vocab["<|endoftext|>"] = len(vocab)
    (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    return folder


def _own_decoders(tmp_path):
    """(tnlg tokenizer, the tokenizer library's own decode): SentencePiece's processor and
    transformers' GPT2TokenizerFast, which tnlg's code does not go through."""
    import sentencepiece
    transformers = pytest.importorskip("transformers")
    from tnlg.data.tokenizer import load_tokenizer
    spp = sentencepiece.SentencePieceProcessor(model_file=str(SPM_MODEL))
    folder = _gpt2_bpe_folder(tmp_path / "gpt2")
    fast = transformers.GPT2TokenizerFast.from_pretrained(str(folder))  # the folder's vocab.json + merges.txt
    return [(load_tokenizer(SPM_MODEL), lambda ids: spp.decode(ids)),
            (load_tokenizer(folder), lambda ids: fast.decode(ids, clean_up_tokenization_spaces=False))]


def test_continuation_is_the_rest_of_the_whole_decoding(tmp_path):
    """Splitting a text's tokens anywhere, prompt + continuation gives the text back (SentencePiece
    drops the space marker of the first piece it decodes, so decoding the new ids alone loses the
    space between prompt and continuation; a byte-level piece may end inside a character), and generated text satisfies
    prompt + text == the tokenizer's own decoding of prompt ids + new ids."""
    from tnlg.generation import continuation_text
    text = "Return a new list of the  things,\nand the café."
    for tok, own_decode in _own_decoders(tmp_path):
        ids = tok.encode(text)
        assert own_decode(ids) == text
        for k in range(1, len(ids)):
            head, cont = own_decode(ids[:k]), continuation_text(tok, ids[:k], ids[k:])
            # a split inside a character's UTF-8 bytes decodes the prompt's part as U+FFFD: the
            # continuation then starts with the whole character
            assert head.rstrip("\ufffd") + cont == text, (tok, k)
        model = GPT(GPTConfig(num_layers=1, hidden_size=32, num_attention_heads=2, seq_length=48,
                              vocab_size=tok.vocab_size, init_method_std=0.5, seed=3))
        texts = tnlg.generate(model, tok, DECODE_PROMPTS, max_new_tokens=8, top_k=50, seed=4, stop_at_eod=False)
        ids = generate_ids(model, [tok.encode(p) or [tok.eod_id] for p in DECODE_PROMPTS], 8, top_k=50, seed=4)
        for p, t, new in zip(DECODE_PROMPTS, texts, ids):
            prompt_ids = tok.encode(p) or [tok.eod_id]
            assert own_decode(prompt_ids) + t == own_decode(prompt_ids + new), (tok, p)
            if p:
                assert p + t == own_decode(prompt_ids + new), (tok, p)
    # the case that broke: the first new SentencePiece piece starts with its space marker
    sp = load_tokenizer_spm()
    head = sp.encode("Return a new list of")
    the = sp.sp.piece_to_id("\u2581the")
    assert continuation_text(sp, head, [the]) == " the" != sp.decode([the])


def load_tokenizer_spm():
    from tnlg.data.tokenizer import load_tokenizer
    return load_tokenizer(SPM_MODEL)


def test_the_readmes_load_snippet_runs_as_written(hf_folder, tmp_path, monkeypatch):
    """README's "The model" shows ``tnlg.load(...)`` then ``tnlg.gather_logits``: run that snippet verbatim on a
    folder at its path (here a Hugging Face GPT-2 folder); its logits are transformers' own."""
    import re
    import shutil
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    snippet = next(s for s in re.findall(r"```python\n(.*?)```", readme, re.S) if "tnlg.load(" in s)
    path = re.search(r'tnlg\.load\("([^"]+)"\)', snippet).group(1)
    folder, hf = hf_folder
    shutil.copytree(folder, tmp_path / path)
    monkeypatch.chdir(tmp_path)
    scope = {"tnlg": tnlg, "torch": torch}
    exec(compile("\n".join(line[2:] if line.startswith("  ") else line for line in snippet.splitlines()), "README", "exec"),
         scope)
    with torch.no_grad():
        want = hf(scope["tokens"]).logits
    assert scope["logits"].shape == want.shape
    torch.testing.assert_close(scope["logits"], want, rtol=1e-5, atol=1e-5)


def test_eval_and_generate_refuse_another_tokenizer_than_the_checkpoints(tmp_path, capsys):
    """A checkpoint records the tokenizer it was trained with; ``--tokenizer-model`` of another one with the same
    vocabulary size (other ids for other words) is refused by both commands before any process starts, naming
    both; a copy of the recorded file elsewhere (same contents) is accepted."""
    import shutil

    from tnlg.data.corpus import corpus_documents
    from tnlg.data.tokenizer import train_sentencepiece
    works = sorted(corpus_documents(), key=lambda doc: -len(doc[1]))[:2]  # two works: two tokenizers
    models = {}
    for name, (_, work) in zip("ab", works):
        text = tmp_path / f"{name}.txt"
        text.write_text(work[:100000])
        models[name] = str(train_sentencepiece([text], 400, tmp_path / name))
    hf_dir, ckpt = tmp_path / "hf", str(tmp_path / "ckpt")
    random_gpt2(400, 16).save_pretrained(hf_dir)
    assert main(["convert", "--from", "hf", str(hf_dir), "--to", ckpt, "--tokenizer-model", models["a"]]) == 0
    prompt = tmp_path / "p.txt"
    prompt.write_text("To be, or not to be")
    capsys.readouterr()
    for argv in (["generate", "--prompt", "To be", "--max-new-tokens", "2"],
                 ["eval", "--task", "text", "--input", str(prompt)]):
        assert main(argv + ["--checkpoint", ckpt, "--tokenizer-model", models["b"]]) == 2, argv
        err = capsys.readouterr().err
        assert "another tokenizer" in err and models["a"] in err and models["b"] in err, err
        assert len(err.strip().splitlines()) == 1
    copy = tmp_path / "elsewhere.model"
    shutil.copy(models["a"], copy)
    assert main(["generate", "--prompt", "To be", "--max-new-tokens", "2", "--checkpoint", ckpt, "--tokenizer-model",
                 str(copy), "--json"]) == 0


def test_eval_and_generate_say_what_they_load_before_the_result(tmp_path, capsys, monkeypatch):
    """On a terminal, rank 0 says what takes the seconds before the result (loading, resharding from the saved
    layout, the time it took); eval's table names a CP size above 1. Nothing of it on stdout."""
    from tnlg.commands.eval import _rows
    hf_dir, ckpt = tmp_path / "hf", str(tmp_path / "ckpt")
    random_gpt2(4096, 16).save_pretrained(hf_dir)
    assert main(["convert", "--from", "hf", str(hf_dir), "--to", ckpt, "--tokenizer-model", "builtin",
                 "--tp", "2"]) == 0
    capsys.readouterr()
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert main(["generate", "--checkpoint", ckpt, "--prompt", "To be", "--max-new-tokens", "2", "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["new_tokens"] == 2
    assert re.search(r"tnlg generate: loading .*iter_0000000 for TP 1 \(resharded from TP 2; every file's SHA-256 "
                     r"checked\) \.\.\.\ntnlg generate: loaded in [0-9.]+ s; generating for 1 prompt", err), err
    rows = dict(_rows({"task": "loss", "loss": 1.0, "tensor_model_parallel_size": 1, "data_parallel_size": 1,
                       "pipeline_model_parallel_size": 1, "context_parallel_size": 2, "seconds": 1.0}))
    assert rows["context parallel"] == 2
