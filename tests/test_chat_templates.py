"""Chat templates of Hugging Face tokenizer folders, against transformers' own ``apply_chat_template`` on tiny
folders built here offline: the template sees every special token the folder defines (the tokenizer class's
defaults where the folder names none), each special or added token of the rendering becomes the single id
transformers gives it, and long conversations render in time linear in their length."""

from __future__ import annotations

import json
import shutil

import pytest

from tnlg.data.chat import chat_template_for, segments
from tnlg.data.sft import tokenize_segments
from tnlg.data.tokenizer import builtin_tokenizer_path, load_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")
pytest.importorskip("transformers")

CHAT = [("system", "Be brief."), ("user", "Hi there!"), ("assistant", "Hello."), ("user", "Bye and thanks?"),
        ("assistant", "Goodbye, then.")]

# Llama-2's published template, shortened (the system turn folded into the first user turn; content trimmed)
LLAMA2 = ("{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}{% set system_message = "
          "messages[0]['content'] %}{% else %}{% set loop_messages = messages %}{% set system_message = false %}"
          "{% endif %}{% for message in loop_messages %}{% if loop.index0 == 0 and system_message != false %}"
          "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}{% else %}"
          "{% set content = message['content'] %}{% endif %}{% if message['role'] == 'user' %}"
          "{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
          "{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}")
# every named special token, read by concatenation (an undefined one would raise)
ALL_SPECIALS = ("{% for m in messages %}{{ bos_token + m['role'] + unk_token + ': ' + m['content'] + pad_token }}"
                "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}\n{% endfor %}"
                "{% if add_generation_prompt %}{{ bos_token + 'assistant' + unk_token + ': ' }}{% endif %}")


def _llama_folder(path, config: dict):
    """A SentencePiece Llama folder: the built-in model as tokenizer.model, and ``config`` as tokenizer_config.json."""
    path.mkdir()
    shutil.copy(builtin_tokenizer_path(), path / "tokenizer.model")
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def _gpt2_folder(path, config: dict, extra_vocab=(), merges=(("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"))):
    """A GPT-2 byte-level BPE folder: the byte alphabet, a few merges, ``extra_vocab`` tokens appended to
    vocab.json, ``<|endoftext|>`` last; ``config`` as tokenizer_config.json."""
    from tests.hf_reference import bytes_to_unicode
    path.mkdir()
    vocab = {ch: i for i, ch in enumerate(sorted(set(bytes_to_unicode().values())))}
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    for t in (*extra_vocab, "<|endoftext|>"):
        vocab[t] = len(vocab)
    (path / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    (path / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges), encoding="utf-8")
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def _tnlg(folder, chat):
    """tnlg's rendering (segments' texts, each id as its vocabulary entry) and ids of ``chat``."""
    tok = load_tokenizer(str(folder))
    segs = segments(chat, chat_template_for(tok))
    return segs, tokenize_segments([segs], tok).ids.tolist(), tok


def _hf(folder, chat):
    import transformers
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    msgs = [{"role": r, "content": c} for r, c in chat]
    return hf, hf.apply_chat_template(msgs, tokenize=False), list(hf.apply_chat_template(msgs, tokenize=True,
                                                                                         return_dict=False))


def _rendered(segs, hf, eod_text):
    """The text of tnlg's segments (an appended end-of-document id is no part of the rendering)."""
    segs = segs[:-1] if segs[-1][0] is None else segs
    return "".join(eod_text if t is None else hf.convert_ids_to_tokens(t) if isinstance(t, int) else t
                   for t, _ in segs)


def test_a_llama_folder_without_bos_token_renders_the_class_default(tmp_path):
    """A SentencePiece Llama folder whose tokenizer_config.json names no bos_token: the template's
    ``{{ bos_token }}`` is LlamaTokenizer's default ``<s>``, encoded as its id, as transformers does."""
    folder = _llama_folder(tmp_path / "llama", {"tokenizer_class": "LlamaTokenizer", "chat_template": LLAMA2})
    segs, ids, tok = _tnlg(folder, CHAT)
    hf, text, hf_ids = _hf(folder, CHAT)
    assert hf.bos_token == "<s>" and text.startswith("<s>[INST] <<SYS>>")
    assert _rendered(segs, hf, hf.eos_token) == text
    special = set(hf.all_special_ids)
    assert [i for i in ids if i in special] == [i for i in hf_ids if i in special]  # ends with eos = tnlg's eod
    assert ids[-1] == hf.eos_token_id == tok.eod_id
    assert ids[0] == hf.bos_token_id == 1 and ids.count(hf.bos_token_id) == 2


