"""tnlg's tokenizers as Hugging Face ``tokenizers`` objects and the files of an exported folder.

A ``tokenizer.json`` tokenizer (:class:`~tnlg.data.tokenizer.TokenizerJSONTokenizer`) is exported as its
folder's own files (``tokenizer.json``, ``tokenizer_config.json`` with its special tokens and chat
template, ``special_tokens_map.json``, ``added_tokens.json``, ``chat_template.jinja`` where present).

:func:`hf_tokenizer` builds a ``tokenizers.Tokenizer`` that gives exactly tnlg's ids (GPT-2 BPE:
tnlg's own pipeline; SentencePiece BPE: rebuilt from the model file: normaliser, pieces, byte
fallback, decoder), checked on fixed probe texts and on the whole vocabulary before it is
returned; :func:`hf_tokenizer_files` adds ``tokenizer_config.json`` and ``special_tokens_map.json``
(the end-of-document token as ``bos``/``eos``) and the source files (docs/hf.md). The weights'
side of the export is :mod:`tnlg.interop.hf`.
"""

from __future__ import annotations

import json
from typing import Optional

from ..errors import UserError
from .tokenizer import GPT2BPETokenizer, SentencePieceTokenizer, TokenizerJSONTokenizer, load_tokenizer

__all__ = ["hf_tokenizer", "hf_tokenizer_files"]

# Texts every exported tokenizer must encode exactly as tnlg does (with the vocabulary itself).
_PROBES = ("", " ", "  ", "\n", "Hello, world!", " leading space", "   three leading", "trailing  ",
           "multiple   spaces\tand\ttabs", "\n\nnew\nlines\r\nand CRLF\n", "digits 0123456789 3.14159 1,000",
           "accents é à ü ß ñ", "CJK 中文 日本語 한국어", "RTL שלום مرحبا", "emoji 🎭 👩‍👩‍👧 🇫🇷",
           "▁already ▁escaped▁", "<unk> <s> </s> <pad> <|endoftext|> <0x41>", "ＡＢＣ ﬁ ① ½ \u00a0nbsp\u3000ideo",
           "zero\u200bwidth \x00 \x7f controls", "MiXeD CaSe, punctuation!?;: (brackets) [x] {y} \"quotes\" 'q'")


def hf_tokenizer(tok):
    """A ``tokenizers.Tokenizer`` that encodes every text to ``tok.encode(text)``.

    GPT-2 BPE: tnlg's own pipeline. SentencePiece BPE: built from the model file
    (:func:`_sentencepiece_bpe`). The end-of-document and other control tokens are special
    tokens, matched in text only when ``encode_special_tokens`` is off: it is on here (and
    as in tnlg, where the text ``</s>`` or ``<|endoftext|>`` is ordinary characters (an exported
    folder leaves it off: transformers matches them, :func:`hf_tokenizer_files`). Checked on fixed
    probe texts and the whole vocabulary before it is returned.
    """
    if isinstance(tok, TokenizerJSONTokenizer):
        import tokenizers
        return tokenizers.Tokenizer.from_str(tok.tok.to_str())  # itself (special tokens' text ordinary characters)
    if isinstance(tok, GPT2BPETokenizer):
        backend = _gpt2_bpe(tok)
    elif isinstance(tok, SentencePieceTokenizer):
        backend = _sentencepiece_bpe(tok)
    else:
        raise UserError(f"cannot export tokenizer {tok!r} for Hugging Face: only SentencePiece BPE models and "
                        "GPT-2 BPE folders are supported.")
    backend.encode_special_tokens = True
    _check_same_ids(tok, backend)
    return backend


def _gpt2_bpe(tok):
    import tokenizers
    backend = tokenizers.Tokenizer.from_str(tok.tok.to_str())
    backend.add_special_tokens([tokenizers.AddedToken(tok.EOD_TOKEN, special=True, normalized=False)])
    return backend


