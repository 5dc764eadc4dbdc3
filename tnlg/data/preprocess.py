"""Raw text -> Megatron ``.bin``/``.idx`` (what Megatron's ``tools/preprocess_data.py`` does).

Inputs: JSON Lines (``.jsonl``/``.json``/``.ndjson``: one document per line, text under
``--json-keys``, default ``text``; blank lines are skipped), plain ``.txt`` files
(a whole file is one document, read as-is: no newline translation), and Parquet files and
``datasets.save_to_disk`` folders (one document per row, the text in the ``--json-keys``
columns, streamed a row group at a time; the same documents give the same bytes as JSONL). Every input is
checked first - missing file, an input with no documents, a malformed JSON line
(named by file and line number), a missing or non-string key - before anything is
written.

Output: ``PREFIX_<key>_document.bin``/``.idx`` per JSON key, one sequence per
document (plus the end-of-document id with ``append_eod``), uint16 when the
vocabulary has fewer than 65500 tokens and int32 otherwise; byte-identical to
Megatron's files for the same tokens. Documents that tokenize to nothing are
skipped (Megatron would write an empty document) and counted.

Workers: ``workers=1`` encodes in this process; ``workers=N`` runs N encoding
processes fed in order through a bounded window, so document order is kept and
memory stays flat. Files are written under temporary names and renamed only when
every input has been encoded.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from collections import deque
from pathlib import Path
from typing import Any, Iterator, Sequence, Union

import numpy as np

from ..errors import UserError
from .indexed import IndexedDatasetBuilder, best_dtype, data_file_path, dataset_prefix, index_file_path
from .inputs import TABLE_KINDS, InputFile, check_inputs, iter_documents, parse_json_line, read_txt
from .tables import iter_table_rows
from .fingerprint import write_sidecar
from .tokenizer import Tokenizer, load_tokenizer

# check_inputs, iter_documents and InputFile live in .inputs (tokenizer training reads inputs too)
__all__ = ["preprocess", "check_inputs", "iter_documents", "output_prefix_for", "InputFile"]


def output_prefix_for(output_prefix: Union[str, Path], key: str = "text") -> str:
    """Megatron's output naming: ``PREFIX_<key>_document``."""
    return f"{os.fspath(output_prefix)}_{key}_document"


# ---------------------------------------------------------------------- encoding workers

_W: dict[str, Any] = {}


def _setup(tokenizer: Tokenizer, json_keys: Sequence[str], append_eod: bool, dtype) -> None:
    _W.update(tokenizer=tokenizer, keys=list(json_keys), append_eod=append_eod, dtype=np.dtype(dtype))


def _init_worker(spec: dict, json_keys: Sequence[str], append_eod: bool, dtype) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    _setup(load_tokenizer(spec, check_sha256=False), json_keys, append_eod, dtype)


def _encode_chunk(task: tuple) -> tuple[int, int, list[tuple[np.ndarray, np.ndarray]]]:
    """Encode one task; returns (documents seen, empty documents, per key (tokens, lengths))."""
    tok: Tokenizer = _W["tokenizer"]
    keys, dtype, eod = _W["keys"], _W["dtype"], _W["append_eod"]
    kind, path = task[0], task[1]
    if kind == "txt":
        per_key_texts = [[read_txt(path)]]
    elif kind == "rows":  # a chunk of a table's rows, read by the caller (tnlg.data.tables)
        per_key_texts = task[3]
    else:
        first_line, lines = task[2], task[3]
        rows = [parse_json_line(raw, path, first_line + i, keys) for i, raw in enumerate(lines) if raw.strip()]
        per_key_texts = [[r[k] for r in rows] for k in range(len(keys))]
    n_docs = len(per_key_texts[0])
    empty = 0
    out = []
    eod_arr = np.array([tok.eod_id], dtype=dtype) if eod else None
    for texts in per_key_texts:
        parts, lengths = [], []
        for ids in tok.encode_batch(texts):
            if not ids:
                empty += 1
                continue
            parts.append(np.array(ids, dtype=dtype))
            if eod_arr is not None:
                parts.append(eod_arr)
            lengths.append(len(ids) + (1 if eod else 0))
        tokens = np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)
        out.append((tokens, np.asarray(lengths, dtype=np.int32)))
    return n_docs, empty, out


