"""The special tokens of a Hugging Face tokenizer folder, read as transformers reads them (docs/finetune.md,
"Chat templates").

Two things come out of a folder, for rendering and encoding its chat template:

* **The named special tokens** (``bos_token``, ``eos_token``, ``unk_token``, ``sep_token``, ``pad_token``,
  ``cls_token``, ``mask_token``), the variables transformers' ``apply_chat_template`` gives a template: the
  tokenizer class's defaults (the class named by ``tokenizer_config.json``'s ``tokenizer_class``, else by
  ``config.json``'s ``model_type``, else Llama's for a SentencePiece model and GPT-2's for a GPT-2 BPE
  folder: ``bos_token`` ``<s>`` where a Llama folder names none), overridden by ``tokenizer_config.json``
  (``null`` unsets one), and, when that file has no ``added_tokens_decoder``, by ``special_tokens_map.json``.
* **The added tokens**, each matched whole in a rendering and encoded as its single id, as a transformers
  tokenizer matches them before the model sees the text: ``added_tokens_decoder`` of
  ``tokenizer_config.json``, ``added_tokens`` of ``tokenizer.json``, ``added_tokens.json``, and the named and
  ``additional_special_tokens``/``extra_special_tokens`` present in the vocabulary. A token whose declared id
  is not tnlg's id of the same piece (or that tnlg's vocabulary lacks) is refused, naming the folder.

No collectives; transformers is imported only to read a tokenizer class's defaults (when installed).
"""

from __future__ import annotations

import inspect
import json
import os
from dataclasses import dataclass
from typing import Any, Optional

from ..errors import UserError

__all__ = ["NAMED", "FolderTokens", "folder_tokens"]

NAMED = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_KIND_CLASS = {"sentencepiece": "LlamaTokenizer", "gpt2bpe": "GPT2Tokenizer"}


@dataclass(frozen=True)
class FolderTokens:
    """``named``: ``(attribute, text)`` of each named special token that is set; ``added``: ``(text, id)`` of
    every token matched whole in a rendering, longest text first."""

    named: tuple[tuple[str, str], ...] = ()
    added: tuple[tuple[str, int], ...] = ()
    prepend: str = ""  # "first", "always", "every" or "": where the folder's tokenizer writes a leading ▁

    def get(self, name: str) -> str:
        return dict(self.named).get(name, "")


def _read_json(path: str) -> Any:
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError, RecursionError) as err:
        raise UserError(f"{path} is not readable JSON ({str(err)[:200]}); the special tokens of the chat template "
                        "are read from it. Fix or remove the file.") from None