@pytest.mark.parametrize("config", [
    {"tokenizer_class": "GPT2Tokenizer", "pad_token": "<|endoftext|>"},
    {"tokenizer_class": "GPT2Tokenizer", "pad_token": "<pad>", "unk_token": "<unk>", "bos_token": "<s>"},
], ids=["defaults", "own"])
def test_every_named_special_token_reaches_the_template(tmp_path, config):
    """``pad_token`` and ``unk_token`` (and the rest) are the template's variables, as transformers passes them;
    each in the vocabulary becomes its single id, and the ids equal ``apply_chat_template``'s."""
    folder = _gpt2_folder(tmp_path / "gpt2", {**config, "chat_template": ALL_SPECIALS},
                          extra_vocab=("<pad>", "<unk>", "<s>") if "unk_token" in config else ())
    segs, ids, tok = _tnlg(folder, CHAT)
    hf, text, hf_ids = _hf(folder, CHAT)
    assert _rendered(segs, hf, "<|endoftext|>") == text
    assert ids == hf_ids + ([] if hf_ids[-1] == tok.eod_id else [tok.eod_id])  # a sample ends with tnlg's eod


# ----------------------------------------------------------------------------------- assistant spans

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# Llama-3's published template, shortened (bos once; each turn's header; content trimmed)
LLAMA3 = ("{{ bos_token }}{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n' + "
          "m['content'] | trim + '<|eot_id|>' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
# Mistral's published v1 template, shortened (no generation prompt; the eos after each answer)
MISTRAL = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}{{ '[INST] ' + m['content'] + ' [/INST]' }}"
           "{% elif m['role'] == 'assistant' %}{{ m['content'] + eos_token }}{% else %}{{ m['content'] + '\n\n' }}"
           "{% endif %}{% endfor %}")
# numbers each turn: what precedes an answer differs from turn to turn
NUMBERED = ("{% for m in messages %}[{{ loop.index }}] {{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}[{{ messages | length + 1 }}] assistant: {% endif %}")
TEMPLATES = {"chatml": CHATML, "llama2": LLAMA2, "llama3": LLAMA3, "mistral": MISTRAL, "numbered": NUMBERED,
             "all_specials": ALL_SPECIALS}
CHATML_VOCAB = ("<|im_start|>", "<|im_end|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<s>", "</s>")


def _chat_folder(tmp_path, template: str):
    added = {str(i): {"content": t, "special": True} for i, t in enumerate(CHATML_VOCAB, start=260)}
    return _gpt2_folder(tmp_path / "chat", {"tokenizer_class": "GPT2Tokenizer", "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<|endoftext|>",
                                             "added_tokens_decoder": added, "chat_template": template},
                        extra_vocab=CHATML_VOCAB)


def _reference_spans(hf, template: str, chat) -> tuple[str, list[bool]]:
    """transformers' rendering of ``chat`` and, per character, whether it is trained on: assistant turn ``i``
    from the end of the rendering of turns ``< i`` with the generation prompt to the end of turns ``<= i``."""
    from transformers.utils.chat_template_utils import render_jinja_template

    def render(msgs, prompt=False):
        out, _ = render_jinja_template([[{"role": r, "content": c} for r, c in msgs]], chat_template=template,
                                       add_generation_prompt=prompt, **hf.special_tokens_map)
        return out[0]

    text = render(chat)
    counted = [False] * len(text)
    for i, (role, _) in enumerate(chat):
        if role == "assistant":
            a, b = len(render(chat[:i], True)), len(render(chat[:i + 1]))
            counted[a:b] = [True] * (b - a)
    return text, counted


