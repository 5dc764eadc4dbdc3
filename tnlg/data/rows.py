"""Rows: one reader of JSON Lines files, Parquet files and ``datasets`` folders, for every command that reads
records (pretraining documents, fine-tuning rows, ``tnlg eval --task generate`` rows, LAMBADA texts).

**Kinds.** A ``.parquet`` file or a folder (``datasets.save_to_disk``) is a table (:mod:`.tables`, pyarrow);
anything else is JSON Lines: one JSON value per line, blank lines skipped, each line parsed from its bytes
(UTF-8, or UTF-16/32 as :func:`json.loads` detects them; only ``\\n`` ends a line).

**Where.** A row is named ``FILE:LINE`` in a JSON Lines file (lines counted from 1, as editors count them)
and ``FILE:row N`` in a table (rows counted from 0 in the table's order across row groups and Arrow files,
as ``datasets`` indexes them: ``Dataset.load_from_disk(FILE)[N]``).

**One error format**: ``WHERE: what is wrong; what a valid row holds.``, then the consumer's sentence (e.g.
``Nothing was written.``): a consumer declares what its valid row holds once (:class:`RowFormat`) and raises
through :meth:`RowFormat.error`; this module raises in the same format for what every consumer refuses.

**Safety, for every consumer.** A JSON line is parsed without a traceback whatever it holds: malformed JSON
and nesting deeper than :data:`MAX_DEPTH` containers (Python's parser would overflow its stack on deep
nesting) are refused with their line; so is any string (a key or a value, anywhere in the row) that cannot
be encoded as UTF-8, i.e. half of a UTF-16 surrogate pair (``"\\ud800"`` alone: valid JSON, no character;
SentencePiece raises on it, a file cannot be written with it). A table's rows are Arrow values validated by
pyarrow in full (UTF-8 included) before they are read. The standard library, :mod:`tnlg.errors` and
:mod:`.tables` (pyarrow, for tables only).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Iterator, NamedTuple, Optional, Sequence

from ..errors import UserError
from .tables import is_table_input, iter_table_rows, table_columns, table_kind

__all__ = ["Where", "RowFormat", "JSONL_SUFFIXES", "MAX_DEPTH", "rows_kind", "parse_line", "check_row",
           "iter_rows"]

JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
MAX_DEPTH = 100  # containers inside containers: a conversation row is 3 deep, tool calls a few more


class Where(NamedTuple):
    """Where a row is: a JSON Lines line (counted from 1) or a table's row (counted from 0)."""

    path: str
    line: Optional[int] = None
    row: Optional[int] = None

    def __str__(self) -> str:
        return f"{self.path}:{self.line}" if self.row is None else f"{self.path}:row {self.row}"


@dataclass(frozen=True)
class RowFormat:
    """What one consumer's valid row holds, for its messages: ``name`` names its files (``"fine-tuning
    data"``), ``holds`` says what a valid row holds (``'a row is {"prompt": str, ...}'``), ``after`` is the
    sentence that ends each message (``"Nothing was written."``; may be empty)."""

    name: str
    holds: str
    after: str = ""

    def error(self, where: object, problem: str) -> UserError:
        """``WHERE: problem; what a valid row holds.`` and the closing sentence, as one paragraph."""
        return UserError(f"{where}: {problem}; {self.holds}.{' ' + self.after if self.after else ''}")

    def file_error(self, path: str, problem: str) -> UserError:
        """The same format for a whole input: ``NAME 'PATH' problem; what a valid row holds.`` (the closing
        sentence is about a row, so it is left out)."""
        return UserError(f"{self.name} {path!r} {problem}; {self.holds}.")


def rows_kind(path: str) -> str:
    """``"parquet"``, ``"arrow"`` (a ``datasets`` folder, checked) or ``"jsonl"`` (anything else)."""
    return table_kind(path) if is_table_input(path) else "jsonl"


def _key_path(keys: tuple) -> str:
    """``the value of 'messages'[0]['content']`` (the first 8 keys, then ``...``), or ``the row``."""
    shown = "".join(repr(k) if i == 0 and isinstance(k, str) else f"[{k!r}]" for i, k in enumerate(keys[:8]))
    return "the row" if not keys else f"the value of {shown}{'...' if len(keys) > 8 else ''}"