def _tasks(infos: Sequence[InputFile], keys: Sequence[str], chunk_bytes: int) -> Iterator[tuple]:
    for info in infos:
        if info.kind == "txt":
            yield ("txt", info.path)
            continue
        if info.kind in TABLE_KINDS:
            for first, per_key in iter_table_rows(info.path, keys, chunk_bytes):
                yield ("rows", info.path, first, per_key)
            continue
        with open(info.path, "rb") as f:
            lines: list[bytes] = []
            size, first = 0, 1
            for lineno, raw in enumerate(f, 1):
                if not lines:
                    first = lineno
                lines.append(raw)
                size += len(raw)
                if size >= chunk_bytes:
                    yield ("jsonl", info.path, first, lines)
                    lines, size = [], 0
            if lines:
                yield ("jsonl", info.path, first, lines)


def _start_method() -> str:
    """A clean worker process, never a fork of the caller: forking a process that runs threads (torch,
    tqdm) or has its own signal handlers can deadlock or leave workers that ignore terminate()."""
    return "spawn"  # (not forkserver either: a forked caller would share its parent's fork server)


def preprocess(inputs: Sequence[Union[str, Path]], output_prefix: Union[str, Path],
               tokenizer: Union[str, dict, Tokenizer], json_keys: Sequence[str] = ("text",),
               append_eod: bool = False, workers: int = 1, progress: bool = True,
               chunk_bytes: int = 1 << 20) -> dict:
    """Tokenize ``inputs`` into ``PREFIX_<key>_document.{bin,idx}``; returns a summary dict.

    Raises :class:`UserError` before writing anything for bad inputs (see
    :func:`check_inputs`) or a bad ``workers``; encoding errors remove the
    temporary files and leave no output.
    """
    if isinstance(inputs, (str, Path)):
        inputs = [inputs]
    if not isinstance(workers, int) or workers < 1:
        raise UserError(f"--workers must be a positive integer, got {workers!r}.")
    json_keys = list(json_keys)
    output_prefix = dataset_prefix(output_prefix)  # "out/x.bin" names the prefix out/x, as everywhere
    tok = load_tokenizer(tokenizer)
    infos = check_inputs(inputs, json_keys)
    total_docs = sum(i.documents for i in infos)
    dtype = best_dtype(tok.vocab_size)
    out_dir = os.path.dirname(os.fspath(output_prefix))
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
    prefixes = [output_prefix_for(output_prefix, k) for k in json_keys]

    bar = None
    if progress and not os.environ.get("TNLG_QUIET"):
        from tqdm import tqdm
        bar = tqdm(total=total_docs, unit="doc", desc="preprocess", dynamic_ncols=True)
    start = time.perf_counter()
    builders = [IndexedDatasetBuilder(data_file_path(p), dtype=dtype) for p in prefixes]
    pool = None
    try:
        if workers == 1:
            _setup(tok, json_keys, append_eod, dtype)
            results: Iterator = map(_encode_chunk, _tasks(infos, json_keys, chunk_bytes))
        else:
            pool = mp.get_context(_start_method()).Pool(
                workers, initializer=_init_worker, initargs=(tok.describe(), json_keys, append_eod, dtype))
            results = _ordered(pool, _tasks(infos, json_keys, chunk_bytes), window=4 * workers)
        docs, empty, tokens = _append(builders, results, bar, start)
        for builder, p in zip(builders, prefixes):
            builder.finalize(index_file_path(p))
            write_sidecar(p, tok)  # the tokenizer's fingerprint, beside Megatron's files (left as Megatron's)
    except BaseException:
        for builder in builders:
            builder.abort()
        raise
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
        if bar is not None:
            bar.close()
        _W.clear()
    seconds = time.perf_counter() - start
    return {"outputs": dict(zip(json_keys, prefixes)), "documents": docs, "empty_documents_skipped": empty,
            "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / max(seconds, 1e-9),
            "dtype": np.dtype(dtype).name, "workers": workers, "tokenizer": tok.describe()}


def _append(builders: list, results: Iterator, bar, start: float) -> tuple[int, int, int]:
    """Append every encoded chunk to the builders (one per key); ``(documents, empty ones, tokens)``."""
    docs = empty = tokens = 0
    for n_docs, n_empty, per_key in results:
        for builder, (toks, lengths) in zip(builders, per_key):
            builder.add_documents(toks, lengths)
        docs += n_docs
        empty += n_empty
        tokens += sum(int(t.size) for t, _ in per_key)
        if bar is not None:
            rate = tokens / max(time.perf_counter() - start, 1e-9)
            bar.set_postfix_str(f"{rate / 1e3:,.0f}k tok/s", refresh=False)
            bar.update(n_docs)
    return docs, empty, tokens


def _ordered(pool, tasks: Iterator[tuple], window: int) -> Iterator:
    """Results of ``tasks`` in order, with at most ``window`` tasks in flight."""
    pending: deque = deque()
    for task in tasks:
        pending.append(pool.apply_async(_encode_chunk, (task,)))
        if len(pending) >= window:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()