def _tnlg_spans(segs, hf) -> tuple[str, list[bool]]:
    """The rendering of tnlg's segments and, per character, whether it is counted (a stretch's counted
    character ranges; an added token's flag)."""
    text, counted = "", []
    for t, c in segs[:-1] if segs[-1][0] is None else segs:  # the appended eod is no part of the rendering
        piece = hf.convert_ids_to_tokens(t) if isinstance(t, int) else t
        flags = [False] * len(piece)
        for a, b in (c if isinstance(c, tuple) else [(0, len(piece))] if c else []):
            flags[a:b] = [True] * (b - a)
        text += piece
        counted += flags
    return text, counted


def _conversation(rng, turns: int, system: bool):
    words = ["hello", " there", "  spaced ", "\nnew line", "tabs\t", "<|im_start|>", "</s>", "ok", "?", "fine."]
    chat = [("system", "You are terse. ")] if system else []
    for _turn in range(turns):
        chat += [("user", "".join(rng.choice(words) for _ in range(rng.randint(1, 4))) or "q"),
                 ("assistant", "".join(rng.choice(words) for _ in range(rng.randint(1, 4))).strip() or "a")]
    return chat


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_assistant_spans_are_the_turn_by_turn_renderings(tmp_path, name):
    """The counted characters are those between the rendering of turns ``< i`` with the generation prompt and
    the rendering of turns ``<= i`` (computed here with transformers' renderer, turn by turn), on random
    conversations with and without a system turn and with contents that start or end with whitespace."""
    import random
    import transformers
    folder = _chat_folder(tmp_path, TEMPLATES[name])
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    tok = load_tokenizer(str(folder))
    template = chat_template_for(tok)
    rng = random.Random(name)
    for trial in range(12):
        chat = _conversation(rng, 1 + trial % 5, system=trial % 2 == 0 and name != "mistral")
        assert _tnlg_spans(segments(chat, template), hf) == _reference_spans(hf, TEMPLATES[name], chat), (name, chat)


def test_a_conversation_of_4000_turns_renders_in_linear_time(tmp_path):
    """A template without generation blocks is not rendered once per assistant turn and prefix: 4,000 turns
    (about 150 kB) take well under a few seconds, and the spans are those of the turn-by-turn renderings."""
    import time
    import transformers
    folder = _chat_folder(tmp_path, CHATML)
    tok = load_tokenizer(str(folder))
    template = chat_template_for(tok)
    chat = []
    for k in range(2000):
        chat += [("user", f"question number {k}: what comes after {k}?"), ("assistant", f"{k + 1} comes after {k}.")]
    t0 = time.perf_counter()
    segs = segments(chat, template)
    took = time.perf_counter() - t0
    assert took < 3.0, f"{took:.1f} s"
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    text, counted = _tnlg_spans(segs, hf)
    assert len(text) > 140_000 and text == hf.apply_chat_template([{"role": r, "content": c} for r, c in chat],
                                                                  tokenize=False)
    # every assistant turn counted, from its content through its <|im_end|>\n; nothing else
    want = []
    for role, content in chat:
        head = f"<|im_start|>{role}\n"
        want += [False] * len(head) + [role == "assistant"] * len(content + "<|im_end|>\n")
    assert counted == want


# ----------------------------------------------------------------------------------- ChatML in a GPT-2 BPE folder