def _unencodable(text: str) -> Optional[int]:
    """The index of the first character of ``text`` UTF-8 cannot encode (a lone surrogate), or ``None``."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        return err.start
    return None


def _fault(value: Any, text: bool, depth: int = 0) -> bool:
    """Whether ``value`` nests deeper than :data:`MAX_DEPTH` or (``text``) holds a string UTF-8 cannot encode:
    one pass without bookkeeping (an ASCII string is known good without reading it; the recursion stops at
    :data:`MAX_DEPTH`)."""
    if isinstance(value, str):
        return text and not value.isascii() and _unencodable(value) is not None
    if isinstance(value, dict):
        if depth >= MAX_DEPTH:
            return True
        for k, v in value.items():
            if isinstance(v, str):
                if text and not v.isascii() and _unencodable(v) is not None:
                    return True
            elif isinstance(v, (dict, list)) and _fault(v, text, depth + 1):
                return True
            if text and isinstance(k, str) and not k.isascii() and _unencodable(k) is not None:
                return True
    elif isinstance(value, list):
        if depth >= MAX_DEPTH:
            return True
        for v in value:
            if isinstance(v, (str, dict, list)) and _fault(v, text, depth + 1):
                return True
    return False


def check_row(value: Any, where: object, fmt: RowFormat, text: bool = True) -> None:
    """Refuse ``value`` nested deeper than :data:`MAX_DEPTH` containers or (``text``) holding a string, key or
    value, that UTF-8 cannot encode; one :meth:`RowFormat.error` naming the place inside the row."""
    if not _fault(value, text):
        return
    stack: list[tuple[Any, int, tuple]] = [(value, 0, ())]  # again, to say where
    while stack:
        item, depth, keys = stack.pop()
        if isinstance(item, str):
            bad = _unencodable(item) if text else None
            if bad is not None:
                raise fmt.error(where, f"{_key_path(keys)} holds {item[bad]!r} at character {bad}, half of a "
                                       "UTF-16 surrogate pair (an escape \\ud800-\\udfff without its other half), "
                                       "which is no character and cannot be tokenized")
            continue
        if isinstance(item, dict):
            pairs: Any = item.items()
        elif isinstance(item, list):
            pairs = enumerate(item)
        else:
            continue
        if depth >= MAX_DEPTH:
            raise fmt.error(where, f"this row is nested deeper than {MAX_DEPTH} levels (at {_key_path(keys)})")
        for k, v in pairs:
            if text and isinstance(k, str) and _unencodable(k) is not None:
                raise fmt.error(where, f"a key of {_key_path(keys)}, {k!r}, holds half of a UTF-16 surrogate "
                                       "pair (an escape \\ud800-\\udfff without its other half), no character")
            if isinstance(v, (str, dict, list)):
                stack.append((v, depth + 1, keys + (k,)))


def parse_line(raw: bytes, where: object, fmt: RowFormat) -> Any:
    """One JSON Lines line's value, checked (:func:`check_row`), or one :meth:`RowFormat.error`."""
    try:
        value = json.loads(raw)
    except RecursionError:
        raise fmt.error(where, f"this JSON line is nested deeper than {MAX_DEPTH} levels (deeper than Python's "
                               "JSON parser goes)") from None
    except ValueError as err:  # JSONDecodeError, and UnicodeDecodeError for bytes that are not UTF-8
        msg = getattr(err, "msg", None) or str(err)
        col = getattr(err, "colno", None)
        raise fmt.error(where, f"malformed JSON ({msg}{f' at column {col}' if col else ''})") from None
    check_row(value, where, fmt)
    return value


def iter_rows(path: str, fmt: RowFormat, columns: Optional[Sequence[str]] = None) -> Iterator[tuple[Where, Any]]:
    """``(where, value)`` for every row of ``path`` in order: a JSON Lines line's value (blank lines skipped)
    or a table row as a dict of its columns (``columns``, default all; a null is ``None``). A missing file
    and every refusal of :func:`parse_line` are one :class:`UserError` in ``fmt``'s format."""
    path = os.fspath(path)
    kind = rows_kind(path)
    if kind == "parquet" and not os.path.isfile(path):
        raise fmt.file_error(path, "does not exist" if not os.path.exists(path) else "is not a file")
    if kind != "jsonl":
        names = list(columns) if columns is not None else table_columns(path)
        for first, per_column in iter_table_rows(path, names):
            for i, values in enumerate(zip(*per_column)):
                where = Where(path, row=first + i)
                row = dict(zip(names, values))
                check_row(row, where, fmt, text=False)  # pyarrow validated the UTF-8
                yield where, row
        return
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        raise fmt.file_error(path, "does not exist") from None
    except IsADirectoryError:  # pragma: no cover - a folder is a table kind
        raise fmt.file_error(path, "is a folder, not a file") from None
    except OSError as err:
        raise fmt.file_error(path, f"cannot be read ({err.strerror})") from None
    with f:
        if not os.path.isfile(path):
            raise fmt.file_error(path, "is not a file")
        for lineno, raw in enumerate(f, 1):
            if raw.strip():
                where = Where(path, line=lineno)
                yield where, parse_line(raw, where, fmt)