def _sentencepiece_bpe(tok):
    """SentencePiece's BPE encoder as a ``tokenizers`` pipeline (the model's settings decide each step).

    * **Model**: BPE over the whole normalised text (SentencePiece does not pre-split; pieces
      never cross a ``▁`` because none was learned that does). SentencePiece merges, at each
      step, the adjacent pair whose concatenation is the normal piece of highest score; the
      merge list is every split ``(left, right)`` of a normal piece into two normal pieces,
      ranked by the score of the piece. ``byte_fallback`` turns unknown characters into
      ``<0xXX>`` pieces; without it runs of unknown characters are one ``<unk>`` (``fuse_unk``).
    * **Normaliser**, in SentencePiece's order: the compiled normalisation rule
      (``Precompiled``; none for ``identity``); with ``remove_extra_whitespaces``, leading and
      trailing spaces dropped and runs of spaces cut to one; spaces escaped as ``▁``; the
      dummy prefix ``▁`` before a non-empty text (``add_dummy_prefix``).
    * **User-defined pieces** are added tokens matched on the normalised text, so they are cut
      out whole and never merged, as SentencePiece does. Limitation: added-token contents go
      through the normaliser too, so a text that is exactly one user-defined piece gets no
      dummy prefix (SentencePiece would emit a lone ``▁`` before it).
    * **Control and unknown pieces** (``<s>``, ``</s>``, ``<unk>``) are special tokens.
    * **Decoder**: ``<unk>`` prints SentencePiece's ``unk_surface``, ``▁`` -> space, byte
      pieces -> UTF-8, the dummy prefix's space dropped.

    Unigram/word/char models, ``treat_whitespace_as_suffix`` and unused pieces (which
    SentencePiece merges through and then splits again) have no exact equivalent: refused.
    """
    import tokenizers
    from tokenizers import models

    m = tok.model()
    _check_exportable(m, tok.path)
    vocab = {piece: i for i, (piece, _, _) in enumerate(m.pieces)}
    normal = {piece: (score, i) for i, (piece, score, t) in enumerate(m.pieces) if t == m.NORMAL}
    ranked = sorted((-score, i, k, piece[:k], piece[k:]) for piece, (score, i) in normal.items()
                    for k in range(1, len(piece)) if piece[:k] in normal and piece[k:] in normal)
    unk = next((piece for piece, _, t in m.pieces if t == m.UNKNOWN), None)
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[(a, b) for *_, a, b in ranked], unk_token=unk,
                                              fuse_unk=True, byte_fallback=m.byte_fallback))
    user = sorted((p for p, _, t in m.pieces if t == m.USER_DEFINED), key=len, reverse=True)
    backend.normalizer = _sentencepiece_normalizer(m, user)
    backend.add_special_tokens([tokenizers.AddedToken(p, special=True, normalized=False)
                                for p, _, t in m.pieces if t in (m.UNKNOWN, m.CONTROL)])
    backend.add_tokens([tokenizers.AddedToken(p, special=False, normalized=True) for p in user])
    backend.decoder = _sentencepiece_decoder(m, unk)
    return backend


def _check_exportable(m, path: str) -> None:
    """A clear error for a SentencePiece model without an exact ``tokenizers`` equivalent."""
    why = None
    if m.model_type != "bpe":
        why = f"it is a {m.model_type} model (only BPE models, what `tnlg train-tokenizer` writes, are supported)"
    elif m.treat_whitespace_as_suffix:
        why = "it was trained with treat_whitespace_as_suffix"
    elif any(t == m.UNUSED for _, _, t in m.pieces):
        why = "it has unused pieces"
    if why:
        raise UserError(f"SentencePiece model {path!r} cannot be exported as a Hugging Face tokenizer: {why}. "
                        "Export the weights alone (tnlg convert --no-tokenizer, or to_hf without a tokenizer).")