def _smollm_folder(path, declare: str, ids=(0, 1, 2)):
    """A SmolLM2-style folder: vocab.json starting with ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>`` (at
    ``ids``), then the byte alphabet and a few merges; ``declare`` says where the folder declares them as added
    tokens: tokenizer_config.json's added_tokens_decoder, special_tokens_map.json, or tokenizer.json."""
    from tests.hf_reference import bytes_to_unicode
    path.mkdir()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("a", "n")]
    vocab = dict(zip(specials, (0, 1, 2)))
    for ch in sorted(set(bytes_to_unicode().values())):
        vocab[ch] = len(vocab)
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    (path / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    (path / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges), encoding="utf-8")
    config = {"tokenizer_class": "GPT2Tokenizer", "bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
              "pad_token": "<|im_end|>", "unk_token": "<|endoftext|>", "chat_template": CHATML}
    if declare == "tokenizer_config":
        config["added_tokens_decoder"] = {str(i): {"content": t, "special": True, "normalized": False}
                                          for t, i in zip(specials, ids)}
    elif declare == "special_tokens_map":
        (path / "special_tokens_map.json").write_text(json.dumps({"additional_special_tokens": specials[1:]}))
    else:
        import tokenizers
        from tokenizers import decoders, models, pre_tokenizers
        fast = tokenizers.Tokenizer(models.BPE.from_file(str(path / "vocab.json"), str(path / "merges.txt")))
        fast.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        fast.decoder = decoders.ByteLevel()
        fast.add_special_tokens(specials)
        (path / "tokenizer.json").write_text(fast.to_str())
        del config["tokenizer_class"]  # read as PreTrainedTokenizerFast
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("declare", ["tokenizer_config", "special_tokens_map", "tokenizer_json"])
def test_chatml_tokens_of_a_gpt2_folder_are_single_ids(tmp_path, declare):
    """``<|im_start|>`` and ``<|im_end|>`` declared by the folder (in any of the three files transformers reads)
    encode as their single ids 1 and 2, exactly as ``apply_chat_template`` gives; the sample then ends with
    the end-of-document id ``<|endoftext|>`` (0)."""
    folder = _smollm_folder(tmp_path / "smol", declare)
    segs, ids, tok = _tnlg(folder, CHAT)
    hf, text, hf_ids = _hf(folder, CHAT)
    assert _rendered(segs, hf, "<|endoftext|>") == text
    assert ids == hf_ids + [0] and ids.count(1) == ids.count(2) == len(CHAT)
    assert tok.eod_id == 0 and (2, True) in segs and (2, False) in segs  # an answer's <|im_end|> is counted


def test_a_folder_whose_added_tokens_disagree_with_its_vocabulary_is_refused(tmp_path):
    from tnlg.errors import UserError
    folder = _smollm_folder(tmp_path / "smol", "tokenizer_config", ids=(0, 5, 2))
    with pytest.raises(UserError, match=r"tokenizer_config\.json declares the token '<\|im_start\|>' as id 5, but "
                                        r"tnlg's id of that piece is 1"):
        chat_template_for(load_tokenizer(str(folder)))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["added_tokens_decoder"]["300"] = {"content": "<tool>", "special": True}
    config["added_tokens_decoder"]["1"] = config["added_tokens_decoder"].pop("5")
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match="'<tool>' as id 300, but tnlg's vocabulary has no such piece") as err:
        chat_template_for(load_tokenizer(str(folder)))
    assert "\n" not in str(err.value) and str(folder) in str(err.value)


# ----------------------------------------------------------------------------------- ids against transformers

