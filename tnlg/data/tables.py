"""Columnar inputs through pyarrow: Parquet files and folders written by ``datasets.save_to_disk``.

How most public pretraining corpora ship: a ``.parquet`` file (one document per row, the text
in a string column), or a Hugging Face ``datasets`` folder (``Dataset.save_to_disk``: a
``state.json`` naming Arrow IPC stream files ``data-0000i-of-0000n.arrow``, read here with
pyarrow alone, no ``datasets`` needed). The text columns are the ``--json-keys`` of JSON
Lines inputs. Both are read as a stream: a Parquet file one row group at a time, a
``datasets`` folder one memory-mapped record batch at a time, so memory stays at one row
group whatever the corpus size. Every batch is validated in full (offsets inside its buffers, UTF-8
text) before a value is read: a damaged or hostile Arrow file must not make pyarrow read memory
outside it.

:func:`check_table` validates a table before anything is written (the columns exist and hold
strings, no row is null) from the schema and each chunk's null count (one read of the text
columns, as JSON Lines inputs are parsed once to check them, no Python strings made);
:func:`iter_table_rows` yields the texts in row order, a chunk at a time. pyarrow is optional
(``pip install 'tnlg[parquet]'``); without it a table input is one clear error.
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Iterator, Sequence

from ..errors import UserError
from ..io import confined_path

__all__ = ["PARQUET_SUFFIXES", "is_table_input", "table_kind", "table_columns", "check_table", "iter_table_rows"]

PARQUET_SUFFIXES = (".parquet",)
_MAX_JSON_BYTES = 64 * 2**20  # a datasets folder's state.json / dataset_dict.json: a few KiB


def _pyarrow():
    try:
        import pyarrow  # noqa: F401
        import pyarrow.ipc  # noqa: F401
        import pyarrow.parquet  # noqa: F401
    except ImportError:
        raise UserError("Parquet files and `datasets` folders are read with the optional `pyarrow` package, "
                        "which is not installed: `pip install 'tnlg[parquet]'` (or `pip install pyarrow`). "
                        "JSON Lines and .txt inputs work without it.") from None
    return pyarrow


def is_table_input(path: str) -> bool:
    """A Parquet file (by extension) or a folder (a ``datasets.save_to_disk`` folder)."""
    return path.lower().endswith(PARQUET_SUFFIXES) or os.path.isdir(path)


def table_kind(path: str) -> str:
    """``"parquet"`` or ``"arrow"`` (a ``datasets`` folder); a folder that is not one is a :class:`UserError`."""
    if not os.path.isdir(path):
        return "parquet"
    if os.path.isfile(os.path.join(path, "dataset_dict.json")):
        splits = _read_json(os.path.join(path, "dataset_dict.json")).get("splits", [])
        splits = splits if isinstance(splits, list) else []
        raise UserError(f"input {path!r} is a `datasets` DatasetDict (splits {splits}); pass one split's folder, "
                        f"e.g. {os.path.join(path, str(splits[0]) if splits else 'train')!r}.")
    if not os.path.isfile(os.path.join(path, "state.json")):
        raise UserError(f"input {path!r} is a folder but not one written by `datasets` `save_to_disk` (it has no "
                        "state.json); pass .jsonl, .txt or .parquet files, or such a folder.")
    return "arrow"


def _read_json(path: str) -> dict:
    """A ``datasets`` folder's JSON file as an object, or one :class:`UserError` saying what is wrong with it."""
    problem = None
    try:
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size > _MAX_JSON_BYTES:
                problem = f"it is {os.fstat(f.fileno()).st_size:,} bytes, not the few KiB `datasets` writes"
            else:
                value = json.loads(f.read().decode("utf-8"))
                problem = None if isinstance(value, dict) else f"it holds a JSON {type(value).__name__}, not an object"
    except (ValueError, UnicodeDecodeError) as err:
        problem = f"it is not JSON ({err})"
    except RecursionError:
        problem = "its JSON is nested deeper than any `datasets` file"
    except OSError as err:
        problem = f"it cannot be read ({err.strerror})"
    if problem:
        raise UserError(f"{path!r} is damaged: {problem}. Write the folder again with `save_to_disk`.")
    return value


def _arrow_files(path: str) -> list[str]:
    """The Arrow files a ``datasets`` folder's ``state.json`` names, in order: each a plain name of a file
    inside the folder (:func:`tnlg.io.confined_path`: no ``..``, not absolute, no link out of it)."""
    state_path = os.path.join(path, "state.json")
    entries = _read_json(state_path).get("_data_files")
    if not isinstance(entries, list) or not entries:
        raise UserError(f"{state_path!r} is damaged: its '_data_files' is {json.dumps(entries)[:60]}, not a list "
                        f"of the folder's Arrow files. Write the folder again with `save_to_disk`.")
    files = []
    for i, entry in enumerate(entries):
        name = entry.get("filename") if isinstance(entry, dict) else None
        if name is None:
            raise UserError(f"{state_path!r} is damaged: entry {i} of '_data_files' ({json.dumps(entry)[:60]}) has "
                            f"no 'filename'. Write the folder again with `save_to_disk`.")
        try:
            files.append(confined_path(path, name))
        except ValueError as err:
            raise UserError(f"{state_path!r} names a file outside its folder: {err}. A `datasets` folder's files "
                            f"are plain names inside it; this state.json was not written by `datasets` or was "
                            f"tampered with. Nothing was read.") from None
    missing = [p for p in files if not os.path.isfile(p)]
    if missing:
        raise UserError(f"`datasets` folder {path!r} is incomplete: its state.json names "
                        f"{[os.path.basename(p) for p in files]}, missing {[os.path.basename(p) for p in missing]}.")
    return files