def _text(value) -> Optional[str]:
    """A special token's text: a string, or the ``content`` of a serialised ``AddedToken``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _class_defaults(name: Optional[str]) -> dict:
    """The named tokens' defaults of transformers' tokenizer class ``name`` (its ``__init__``'s keyword
    defaults); empty when transformers or the class is not there."""
    if not name:
        return {}
    try:
        from transformers.models.auto.tokenization_auto import tokenizer_class_from_name
        cls = tokenizer_class_from_name(name)
        params = inspect.signature(cls.__init__).parameters if cls is not None else {}
    except Exception:  # noqa: BLE001 - no transformers, or a class it cannot import: no defaults
        return {}
    return {k: p.default for k, p in params.items() if k in NAMED and isinstance(p.default, str)}


def _class_name(folder: str, config: dict, kind: Optional[str]) -> Optional[str]:
    name = config.get("tokenizer_class")
    if isinstance(name, str) and name:
        return name
    model = _read_json(os.path.join(folder, "config.json"))
    model_type = model.get("model_type") if isinstance(model, dict) else None
    if isinstance(model_type, str):
        try:
            from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES
            mapped = TOKENIZER_MAPPING_NAMES.get(model_type)
            mapped = mapped[0] if isinstance(mapped, (tuple, list)) else mapped
            if isinstance(mapped, str):
                return mapped
        except ImportError:
            pass
    return _KIND_CLASS.get(kind or "")


def _extra(value) -> list[str]:
    items = value.values() if isinstance(value, dict) else value if isinstance(value, list) else []
    return [t for t in map(_text, items) if t]


def folder_tokens(folder: Optional[str], tokenizer, class_defaults: bool = True) -> FolderTokens:
    """The named special tokens and added tokens of the tokenizer folder ``folder`` for tnlg's ``tokenizer``
    (see the module docstring); the class defaults alone when ``folder`` is ``None``. Without
    ``class_defaults``, only what the folder's files name (transformers is not imported)."""
    kind = getattr(tokenizer, "kind", None)
    config = _read_json(os.path.join(folder, "tokenizer_config.json")) if folder else None
    config = config if isinstance(config, dict) else {}
    values: dict = {}
    if class_defaults:
        values.update(_class_defaults(_class_name(folder, config, kind) if folder else _KIND_CLASS.get(kind or "")))
    values.update({k: config[k] for k in NAMED if k in config})
    smap = _read_json(os.path.join(folder, "special_tokens_map.json")) if folder else None
    smap = smap if isinstance(smap, dict) else {}
    if "added_tokens_decoder" not in config:  # transformers reads the legacy map only then
        values.update({k: smap[k] for k in NAMED if k in smap})
    named = {k: t for k, t in ((k, _text(v)) for k, v in values.items()) if t}
    fast = _read_json(os.path.join(folder, "tokenizer.json")) if folder else None

    declared: dict[str, tuple[int, str]] = {}  # text -> (id, where it was declared)

    def declare(text, token_id, where: str) -> None:
        if isinstance(text, str) and text and isinstance(token_id, int) and text not in declared:
            declared[text] = (token_id, where)

    decoder = config.get("added_tokens_decoder")
    if isinstance(decoder, dict):
        for key, value in decoder.items():
            declare(_text(value), int(key) if str(key).isdigit() else None, "tokenizer_config.json")
    if isinstance(fast, dict) and isinstance(fast.get("added_tokens"), list):
        for entry in fast["added_tokens"]:
            if isinstance(entry, dict):
                declare(entry.get("content"), entry.get("id"), "tokenizer.json")
    legacy = _read_json(os.path.join(folder, "added_tokens.json")) if folder else None
    if isinstance(legacy, dict):
        for text, token_id in legacy.items():
            declare(text, token_id, "added_tokens.json")

    added: dict[str, int] = {}
    for text, (token_id, where) in declared.items():
        own = tokenizer.piece_id(text)
        if own != token_id:
            have = f"tnlg's id of that piece is {own}" if own is not None else "tnlg's vocabulary has no such piece"
            raise UserError(f"{os.path.join(str(folder), where)} declares the token {text!r} as id {token_id}, but "
                            f"{have} (vocabulary of {tokenizer.vocab_size} ids from {_files(tokenizer)}); its chat "
                            "template would encode to ids transformers does not give. Use a folder whose "
                            "vocabulary holds the folder's added tokens, or write the rows as prompt/completion.")
        added[text] = token_id
    for text in [*named.values(), *_extra(config.get("additional_special_tokens")),
                 *_extra(config.get("extra_special_tokens")), *_extra(smap.get("additional_special_tokens"))]:
        own = tokenizer.piece_id(text)
        if text not in added and own is not None:
            added[text] = own
    return FolderTokens(tuple(sorted(named.items())),
                        tuple(sorted(added.items(), key=lambda kv: (-len(kv[0]), kv[0]))),
                        _prepend_scheme(fast, config, kind))


def _prepend_scheme(fast, config: dict, kind: Optional[str]) -> str:
    """Where the folder's transformers tokenizer writes a SentencePiece-style leading ``▁``: ``"first"`` (only
    before the text at the start of the input), ``"always"`` (before every stretch of text between added
    tokens), both never before a text that starts with a space (a ``Metaspace``); ``"every"`` (a ``Prepend``
    normaliser, tnlg's own export: before every stretch, whatever it starts with); ``""`` (never: byte-level
    BPE). transformers builds a LlamaTokenizer's ``Metaspace`` itself, whatever tokenizer.json says: ``never``
    with ``add_prefix_space`` false, ``always`` with ``legacy`` true, else ``first`` (as for a SentencePiece
    model without tokenizer.json); any other class uses tokenizer.json's."""
    if config.get("tokenizer_class") in _LLAMA_CLASSES or (not isinstance(fast, dict) and kind == "sentencepiece"):
        if config.get("add_prefix_space") is False:
            return ""
        return "always" if config.get("legacy") else "first"
    if isinstance(fast, dict):
        for step in _steps(fast.get("pre_tokenizer")):
            if step.get("type") == "Metaspace":
                scheme = step.get("prepend_scheme", "always" if step.get("add_prefix_space", True) else "never")
                return "" if scheme == "never" else str(scheme)
        for step in _steps(fast.get("normalizer")):
            pattern = step.get("pattern")
            regex = str(pattern.get("Regex")) if isinstance(pattern, dict) else ""
            if step.get("type") == "Prepend" or (step.get("type") == "Replace" and "\\A" in regex
                                                 and step.get("content") == "\u2581"):
                return "every"
    return ""


_LLAMA_CLASSES = ("LlamaTokenizer", "LlamaTokenizerFast", "CodeLlamaTokenizer", "CodeLlamaTokenizerFast")


def _steps(part) -> list[dict]:
    """The steps of a tokenizer.json normaliser or pre-tokenizer (a ``Sequence``'s, flattened)."""
    if not isinstance(part, dict):
        return []
    inner = part.get("normalizers") or part.get("pretokenizers")
    if part.get("type") == "Sequence" and isinstance(inner, list):
        return [s for p in inner for s in _steps(p)]
    return [part]


def _files(tokenizer) -> str:
    spec = tokenizer.describe() if hasattr(tokenizer, "describe") else {}
    return repr(spec.get("path") or spec.get("vocab_file") or "?")