QWEN = ("{% for m in messages %}{% if loop.first and m['role'] != 'system' %}<|im_start|>system\nYou are a helpful "
        "assistant.<|im_end|>\n{% endif %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CHATML_GENERATION = ("{% for m in messages %}{% if m['role'] == 'assistant' %}<|im_start|>assistant\n{% generation %}"
                     "{{ m['content'] }}<|im_end|>{% endgeneration %}\n{% else %}<|im_start|>{{ m['role'] }}\n"
                     "{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
                     "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.mark.parametrize("in_vocab", [True, False], ids=["specials_in_vocab", "specials_absent"])
@pytest.mark.parametrize("name", ["chatml", "chatml_generation", "llama2", "llama3", "mistral", "qwen"])
def test_ids_equal_apply_chat_template_on_random_conversations(tmp_path, name, in_vocab):
    """Every template against ``apply_chat_template(tokenize=True)`` on random conversations, with the folder's
    special tokens in its vocabulary (declared: single ids) or absent from it (plain text on both sides)."""
    import random
    import transformers
    template = {**TEMPLATES, "qwen": QWEN, "chatml_generation": CHATML_GENERATION}[name]
    if in_vocab:
        folder = _chat_folder(tmp_path, template)
    else:
        folder = _gpt2_folder(tmp_path / "plain", {"tokenizer_class": "GPT2Tokenizer", "chat_template": template})
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    tok = load_tokenizer(str(folder))
    chat_template = chat_template_for(tok)
    rng = random.Random(f"{name}{in_vocab}")
    for trial in range(10):
        chat = _conversation(rng, 1 + trial % 4, system=trial % 2 == 1 and name != "mistral")
        ids = tokenize_segments([segments(chat, chat_template)], tok).ids.tolist()
        want = list(hf.apply_chat_template([{"role": r, "content": c} for r, c in chat], tokenize=True,
                                           return_dict=False))
        assert ids == want + ([] if want[-1] == tok.eod_id else [tok.eod_id]), (name, chat)


def _sentencepiece_folder(tmp_path, how: str, template: str):
    """A SentencePiece Llama folder of the built-in model: ``model`` tokenizer.model alone (transformers writes the
    leading ``▁`` only at the start of the text), ``legacy`` the same with ``legacy: true`` (before every
    stretch between special tokens), ``export`` tnlg's own export (tokenizer.json beside the .model),
    ``converted`` transformers' conversion saved as tokenizer.json alone (tnlg's tokenizer-json kind),
    ``llama_json`` a LlamaTokenizer folder whose tokenizer.json (saved with ``legacy: true``) says ``always``
    beside ``legacy: false`` (transformers rebuilds the prefix from ``legacy``: only at the start)."""
    if how == "export":
        from tnlg.data.hf_tokenizer import hf_tokenizer_files
        folder = tmp_path / "export"
        folder.mkdir()
        for name, data in hf_tokenizer_files(load_tokenizer("builtin"), 64).items():
            (folder / name).write_bytes(data)
        config = json.loads((folder / "tokenizer_config.json").read_text())
        config.update(chat_template=template, split_special_tokens=False)
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
        return folder
    config = {"tokenizer_class": "LlamaTokenizer", "chat_template": template, **({"legacy": True} if how == "legacy"
                                                                                 else {})}
    folder = _llama_folder(tmp_path / how, config)
    if how == "llama_json":
        import transformers
        legacy = _llama_folder(tmp_path / "legacy-source", {**config, "legacy": True})
        transformers.AutoTokenizer.from_pretrained(str(legacy)).save_pretrained(str(folder))
        saved = json.loads((folder / "tokenizer.json").read_text())
        assert saved["pre_tokenizer"]["prepend_scheme"] == "always"
        (folder / "tokenizer_config.json").write_text(json.dumps({**config, "legacy": False}))
        return folder
    if how == "converted":
        import transformers
        out = tmp_path / "converted-out"
        transformers.AutoTokenizer.from_pretrained(str(folder)).save_pretrained(str(out))
        for extra in out.glob("*.model"):
            extra.unlink()
        return out
    return folder


@pytest.mark.parametrize("how", ["model", "legacy", "export", "converted", "llama_json"])
@pytest.mark.parametrize("name", ["chatml", "llama2", "llama3", "mistral"])
def test_sentencepiece_folders_give_apply_chat_templates_ids(tmp_path, name, how):
    """With a SentencePiece model, the leading ``▁`` goes where the folder's transformers tokenizer writes it: at
    the start of the text only, or at the start of every stretch between special tokens; never at a span's
    boundary inside a stretch."""
    import random
    import transformers
    folder = _sentencepiece_folder(tmp_path, how, TEMPLATES[name])
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    tok = load_tokenizer(str(folder))
    assert tok.kind == ("tokenizer-json" if how == "converted" else "sentencepiece")
    chat_template = chat_template_for(tok)
    rng = random.Random(f"{name}{how}")
    for trial in range(8):
        chat = _conversation(rng, 1 + trial % 4, system=trial % 2 == 1 and name != "mistral")
        ids = tokenize_segments([segments(chat, chat_template)], tok).ids.tolist()
        want = list(hf.apply_chat_template([{"role": r, "content": c} for r, c in chat], tokenize=True,
                                           return_dict=False))
        assert ids == want + ([] if want[-1] == tok.eod_id else [tok.eod_id]), (name, how, chat)
