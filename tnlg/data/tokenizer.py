"""Tokenizers behind one small interface: ``encode``, ``decode``, ``vocab_size``, ``eod_id``.

Three kinds, all local files only (nothing is ever downloaded):

* :class:`SentencePieceTokenizer` - a SentencePiece ``.model`` file. The end-of-document
  token is the model's ``eos`` piece (id 2 with SentencePiece's defaults), as in
  Megatron's ``SentencePieceTokenizer``.
* :class:`GPT2BPETokenizer` - GPT-2's byte-level BPE (the vocabulary of GPT-2, Megatron
  and T-NLG) from local ``vocab.json`` + ``merges.txt``, through the optional
  ``tokenizers`` library (``pip install 'tnlg[gpt2bpe]'``). The end-of-document token
  is ``<|endoftext|>``.
* :class:`TokenizerJSONTokenizer` - a Hugging Face ``tokenizer.json`` (a folder that has no
  ``vocab.json`` + ``merges.txt`` nor a ``.model`` file), read with ``tokenizers``, as
  transformers' fast tokenizers read it; the end-of-document token is the folder's ``eos_token``.

:func:`load_tokenizer` accepts a path or the :meth:`Tokenizer.describe` dict that a
checkpoint stores, so a run can reload exactly the tokenizer it trained with.
:func:`read_sentencepiece_model` reads what a ``.model`` file holds (pieces, scores, types,
normaliser settings) without protobuf, for the Hugging Face export (:mod:`tnlg.interop.hf`).
:func:`train_sentencepiece` trains a BPE model whose defaults round-trip text
exactly: identity normalisation, no whitespace collapsing, byte fallback.
"""

from __future__ import annotations

import io
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional, Sequence, Union

from ..errors import UserError
from ..io import atomic_write, file_sha256
from .inputs import check_inputs, iter_documents
from .paths import TOKENIZER_MODEL

__all__ = [
    "Tokenizer", "SentencePieceTokenizer", "GPT2BPETokenizer", "TokenizerJSONTokenizer", "load_tokenizer",
    "folder_tokenizers", "train_sentencepiece", "ROUND_TRIP_TRAINER_OPTIONS", "builtin_tokenizer_path", "space_piece_share",
    "SentencePieceModel", "read_sentencepiece_model",
]

# SentencePiece trainer options that make decode(encode(text)) == text for any text:
# no NFKC folding, no collapsing of runs of spaces, unknown characters as UTF-8 bytes.
ROUND_TRIP_TRAINER_OPTIONS: dict[str, Any] = {
    "model_type": "bpe",
    "normalization_rule_name": "identity",
    "remove_extra_whitespaces": False,
    "byte_fallback": True,
}


def builtin_tokenizer_path() -> str:
    """Path of the SentencePiece model shipped with the built-in corpus."""
    return str(TOKENIZER_MODEL)


