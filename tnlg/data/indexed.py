"""Megatron's memory-mapped indexed dataset: ``PREFIX.bin`` (tokens) + ``PREFIX.idx`` (index).

Layout (little-endian; Megatron-LM ``megatron/core/datasets/indexed_dataset.py``,
described in ``docs/data.md``)::

    .idx  b"MMIDIDX\\x00\\x00" | version <Q = 1 | dtype code <B | sequence count <Q |
          document count <Q (documents + 1) | int32 lengths[S] | int64 byte pointers[S] |
          int64 document_indices[D] | optional int8 modes[S] (multimodal)
    .bin  the tokens of every sequence back to back, no header

A *document* is ``document_indices[i] .. document_indices[i+1]`` sequences; text
preprocessing writes one sequence per document. :class:`IndexedDatasetBuilder`
writes files byte-identical to Megatron's builder, under temporary names that
are renamed only by :meth:`IndexedDatasetBuilder.finalize`. :class:`IndexedDataset`
memory-maps both files (as Megatron does: an index of hundreds of millions of
documents is GBs, and every rank would otherwise hold its own copy), checks the
header against the file sizes and the arrays in one chunked pass before training
starts, and then reads tokens zero-copy.
"""

from __future__ import annotations

import functools
import hashlib
import mmap
import os
import struct
from pathlib import Path
from typing import Optional, Sequence, Union

import numpy as np

from ..errors import UserError
from ..io import atomic_output, temporary_name

__all__ = ["IndexedDataset", "IndexedDatasetBuilder", "dataset_prefix", "DTYPES", "best_dtype", "dtype_code",
           "data_file_path", "index_file_path"]

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_SIZE = len(MAGIC) + 8 + 1 + 8 + 8  # 34 bytes
CHUNK = 1 << 20  # entries per step when scanning the mapped index (bounded temporaries)

# Megatron's DType enum codes.
DTYPES: dict[int, type] = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64,
                           6: np.float64, 7: np.float32, 8: np.uint16}


def dtype_code(dtype) -> int:
    """Megatron's code for a numpy dtype (``uint16`` -> 8, ``int32`` -> 4, ...)."""
    dt = np.dtype(dtype)
    for code, t in DTYPES.items():
        if np.dtype(t) == dt:
            return code
    raise UserError(f"dtype {dt} has no Megatron code; valid: "
                    f"{sorted(np.dtype(t).name for t in DTYPES.values())}.")


def best_dtype(vocab_size: Optional[int]):
    """Token dtype Megatron picks for a vocabulary: uint16 below 65500 tokens, else int32."""
    if vocab_size is not None and vocab_size < 65500:
        return np.uint16
    return np.int32


def data_file_path(prefix: Union[str, Path]) -> str:
    return f"{prefix}.bin"


def index_file_path(prefix: Union[str, Path]) -> str:
    return f"{prefix}.idx"


def _decreases(d: np.ndarray) -> bool:
    """Whether ``d[i + 1] < d[i]`` anywhere, scanned ``CHUNK`` entries at a time."""
    n = len(d) - 1
    return any(bool((d[a + 1:min(a + CHUNK, n) + 1] < d[a:min(a + CHUNK, n)]).any()) for a in range(0, n, CHUNK))


def dataset_prefix(path: Union[str, Path]) -> str:
    """The prefix a dataset path means: ``X.bin``, ``X.idx`` and ``X`` are all the dataset ``X``
    (its ``X.bin`` + ``X.idx``). Every data path that enters tnlg (``--data-path``, ``tnlg eval
    --task loss --input``, ``tnlg data info``, ``tnlg preprocess --output-prefix``) goes through
    this, so options, checkpoints and messages record the prefix alone."""
    p = os.fspath(path)
    return p[:-4] if p.endswith((".bin", ".idx")) else p


def prefixes_beside(prefix: str, most: int = 10) -> str:
    """A sentence naming the datasets (``.bin`` + ``.idx`` pairs, by prefix) in ``prefix``'s folder, for the
    error of a prefix that names none: ``--data-path data/py`` beside ``data/py_text_document.bin/.idx``."""
    folder = os.path.dirname(os.fspath(prefix)) or "."
    if not os.path.isdir(folder):
        return f"The folder {folder!r} does not exist."
    names = set(os.listdir(folder))
    found = sorted(os.path.join(os.path.dirname(os.fspath(prefix)), n[:-4]) for n in names
                   if n.endswith(".idx") and n[:-4] + ".bin" in names)
    if not found:
        return f"{folder!r} holds no dataset (no .bin + .idx pair)."
    more = f" and {len(found) - most} more" if len(found) > most else ""
    return f"Datasets in {folder!r}: {', '.join(repr(f) for f in found[:most])}{more}."