def _sentencepiece_normalizer(m, user: list):
    """SentencePiece's normalisation steps, in its order (``user``: the user-defined pieces, longest first)."""
    from tokenizers import Regex, normalizers

    space = "▁" if m.escape_whitespaces else " "
    steps: list[normalizers.Normalizer] = []
    if m.precompiled_charsmap:
        steps.append(normalizers.Precompiled(m.precompiled_charsmap))
    if m.remove_extra_whitespaces:
        steps += [normalizers.Replace(Regex(r"\A +| +\z"), ""), normalizers.Replace(Regex(" {2,}"), " ")]
    if m.escape_whitespaces:
        steps.append(normalizers.Replace(" ", "▁"))
    if m.add_dummy_prefix:
        # the prefix goes before the whole non-empty text, not before each stretch between user-defined pieces;
        # the look-ahead keeps the pieces' own contents (normalised by tokenizers to build its matcher) unprefixed
        lone = "(?!(?:" + "|".join(_onig_escape(p) for p in user) + r")\z)" if user else ""
        steps.append(normalizers.Replace(Regex(r"\A" + lone + r"(?=[\s\S])"), space))
    return normalizers.Sequence(steps)


def _sentencepiece_decoder(m, unk):
    """``<unk>`` -> its surface, ``▁`` -> space, byte pieces -> UTF-8, the dummy prefix's space dropped."""
    from tokenizers import decoders

    steps: list = [decoders.Replace(unk, m.unk_surface)] if unk is not None else []
    steps += [decoders.Replace("▁", " ")] if m.escape_whitespaces else []
    steps += [decoders.ByteFallback()] if m.byte_fallback else []
    steps += [decoders.Fuse()] + ([decoders.Strip(" ", 1, 0)] if m.add_dummy_prefix else [])
    return decoders.Sequence(steps)


def _onig_escape(text: str) -> str:
    """``text`` as a literal in a ``tokenizers.Regex`` (Oniguruma syntax)."""
    return "".join("\\" + c if not (c.isalnum() or c == "_" or ord(c) > 127) else c for c in text)


