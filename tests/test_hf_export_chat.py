"""An exported folder keeps the chat template the model was fine-tuned with, and its special tokens as
transformers expects them: ``AutoTokenizer`` of the folder turns an appended end-of-text into its one id (as TRL
appends and counts it), and ``apply_chat_template`` renders what fine-tuning rendered.
"""

from __future__ import annotations

import json
import os

import pytest

transformers = pytest.importorskip("transformers")

from tnlg.data.tokenizer import load_tokenizer  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there!"},
        {"role": "assistant", "content": "Hello, friend."}, {"role": "user", "content": "Bye?"},
        {"role": "assistant", "content": "Goodbye and good night."}]


def _export(tok, folder) -> "transformers.PreTrainedTokenizerBase":
    from tnlg.data.hf_tokenizer import hf_tokenizer_files
    os.makedirs(folder)
    for name, data in hf_tokenizer_files(tok, 128).items():
        with open(os.path.join(folder, name), "wb") as f:
            f.write(data)
    return transformers.AutoTokenizer.from_pretrained(str(folder))


def _gpt2_folder(path):
    from tests.hf_reference import bytes_to_unicode
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("a", "n"), ("o", "o"), ("Ġ", "g")]
    vocab = {ch: i for i, ch in enumerate(sorted(set(bytes_to_unicode().values())))}
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    vocab["<|endoftext|>"] = len(vocab)
    path.mkdir()
    (path / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    (path / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges), encoding="utf-8")
    return str(path)


def _builtin_text(messages, eos: str) -> str:
    """The built-in template's rendering, written out from its definition (docs/finetune.md)."""
    out = ""
    for m in messages:
        if m["role"] == "assistant":
            out += m["content"] + eos
        else:
            out += f"<|{m['role']}|>\n{m['content']}\n" + ("<|assistant|>\n" if m["role"] == "user" else "")
    return out


@pytest.mark.parametrize("kind", ["sentencepiece", "gpt2bpe"])
def test_an_exported_folder_keeps_the_builtin_template_and_one_end_of_text_id(tmp_path, kind):
    from tnlg.data.chat import BUILTIN
    from tnlg.data.sft import tokenize_rows
    from tnlg.data.sft_rows import SFTRow
    tok = load_tokenizer("builtin" if kind == "sentencepiece" else _gpt2_folder(tmp_path / "gpt2"))
    hf = _export(tok, tmp_path / "out")
    eos = hf.eos_token
    assert hf.eos_token_id == tok.eod_id
    # TRL's prompt-completion samples: the completion + eos_token, tokenized: the end-of-text is one id
    text = "The answer is four."
    ids = hf(text + eos, add_special_tokens=False)["input_ids"]
    assert ids == tok.encode(text) + [tok.eod_id]
    # the chat template fine-tuning rendered conversations with
    assert hf.apply_chat_template(CHAT, tokenize=False) == _builtin_text(CHAT, eos)
    out = hf.apply_chat_template(CHAT, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    assert out["input_ids"].count(tok.eod_id) == 2
    # tnlg reading the exported folder again fine-tunes with the built-in template itself (the same tokens)
    from tnlg.data.chat import chat_template_for
    assert chat_template_for(load_tokenizer(str(tmp_path / "out"))) is BUILTIN
    if kind == "gpt2bpe":  # byte-level BPE splits at the segments' edges alike: the very ids and counted tokens
        messages = tuple((m["role"], m["content"]) for m in CHAT)
        sample = tokenize_rows([SFTRow("row", None, None, messages)], tok, BUILTIN)
        assert out["input_ids"] == sample.ids.tolist()
        assert out["assistant_masks"] == sample.counted.astype(int).tolist()


def test_an_exported_folder_keeps_the_folders_own_template_and_tokens(tmp_path):
    from tests.test_chat_templates import CHATML, _smollm_folder
    src = _smollm_folder(tmp_path / "smol", "tokenizer_config")
    hf = _export(load_tokenizer(str(src)), tmp_path / "out")
    want = transformers.AutoTokenizer.from_pretrained(str(src))
    config = json.loads((tmp_path / "out" / "tokenizer_config.json").read_text())
    assert config["chat_template"] == CHATML and not config.get("split_special_tokens")
    assert (hf.bos_token, hf.eos_token, hf.pad_token) == ("<|im_start|>", "<|im_end|>", "<|im_end|>")
    for gen in (False, True):
        assert hf.apply_chat_template(CHAT, tokenize=True, add_generation_prompt=gen) == \
            want.apply_chat_template(CHAT, tokenize=True, add_generation_prompt=gen)
    assert hf("ok<|im_end|>", add_special_tokens=False)["input_ids"][-1] == 2
