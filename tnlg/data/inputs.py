"""Reading text inputs: ``.jsonl`` (one document per line), ``.txt`` (one document per file),
``.parquet`` and ``datasets`` folders (one document per row, :mod:`tnlg.data.tables`).

Shared by tokenizer training (:func:`tnlg.data.tokenizer.train_sentencepiece`) and
preprocessing (:mod:`tnlg.data.preprocess`), which both read inputs the same way:
JSON Lines (``.jsonl``/``.json``/``.ndjson``: one object per line, text under
``json_keys``; blank lines are skipped) and plain ``.txt`` files (the whole file is one
document, read as-is); Parquet files and ``datasets.save_to_disk`` folders, the text in the
columns named by ``json_keys``. :func:`check_inputs` validates every input before anything is
written; :func:`iter_documents` yields the documents in order.

A JSON line is parsed by the one rows reader (:mod:`.rows`: its ``FILE:LINE`` error format, its depth bound
and its refusal of lone surrogates). This module imports only the standard library, :mod:`tnlg.errors`,
:mod:`.rows` and :mod:`.tables` (which imports pyarrow when a table is read).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence, Union

from ..errors import UserError
from .rows import JSONL_SUFFIXES, RowFormat, Where, parse_line
from .tables import check_table, is_table_input, iter_table_rows, table_kind

__all__ = ["InputFile", "check_inputs", "iter_documents", "parse_json_line", "read_txt", "input_kind",
           "JSONL_SUFFIXES", "TXT_SUFFIXES", "TABLE_KINDS"]

TXT_SUFFIXES = (".txt",)
TABLE_KINDS = ("parquet", "arrow")  # columnar inputs (tnlg.data.tables): one document per row


@dataclass
class InputFile:
    """One checked input: its path, its kind and how many documents it holds."""

    path: str
    kind: str  # "jsonl", "txt", "parquet" or "arrow" (a datasets folder)
    documents: int


def input_kind(path: str) -> str:
    """``"jsonl"``, ``"txt"``, ``"parquet"`` by extension, or ``"arrow"`` for a ``datasets`` folder;
    anything else is a :class:`UserError`."""
    low = path.lower()
    if low.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if low.endswith(TXT_SUFFIXES):
        return "txt"
    if is_table_input(path):
        return table_kind(path)
    raise UserError(f"input {path!r} has an unknown extension; use JSON Lines ({', '.join(JSONL_SUFFIXES)}: "
                    "one JSON object per line), plain text (.txt: the whole file is one document), Parquet "
                    "(.parquet: one document per row) or a folder written by `datasets` save_to_disk.")


@functools.lru_cache(maxsize=16)
def _document_format(json_keys: tuple) -> RowFormat:
    """What a document line holds, for the messages of :mod:`.rows` (made once per key list)."""
    return RowFormat("input", f"a line is one JSON object such as {{\"{json_keys[0]}\": \"document text\"}} (the text "
                              "under --json-keys)", "Nothing was written.")


def parse_json_line(raw: bytes, path: str, lineno: int, json_keys: Sequence[str]) -> list[str]:
    """The strings under ``json_keys`` of one JSON line, or a :class:`UserError` naming ``path:lineno``
    (:func:`tnlg.data.rows.parse_line`: malformed JSON, deep nesting and lone surrogates refused)."""
    fmt = _document_format(tuple(json_keys))
    where = Where(path, line=lineno)
    obj = parse_line(raw, where, fmt)
    if not isinstance(obj, dict):
        raise fmt.error(where, f"expected a JSON object with key(s) {list(json_keys)}, got {type(obj).__name__}")
    out = []
    for key in json_keys:
        if key not in obj:
            raise fmt.error(where, f"no key {key!r} in this JSON object (its keys: {sorted(obj)[:10]}); pick the "
                                   "text field with --json-keys")
        value = obj[key]
        if not isinstance(value, str):
            raise fmt.error(where, f"the value of {key!r} is a {type(value).__name__}, not a string")
        out.append(value)
    return out


def check_inputs(inputs: Sequence[Union[str, Path]], json_keys: Sequence[str] = ("text",)) -> list[InputFile]:
    """Validate every input and count its documents; raise :class:`UserError` on the first problem.

    Parses every JSON line (so a malformed line is reported with its file and line
    number before any output exists).
    """
    if isinstance(inputs, (str, Path)):
        inputs = [inputs]
    if not inputs:
        raise UserError("no input files given; pass --input FILE... (.jsonl or .txt).")
    json_keys = list(json_keys)
    if not json_keys:
        raise UserError("--json-keys is empty; give at least one key such as 'text'.")
    infos = []
    for p in inputs:
        path = os.fspath(p)
        kind = input_kind(path)
        if kind == "arrow":  # a folder (input_kind checked it is a datasets one)
            infos.append(InputFile(path, kind, check_table(path, json_keys)))
            continue
        if not os.path.isfile(path):
            raise UserError(f"input {path!r} does not exist or is not a file.")
        if kind == "parquet":
            infos.append(InputFile(path, kind, check_table(path, json_keys)))
            continue
        if kind == "txt":
            if len(json_keys) != 1:
                raise UserError(f"text input {path!r} holds one document, but --json-keys names {len(json_keys)} "
                                "keys; use .txt inputs with a single key.")
            if os.path.getsize(path) == 0:
                raise UserError(f"input {path!r} has no documents: the file is empty (a .txt file is one "
                                "document). Remove it from --input.")
            infos.append(InputFile(path, kind, 1))
            continue
        n = 0
        with open(path, "rb") as f:
            for lineno, raw in enumerate(f, 1):
                if not raw.strip():
                    continue
                parse_json_line(raw, path, lineno, json_keys)
                n += 1
        if n == 0:
            raise UserError(f"input {path!r} has no documents: it has no non-blank JSON lines. "
                            "Remove it from --input.")
        infos.append(InputFile(path, kind, n))
    return infos


def read_txt(path: str) -> str:
    """A ``.txt`` input as one document, byte-exact (no newline translation); must be UTF-8."""
    try:
        with open(path, encoding="utf-8", newline="") as f:
            return f.read()
    except UnicodeDecodeError as err:
        raise UserError(f"{path!r} is not UTF-8 text (byte {err.start}: {err.reason}); convert it to UTF-8 "
                        "first.") from None


def iter_documents(inputs: Sequence[Union[str, Path]], json_keys: Sequence[str] = ("text",)
                   ) -> Iterator[tuple[str, int, str]]:
    """Yield ``(path, line_number, text)`` for every document and key, in input order
    (``line_number`` is 0 for ``.txt`` files). Does not validate; see :func:`check_inputs`."""
    if isinstance(inputs, (str, Path)):
        inputs = [inputs]
    for p in inputs:
        path = os.fspath(p)
        kind = input_kind(path)
        if kind == "txt":
            yield path, 0, read_txt(path)
            continue
        if kind in TABLE_KINDS:
            for first, columns in iter_table_rows(path, json_keys):
                for i, texts in enumerate(zip(*columns)):
                    for text in texts:
                        yield path, first + i, text
            continue
        with open(path, "rb") as f:
            for lineno, raw in enumerate(f, 1):
                if raw.strip():
                    for text in parse_json_line(raw, path, lineno, json_keys):
                        yield path, lineno, text