class Tokenizer:
    """Interface every tokenizer provides.

    ``encode(text) -> list[int]``, ``decode(ids) -> str``, ``vocab_size`` (ids are in
    ``[0, vocab_size)``), ``eod_id`` (appended after each document by preprocessing),
    and ``describe()`` -> a JSON-able dict that :func:`load_tokenizer` turns back into
    the same tokenizer (``spec`` is the same dict). Subclasses set ``_vocab`` and ``_eod``
    (or override the two properties).
    """

    kind = "abstract"
    _vocab: int
    _eod: int

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Encode several texts (one Python call; subclasses may batch)."""
        return [self.encode(t) for t in texts]

    def encode_with_offsets(self, texts: Sequence[str], continued: bool = False
                            ) -> list[tuple[list[int], list[tuple[int, int]]]]:
        """Each text's ids and each id's character span ``[start, end)`` in the text (for a chat template's
        rendering: which tokens a counted span covers). ``continued``: the texts continue a text before them,
        so no leading-space prefix is written where the tokenizer writes one (SentencePiece's dummy ``▁``)."""
        raise NotImplementedError(f"{type(self).__name__} gives no character offsets")

    def decode(self, ids: Iterable[int]) -> str:
        raise NotImplementedError

    def piece_id(self, text: str) -> Optional[int]:
        """The id of the vocabulary entry whose text is exactly ``text`` (``None``: no such entry)."""
        return None

    @property
    def vocab_size(self) -> int:
        return self._vocab

    @property
    def eod_id(self) -> int:
        return self._eod

    def describe(self) -> dict:
        raise NotImplementedError

    @property
    def spec(self) -> dict:
        return self.describe()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self.vocab_size}, eod_id={self.eod_id})"


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece model file (any model type). ``eod_id`` is the ``eos`` id."""

    kind = "sentencepiece"

    def __init__(self, model_path: Union[str, Path]):
        import sentencepiece as spm

        path = Path(model_path)
        if not path.is_file():
            raise UserError(f"SentencePiece model {str(path)!r} does not exist or is not a file; "
                            "pass the .model file written by `tnlg train-tokenizer` or spm_train.")
        self.path = str(path.resolve())
        try:
            self.sp = spm.SentencePieceProcessor(model_file=self.path)
        except (OSError, RuntimeError) as err:
            raise UserError(f"{self.path!r} is not a SentencePiece model ({err}).") from None
        eos = self.sp.eos_id()
        if eos < 0:
            raise UserError(f"SentencePiece model {self.path!r} has no end-of-sentence piece "
                            "(trained with eos_id=-1); preprocessing and the GPT dataset need one "
                            "as the end-of-document token. Retrain with the default eos_id=2.")
        self._eod = int(eos)
        self._vocab = int(self.sp.get_piece_size())
        self._sha: Optional[str] = None
        self._sp_continued: Any = None

    def encode(self, text: str) -> list[int]:
        return self.sp.encode(text)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self.sp.encode(list(texts), num_threads=1)

    def decode(self, ids: Iterable[int]) -> str:
        return self.sp.decode([int(i) for i in ids])

    def encode_with_offsets(self, texts: Sequence[str], continued: bool = False
                            ) -> list[tuple[list[int], list[tuple[int, int]]]]:
        """From SentencePiece's ``SentencePieceText`` (serialized; read without protobuf: pieces = 2, each
        id = 2, begin = 4, end = 5, byte offsets into the text). ``continued``: the same model with
        ``normalizer_spec.add_dummy_prefix`` false."""
        sp = self.sp
        if continued:
            if self._sp_continued is None:
                import sentencepiece as spm
                # a second ModelProto field 3 (normalizer_spec) holding only add_dummy_prefix (its field 3) = 0
                # merges into the first, as protobuf parsing does with a repeated message field
                proto = self.sp.serialized_model_proto() + b"\x1a\x02\x18\x00"
                self._sp_continued = spm.SentencePieceProcessor(model_proto=proto)
            sp = self._sp_continued
        out = []
        for text, raw in zip(texts, sp.encode(list(texts), return_type="serialized_proto", num_threads=1)):
            chars = _char_at_byte(text)
            ids, spans = [], []
            for number, value in _proto_fields(raw):
                if number == 2:
                    piece = dict(_proto_fields(value))
                    ids.append(int(piece.get(2, 0)))
                    spans.append((chars[int(piece.get(4, 0))], chars[int(piece.get(5, 0))]))
            out.append((ids, spans))
        return out

    def piece_id(self, text: str) -> Optional[int]:
        i = int(self.sp.piece_to_id(text))
        return i if self.sp.id_to_piece(i) == text else None

    def model(self) -> "SentencePieceModel":
        """The pieces and settings of the loaded model (see :func:`read_sentencepiece_model`)."""
        return read_sentencepiece_model(self.sp.serialized_model_proto())

    def describe(self) -> dict:
        if self._sha is None:
            self._sha = file_sha256(self.path)
        spec = {"kind": self.kind, "path": self.path, "sha256": self._sha,
                "vocab_size": self._vocab, "eod_id": self._eod}
        if self.path == str(Path(builtin_tokenizer_path()).resolve()):
            spec["builtin"] = True  # reloads from the installed package wherever it lives
        return spec


def _import_tokenizers():
    try:
        import tokenizers  # noqa: F401
    except ImportError:
        raise UserError("the GPT-2 BPE tokenizer needs the optional `tokenizers` package, which is "
                        "not installed: `pip install 'tnlg[gpt2bpe]'` (or `pip install tokenizers`). "
                        "SentencePiece .model files work without it.") from None
    return tokenizers


class _TokenizersBacked(Tokenizer):
    """What the kinds read by the ``tokenizers`` library share: ``self.tok`` (a ``tokenizers.Tokenizer``)
    encodes without special tokens added, decodes keeping them, and looks a piece up."""

    tok: Any

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def piece_id(self, text: str) -> Optional[int]:
        i = self.tok.token_to_id(text)
        return None if i is None else int(i)


class GPT2BPETokenizer(_TokenizersBacked):
    """GPT-2 byte-level BPE from local ``vocab.json`` and ``merges.txt``.

    Exactly GPT-2's scheme (its pre-tokenisation regex, byte-to-unicode table, no
    prefix space), so ``decode(encode(t)) == t`` for every string. ``<|endoftext|>``
    is the end-of-document id (50256 in GPT-2's vocabulary); as in GPT-2 and
    Megatron, that text inside a document is encoded as ordinary characters.
    """

    kind = "gpt2bpe"
    EOD_TOKEN = "<|endoftext|>"

    def __init__(self, vocab_file: Union[str, Path], merges_file: Union[str, Path]):
        tokenizers = _import_tokenizers()
        from tokenizers import decoders, models, pre_tokenizers

        for name, p in (("vocab_file", vocab_file), ("merges_file", merges_file)):
            if not Path(p).is_file():
                raise UserError(f"GPT-2 BPE {name} {str(p)!r} does not exist; pass local copies of "
                                "GPT-2's vocab.json and merges.txt (they are never downloaded).")
        self.vocab_file = str(Path(vocab_file).resolve())
        self.merges_file = str(Path(merges_file).resolve())
        try:
            with open(self.vocab_file, encoding="utf-8") as f:
                vocab = json.load(f)
            model = models.BPE.from_file(self.vocab_file, self.merges_file)
        except Exception as err:  # noqa: BLE001 - malformed user files
            raise UserError(f"could not read GPT-2 BPE files {self.vocab_file!r} / {self.merges_file!r}: "
                            f"{err}") from None
        if self.EOD_TOKEN not in vocab:
            raise UserError(f"vocab file {self.vocab_file!r} has no {self.EOD_TOKEN!r} entry, the GPT-2 "
                            "end-of-document token; use GPT-2's vocab.json.")
        tok = tokenizers.Tokenizer(model)
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tok.decoder = decoders.ByteLevel()
        self.tok = tok
        self._vocab = len(vocab)
        self._eod = int(vocab[self.EOD_TOKEN])
        self._sha: Optional[list[str]] = None

    def encode_with_offsets(self, texts: Sequence[str], continued: bool = False
                            ) -> list[tuple[list[int], list[tuple[int, int]]]]:
        return [(e.ids, list(e.offsets)) for e in self.tok.encode_batch(list(texts), add_special_tokens=False)]

    def describe(self) -> dict:
        if self._sha is None:
            self._sha = [file_sha256(self.vocab_file), file_sha256(self.merges_file)]
        return {"kind": self.kind, "vocab_file": self.vocab_file, "merges_file": self.merges_file,
                "sha256": self._sha, "vocab_size": self._vocab, "eod_id": self._eod}


class TokenizerJSONTokenizer(_TokenizersBacked):
    """A Hugging Face ``tokenizer.json`` (what transformers' fast tokenizers read: Llama 3, Mistral's newer
    folders, SmolLM, a SentencePiece model converted by transformers), read with the ``tokenizers`` library.

    Texts are encoded without the post-processor's additions (no BOS), and the text of a *special* added token
    inside a document is ordinary characters, as with the other kinds (``encode_special_tokens``); a chat
    template's rendering has its special tokens cut out first (:mod:`tnlg.data.chat`). The end-of-document id
    is the folder's ``eos_token`` (:mod:`tnlg.data.special_tokens`: ``tokenizer_config.json``,
    ``special_tokens_map.json``), else ``<|endoftext|>`` or ``</s>`` where the vocabulary has it. The
    fingerprint covers ``tokenizer.json`` and, where present, ``tokenizer_config.json`` (which names the eos).
    """

    kind = "tokenizer-json"

    def __init__(self, path: Union[str, Path]):
        tokenizers = _import_tokenizers()
        p = Path(path)
        if not p.is_file():
            raise UserError(f"tokenizer file {str(p)!r} does not exist; pass a Hugging Face folder's tokenizer.json "
                            "or the folder.")
        self.path = str(p.resolve())
        try:
            self.tok = tokenizers.Tokenizer.from_file(self.path)
        except Exception as err:  # noqa: BLE001 - a malformed user file
            raise UserError(f"{self.path!r} is not a tokenizer.json the `tokenizers` library can read "
                            f"({str(err)[:200]}).") from None
        self.tok.encode_special_tokens = True
        self._vocab = int(self.tok.get_vocab_size(with_added_tokens=True))
        folder = os.path.dirname(self.path)
        from .special_tokens import folder_tokens
        eos = folder_tokens(folder, self, class_defaults=False).get("eos_token")
        candidates = [t for t in (eos, "<|endoftext|>", "</s>") if t and self.piece_id(t) is not None]
        if not candidates:
            raise UserError(f"tokenizer {self.path!r} has no end-of-document token: its folder names no eos_token "
                            "(tokenizer_config.json or special_tokens_map.json) that its vocabulary holds, and it "
                            "has neither <|endoftext|> nor </s>. Add the eos_token to tokenizer_config.json.")
        self.eod_token = candidates[0]
        self._eod = int(self.piece_id(self.eod_token))  # type: ignore[arg-type]
        config = os.path.join(folder, "tokenizer_config.json")
        self._files = [self.path] + ([config] if os.path.isfile(config) else [])
        self._sha: Optional[list[str]] = None
        self._continued: Any = None

    def encode_with_offsets(self, texts: Sequence[str], continued: bool = False
                            ) -> list[tuple[list[int], list[tuple[int, int]]]]:
        """``continued``: a copy of the pipeline with its ``Metaspace`` prefix off and ``Prepend`` steps dropped."""
        tok = self.tok
        if continued:
            if self._continued is None:
                import tokenizers
                spec = json.loads(self.tok.to_str())
                spec["pre_tokenizer"] = _without_prefix(spec.get("pre_tokenizer"))
                spec["normalizer"] = _without_prefix(spec.get("normalizer"))
                self._continued = tokenizers.Tokenizer.from_str(json.dumps(spec))
                self._continued.encode_special_tokens = True
            tok = self._continued
        return [(e.ids, list(e.offsets)) for e in tok.encode_batch(list(texts), add_special_tokens=False)]

    def describe(self) -> dict:
        if self._sha is None:
            self._sha = [file_sha256(f) for f in self._files]
        return {"kind": self.kind, "path": self.path, "sha256": self._sha, "vocab_size": self._vocab,
                "eod_id": self._eod}


def _char_at_byte(text: str) -> list[int]:
    """For each UTF-8 byte offset of ``text`` (and its end), the index of the character it falls in."""
    out = []
    for i, ch in enumerate(text):
        out += [i] * len(ch.encode("utf-8", "surrogatepass"))
    return out + [len(text)]


def _without_prefix(part):
    """A tokenizer.json normaliser or pre-tokenizer that writes no leading ``▁``: a ``Metaspace``'s
    ``prepend_scheme`` ``never``, a ``Prepend`` step dropped."""
    if not isinstance(part, dict):
        return part
    if part.get("type") == "Metaspace":
        return {**part, "prepend_scheme": "never"}
    if part.get("type") == "Prepend":
        return None
    for key in ("normalizers", "pretokenizers"):
        if part.get("type") == "Sequence" and isinstance(part.get(key), list):
            steps = [s for s in (_without_prefix(p) for p in part[key]) if s is not None]
            return {**part, key: steps}
    return part


_SPEC_HELP = ("a SentencePiece .model file, a Hugging Face tokenizer.json, a directory holding vocab.json + "
              "merges.txt (GPT-2 BPE), one .model file or a tokenizer.json, the word 'builtin' (the model shipped with the built-in corpus), "
              "or a dict from Tokenizer.describe()")


def load_tokenizer(path_or_spec: Union[str, os.PathLike, Mapping, Tokenizer],
                   check_sha256: bool = True) -> Tokenizer:
    """Load a tokenizer from a path or a :meth:`Tokenizer.describe` dict.

    Accepts: a ``.model`` file; a ``tokenizer.json``; a directory with ``vocab.json`` +
    ``merges.txt`` (else a single ``.model``, else a ``tokenizer.json``); a ``vocab.json`` path
    with ``merges.txt`` beside it; ``"builtin"``; a spec dict (``{"kind": "sentencepiece",
    "path": ...}``, ``{"kind": "gpt2bpe", "vocab_file": ..., "merges_file": ...}`` or
    ``{"kind": "tokenizer-json", "path": ...}``). With a spec that records ``sha256``
    and ``check_sha256``, files whose contents changed are refused.
    """
    if isinstance(path_or_spec, Tokenizer):
        return path_or_spec
    if isinstance(path_or_spec, Mapping):
        return _from_spec(dict(path_or_spec), check_sha256)
    if not isinstance(path_or_spec, (str, os.PathLike)):
        raise UserError(f"cannot load a tokenizer from {path_or_spec!r}; pass {_SPEC_HELP}.")
    text = os.fspath(path_or_spec)
    if text == "builtin":
        return SentencePieceTokenizer(builtin_tokenizer_path())
    p = Path(text).expanduser()
    if p.is_dir():
        form = _folder_form(p)
        if form is not None:
            kind, files = form
            return kind(*files)
        models = sorted(p.glob("*.model"))
        raise UserError(f"tokenizer directory {text!r} holds neither vocab.json + merges.txt, nor exactly "
                        f"one .model file (found {[m.name for m in models]}), nor a tokenizer.json; pass {_SPEC_HELP}.")
    if p.name == "tokenizer.json" and p.is_file():
        return TokenizerJSONTokenizer(p)
    if p.name.endswith(".json") and p.is_file():
        merges = p.with_name("merges.txt")
        return GPT2BPETokenizer(p, merges)
    if not p.exists():
        raise UserError(f"tokenizer {text!r} does not exist; pass {_SPEC_HELP}.")
    return SentencePieceTokenizer(p)


def _folder_form(p: Path) -> Optional[tuple[Callable[..., Tokenizer], tuple]]:
    """The tokenizer :func:`load_tokenizer` reads from folder ``p`` and its files: GPT-2's ``vocab.json`` +
    ``merges.txt``, else exactly one ``.model`` file, else (no ``.model``) a ``tokenizer.json``; ``None``."""
    if (p / "vocab.json").is_file() and (p / "merges.txt").is_file():
        return GPT2BPETokenizer, (p / "vocab.json", p / "merges.txt")
    models = sorted(p.glob("*.model"))
    if len(models) == 1:
        return SentencePieceTokenizer, (models[0],)
    if not models and (p / "tokenizer.json").is_file():
        return TokenizerJSONTokenizer, (p / "tokenizer.json",)
    return None


def holds_tokenizer(folder: Union[str, os.PathLike]) -> bool:
    """Whether :func:`load_tokenizer` of ``folder`` finds a tokenizer's files there (a model folder's own)."""
    p = Path(folder).expanduser()
    return p.is_dir() and _folder_form(p) is not None


def folder_tokenizers(folder: Union[str, os.PathLike]) -> list[Tokenizer]:
    """Every tokenizer a model folder ships that tnlg reads, in each form it is published in: GPT-2's
    ``vocab.json`` + ``merges.txt``, each ``.model`` file, a ``tokenizer.json`` (a GPT-2 folder holds both
    forms of one tokenizer). A form that does not load is left out; a folder with none gives ``[]``."""
    p = Path(folder).expanduser()
    if not p.is_dir():
        return []
    forms: list[tuple[Callable[..., Tokenizer], tuple]] = []
    if (p / "vocab.json").is_file() and (p / "merges.txt").is_file():
        forms.append((GPT2BPETokenizer, (p / "vocab.json", p / "merges.txt")))
    forms += [(SentencePieceTokenizer, (m,)) for m in sorted(p.glob("*.model"))]
    if (p / "tokenizer.json").is_file():
        forms.append((TokenizerJSONTokenizer, (p / "tokenizer.json",)))
    found = []
    for kind, files in forms:
        try:
            found.append(kind(*files))
        except UserError:
            continue
    return found


def _from_spec(spec: dict, check_sha256: bool) -> Tokenizer:
    kind = spec.get("kind")
    if kind == "sentencepiece":
        path = spec["path"]
        if spec.get("builtin") and not Path(path).is_file():
            path = builtin_tokenizer_path()
        tok: Tokenizer = SentencePieceTokenizer(path)
    elif kind == "gpt2bpe":
        tok = GPT2BPETokenizer(spec["vocab_file"], spec["merges_file"])
    elif kind == TokenizerJSONTokenizer.kind:
        tok = TokenizerJSONTokenizer(spec["path"])
    else:
        raise UserError(f"unknown tokenizer kind {kind!r} in spec {spec!r}; valid kinds are "
                        f"'sentencepiece', 'gpt2bpe' and '{TokenizerJSONTokenizer.kind}'.")
    want = spec.get("sha256")
    if check_sha256 and want is not None:
        have = tok.describe()["sha256"]
        if have != want:
            raise UserError(f"tokenizer files of spec {spec!r} changed since the spec was recorded "
                            f"(sha256 {have} != {want}); the token ids would not match the "
                            "checkpoint. Restore the original files or pass check_sha256=False.")
    return tok


# --------------------------------------------------------------------------- model file

@dataclass(frozen=True)
class SentencePieceModel:
    """What a SentencePiece ``.model`` file (a serialized ``sentencepiece.ModelProto``) says
    about encoding: every piece with its score and type, and the normaliser settings.

    Piece types (``sentencepiece_model.proto``): 1 normal, 2 unknown, 3 control (``<s>``,
    ``</s>``: never produced from text), 4 user-defined (always cut out of the text whole),
    5 unused, 6 byte (``<0x41>``: byte fallback).
    """

    NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

    pieces: tuple[tuple[str, float, int], ...]  # (piece, score, type), indexed by id
    model_type: str  # "unigram", "bpe", "word" or "char"
    byte_fallback: bool
    unk_surface: str  # what decoding an unknown piece prints
    precompiled_charsmap: bytes  # the normalisation rule, compiled (empty for "identity")
    add_dummy_prefix: bool
    remove_extra_whitespaces: bool
    escape_whitespaces: bool
    treat_whitespace_as_suffix: bool


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        b = buf[i]
        i += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, i
        shift += 7


def _proto_fields(buf: bytes) -> Iterator[tuple[int, Any]]:
    """``(field number, value)`` of a serialized protobuf message: ints for varints, bytes
    for length-delimited fields and for fixed 32/64-bit ones (protobuf wire format)."""
    i = 0
    while i < len(buf):
        key, i = _varint(buf, i)
        number, wire = key >> 3, key & 7
        value: Union[int, bytes]
        if wire == 0:
            value, i = _varint(buf, i)
        elif wire == 2:
            n, i = _varint(buf, i)
            value, i = buf[i:i + n], i + n
        elif wire in (1, 5):
            n = 8 if wire == 1 else 4
            value, i = buf[i:i + n], i + n
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
        if i > len(buf):
            raise ValueError("truncated protobuf message")
        yield number, value


def read_sentencepiece_model(model: Union[str, Path, bytes]) -> SentencePieceModel:
    """Read a SentencePiece model file (or its bytes) without the protobuf package.

    Field numbers and defaults are those of ``sentencepiece_model.proto``: ``ModelProto``
    pieces = 1 (piece 1, score 2, type 3), trainer_spec = 2 (model_type 3, byte_fallback
    35, treat_whitespace_as_suffix 24, unk_surface 44), normalizer_spec = 3
    (precompiled_charsmap 2, add_dummy_prefix 3, remove_extra_whitespaces 4,
    escape_whitespaces 5).
    """
    data = model if isinstance(model, bytes) else Path(model).read_bytes()
    pieces: list[tuple[str, float, int]] = []
    trainer: dict[int, Any] = {}
    norm: dict[int, Any] = {}
    try:
        for number, value in _proto_fields(data):
            if number == 1:
                p = dict(_proto_fields(value))
                score = struct.unpack("<f", p[2])[0] if 2 in p else 0.0
                pieces.append((p.get(1, b"").decode("utf-8"), score, int(p.get(3, SentencePieceModel.NORMAL))))
            elif number == 2:
                trainer.update(_proto_fields(value))
            elif number == 3:
                norm.update(_proto_fields(value))
    except (ValueError, IndexError, UnicodeDecodeError, struct.error) as err:
        where = "the model bytes" if isinstance(model, bytes) else repr(str(model))
        raise UserError(f"{where} is not a readable SentencePiece model ({err}).") from None
    return SentencePieceModel(
        pieces=tuple(pieces),
        model_type={1: "unigram", 2: "bpe", 3: "word", 4: "char"}.get(trainer.get(3, 1), str(trainer.get(3))),
        byte_fallback=bool(trainer.get(35, 0)), unk_surface=trainer.get(44, " \u2047 ".encode()).decode("utf-8"),
        precompiled_charsmap=bytes(norm.get(2, b"")), add_dummy_prefix=bool(norm.get(3, 1)),
        remove_extra_whitespaces=bool(norm.get(4, 1)), escape_whitespaces=bool(norm.get(5, 1)),
        treat_whitespace_as_suffix=bool(trainer.get(24, 0)))


# --------------------------------------------------------------------------- training

def _iter_training_lines(inputs: Sequence[Union[str, Path]], json_keys: Sequence[str]) -> Iterator[str]:
    """Lines of every document: SentencePiece trains on sentences, and newlines are
    never inside a piece (they encode through byte fallback)."""
    for _, _, text in iter_documents(inputs, json_keys):
        for line in text.split("\n"):
            if line:
                yield line


def train_sentencepiece(inputs: Sequence[Union[str, Path]], vocab_size: int, output_prefix: Union[str, Path],
                        json_keys: Sequence[str] = ("text",), num_threads: int = 1,
                        **options: Any) -> str:
    """Train a SentencePiece model on ``inputs`` and write ``output_prefix + ".model"``/``".vocab"``.

    Inputs are read like :mod:`tnlg.data.preprocess` reads them (:mod:`tnlg.data.inputs`: ``.txt`` = one
    document, ``.jsonl`` = one document per line under ``json_keys``). Defaults are
    :data:`ROUND_TRIP_TRAINER_OPTIONS` (BPE, identity normalisation, spaces kept,
    byte fallback); ``options`` override or add SentencePiece trainer options.
    Both files are written under temporary names and renamed at the end.
    Returns the ``.model`` path.
    """
    import sentencepiece as spm

    if not isinstance(vocab_size, int) or vocab_size < 260:
        raise UserError(f"--vocab-size must be an integer >= 260 (256 byte-fallback pieces + specials), "
                        f"got {vocab_size!r}.")
    check_inputs(inputs, json_keys)
    out = Path(output_prefix)
    if out.parent and not out.parent.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
    trainer = dict(ROUND_TRIP_TRAINER_OPTIONS)
    trainer.update(vocab_size=vocab_size, num_threads=num_threads)
    trainer.update(options)
    buf = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(sentence_iterator=_iter_training_lines(inputs, json_keys),
                                       model_writer=buf, **trainer)
    except RuntimeError as err:
        raise UserError(f"SentencePiece training failed: {err}. A vocabulary larger than the text "
                        "supports is the usual cause; try a smaller --vocab-size.") from None
    model_bytes = buf.getvalue()
    sp = spm.SentencePieceProcessor(model_proto=model_bytes)
    vocab_lines = "".join(f"{sp.id_to_piece(i)}\t{sp.get_score(i)}\n" for i in range(sp.get_piece_size()))
    model_path = str(out) + ".model"
    atomic_write(model_path, model_bytes, durable=False)
    atomic_write(str(out) + ".vocab", vocab_lines.encode("utf-8"), durable=False)
    return model_path


def space_piece_share(model_path: Union[str, Path], inputs: Sequence[Union[str, Path]],
                      json_keys: Sequence[str] = ("text",), max_chars: int = 1_000_000) -> float:
    """The share of a SentencePiece model's tokens that are the single-space piece ``▁``, on the first
    ``max_chars`` characters of ``inputs``' training lines. Indented code under the default trainer options
    (no whitespace-only pieces beyond one space) spends a large share of its tokens on it: 40.8% on a corpus
    of the standard library's Python files (docs/data.md)."""
    import sentencepiece as spm
    sp = spm.SentencePieceProcessor(model_file=str(model_path))
    space, total, seen = sp.piece_to_id("\u2581"), 0, 0
    if sp.id_to_piece(space) != "\u2581":
        return 0.0
    count = 0
    for line in _iter_training_lines(inputs, json_keys):
        ids = sp.encode(line)
        count += sum(1 for i in ids if i == space)
        total += len(ids)
        seen += len(line)
        if seen >= max_chars:
            break
    return count / total if total else 0.0
