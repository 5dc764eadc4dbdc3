"""The ``.metadata`` index of a ``torch_dist`` checkpoint, checked before anything is read by it.

The index (``torch.distributed.checkpoint.metadata.Metadata``, unpickled by :mod:`.safe_load` without
running code) is data from disk, so every value it gives is checked: each data file it names
(``_StorageInfo.relative_path``) is a plain file name inside the iteration folder that is there and
holds the bytes given to it (no ``..``, not absolute, no symbolic link leading out: nothing outside
the folder is opened or even looked at); each tensor's chunks lie inside its global size, have the
bytes of their elements in their file, and cover it as a union (chunks may overlap; a hole is
refused); and a tensor's bytes fit in the data files' bytes, so no size the files cannot hold is
allocated. Each failure is one :class:`~tnlg.errors.UserError` naming the value. The check is linear in
the index's size however its pickle shares objects (:func:`check_index`).
"""

from __future__ import annotations

import bisect
import math
import os
from typing import Optional

import torch

from ...errors import UserError
from ...io import confined_path
from .safe_load import shown

__all__ = ["check_index"]

_MAX_GRID = 10_000_000  # cells of the coverage checks of all tensors (per tensor: the chunks' boundaries per
#                        dimension, multiplied)
_MAX_FILL_RATIO = 16  # how many times over a tensor's distinct chunks may cover its grid's cells, summed


def _bad(index: str, what: str) -> UserError:
    return UserError(f"torch_dist index {index!r}: {what}; it is damaged or was tampered with (a "
                     "torch.distributed.checkpoint index written by Megatron-LM gives none of this). Nothing was "
                     "written.")


def _whole(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _ints(value: object) -> Optional[tuple]:
    """``value`` as a tuple of non-negative ints (a ``torch.Size``, tuple or list of them), else ``None``."""
    if not isinstance(value, (tuple, list)) or len(value) > 64 or not all(_whole(v) for v in value):
        return None
    return tuple(value)


def _data_files(meta, iter_dir: str, index: str) -> tuple[dict, dict, int]:
    """``(storage, paths, total bytes)``: ``(key, chunk offsets or None) -> _StorageInfo`` and each named file's path,
    every name confined to ``iter_dir`` and every byte range inside its file."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import MetadataIndex
    if not isinstance(getattr(meta, "storage_data", None), dict) or not isinstance(
            getattr(meta, "state_dict_metadata", None), dict):
        raise _bad(index, "its storage_data or state_dict_metadata is not a mapping")
    storage, paths, sizes = {}, {}, {}
    for k, info in meta.storage_data.items():
        raw = getattr(k, "offset", None)
        offset = None if raw is None else _ints(raw)
        if not isinstance(k, MetadataIndex) or not isinstance(getattr(k, "fqn", None), str) or (
                raw is not None and offset is None):
            raise _bad(index, f"a storage entry's key is {shown(k)}, not a MetadataIndex of a name and offsets")
        if not isinstance(info, _StorageInfo) or not _whole(getattr(info, "offset", None)) or not _whole(
                getattr(info, "length", None)) or not hasattr(info, "relative_path"):
            raise _bad(index, f"the storage of {shown(k.fqn)} is {shown(info)}, not a file, byte offset and length")
        name = info.relative_path
        if not isinstance(name, str) or name not in paths:
            try:
                path = confined_path(iter_dir, name)
            except ValueError:
                raise _bad(index, f"the storage of {shown(k.fqn)} names the file {shown(name)}, which is not a plain "
                                  "file name inside the checkpoint's folder (no '/', no '..', not absolute, no "
                                  "symbolic link leading out); tnlg reads no file outside it") from None
            if not os.path.isfile(path):
                raise UserError(f"{path!r}, named by the torch_dist index of {iter_dir!r}, is missing. Nothing was "
                                "written.")
            paths[name], sizes[name] = path, os.path.getsize(path)
        if sizes[name] < info.offset + info.length:
            raise UserError(f"{paths[name]!r} is truncated: the torch_dist index needs {info.offset + info.length} "
                            f"bytes, it has {sizes[name]}. Nothing was written.")
        storage[(k.fqn, offset)] = info
    return storage, paths, sum(sizes.values())


class _Budget:
    """The cells the coverage checks of a whole index may allocate and fill (:data:`_MAX_GRID`)."""

    def __init__(self, index: str):
        self.index, self.grid, self.fill = index, _MAX_GRID, _MAX_FILL_RATIO * _MAX_GRID

    def spend(self, key: str, cells: int, filled: int) -> None:
        if cells > self.grid:
            raise _bad(self.index, f"{shown(key)} is split into chunks on a grid of {cells} cells, more than the "
                                   f"{_MAX_GRID} cells all the tensors of a checkpoint need together")
        if filled > self.fill or filled > _MAX_FILL_RATIO * cells:
            raise _bad(self.index, f"the chunks of {shown(key)} overlap each other {filled / cells:.0f}-fold (the same "
                                   f"elements in many chunks; a checkpoint's chunks overlap at most "
                                   f"{_MAX_FILL_RATIO}-fold)")
        self.grid, self.fill = self.grid - cells, self.fill - filled


def check_index(meta, iter_dir: str, index: str) -> tuple[dict, dict, dict]:
    """Check the index ``meta`` of the store in ``iter_dir`` (module docstring); returns ``(storage,
    paths, chunks)``: the storage record of each ``(key, chunk offsets)``, the path of each data file name
    and each tensor key's distinct chunks ``((offsets, sizes), ...)``.

    Linear in the index's size, however its pickle shares objects: a chunk list is read once however many
    records share it, a chunk listed twice is one chunk, a record is checked once however many keys share
    it; per key, its chunks' storage entries are looked up first (each lookup that succeeds is a distinct
    storage entry, the first that fails ends the check); and the coverage grids of all tensors together
    are bounded (:class:`_Budget`)."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata
    storage, paths, total = _data_files(meta, iter_dir, index)
    lists: dict[int, tuple] = {}  # id of a chunk list read -> its distinct chunks
    records: set[int] = set()  # ids of the records checked
    budget, chunks = _Budget(index), {}
    for key, md in meta.state_dict_metadata.items():
        if not isinstance(key, str) or not isinstance(md, (TensorStorageMetadata, BytesStorageMetadata)):
            raise _bad(index, f"the entry {shown(key)} is {shown(md)}, not the record of a tensor or an object")
        if not isinstance(md, TensorStorageMetadata):
            continue
        dtype, size = getattr(getattr(md, "properties", None), "dtype", None), _ints(getattr(md, "size", None))
        if not isinstance(dtype, torch.dtype) or size is None or not isinstance(getattr(md, "chunks", None), list):
            raise _bad(index, f"{shown(key)} has no element type, size and list of chunks")
        if id(md.chunks) not in lists:
            lists[id(md.chunks)] = _distinct(key, md.chunks, index)
        _check_storage(key, lists[id(md.chunks)], dtype.itemsize, storage, index)
        if id(md) not in records:
            _check_record(key, dtype, size, lists[id(md.chunks)], total, budget, index)
            records.add(id(md))
        chunks[key] = lists[id(md.chunks)]
    return storage, paths, chunks


