"""A ``--tokenizer-model`` that is not the model's own tokenizer is refused, or used only when the user says so.

The model's own tokenizer is a Hugging Face folder's tokenizer files (in every form the folder ships them: a GPT-2
folder saved by transformers holds ``vocab.json`` + ``merges.txt`` and ``tokenizer.json``) or a tnlg checkpoint's
record. ``tnlg finetune``, ``generate``, ``eval`` and ``convert --from hf`` compare ``--tokenizer-model`` with it by
fingerprint (kind, vocabulary size, file contents): another one, even of the same vocabulary size, is one paragraph
naming both before anything is written or any worker starts; ``--allow-other-tokenizer`` uses it and says so once.
The tokenizers here are two byte-level BPEs of the same size (259 tokens) whose merges differ.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest

from tnlg.cli import main

RUN = ["--train-iters", "1", "--micro-batch-size", "1", "--global-batch-size", "1", "--eval-interval", "0",
       "--no-plot", "--peak-tflops", "1", "--sample-prompt", "", "--nproc-per-node", "1"]


def _byte_bpe(folder, merges):
    """A GPT-2 byte-level BPE (the 256 byte symbols, ``merges``, ``<|endoftext|>``) in both forms a published
    GPT-2 folder holds: ``vocab.json`` + ``merges.txt``, and the ``tokenizer.json`` + ``tokenizer_config.json``
    transformers' GPT-2 tokenizer writes from them."""
    import transformers
    from tests.hf_reference import bytes_to_unicode
    os.makedirs(folder, exist_ok=True)
    table = bytes_to_unicode()
    vocab = {table[b]: b for b in range(256)}
    for a, b in merges:
        vocab[a + b] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
    tok = transformers.GPT2TokenizerFast(vocab=str(folder / "vocab.json"), merges=str(folder / "merges.txt"))
    assert len(tok) == len(vocab)
    tok.save_pretrained(str(folder))
    return folder


@pytest.fixture()
def made(tmp_path, monkeypatch):
    """``hf``: a GPT-2 model folder with its own tokenizer (merges ``Ġ t``, ``h e``); ``other``: a tokenizer of
    the same size with other merges; ``ckpt``: a tnlg checkpoint recording the folder's tokenizer; rows."""
    pytest.importorskip("transformers")
    import torch
    import transformers
    monkeypatch.setenv("TNLG_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, n_positions=32, vocab_size=259, bos_token_id=258,
                                  eos_token_id=258, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(tmp_path / "hf")
    _byte_bpe(tmp_path / "hf", [("Ġ", "t"), ("h", "e")])
    _byte_bpe(tmp_path / "other", [("i", "n"), ("o", "n")])
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(dict(prompt=f"Question {i}?", completion=f" Answer {i}."))
                                                 + "\n" for i in range(2)))
    return tmp_path


def _refused(argv, capsys) -> str:
    capsys.readouterr()
    status = main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert status == 2 and "Traceback" not in err, err
    return err


def _names_both(err: str, made) -> None:
    """The paragraph names the model's tokenizer and the other one, and the flag that allows it."""
    assert "was trained with another tokenizer" in err and "--allow-other-tokenizer" in err, err
    assert str(made / "hf") in err and str(made / "other" / "vocab.json") in err, err
    assert err.count("259 tokens") >= 2, err  # (the same size: the contents tell them apart)


def _finetune(made, *extra):
    return ["finetune", "--load", made / "hf", "--sft-data-path", made / "rows.jsonl", "--save", made / "ft", *RUN,
            *extra]


def test_finetune_refuses_another_tokenizer_for_a_hugging_face_folder_before_writing_anything(made, capsys):
    err = _refused(_finetune(made, "--tokenizer-model", made / "other"), capsys)
    _names_both(err, made)
    assert "Nothing was written." in err
    assert not (made / "ft").exists() and not (made / "cache").exists()


def test_finetune_takes_the_folders_own_tokenizer_in_any_of_its_forms_and_copies_of_it(made, capsys):
    from tnlg.cli import build_parser
    from tnlg.commands.finetune import Start
    copy = made / "copy"
    copy.mkdir()
    for name in ("vocab.json", "merges.txt"):
        shutil.copy(made / "hf" / name, copy / name)
    for tok in (made / "hf", made / "hf" / "tokenizer.json", copy):
        args = build_parser(only="finetune").parse_args([str(a) for a in _finetune(made, "--tokenizer-model", tok)])
        assert Start.of(args).notes == [], tok
    assert not (made / "ft").exists()