class IndexedDataset:
    """Read-only view of a ``.bin``/``.idx`` pair; both files are memory-mapped, neither is read.

    ``len(ds)`` sequences; ``ds[i]`` / ``ds.get(i, offset, length)`` return numpy
    views into the memory-mapped ``.bin``; ``sequence_lengths``, ``sequence_pointers``
    (byte offsets) and ``document_indices`` are exactly what Megatron's reader
    returns, as read-only views into the memory-mapped ``.idx`` (as Megatron's
    reader: no per-rank copy, the page cache is shared by every process of a node).
    ``document(d)`` gives the tokens of document ``d``. Corrupt files raise
    :class:`~tnlg.errors.UserError` when opened: missing partner file, wrong magic,
    unknown version or dtype code, counts that do not match the ``.idx`` size (from
    the header and the file size alone), and - by one streaming pass over the mapped
    arrays in fixed-size chunks, so at most a few MB of temporaries - negative
    lengths, inconsistent document indices, pointers that are not multiples of the
    token size, a ``.bin`` shorter than the pointers need.
    """

    def __init__(self, path_prefix: Union[str, Path]):
        self.path_prefix = dataset_prefix(path_prefix)
        self._open()

    # pickling (DataLoader workers) reopens the maps by path; the parent checked the contents already
    def __getstate__(self):
        return {"path_prefix": self.path_prefix}

    def __setstate__(self, state):
        self.path_prefix = state["path_prefix"]
        self._open(check_contents=False)

    def _open(self, check_contents: bool = True) -> None:
        prefix = self.path_prefix
        idx_path, bin_path = index_file_path(prefix), data_file_path(prefix)
        have_idx, have_bin = os.path.isfile(idx_path), os.path.isfile(bin_path)
        if not have_idx and not have_bin:
            raise UserError(f"no indexed dataset at {prefix!r}: neither {idx_path!r} nor {bin_path!r} "
                            f"exists. {prefixes_beside(prefix)} Pass the prefix without .bin/.idx, e.g. "
                            "'data/my-corpus_text_document' (see `tnlg preprocess`).")
        if not have_idx or not have_bin:
            present, missing = (bin_path, idx_path) if have_bin else (idx_path, bin_path)
            raise UserError(f"indexed dataset {prefix!r} is incomplete: {present!r} exists but its partner "
                            f"{missing!r} is missing. Both files are needed; copy it next to the other or "
                            "rerun preprocessing.")
        with open(idx_path, "rb") as f:
            idx_size = os.fstat(f.fileno()).st_size
            header = f.read(HEADER_SIZE)
            seq_count, doc_count, has_modes = self._parse_header(header, idx_size, idx_path)
            self._idx_mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self.idx_size = idx_size
        off = HEADER_SIZE
        buf = self._idx_mmap
        self.sequence_lengths = np.frombuffer(buf, dtype=np.int32, count=seq_count, offset=off)
        off += 4 * seq_count
        self.sequence_pointers = np.frombuffer(buf, dtype=np.int64, count=seq_count, offset=off)
        off += 8 * seq_count
        self.document_indices = np.frombuffer(buf, dtype=np.int64, count=doc_count, offset=off)
        off += 8 * doc_count
        self.sequence_modes = (np.frombuffer(buf, dtype=np.int8, count=seq_count, offset=off)
                               if has_modes else None)
        self.bin_size = bin_size = os.path.getsize(bin_path)
        if check_contents:
            self._check_contents(idx_path, bin_path)
        itemsize = self.dtype.itemsize
        if bin_size == 0:
            self._mmap = None
            self._tokens = np.empty(0, dtype=self.dtype)
        else:
            with open(bin_path, "rb") as f:
                self._mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            usable = bin_size - bin_size % itemsize
            self._tokens = np.frombuffer(self._mmap, dtype=self.dtype, count=usable // itemsize)

    def _parse_header(self, idx: bytes, idx_size: int, idx_path: str) -> tuple[int, int, bool]:
        """Check the 34-byte header against the file size; set ``dtype``; return the counts."""
        if idx_size < HEADER_SIZE:
            raise UserError(f"{idx_path!r} is {idx_size} bytes, shorter than the {HEADER_SIZE}-byte header "
                            "of a Megatron index; the file is truncated or not an index.")
        if idx[:9] != MAGIC:
            raise UserError(f"{idx_path!r} does not start with Megatron's index magic {MAGIC!r} (found "
                            f"{idx[:9]!r}); it is not an mmap indexed-dataset index (the old 'lazy'/'cached' "
                            "formats are not supported).")
        (version,) = struct.unpack_from("<Q", idx, 9)
        if version != VERSION:
            raise UserError(f"{idx_path!r} has index version {version}; only version {VERSION} exists.")
        (code,) = struct.unpack_from("<B", idx, 17)
        if code not in DTYPES:
            raise UserError(f"{idx_path!r} has dtype code {code}; valid codes are "
                            + ", ".join(f"{c} ({np.dtype(t).name})" for c, t in DTYPES.items()) + ".")
        seq_count, doc_count = struct.unpack_from("<QQ", idx, 18)
        base = HEADER_SIZE + seq_count * (4 + 8) + doc_count * 8
        if idx_size not in (base, base + seq_count):
            raise UserError(f"{idx_path!r} claims {seq_count} sequences and {doc_count} document indices, "
                            f"which need {base} bytes ({base + seq_count} with modes), but the file is "
                            f"{idx_size} bytes; the index is truncated or corrupt.")
        if doc_count < 1:
            raise UserError(f"{idx_path!r} has no document indices (count 0); a valid index has at least "
                            "the leading 0.")
        self.dtype = np.dtype(DTYPES[code])
        self.dtype_code = code
        return seq_count, doc_count, idx_size > base

    def _check_contents(self, idx_path: str, bin_path: str) -> None:
        """One pass over the mapped arrays, ``CHUNK`` entries at a time (bounded temporaries)."""
        lengths, pointers, d = self.sequence_lengths, self.sequence_pointers, self.document_indices
        seq_count, itemsize = len(lengths), self.dtype.itemsize
        for a in range(0, seq_count, CHUNK):
            if lengths[a:a + CHUNK].min() < 0:
                raise UserError(f"{idx_path!r} has negative sequence lengths; the index is corrupt.")
        if d[0] != 0 or d[-1] > seq_count or _decreases(d):
            raise UserError(f"{idx_path!r} has document indices that do not run from 0 up to at most the "
                            f"sequence count {seq_count} without decreasing (first {int(d[0])}, last "
                            f"{int(d[-1])}); the index is corrupt.")
        need, bad = 0, -1
        for a in range(0, seq_count, CHUNK):
            ends = pointers[a:a + CHUNK] + lengths[a:a + CHUNK].astype(np.int64) * itemsize
            i = int(ends.argmax())
            if bad < 0 and int(ends[i]) > self.bin_size:
                bad = a + int(np.argmax(ends > self.bin_size))
            need = max(need, int(ends[i]))
        if bad >= 0:
            raise UserError(f"{bin_path!r} is {self.bin_size} bytes but its index needs {need}: sequence {bad} "
                            f"(pointer {int(pointers[bad])}, {int(lengths[bad])} tokens of {self.dtype.name}) "
                            "runs past the end. The .bin is truncated or belongs to another .idx; rerun "
                            "preprocessing.")
        if itemsize > 1 and any((pointers[a:a + CHUNK] % itemsize).any() for a in range(0, seq_count, CHUNK)):
            raise UserError(f"{idx_path!r} has byte pointers that are not multiples of the token size "
                            f"{itemsize} ({self.dtype.name}); the index is corrupt.")

    # ------------------------------------------------------------------ layout facts (computed once, cheaply)
    @functools.cached_property
    def one_sequence_per_document(self) -> bool:
        """Every document is exactly one sequence (``document_indices == 0, 1, ..., S``): what text
        preprocessing writes, and the case where sequence ``i`` *is* document ``i``."""
        d, n = self.document_indices, len(self)
        if len(d) != n + 1:
            return False
        return all(np.array_equal(d[a:a + CHUNK], np.arange(a, min(a + CHUNK, len(d)), dtype=np.int64))
                   for a in range(0, len(d), CHUNK))

    @functools.cached_property
    def contiguous(self) -> bool:
        """The sequences lie back to back in ``.bin`` in index order (pointer ``i + 1`` = pointer ``i`` +
        length ``i``), as every builder writes them; then a range of sequences is one slice of tokens."""
        lengths, pointers, itemsize = self.sequence_lengths, self.sequence_pointers, self.dtype.itemsize
        expected = 0
        for a in range(0, len(lengths), CHUNK):
            sizes = lengths[a:a + CHUNK].astype(np.int64) * itemsize
            starts = np.cumsum(sizes) - sizes + expected
            if not np.array_equal(starts, pointers[a:a + CHUNK]):
                return False
            expected = int(starts[-1] + sizes[-1])
        return True

    def fingerprint(self) -> str:
        """A cheap identity of the two files, for cache keys: their sizes and modification times, the
        header, and a sample of blocks (first, last and 62 evenly spaced 4 KiB blocks of each file).
        Reads at most ~0.5 MB, whatever the corpus size (hashing the whole ``.idx`` would read GBs)."""
        h = hashlib.sha256()
        for path, buf, size in ((index_file_path(self.path_prefix), self._idx_mmap, self.idx_size),
                                (data_file_path(self.path_prefix), self._mmap, self.bin_size)):
            st = os.stat(path)
            h.update(f"{size} {st.st_mtime_ns}".encode())
            if buf is None or size == 0:
                continue
            block = 4096
            for start in sorted({min(max(0, size - block), int(i * (size - block) / 63)) for i in range(64)}):
                h.update(buf[start:start + block])
        return h.hexdigest()

    # ------------------------------------------------------------------ reading
    def __len__(self) -> int:
        return len(self.sequence_lengths)

    @property
    def sizes(self) -> np.ndarray:
        """Sequence lengths (Megatron's name)."""
        return self.sequence_lengths

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.sequence_lengths.sum(dtype=np.int64))

    def __getitem__(self, idx: int) -> np.ndarray:
        if not isinstance(idx, (int, np.integer)):
            raise TypeError(f"IndexedDataset indices must be integers, got {type(idx).__name__}")
        n = len(self)
        if idx < 0:
            idx += n
        if not 0 <= idx < n:
            raise IndexError(f"sequence {idx} out of range for {n} sequences")
        start = int(self.sequence_pointers[idx]) // self.dtype.itemsize
        return self._tokens[start:start + self.sequence_lengths[idx]]

    def get(self, idx: int, offset: int = 0, length: Optional[int] = None) -> np.ndarray:
        """Tokens ``offset .. offset + length`` of sequence ``idx`` (to its end when ``length`` is None)."""
        seq_len = int(self.sequence_lengths[idx])
        if length is None:
            length = seq_len - offset
        if offset < 0 or length < 0 or offset + length > seq_len:
            raise IndexError(f"tokens {offset}..{offset + length} out of range for sequence {idx} "
                             f"of {seq_len} tokens")
        start = int(self.sequence_pointers[idx]) // self.dtype.itemsize + offset
        return self._tokens[start:start + length]

    def document(self, doc: int) -> np.ndarray:
        """All tokens of document ``doc`` (its sequences concatenated)."""
        a, b = int(self.document_indices[doc]), int(self.document_indices[doc + 1])
        if a == b:
            return self._tokens[:0]
        itemsize = self.dtype.itemsize
        start = int(self.sequence_pointers[a]) // itemsize
        end = int(self.sequence_pointers[b - 1]) // itemsize + int(self.sequence_lengths[b - 1])
        if end - start == int(self.sequence_lengths[a:b].sum()):  # contiguous (always, for our files)
            return self._tokens[start:end]
        return np.concatenate([self[i] for i in range(a, b)])

    @staticmethod
    def exists(path_prefix: Union[str, Path]) -> bool:
        p = dataset_prefix(path_prefix)
        return os.path.isfile(index_file_path(p)) and os.path.isfile(data_file_path(p))

    def __repr__(self) -> str:
        return (f"IndexedDataset({self.path_prefix!r}, dtype={self.dtype.name}, sequences={len(self)}, "
                f"documents={self.num_documents})")


