"""Megatron's GPT dataset: fixed-length samples over shuffled documents, splits, blending, cached indices.

A sample is ``seq_length + 1`` consecutive tokens of one long stream: the split's
documents in a seeded order that is redrawn every epoch (each epoch visits every
document once), with samples crossing document boundaries; neighbouring samples
share one token (``tokens = sample[:-1]``, ``labels = sample[1:]``). The order of
samples is then shuffled again. As in Megatron (``megatron/core/datasets/gpt_dataset.py``),
three arrays describe this:

* ``doc_idx``: the document order of all epochs (document ids);
* ``sample_idx`` ``[N + 1, 2]``: ``(position in doc_idx, offset)`` where sample ``i``
  starts; sample ``i`` ends (inclusive) where sample ``i + 1`` starts;
* ``shuffle_idx`` ``[N]``: dataset index -> sample.

Unlike Megatron, every epoch is drawn on its own, from generators seeded by
``(seed, epoch)``: epoch ``e``'s document order, and the shuffle of the samples that
end in epoch ``e`` among themselves. Building for more epochs therefore appends to the
arrays and never changes what is already there, so a run resumed with another
``--train-iters`` or ``--global-batch-size`` (another number of samples) continues
with the very samples an uninterrupted run would have read (docs/data.md).

Enough epochs are built to cover ``num_samples`` (one epoch when it is 0/None).
The arrays are saved as ``.npy`` keyed by a hash of what decides them - a cheap
fingerprint of the data files (:meth:`IndexedDataset.fingerprint`), the documents,
``seq_length``, ``seed`` and the number of epochs - in ``<data dir>/index-cache/`` - or,
when that folder is not writable (a read-only corpus), in ``cache_dir`` /
``$TNLG_CACHE/index-cache`` - by one process under a file lock; other ranks wait
(``barrier``) and load them with ``mmap``. The corpus itself is memory-mapped too;
with one sequence per document (what preprocessing writes) no per-document array is
copied into a rank's memory.

Splits (``"949,50,1"``) are by whole documents, with Megatron's rounding; an empty
part gives ``None``. ``data_path=["0.7", "A", "0.3", "B"]`` blends datasets by weight:
sample ``i`` of the blend comes from the dataset whose ``k``-th sample is due
earliest (ideal time ``(k + 0.5) / weight``), so every prefix of the blend holds each
dataset within one sample of its share.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import weakref
from pathlib import Path
from typing import Callable, Optional, Protocol, Sequence, Union, cast

import numpy as np
import torch
import torch.distributed as dist

from ..errors import UserError
from ..io import atomic_output, atomic_write, file_lock
from .indexed import IndexedDataset, dataset_prefix
from .paths import default_cache_dir

__all__ = ["GPTDataset", "BlendedDataset", "build_train_valid_test_datasets", "parse_split", "split_bounds",
           "parse_data_path", "normalize_data_path", "build_index_arrays", "num_epochs", "epoch_sample_bounds", "blending_indices",
           "INDEX_VERSION"]

log = logging.getLogger(__name__)
INDEX_VERSION = 2  # bump when the index arrays change for the same inputs
SPLIT_NAMES = ("train", "valid", "test")


# ------------------------------------------------------------------------------ arguments

def parse_split(split: Union[str, Sequence[float]]) -> list[float]:
    """``"949,50,1"`` (or ``"949/50/1"``, or numbers) -> three weights summing to 1; missing parts are 0."""
    raw = split
    parts: Sequence[Union[str, float]]
    if isinstance(split, str):
        parts = [p for p in split.replace("/", ",").split(",") if p.strip() != ""]
    else:
        parts = list(split)
    try:
        values = [float(p) for p in parts]
    except (TypeError, ValueError):
        raise UserError(f"--split {raw!r} is not a list of numbers; use e.g. '949,50,1' "
                        "(train, validation, test weights).") from None
    if not 1 <= len(values) <= 3 or any(v < 0 or v != v for v in values) or sum(values) <= 0:
        raise UserError(f"--split {raw!r} must be 1 to 3 non-negative weights with a positive sum, "
                        "e.g. '949,50,1' or '100,0,0'.")
    values += [0.0] * (3 - len(values))
    total = sum(values)
    return [v / total for v in values]


def split_bounds(weights: Sequence[float], size: int) -> list[int]:
    """Megatron's ``get_split_indices``: ``[0, a, b, size]`` document boundaries of the three parts."""
    bounds = [0]
    for w in weights:
        bounds.append(bounds[-1] + int(round(w * float(size))))
    diff = bounds[-1] - size
    for i in range(1, len(bounds)):
        bounds[i] -= diff
    bounds = [min(max(b, 0), size) for b in bounds]
    return bounds