def test_finetune_with_allow_other_tokenizer_trains_records_it_and_says_so_once(made, capsys):
    from tnlg.checkpoint.files import read_meta, resolve
    from tnlg.data.tokenizer import load_tokenizer
    capsys.readouterr()
    assert main([str(a) for a in _finetune(made, "--tokenizer-model", made / "other", "--allow-other-tokenizer")]) == 0
    out = capsys.readouterr()
    text = out.out + out.err
    assert text.count("--allow-other-tokenizer says") == 1, text
    assert f"note: --tokenizer-model {str(made / 'other' / 'vocab.json')!r}" in text, text
    recorded = read_meta(resolve(str(made / "ft"), "--load"))["tokenizer"]
    assert recorded["sha256"] == load_tokenizer(str(made / "other")).describe()["sha256"]


def test_finetune_refuses_another_tokenizer_than_a_tnlg_checkpoint_records(made, capsys):
    assert main(["convert", "--from", "hf", str(made / "hf"), "--to", str(made / "ckpt"), "--tokenizer-model",
                 str(made / "hf")]) == 0
    err = _refused(["finetune", "--load", made / "ckpt", "--sft-data-path", made / "rows.jsonl", "--save",
                    made / "ft", *RUN, "--tokenizer-model", made / "other"], capsys)
    assert "recorded in the checkpoint" in err and "Nothing was written." in err, err
    assert not (made / "ft").exists()


def test_allow_other_tokenizer_without_a_tokenizer_is_one_paragraph(made, capsys):
    err = _refused(_finetune(made, "--allow-other-tokenizer"), capsys)
    assert "--allow-other-tokenizer goes with --tokenizer-model" in err, err
    err = _refused(["generate", "--checkpoint", made / "hf", "--prompt", "the", "--allow-other-tokenizer"], capsys)
    assert "--allow-other-tokenizer goes with --tokenizer-model" in err, err
    err = _refused(["convert", "--from", "hf", made / "hf", "--to", made / "c", "--allow-other-tokenizer"], capsys)
    assert "--allow-other-tokenizer is for --from hf DIR with --tokenizer-model" in err, err


def test_generate_and_eval_refuse_another_tokenizer_before_loading(made, capsys):
    _names_both(_refused(["generate", "--checkpoint", made / "hf", "--tokenizer-model", made / "other", "--prompt",
                          "the"], capsys), made)
    (made / "text.txt").write_text("the theme of the thing\n")
    _names_both(_refused(["eval", "--task", "text", "--input", made / "text.txt", "--checkpoint", made / "hf",
                          "--tokenizer-model", made / "other"], capsys), made)


def test_generate_with_allow_other_tokenizer_runs_and_one_of_its_processes_says_so(made):
    from tnlg.runtime.spawn import run_tnlg
    out = run_tnlg(["generate", "--checkpoint", made / "hf", "--tokenizer-model", made / "other", "--prompt", "the",
                    "--max-new-tokens", "2", "--greedy", "--allow-other-tokenizer", "--nproc-per-node", "2", "--json"],
                   made)
    assert out.count("--allow-other-tokenizer says") == 1, out
    assert json.loads(next(line for line in out.splitlines() if line.startswith("{")))["new_tokens"] == 2


def test_convert_from_hf_refuses_another_tokenizer_unless_allowed(made, capsys):
    from tnlg.checkpoint.files import read_meta, resolve
    err = _refused(["convert", "--from", "hf", made / "hf", "--to", made / "c", "--tokenizer-model", made / "other"],
                   capsys)
    _names_both(err, made)
    assert not (made / "c").exists()
    assert main(["convert", "--from", "hf", str(made / "hf"), "--to", str(made / "c"), "--tokenizer-model",
                 str(made / "other"), "--allow-other-tokenizer"]) == 0
    assert "--allow-other-tokenizer says" in capsys.readouterr().err
    assert read_meta(resolve(str(made / "c"), "--load"))["tokenizer"]["vocab_file"] == str(made / "other" / "vocab.json")