class IndexedDatasetBuilder:
    """Write a ``.bin``/``.idx`` pair byte-identical to Megatron's ``IndexedDatasetBuilder``.

    Same calls: ``add_item(tokens)`` appends one sequence, ``end_document()`` closes
    a document, ``add_document(tokens, lengths)`` does both for a document of several
    sequences; ``finalize(idx_path)``. Tokens go to ``<bin>.tmp-<pid>`` and the
    index to ``<idx>.tmp-<pid>`` (:func:`tnlg.io.temporary_name`); ``finalize`` renames the
    ``.bin`` and then the ``.idx``, so a reader never sees a new index without its data. Use as a
    context manager (or call :meth:`abort`) to remove the temporary files on error.
    """

    def __init__(self, bin_path: Union[str, Path], dtype=np.int32):
        self.dtype = np.dtype(dtype)
        dtype_code(self.dtype)  # validate early
        self.bin_path = os.fspath(bin_path)
        self._tmp_bin = temporary_name(self.bin_path)
        self._file = open(self._tmp_bin, "wb")
        self._lengths: list[np.ndarray] = []
        self._doc_idx: list[np.ndarray] = [np.zeros(1, dtype=np.int64)]
        self._num_seqs = 0
        self._range: Optional[tuple[int, int]] = None
        if np.issubdtype(self.dtype, np.integer):
            info = np.iinfo(self.dtype)
            self._range = (int(info.min), int(info.max))

    def __enter__(self) -> "IndexedDatasetBuilder":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()

    def _as_array(self, tokens) -> np.ndarray:
        if hasattr(tokens, "numpy"):  # torch tensor, as Megatron's builder accepts
            tokens = tokens.detach().cpu().numpy()
        arr = np.asarray(tokens)
        if arr.dtype != self.dtype:
            if self._range is not None and arr.size and np.issubdtype(arr.dtype, np.number):
                lo, hi = arr.min(), arr.max()
                if lo < self._range[0] or hi > self._range[1]:
                    raise UserError(f"token ids {int(lo)}..{int(hi)} do not fit {self.dtype.name}; use int32 "
                                    "(the vocabulary has 65500 tokens or more).")
            arr = arr.astype(self.dtype)
        return arr.reshape(-1)

    def add_item(self, tokens) -> None:
        """Append one sequence."""
        arr = self._as_array(tokens)
        self._file.write(arr.tobytes(order="C"))
        self._lengths.append(np.array([arr.size], dtype=np.int32))
        self._num_seqs += 1

    def end_document(self) -> None:
        """Close the current document (its sequences are those added since the last call)."""
        self._doc_idx.append(np.array([self._num_seqs], dtype=np.int64))

    def add_document(self, tokens, lengths: Sequence[int]) -> None:
        """Append one document whose ``tokens`` form sequences of ``lengths``."""
        arr = self._as_array(tokens)
        sizes = np.asarray(lengths, dtype=np.int32).reshape(-1)
        if int(sizes.sum()) != arr.size:
            raise ValueError(f"sequence lengths sum to {int(sizes.sum())} but the document has {arr.size} tokens")
        self._file.write(arr.tobytes(order="C"))
        self._lengths.append(sizes)
        self._num_seqs += len(sizes)
        self.end_document()

    def add_documents(self, tokens, doc_lengths: Sequence[int]) -> None:
        """Append many one-sequence documents at once: ``tokens`` concatenated, ``doc_lengths`` each."""
        arr = self._as_array(tokens)
        lengths = np.asarray(doc_lengths, dtype=np.int32).reshape(-1)
        if int(lengths.sum(dtype=np.int64)) != arr.size:
            raise ValueError(f"document lengths sum to {int(lengths.sum())} but {arr.size} tokens were given")
        self._file.write(arr.tobytes(order="C"))
        self._lengths.append(lengths)
        self._doc_idx.append(np.arange(self._num_seqs + 1, self._num_seqs + len(lengths) + 1, dtype=np.int64))
        self._num_seqs += len(lengths)

    def finalize(self, idx_path: Union[str, Path]) -> None:
        """Write the index and move both files to their final names (``.bin`` first)."""
        idx_path = os.fspath(idx_path)
        self._file.close()
        lengths = np.concatenate(self._lengths) if self._lengths else np.zeros(0, dtype=np.int32)
        doc_idx = np.concatenate(self._doc_idx)
        pointers = np.zeros(len(lengths), dtype=np.int64)
        if len(lengths) > 1:
            np.cumsum(lengths[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        with atomic_output(idx_path, "wb", durable=False) as f:
            f.write(MAGIC)
            f.write(struct.pack("<Q", VERSION))
            f.write(struct.pack("<B", dtype_code(self.dtype)))
            f.write(struct.pack("<Q", len(lengths)))
            f.write(struct.pack("<Q", len(doc_idx)))
            f.write(lengths.astype(np.int32).tobytes(order="C"))
            f.write(pointers.tobytes(order="C"))
            f.write(doc_idx.astype(np.int64).tobytes(order="C"))
            # the data first, then (leaving this block) the index: a reader never sees a new index without its data
            os.replace(self._tmp_bin, self.bin_path)

    def abort(self) -> None:
        """Close and delete the temporary ``.bin``; the final names are untouched (the temporary
        index only exists inside :meth:`finalize`, which removes it itself on failure)."""
        try:
            self._file.close()
        except OSError:
            pass
        if os.path.exists(self._tmp_bin):
            os.remove(self._tmp_bin)