def parse_data_path(data_path: Union[str, Sequence[str]]) -> tuple[list[str], Optional[list[float]]]:
    """``["A"]`` -> ``(["A"], None)``; ``["0.7", "A", "0.3", "B"]`` -> ``(["A", "B"], [0.7, 0.3])``."""
    items = data_path.split() if isinstance(data_path, str) else [str(x) for x in data_path]
    if not items:
        raise UserError("--data-path is empty; pass a prefix such as 'data/corpus_text_document' "
                        "or weights and prefixes such as '0.7 A 0.3 B'.")
    if len(items) == 1:
        return [dataset_prefix(items[0])], None
    if len(items) % 2:
        raise UserError(f"--data-path {' '.join(items)!r} has {len(items)} entries; with several datasets give "
                        "weight/prefix pairs, e.g. '0.7 A 0.3 B'.")
    weights, prefixes = [], []
    for w, p in zip(items[0::2], items[1::2]):
        try:
            weight = float(w)
        except ValueError:
            raise UserError(f"--data-path: {w!r} should be a weight before prefix {p!r}; use weight/prefix "
                            "pairs such as '0.7 A 0.3 B'.") from None
        if not weight > 0:
            raise UserError(f"--data-path: the weight of {p!r} is {w}; weights must be positive.")
        weights.append(weight)
        prefixes.append(dataset_prefix(p))
    total = sum(weights)
    return prefixes, [w / total for w in weights]


def normalize_data_path(data_path: Union[str, Sequence[str]]) -> list[str]:
    """``--data-path`` as given, checked, with each dataset written as its prefix (``X.bin`` -> ``X``;
    weights kept as given): what the options and the checkpoints record."""
    items = data_path.split() if isinstance(data_path, str) else [str(x) for x in data_path]
    prefixes, weights = parse_data_path(items)
    if weights is None:
        return prefixes
    return [x for w, p in zip(items[0::2], prefixes) for x in (w, p)]


# ------------------------------------------------------------------------------ index arrays