def _distinct(key: str, listed: list, index: str) -> tuple:
    """The distinct ``(offsets, sizes)`` of a chunk list, in the order first listed (each chunk object read once)."""
    distinct: dict[tuple, None] = {}
    seen: set[int] = set()
    for chunk in listed:
        if id(chunk) in seen:
            continue
        seen.add(id(chunk))
        offsets, sizes = _ints(getattr(chunk, "offsets", None)), _ints(getattr(chunk, "sizes", None))
        if offsets is None or sizes is None:
            raise _bad(index, f"a chunk of {shown(key)} has no offsets and sizes (whole numbers)")
        distinct[(offsets, sizes)] = None
    return tuple(distinct)


def _check_storage(key: str, boxes: tuple, itemsize: int, storage: dict, index: str) -> None:
    """Each chunk of ``key`` has a storage entry with the bytes of its elements."""
    for offsets, sizes in boxes:
        info = storage.get((key, offsets))
        if info is None:
            raise _bad(index, f"the chunk of {shown(key)} at {list(offsets)} has no storage entry (no file holds it)")
        if math.prod(sizes) * itemsize > info.length:
            raise _bad(index, f"the chunk of {shown(key)} at {list(offsets)} needs {math.prod(sizes) * itemsize} "
                              f"bytes for its elements, its storage has {info.length}")


def _check_record(key: str, dtype: torch.dtype, size: tuple, boxes: tuple, total: int, budget: _Budget,
                  index: str) -> None:
    """One tensor record: its bytes fit the data files, its chunks are boxes inside it that cover it."""
    numel = math.prod(size)
    if numel * dtype.itemsize > total:
        raise _bad(index, f"{shown(key)} is declared of size {list(size)} ({dtype}: {numel * dtype.itemsize} "
                          f"bytes), more than the {total} bytes of all its data files")
    for offsets, sizes in boxes:
        if len(offsets) != len(size) or len(sizes) != len(size) or any(
                o + s > n for o, s, n in zip(offsets, sizes, size)):
            raise _bad(index, f"a chunk of {shown(key)} (size {list(size)}) is not a box inside it")
    if not _covers(size, boxes, key, budget):
        raise UserError(f"torch_dist index {index!r}: the chunks of {shown(key)} leave part of its {list(size)} "
                        "elements uncovered; the checkpoint is incomplete. Nothing was written.")


def _covers(size: tuple, boxes: tuple, key: str, budget: _Budget) -> bool:
    """Whether the union of ``boxes`` (``(offsets, sizes)``) is the whole box ``size``: on the grid of the
    boxes' boundaries, every cell is inside one of them (the grid's cells and the cells the boxes fill
    spent from ``budget``)."""
    if 0 in size:
        return True
    cuts = []
    for d, n in enumerate(size):
        edges = {0, n}
        for offsets, sizes in boxes:
            edges.update((offsets[d], offsets[d] + sizes[d]))
        cuts.append(sorted(edges))
    spans = [[(bisect.bisect_left(c, o), bisect.bisect_left(c, o + s)) for c, o, s in zip(cuts, offsets, sizes)]
             for offsets, sizes in boxes]
    budget.spend(key, math.prod(len(c) - 1 for c in cuts), sum(math.prod(b - a for a, b in span) for span in spans))
    grid = torch.zeros([len(c) - 1 for c in cuts], dtype=torch.bool)
    for span in spans:
        grid[tuple(slice(a, b) for a, b in span)] = True
    return bool(grid.all())