def _batches(path: str, kind: str, columns: Sequence[str]) -> Iterator:
    """Record batches of ``columns`` in row order: a Parquet row group, or an Arrow stream's batch; a file
    pyarrow cannot read (corrupt pages, a truncated stream) or a later file of a ``datasets`` folder without
    one of the columns is one :class:`UserError` naming the file."""
    pa = _pyarrow()
    if kind == "parquet":
        with _readable(path, "a Parquet file"):
            pf = pa.parquet.ParquetFile(path)
            for i in range(pf.num_row_groups):
                for batch in pf.read_row_group(i, columns=list(columns)).to_batches():
                    batch.validate(full=True)
                    yield batch
        return
    for name in _arrow_files(path):
        with _readable(name, "an Arrow stream"), pa.memory_map(name) as source:
            stream = pa.ipc.open_stream(source)
            lacking = [c for c in columns if c not in stream.schema.names]
            if lacking:
                raise UserError(f"{name!r} of `datasets` folder {path!r} has no column {lacking[0]!r} (its columns: "
                                f"{stream.schema.names}), which its first file has; the folder is not one dataset. "
                                f"Nothing was written.")
            for batch in stream:
                batch = batch.select(list(columns))
                # an Arrow file is read as it is: offsets past the data or bad UTF-8 would be read from
                # outside its buffers (a crash, or memory not the file's); full validation refuses them
                batch.validate(full=True)
                yield batch


@contextlib.contextmanager
def _readable(path: str, what: str):
    """pyarrow's errors reading ``path`` (damaged data, a short file, an allocation a damaged size asks for)
    as one :class:`UserError`."""
    pa = _pyarrow()
    try:
        yield
    except (pa.lib.ArrowException, OSError) as err:
        said = " ".join("".join(c if c.isprintable() else " " for c in str(err)).split())[:300].rstrip(". ")
        raise UserError(f"input {path!r} is not {what} pyarrow can read: {said}. It is damaged or truncated; "
                        f"nothing was written.") from None


def _schema(path: str, kind: str):
    pa = _pyarrow()
    if kind == "parquet":
        with _readable(path, "a Parquet file"):
            return pa.parquet.read_schema(path)
    first = _arrow_files(path)[0]
    with _readable(first, "an Arrow stream"), pa.memory_map(first) as source:
        return pa.ipc.open_stream(source).schema


def table_columns(path: str) -> list[str]:
    """The column names of a table input (a Parquet file's, or a ``datasets`` folder's first Arrow file's)."""
    return list(_schema(path, table_kind(path)).names)


def check_table(path: str, columns: Sequence[str]) -> int:
    """The number of documents (rows) of a table input whose ``columns`` exist, hold strings and no
    nulls; else one :class:`UserError` naming the input, the column and what it has."""
    pa = _pyarrow()
    kind = table_kind(path)
    schema = _schema(path, kind)
    what = "Parquet file" if kind == "parquet" else "`datasets` folder"
    def is_text(name: str) -> bool:
        t = schema.field(name).type
        return pa.types.is_string(t) or pa.types.is_large_string(t)

    text_columns = [n for n in schema.names if is_text(n)]
    for col in columns:
        if col not in schema.names:
            hint = f" (its text columns: {text_columns})" if text_columns else " (none of them holds text)"
            raise UserError(f"{what} {path!r} has no column {col!r}; its columns are {schema.names}{hint}. Name "
                            "the text column with --json-keys. Nothing was written.")
        t = schema.field(col).type
        if not is_text(col):
            raise UserError(f"column {col!r} of {what} {path!r} holds {t}, not text; name a string column with "
                            f"--json-keys (its columns: {schema.names}). Nothing was written.")
    rows = 0
    for batch in _batches(path, kind, columns):
        for col in columns:
            nulls = batch.column(col).null_count
            if nulls:
                first = rows + batch.column(col).is_null().to_pylist().index(True)
                raise UserError(f"{path}:row {first}: no value (null) in column {col!r} of this {what} ({nulls} null "
                                "rows in that chunk); every document is a string. Nothing was written.")
        rows += batch.num_rows
    if rows == 0:
        raise UserError(f"input {path!r} has no documents: the table has no rows. Remove it from --input.")
    return rows


def iter_table_rows(path: str, columns: Sequence[str], chunk_bytes: int = 1 << 20
                    ) -> Iterator[tuple[int, list[list[str]]]]:
    """``(first row, texts per column)`` chunks of about ``chunk_bytes`` of text, in row order
    (read a row group / record batch at a time). Does not validate; see :func:`check_table`."""
    kind = table_kind(path)
    first = 0
    for batch in _batches(path, kind, columns):
        n = batch.num_rows
        size = sum(batch.column(c).nbytes for c in columns)
        step = max(1, int(n * chunk_bytes / max(size, 1)))
        for a in range(0, n, step):
            part = batch.slice(a, step)
            yield first + a, [part.column(c).to_pylist() for c in columns]
        first += n