def num_epochs(tokens_per_epoch: int, seq_length: int, num_samples: int) -> int:
    """Epochs needed for ``num_samples`` samples of ``seq_length`` (+1) tokens: the smallest ``E`` with
    ``(E * tokens_per_epoch - 1) // seq_length >= num_samples``; 1 when ``num_samples`` is 0."""
    if tokens_per_epoch < 2:
        raise UserError(f"the documents of this split hold {tokens_per_epoch} token(s); a sample needs at least 2.")
    if num_samples <= 0:
        return 1
    epochs = max(1, -(-(num_samples * seq_length + 1) // tokens_per_epoch))
    while (epochs * tokens_per_epoch - 1) // seq_length < num_samples:
        epochs += 1
    return epochs


def _epoch_rng(seed: int, epoch: int, stream: int) -> np.random.Generator:
    """The generator of one epoch: stream 0 orders its documents, stream 1 shuffles its samples. Seeded by
    ``(seed, epoch, stream)`` alone, so an epoch comes out the same however many epochs are built."""
    return np.random.default_rng([seed, epoch, stream])


def epoch_sample_bounds(tokens_per_epoch: int, seq_length: int, epochs: int) -> np.ndarray:
    """``[E + 1]`` sample boundaries: epoch ``e`` owns samples ``bounds[e] .. bounds[e + 1]``, those that
    end (last token) in it; ``bounds[e] = (e * tokens_per_epoch - 1) // seq_length`` (0 for ``e = 0``)."""
    e = np.arange(epochs + 1, dtype=np.int64)
    return np.maximum(0, (e * tokens_per_epoch - 1) // seq_length)


def build_index_arrays(sizes: np.ndarray, documents: np.ndarray, seq_length: int, num_samples: int,
                       seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(doc_idx, sample_idx, shuffle_idx)`` for documents ``documents`` of lengths ``sizes[documents]``.

    Same layout and meaning as Megatron's arrays (see the module docstring), but
    every epoch is drawn on its own (:func:`_epoch_rng`): epoch ``e``'s document
    order is a permutation seeded by ``(seed, e, 0)``, and the samples that end in
    epoch ``e`` (:func:`epoch_sample_bounds`) are shuffled among themselves by
    ``(seed, e, 1)``. So the arrays for ``E`` epochs are a prefix of those for more
    epochs: asking for more or fewer samples (a resumed run with another
    ``--train-iters`` or ``--global-batch-size``) keeps the order of every sample
    both runs have. ``sample_idx`` is computed with numpy (``searchsorted`` over the
    stream positions ``i * seq_length``) and equals Megatron's C++ loop for the same ``doc_idx``.
    """
    documents = np.asarray(documents, dtype=np.int64)
    if int(seed) < 0:
        raise UserError(f"--seed must be a non-negative integer for the data order, got {seed}.")
    tokens_per_epoch = int(sizes[documents].sum(dtype=np.int64))
    epochs = num_epochs(tokens_per_epoch, seq_length, num_samples)
    doc_dtype = np.int32 if len(sizes) < 2 ** 31 else np.int64
    doc_idx = np.concatenate([_epoch_rng(seed, e, 0).permutation(documents) for e in range(epochs)]
                             ).astype(doc_dtype)

    total_samples = (epochs * tokens_per_epoch - 1) // seq_length
    cum = np.zeros(len(doc_idx) + 1, dtype=np.int64)
    np.cumsum(sizes[doc_idx], out=cum[1:])
    starts = np.arange(total_samples + 1, dtype=np.int64) * seq_length
    pos = np.searchsorted(cum, starts, side="right") - 1
    idx_dtype = np.int32 if len(doc_idx) < 2 ** 31 else np.int64
    sample_idx = np.stack([pos, starts - cum[pos]], axis=1).astype(idx_dtype)

    bounds = epoch_sample_bounds(tokens_per_epoch, seq_length, epochs)
    assert bounds[-1] == total_samples
    shuffle_dtype = np.uint32 if total_samples < 2 ** 32 - 1 else np.int64
    shuffle_idx = np.empty(total_samples, dtype=shuffle_dtype)
    for e in range(epochs):
        a, b = int(bounds[e]), int(bounds[e + 1])
        shuffle_idx[a:b] = _epoch_rng(seed, e, 1).permutation(b - a) + a
    return doc_idx, sample_idx, shuffle_idx


def _writable_dir(path: Path) -> bool:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    return os.access(path, os.W_OK | os.X_OK)


def _cache_dirs(prefix: str, cache_dir: Optional[Union[str, Path]]) -> list[Path]:
    """Folders to look in, in order; the first writable one is where indices are built."""
    if cache_dir is not None:
        return [Path(cache_dir).expanduser()]
    return [Path(os.path.dirname(os.path.abspath(prefix))) / "index-cache", default_cache_dir() / "index-cache"]


class _Units:
    """Where each sampling unit (a document; a sequence for non-contiguous files) lies in ``.bin``.

    ``ptr[u]`` (byte offset) and ``size[u]`` (tokens) of unit ``u``; ``doc_to_unit(d)``.
    In the usual case - one sequence per document, as preprocessing writes - these
    are the memory-mapped ``.idx`` arrays themselves: nothing is copied or computed
    per document, whatever the corpus size. Documents of several sequences lying back
    to back get computed arrays (one int64 pair per document); otherwise the units are
    the sequences. Built once per :class:`IndexedDataset` (:func:`_units_of`).
    """

    def __init__(self, ds: IndexedDataset):
        self.itemsize = ds.dtype.itemsize
        self._doc_to_unit: Optional[np.ndarray] = None
        if ds.one_sequence_per_document:
            self.ptr, self.size = ds.sequence_pointers, ds.sequence_lengths
            self.are_documents = True
        elif ds.contiguous:
            lengths = ds.sequence_lengths.astype(np.int64)
            cum = np.zeros(len(lengths) + 1, dtype=np.int64)
            np.cumsum(lengths, out=cum[1:])
            d = ds.document_indices
            start = cum[d[:-1]]
            self.size = cum[d[1:]] - start
            self.ptr = start * self.itemsize
            self.are_documents = True
        else:
            self.ptr, self.size = ds.sequence_pointers, ds.sequence_lengths
            self._doc_to_unit = ds.document_indices
            self.are_documents = False

    def doc_to_unit(self, doc: int) -> int:
        if self._doc_to_unit is None:
            return int(doc)
        return int(self._doc_to_unit[doc])

    def __len__(self) -> int:
        return len(self.size)


_UNITS: "weakref.WeakKeyDictionary[IndexedDataset, _Units]" = weakref.WeakKeyDictionary()


def _units_of(ds: IndexedDataset) -> _Units:
    """The :class:`_Units` of ``ds``, shared by its train/valid/test datasets."""
    if ds not in _UNITS:
        _UNITS[ds] = _Units(ds)
    return _UNITS[ds]


class GPTDataset(torch.utils.data.Dataset):
    """Samples of ``seq_length`` tokens (+1 for labels) from documents ``[doc_begin, doc_end)`` of one corpus.

    ``ds[i]`` -> ``{"tokens", "labels"}`` int64 ``[seq]``, ``"loss_mask"`` float32 ``[seq]``
    (0 where the target is the end-of-document id with ``eod_mask_loss``), and with
    ``reset_position_ids``/``reset_attention_mask`` also ``"position_ids"`` int64
    ``[seq]`` (restarting at 0 after every end-of-document token when resetting) and
    ``"attention_mask"`` int64 ``[seq]``: each position's document (the position where it starts when
    resetting, else 0: one document), from which attention builds the causal mask within documents
    (:func:`tnlg.parallel.masks.document_mask`). Use :func:`build_train_valid_test_datasets`.
    """

    def __init__(self, indexed: IndexedDataset, name: str, doc_begin: int, doc_end: int, seq_length: int,
                 num_samples: int, seed: int, cache_dir: Optional[Union[str, Path]] = None,
                 eod_id: Optional[int] = None, eod_mask_loss: bool = False, reset_position_ids: bool = False,
                 reset_attention_mask: bool = False, vocab_size: Optional[int] = None, build: bool = True):
        if not isinstance(seq_length, int) or seq_length < 1:
            raise UserError(f"seq_length must be a positive integer, got {seq_length!r}.")
        if (eod_mask_loss or reset_position_ids or reset_attention_mask) and eod_id is None:
            raise UserError("--eod-mask-loss / --reset-position-ids / --reset-attention-mask need the "
                            "end-of-document token id (eod_id); pass the tokenizer's eod_id.")
        self.indexed, self.name = indexed, name
        self.doc_begin, self.doc_end = int(doc_begin), int(doc_end)
        self.seq_length, self.num_samples, self.seed = seq_length, int(num_samples or 0), int(seed)
        self.eod_id, self.eod_mask_loss = eod_id, eod_mask_loss
        self.reset_position_ids, self.reset_attention_mask = reset_position_ids, reset_attention_mask
        self.vocab_size, self._cache_dir = vocab_size, cache_dir
        self.units = _units_of(indexed)
        self.unit_begin = self.units.doc_to_unit(self.doc_begin)
        self.unit_end = self.units.doc_to_unit(self.doc_end)
        if self.unit_end <= self.unit_begin:
            raise UserError(f"{self.name} split of {indexed.path_prefix!r} has no documents.")
        tokens = int(self.units.size[self.unit_begin:self.unit_end].sum(dtype=np.int64))
        self.num_epochs = num_epochs(tokens, seq_length, self.num_samples)
        self._load_or_build(build)

    # pickling (DataLoader workers started with spawn): reopen the maps, do not copy the arrays
    _MAPPED = ("units", "doc_idx", "sample_idx", "shuffle_idx", "_doc_idx", "_sample_idx", "_shuffle_idx")

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k not in self._MAPPED}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.units = _units_of(self.indexed)
        if not self._try_load({k: Path(v) for k, v in self.cache_paths.items()}):
            raise RuntimeError(f"the index files {sorted(self.cache_paths.values())} changed or vanished while "
                               "the dataset was being sent to a worker process")

    # ---------------------------------------------------------------- cache
    def description(self) -> dict:
        prefix = self.indexed.path_prefix
        # everything the arrays depend on: the data (a cheap fingerprint, not a hash of a GBs-large .idx),
        # the documents, seq_length, seed and the number of epochs (not num_samples: runs asking for
        # different numbers of samples within the same epochs share one set of arrays)
        return {"class": "GPTDataset", "index_version": INDEX_VERSION, "dataset": os.path.basename(prefix),
                "fingerprint": self.indexed.fingerprint(), "bin_size": self.indexed.bin_size,
                "split": self.name, "documents": [self.doc_begin, self.doc_end],
                "units": [self.unit_begin, self.unit_end], "seq_length": self.seq_length,
                "num_epochs": self.num_epochs, "seed": self.seed}

    def _paths(self, folder: Path) -> dict[str, Path]:
        stem = f"{os.path.basename(self.indexed.path_prefix)}-{self.name}-{self._key}"
        return {k: folder / f"{stem}-{k}.npy" for k in ("doc_idx", "sample_idx", "shuffle_idx")} | {
            "meta": folder / f"{stem}-meta.json", "lock": folder / f"{stem}.lock"}

    def _load_or_build(self, build: bool) -> None:
        desc = self.description()
        self._key = hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).hexdigest()[:16]
        folders = _cache_dirs(self.indexed.path_prefix, self._cache_dir)
        for folder in folders:
            if self._try_load(self._paths(folder)):
                return
        if not build:
            raise FileNotFoundError("index not built yet")
        target = next((f for f in folders if _writable_dir(f)), None)
        if target is None:
            raise UserError(f"cannot cache the dataset indices: none of {[str(f) for f in folders]} is writable "
                            "(the data folder is read-only?). Pass a writable --data-cache-path or set TNLG_CACHE.")
        paths = self._paths(target)
        with file_lock(paths["lock"]):
            if self._try_load(paths):
                return
            doc_idx, sample_idx, shuffle_idx = build_index_arrays(
                self.units.size, np.arange(self.unit_begin, self.unit_end), self.seq_length, self.num_samples,
                self.seed)
            max_token, min_token = self._token_range()
            for k, arr in (("doc_idx", doc_idx), ("sample_idx", sample_idx), ("shuffle_idx", shuffle_idx)):
                with atomic_output(paths[k], "wb", durable=False) as f:  # a rebuildable cache
                    np.save(f, arr, allow_pickle=False)
            assert len(doc_idx) == self.num_epochs * (self.unit_end - self.unit_begin)
            meta = dict(desc, total_samples=int(len(shuffle_idx)), max_token=max_token, min_token=min_token)
            # written last: the marker that the arrays are complete
            atomic_write(paths["meta"], json.dumps(meta, indent=1), durable=False)
            log.info("built %s indices of %s in %s", self.name, self.indexed.path_prefix, target)
            if not self._try_load(paths):
                raise RuntimeError(f"index files in {target} could not be read back")

    def _try_load(self, paths: dict[str, Path]) -> bool:
        try:
            meta = json.loads(paths["meta"].read_text())
        except (OSError, ValueError):
            return False
        desc = self.description()
        if {k: meta.get(k) for k in desc} != desc:
            return False
        try:
            self.doc_idx = np.load(paths["doc_idx"], mmap_mode="r", allow_pickle=False)
            self.sample_idx = np.load(paths["sample_idx"], mmap_mode="r", allow_pickle=False)
            self.shuffle_idx = np.load(paths["shuffle_idx"], mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError):
            return False
        if len(self.sample_idx) != len(self.shuffle_idx) + 1:
            return False
        self.meta = meta
        self.cache_paths = {k: str(v) for k, v in paths.items() if k != "lock"}
        self._check_vocab()
        # plain ndarray views of the same maps (no copy): scalar indexing skips np.memmap's overhead
        self._doc_idx = np.asarray(self.doc_idx)
        self._sample_idx = np.asarray(self.sample_idx)
        self._shuffle_idx = np.asarray(self.shuffle_idx)
        return True

    # ---------------------------------------------------------------- vocab check
    def _unit_tokens(self, u: int) -> np.ndarray:
        a = int(self.units.ptr[u]) // self.units.itemsize
        return self.indexed._tokens[a:a + int(self.units.size[u])]

    def _span(self) -> tuple[int, int]:
        """Token range ``[a, b)`` of this split's units (contiguous files only)."""
        units, last = self.units, self.unit_end - 1
        return (int(units.ptr[self.unit_begin]) // units.itemsize,
                int(units.ptr[last]) // units.itemsize + int(units.size[last]))

    def _token_range(self) -> tuple[Optional[int], Optional[int]]:
        tokens = self.indexed._tokens
        if tokens.size == 0:
            return None, None
        if self.indexed.contiguous:
            a, b = self._span()
            span = tokens[a:b]  # a view of the map: max/min stream through it without a copy
            return (int(span.max()), int(span.min())) if span.size else (None, None)
        mx, mn = None, None
        for u in range(self.unit_begin, self.unit_end):
            t = self._unit_tokens(u)
            if t.size:
                mx = int(t.max()) if mx is None else max(mx, int(t.max()))
                mn = int(t.min()) if mn is None else min(mn, int(t.min()))
        return mx, mn

    def _first_out_of_vocab(self, v: int) -> tuple[int, int]:
        """``(unit, token id)`` of the first token outside ``[0, v)`` (``v``: the vocabulary size) in this split."""
        tokens, units = self.indexed._tokens, self.units
        if self.indexed.contiguous:
            a, b = self._span()
            step = 1 << 24
            for c in range(a, b, step):
                chunk = tokens[c:min(b, c + step)]
                hits = np.flatnonzero((chunk >= v) | (chunk < 0))
                if hits.size:
                    pos = c + int(hits[0])
                    u = self.unit_begin + int(np.searchsorted(units.ptr[self.unit_begin:self.unit_end],
                                                              pos * units.itemsize, side="right")) - 1
                    return u, int(chunk[hits[0]])
        else:
            for u in range(self.unit_begin, self.unit_end):
                t = self._unit_tokens(u)
                hits = np.flatnonzero((t >= v) | (t < 0))
                if hits.size:
                    return u, int(t[hits[0]])
        raise AssertionError("the cached token range disagrees with the data")

    def _check_vocab(self) -> None:
        if self.vocab_size is None or self.meta.get("max_token") is None:
            return
        if self.meta["max_token"] < self.vocab_size and self.meta["min_token"] >= 0:
            return
        u, bad = self._first_out_of_vocab(self.vocab_size)
        where = f"document {u}" if self.units.are_documents else f"sequence {u}"
        raise UserError(f"{where} of {self.indexed.path_prefix!r} holds token id {bad}, outside the "
                        f"vocabulary of {self.vocab_size} tokens (valid ids 0..{self.vocab_size - 1}). "
                        "Was the corpus preprocessed with another tokenizer? Preprocess it with the "
                        "tokenizer you train with, or pass that tokenizer.")

    # ---------------------------------------------------------------- samples
    def __len__(self) -> int:
        return len(self._shuffle_idx)

    def get_tokens(self, idx: int) -> np.ndarray:
        """The ``seq_length + 1`` tokens of dataset index ``idx`` (after the sample shuffle)."""
        j = int(self._shuffle_idx[idx])
        d0, o0 = self._sample_idx[j]
        d1, o1 = self._sample_idx[j + 1]
        ptr, size, isz, tokens = self.units.ptr, self.units.size, self.units.itemsize, self.indexed._tokens
        if d0 == d1:
            s = ptr[self._doc_idx[d0]] // isz + o0
            return tokens[s:s + (o1 - o0 + 1)]
        u = self._doc_idx[d0]
        start = ptr[u] // isz
        parts = [tokens[start + o0:start + size[u]]]
        for k in range(d0 + 1, d1):
            u = self._doc_idx[k]
            start = ptr[u] // isz
            parts.append(tokens[start:start + size[u]])
        u = self._doc_idx[d1]
        start = ptr[u] // isz
        parts.append(tokens[start:start + o1 + 1])
        return np.concatenate(parts)

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        if idx < 0:
            idx += len(self)
        if not 0 <= idx < len(self):
            raise IndexError(f"sample {idx} out of range for {len(self)} samples")
        sample = torch.from_numpy(self.get_tokens(idx).astype(np.int64))
        return _make_item(sample, self.eod_id, self.eod_mask_loss, self.reset_position_ids,
                          self.reset_attention_mask)

    def __repr__(self) -> str:
        return (f"GPTDataset({self.name}, {self.indexed.path_prefix!r}, documents {self.doc_begin}..{self.doc_end}, "
                f"seq_length={self.seq_length}, samples={len(self)})")


def _make_item(sample: torch.Tensor, eod_id: Optional[int], eod_mask_loss: bool, reset_position_ids: bool,
               reset_attention_mask: bool) -> dict[str, torch.Tensor]:
    tokens, labels = sample[:-1], sample[1:]
    seq = tokens.shape[0]
    loss_mask = torch.ones(seq, dtype=torch.float32)
    if eod_mask_loss:
        loss_mask[labels == eod_id] = 0.0
    item = {"tokens": tokens, "labels": labels, "loss_mask": loss_mask}
    if reset_position_ids or reset_attention_mask:
        is_eod = cast(torch.Tensor, tokens == eod_id)  # (eod_id is set: GPTDataset checks it for these flags)
        # segment of each position: number of end-of-document tokens strictly before it
        seg = torch.zeros(seq, dtype=torch.int64)
        seg[1:] = torch.cumsum(is_eod[:-1].to(torch.int64), 0)
        arange = torch.arange(seq, dtype=torch.int64)
        if reset_position_ids:
            seg_start = torch.zeros(int(seg[-1]) + 1, dtype=torch.int64)
            seg_start[1:] = torch.nonzero(is_eod[:-1]).flatten()[: int(seg[-1])] + 1
            item["position_ids"] = arange - seg_start[seg]
        else:
            item["position_ids"] = arange
        # the documents as ids (one document when not resetting): attention builds the block-causal mask
        starts = torch.zeros(int(seg[-1]) + 1, dtype=torch.int64)  # (a document's id: where it starts)
        starts[1:] = torch.nonzero(is_eod[:-1]).flatten()[: int(seg[-1])] + 1
        item["attention_mask"] = starts[seg] if reset_attention_mask else torch.zeros(seq, dtype=torch.int64)
    return item


# ------------------------------------------------------------------------------ blending

def blending_indices(weights: Sequence[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """``(dataset_index, dataset_sample_index)`` of a blend of ``size`` samples.

    The ``k``-th sample of dataset ``d`` is due at ``(k + 0.5) / weight_d``; the blend
    takes samples in order of due time (ties: lower ``d`` first). Every prefix of
    length ``n`` holds ``round(weight_d * n)`` samples of ``d`` to within one sample.
    """
    w = np.asarray(weights, dtype=np.float64)
    w = w / w.sum()
    times, owners, ranks = [], [], []
    for d, wd in enumerate(w):
        k = np.arange(int(np.ceil(wd * size)) + 2, dtype=np.int64)
        times.append((k + 0.5) / wd)
        owners.append(np.full(len(k), d, dtype=np.int16))
        ranks.append(k)
    t, o, r = np.concatenate(times), np.concatenate(owners), np.concatenate(ranks)
    order = np.argsort(t, kind="stable")[:size]
    return o[order], r[order]


class SizedDataset(Protocol):
    """A map-style dataset with a length (what :class:`BlendedDataset` draws from)."""

    def __len__(self) -> int: ...

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]: ...


class BlendedDataset(torch.utils.data.Dataset):
    """``size`` samples drawn from ``datasets`` by ``weights`` (see :func:`blending_indices`)."""

    def __init__(self, datasets: Sequence[SizedDataset], weights: Sequence[float], size: int):
        self.datasets = list(datasets)
        self.weights = [float(w) / sum(weights) for w in weights]
        self.size = int(size)
        self.dataset_index, self.dataset_sample_index = blending_indices(self.weights, self.size)
        for d, ds in enumerate(self.datasets):
            need = int(self.dataset_sample_index[self.dataset_index == d].max(initial=-1)) + 1
            if need > len(ds):
                raise RuntimeError(f"blended dataset {d} has {len(ds)} samples but the blend needs {need}")

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        if idx < 0:
            idx += self.size
        if not 0 <= idx < self.size:
            raise IndexError(f"sample {idx} out of range for {self.size} samples")
        return self.datasets[int(self.dataset_index[idx])][int(self.dataset_sample_index[idx])]


# ------------------------------------------------------------------------------ entry point

def _default_is_builder() -> bool:
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def build_train_valid_test_datasets(
        data_path: Union[str, Sequence[str]], split: Union[str, Sequence[float]], seq_length: int,
        num_samples: Sequence[int], seed: int, cache_dir: Optional[Union[str, Path]] = None,
        eod_id: Optional[int] = None, eod_mask_loss: bool = False, reset_position_ids: bool = False,
        reset_attention_mask: bool = False, vocab_size: Optional[int] = None,
        barrier: Optional[Callable[[], None]] = None, is_builder: Optional[bool] = None,
) -> tuple[Optional[torch.utils.data.Dataset], Optional[torch.utils.data.Dataset],
           Optional[torch.utils.data.Dataset]]:
    """Train, validation and test datasets (``None`` for an empty split), Megatron style.

    ``data_path``: ``["PREFIX"]`` or ``["W1", "PREFIX1", "W2", "PREFIX2", ...]``;
    ``split``: ``"949,50,1"``; ``num_samples``: samples wanted per split (0 = one epoch).
    ``cache_dir`` (``--data-cache-path``): where index arrays go; default next to the
    data, or ``$TNLG_CACHE/index-cache`` when that folder is read-only.
    ``vocab_size``: refuse data with token ids outside ``[0, vocab_size)``.

    Call it on every rank. With ``barrier`` (e.g. ``torch.distributed.barrier``), the
    builder (``is_builder``, default global rank 0) builds missing indices first, then
    every rank calls ``barrier()`` once, then the others load (building themselves,
    under the same file lock, only if they cannot see the builder's files). Without a
    barrier each rank builds-or-loads under a file lock. No collective runs here
    except the ``barrier`` you pass.
    """
    prefixes, weights = parse_data_path(data_path)
    split_weights = parse_split(split)
    if len(num_samples) != 3:
        raise UserError(f"num_samples must give train, valid and test counts, got {num_samples!r}.")
    if is_builder is None:
        is_builder = _default_is_builder()
    opts = dict(seq_length=seq_length, seed=seed, cache_dir=cache_dir, eod_id=eod_id, eod_mask_loss=eod_mask_loss,
                reset_position_ids=reset_position_ids, reset_attention_mask=reset_attention_mask,
                vocab_size=vocab_size)

    def make() -> list:
        indexed = [IndexedDataset(p) for p in prefixes]
        out = []
        for s, name in enumerate(SPLIT_NAMES):
            parts = []
            for ds in indexed:
                b = split_bounds(split_weights, ds.num_documents)
                parts.append((ds, b[s], b[s + 1]))
            out.append(_build_split(name, parts, weights, int(num_samples[s] or 0), opts))
        return out

    if barrier is None:
        return tuple(make())
    result = make() if is_builder else None
    barrier()
    if result is None:
        result = make()
    return tuple(result)


def _build_split(name: str, parts: list, weights: Optional[list[float]], num_samples: int, opts: dict):
    live = [(i, p) for i, p in enumerate(parts) if p[2] > p[1]]
    if not live:
        log.info("the %s split is empty (no documents); it is skipped", name)
        return None
    if weights is None:
        ds, a, b = live[0][1]
        return GPTDataset(ds, name, a, b, num_samples=num_samples, **opts)
    if len(live) < len(parts):
        missing = [parts[i][0].path_prefix for i in range(len(parts)) if i not in dict(live)]
        log.warning("the %s split of %s is empty; blending the others with renormalised weights", name, missing)
    w = [weights[i] for i, _ in live]
    total = sum(w)
    w = [x / total for x in w]
    if num_samples > 0:
        dataset_index, _ = blending_indices(w, num_samples)
        counts = np.bincount(dataset_index, minlength=len(live))
        members = [GPTDataset(ds, name, a, b, num_samples=int(max(c, 1)), **opts)
                   for c, (_, (ds, a, b)) in zip(counts, live)]
        return BlendedDataset(members, w, num_samples)
    members = [GPTDataset(ds, name, a, b, num_samples=0, **opts) for _, (ds, a, b) in live]
    size = int(min(len(m) / wd for m, wd in zip(members, w)))
    return BlendedDataset(members, w, max(size, 1))