def _check_same_ids(tok, backend) -> None:
    """Refuse a ``backend`` that encodes a probe text or the vocabulary differently from ``tok``."""
    vocab_text = " ".join(tok.decode([i]) for i in range(tok.vocab_size) if i != tok.eod_id)
    for text in (*_PROBES, vocab_text, vocab_text.replace(" ", "")):
        want = list(tok.encode(text))
        got = backend.encode(text, add_special_tokens=False).ids
        if got != want:
            k = next((j for j, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
            raise UserError(f"the Hugging Face tokenizer built from {tok!r} would encode {text[:80]!r} as "
                            f"{got[max(0, k - 2):k + 6]} at token {k} where tnlg gives {want[max(0, k - 2):k + 6]}; "
                            "the export stops rather than write a tokenizer that disagrees with the model's training "
                            "ids. Export the weights alone (tnlg convert --no-tokenizer) and please report this "
                            "tokenizer.")


def hf_tokenizer_files(tok, model_max_length: Optional[int] = None) -> dict[str, bytes]:
    """Name -> contents of the tokenizer files of an exported folder: ``tokenizer.json``
    (:func:`hf_tokenizer`), ``tokenizer_config.json``, ``special_tokens_map.json`` (the
    end-of-document token as ``bos_token`` and ``eos_token``) and the source files
    (``tokenizer.model``, or ``vocab.json`` + ``merges.txt``), so tnlg and SentencePiece
    can load the folder too.

    ``tokenizer_config.json`` holds the chat template tnlg renders ``messages`` rows with for this tokenizer
    (:func:`tnlg.data.chat.chat_template_for`: the folder's own, with its named special tokens and its added
    tokens declared in ``tokenizer.json`` at their ids; else the built-in one as Jinja,
    :data:`~tnlg.data.chat.BUILTIN_JINJA`), and special tokens as transformers expects them: the text of a
    special token (an appended ``eos_token``, a template's ``<|im_start|>``) is that token's single id
    (``split_special_tokens`` false, transformers' default), as TRL appends and counts the end-of-text."""
    tok = load_tokenizer(tok)
    if isinstance(tok, TokenizerJSONTokenizer):
        return _tokenizer_json_files(tok, model_max_length)
    backend = hf_tokenizer(tok)
    eod = backend.id_to_token(tok.eod_id)
    special = {"bos_token": eod, "eos_token": eod}
    if not isinstance(tok, GPT2BPETokenizer):  # GPT-2's byte-level BPE has no unknown token
        m = tok.model()
        unk = [p for p, _, t in m.pieces if t == m.UNKNOWN]
        if unk:
            special["unk_token"] = unk[0]
    template = _chat_template(tok, backend, special)
    config = dict(tokenizer_class="PreTrainedTokenizerFast", **special, add_bos_token=False, add_eos_token=False,
                  clean_up_tokenization_spaces=False, chat_template=template)
    if model_max_length:
        config["model_max_length"] = int(model_max_length)
    files = {"tokenizer.json": backend.to_str(pretty=True).encode("utf-8"),
             "tokenizer_config.json": json.dumps(config, indent=2, ensure_ascii=False).encode("utf-8") + b"\n",
             "special_tokens_map.json": json.dumps(special, indent=2, ensure_ascii=False).encode("utf-8") + b"\n"}
    if isinstance(tok, GPT2BPETokenizer):
        sources = {"vocab.json": tok.vocab_file, "merges.txt": tok.merges_file}
    else:
        sources = {"tokenizer.model": tok.path}
    for name, path in sources.items():
        with open(path, "rb") as f:
            files[name] = f.read()
    return files


def _chat_template(tok, backend, special: dict) -> str:
    """The Jinja chat template of ``tok`` as fine-tuning renders ``messages`` rows with it: a folder's own
    (its named special tokens into ``special``, its added tokens declared special in ``backend`` at the ids the
    template cut them out as, so transformers matches them alike), else the built-in one's Jinja."""
    import tokenizers
    from .chat import BUILTIN_JINJA, chat_template_for
    template = chat_template_for(tok)
    if template.text is None:
        return BUILTIN_JINJA
    for name, text in template.named:
        if text and name in ("bos_token", "eos_token", "unk_token", "pad_token") and \
                backend.token_to_id(text) is not None:  # (one the vocabulary lacks: transformers would add it)
            special[name] = text
    declared = [text for text, i in template.added if backend.token_to_id(text) == i]
    backend.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False) for t in declared])
    return template.text


# the files of a tokenizer.json folder that carry its tokens, special tokens and chat template
_FOLDER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                 "chat_template.jinja")


def _tokenizer_json_files(tok: TokenizerJSONTokenizer, model_max_length: Optional[int]) -> dict[str, bytes]:
    """A ``tokenizer.json`` folder's own files, as they are (its special tokens and chat template kept as
    transformers reads them), with ``model_max_length`` added to ``tokenizer_config.json`` where it has none
    (and ``eos_token`` where the folder names none: the end-of-document token tnlg used)."""
    import os
    folder = os.path.dirname(tok.path)
    files = {}
    for name in _FOLDER_FILES:
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            with open(path, "rb") as f:
                files[name] = f.read()
    config = json.loads(files["tokenizer_config.json"]) if "tokenizer_config.json" in files else {
        "tokenizer_class": "PreTrainedTokenizerFast"}
    if not isinstance(config, dict):
        raise UserError(f"{os.path.join(folder, 'tokenizer_config.json')} holds a JSON {type(config).__name__}, not "
                        "an object; fix or remove the file.")
    config.setdefault("eos_token", tok.eod_token)
    if model_max_length and "model_max_length" not in config:
        config["model_max_length"] = int(model_max_length)
    files["tokenizer_config.json"] = json.dumps(config, indent=2, ensure_ascii=False).encode("utf-8") + b"\n"
    return files
