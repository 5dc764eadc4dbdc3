"""The weight files of a Hugging Face ``save_pretrained`` folder, read by tnlg itself (not through
``from_pretrained``, which fills a tensor the files lack with random values).

Which files, in transformers' order: ``model.safetensors``, else ``model.safetensors.index.json`` and the
shards its ``weight_map`` names, else ``pytorch_model.bin``, else ``pytorch_model.bin.index.json`` and its
shards. A shard is named by a plain file name in the folder (no ``/``, no ``..``). A file that is a link
must resolve inside the folder, or, for a folder of the Hugging Face cache (``.../snapshots/REV``, whose
files are links into the repository's ``blobs``), inside that ``blobs`` folder (:func:`inside`).

A safetensors file is checked from its header before any tensor is read (:func:`_safetensors_header`): the
8-byte length within the file and at most 100 MiB, JSON of ``{name: {dtype, shape, data_offsets}}``, every
dtype one tnlg reads (``F16``, ``BF16``, ``F32``, ``F64``), every byte range inside the file and of the
size its shape and dtype say. So :func:`weight_index` knows every tensor's name, dtype and shape from the
headers alone, and the reader compares them with the model the config describes before reading data.
A ``pytorch_model.bin`` is a pickle: read with ``torch.load(weights_only=True)`` after
``get_unsafe_globals_in_checkpoint`` named no global (a pickle that calls ``os.system`` is refused, not
run), memory-mapped when it is a zip archive. Every failure is one :class:`UserError` paragraph.
"""

from __future__ import annotations

import io
import json
import math
import os
import struct
from typing import NamedTuple

import torch

from ..errors import UserError
from .megatron.safe_load import reason, runs_code, shown

__all__ = ["SAFETENSORS", "SAFETENSORS_INDEX", "BIN", "BIN_INDEX", "Entry", "WeightFiles", "weight_files", "inside"]

SAFETENSORS, SAFETENSORS_INDEX = "model.safetensors", "model.safetensors.index.json"
BIN, BIN_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"
MAX_HEADER = 100 * 2**20  # safetensors' own limit on a header
MAX_INDEX = 64 * 2**20
DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64}
_NAMES = {v: k for k, v in DTYPES.items()}
_NOTHING = "Nothing was written."


class Entry(NamedTuple):
    """One tensor of the folder: the file holding it (a name in the folder), its dtype (safetensors'
    name) and shape."""
    file: str
    dtype: str
    shape: tuple


def _bad(folder: str, what: str) -> UserError:
    return UserError(f"Hugging Face folder {folder!r}: {what} {_NOTHING}")


def inside(folder: str, name: str) -> str:
    """``folder/name``, refused in one paragraph when it resolves outside the folder (a link out), except
    into the ``blobs`` of the Hugging Face cache repository a ``snapshots/REV`` folder belongs to."""
    path = os.path.join(folder, name)
    real, home = os.path.realpath(path), os.path.realpath(folder)
    roots = [home]
    if os.path.basename(os.path.dirname(home)) == "snapshots":
        roots.append(os.path.join(os.path.dirname(os.path.dirname(home)), "blobs"))
    if not any(real.startswith(root + os.sep) for root in roots):
        raise _bad(folder, f"{name} is a link to {real!r}, outside the folder; tnlg reads a folder's own files "
                   "(or, in the Hugging Face cache, its blobs).")
    return path


def _shard_name(folder: str, index: str, name) -> str:
    if (not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\\" in name or "\0" in name
            or len(name) > 255):
        raise _bad(folder, f"{index} names the file {shown(name)}; a shard must be a file name inside the folder "
                   "(no path separators, no '..').")
    return name


def _read_index(folder: str, index: str) -> dict[str, str]:
    """``{tensor name: shard file name}`` of an ``*.index.json``."""
    path = inside(folder, index)
    try:
        if os.path.getsize(path) > MAX_INDEX:
            raise ValueError(f"{os.path.getsize(path)} bytes, more than {MAX_INDEX}")
        with open(path, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as exc:
        raise _bad(folder, f"{index} cannot be read as a shard index ({reason(exc)}); it must be JSON with a "
                   "'weight_map' of tensor names to shard files.") from None
    if not isinstance(weight_map, dict) or not weight_map:
        raise _bad(folder, f"{index}'s weight_map is {shown(weight_map)}; it must map tensor names to shard files.")
    return {str(k): _shard_name(folder, index, v) for k, v in weight_map.items()}


def _check_entry(folder: str, file: str, name: str, info, data_size: int) -> Entry:
    """The :class:`Entry` of one header record, checked: a dtype tnlg reads, a shape of non-negative
    integers, a byte range inside the data of exactly the shape's size."""
    where = f"{file}'s tensor {name[:100]!r}"
    if not isinstance(info, dict):
        raise _bad(folder, f"{where} is described by {shown(info)}, not a record of dtype, shape, data_offsets.")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise _bad(folder, f"{where} has dtype {shown(dtype)}; tnlg reads floating-point weights stored as "
                   f"{', '.join(DTYPES)} (a quantized or integer tensor is not one).")
    if (not isinstance(shape, list) or len(shape) > 8
            or not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2**48 for d in shape)):
        raise _bad(folder, f"{where} has shape {shown(shape)}; a shape is a list of non-negative integers.")
    size = math.prod(shape) * DTYPES[dtype].itemsize
    pair = offsets if isinstance(offsets, list) and len(offsets) == 2 else [-1, -1]
    begin, end = (o if isinstance(o, int) and not isinstance(o, bool) else -1 for o in pair)
    if not 0 <= begin <= end <= data_size or end - begin != size:
        raise _bad(folder, f"{where} ({dtype} {shape}, {size} bytes) has data_offsets {shown(offsets)} in a data "
                   f"section of {data_size} bytes; the file is damaged or truncated.")
    return Entry(file, dtype, tuple(shape))


def _safetensors_header(folder: str, file: str) -> dict[str, Entry]:
    """Every tensor of one safetensors file, from its checked header (module docstring)."""
    path = inside(folder, file)
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
            if not 2 <= n <= min(MAX_HEADER, size - 8):
                raise _bad(folder, f"{file} is not a safetensors file: its header length is "
                           f"{n if n <= 2**64 // 2 else 'over 2^63'} bytes in a file of {size} bytes (at most "
                           f"{MAX_HEADER} and inside the file).")
            header = json.loads(f.read(n))
    except UserError:
        raise
    except (OSError, ValueError, RecursionError) as exc:
        raise _bad(folder, f"{file} cannot be read as safetensors ({reason(exc)}).") from None
    if not isinstance(header, dict):
        raise _bad(folder, f"{file}'s safetensors header is {shown(header)}, not a record of tensors.")
    data = size - 8 - n
    return {str(k): _check_entry(folder, file, str(k), v, data) for k, v in header.items() if k != "__metadata__"}


def _load_bin(folder: str, file: str) -> dict:
    """A ``pytorch_model.bin`` (module docstring): ``{name: tensor}``, nothing unpickled but tensors."""
    path = inside(folder, file)
    try:
        globs = torch.serialization.get_unsafe_globals_in_checkpoint(path)
        zipped = True
    except Exception:  # noqa: BLE001 - not a zip archive: torch < 1.6's format, or damaged (torch.load says)
        globs, zipped = [], False
    for name in globs:
        why = "asks to run code when it is unpickled" if runs_code(name) else "holds an object that is not a tensor"
        raise _bad(folder, f"{file} {why} (it names {name[:80]}): a weight file holds tensors, and tnlg never "
                   "unpickles anything else from one. Do not load it with other tools either.")
    try:
        if zipped:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        else:
            with open(path, "rb") as f:
                state = torch.load(io.BytesIO(f.read()), map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any failure of a stranger's pickle is one paragraph
        raise _bad(folder, f"{file} cannot be loaded as a PyTorch weight file ({reason(exc)}); it is damaged, "
                   "truncated or not one.") from None
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                              for k, v in state.items()):
        raise _bad(folder, f"{file} holds {shown(state)}, not a dict of tensor names to tensors.")
    for name, t in state.items():
        if t.dtype not in _NAMES:
            raise _bad(folder, f"{file}'s tensor {name[:100]!r} has dtype {t.dtype}; tnlg reads floating-point "
                       "weights (float16, bfloat16, float32, float64).")
    return state


class WeightFiles:
    """Every tensor of a folder by name (:attr:`entries`, from the headers), and :meth:`tensor` to read
    one. A tensor listed twice (in two shards, or in a shard the index does not name for it) is refused."""

    def __init__(self, folder: str, entries: dict[str, Entry], loaded: dict[str, dict]):
        self.folder, self.entries, self._loaded = folder, entries, loaded
        self._open: dict = {}

    def tensor(self, name: str) -> torch.Tensor:
        entry = self.entries[name]
        if entry.file in self._loaded:
            return self._loaded[entry.file][name]
        try:
            if entry.file not in self._open:
                from safetensors import safe_open
                self._open[entry.file] = safe_open(os.path.join(self.folder, entry.file), framework="pt")
            t = self._open[entry.file].get_tensor(name)
        except Exception as exc:  # noqa: BLE001 - the library's checks past the header's (overlaps, ...)
            raise _bad(self.folder, f"{entry.file}'s tensor {name[:100]!r} cannot be read ({reason(exc)}); the "
                       "file is damaged.") from None
        if tuple(t.shape) != entry.shape or t.dtype != DTYPES[entry.dtype]:
            raise _bad(self.folder, f"{entry.file}'s tensor {name[:100]!r} reads as {t.dtype} {list(t.shape)}, "
                       f"not the {entry.dtype} {list(entry.shape)} of its header.")
        return t


def _which(folder: str) -> str:
    for name in (SAFETENSORS, SAFETENSORS_INDEX, BIN, BIN_INDEX):
        if os.path.isfile(os.path.join(folder, name)):
            return name
    raise _bad(folder, f"it holds no weights: none of {SAFETENSORS}, {SAFETENSORS_INDEX}, {BIN}, {BIN_INDEX} "
               "(what save_pretrained writes).")


def weight_files(folder: str) -> WeightFiles:
    """The folder's weights (module docstring): every tensor's name, dtype and shape from the headers
    (a ``.bin`` is loaded, memory-mapped), nothing of a safetensors file read but its header."""
    first = _which(folder)
    index = _read_index(folder, first) if first.endswith(".index.json") else None
    files = sorted(set(index.values())) if index else [first]
    entries: dict[str, Entry] = {}
    loaded: dict[str, dict] = {}
    for file in files:
        if not os.path.isfile(os.path.join(folder, file)):
            raise _bad(folder, f"{first} names the shard {file!r}, which is not a file in the folder.")
        if file.endswith(".safetensors") or first.startswith("model.safetensors"):
            found = _safetensors_header(folder, file)
        else:
            loaded[file] = _load_bin(folder, file)
            found = {n: Entry(file, _NAMES[t.dtype], tuple(t.shape)) for n, t in loaded[file].items()}
        for name, entry in found.items():
            if name in entries:
                raise _bad(folder, f"the tensor {name[:100]!r} is in both {entries[name].file} and {file}.")
            if index is not None and index.get(name) != file:
                raise _bad(folder, f"{file} holds the tensor {name[:100]!r}, which {first} places in "
                           f"{shown(index.get(name))}; the index does not match its shards.")
            entries[name] = entry
    missing = sorted(set(index or ()) - set(entries))
    if missing:
        raise _bad(folder, f"{first} places {len(missing)} tensors ({', '.join(map(repr, missing[:3]))}) in shards "
                   "that do not hold them.")
    return WeightFiles(folder, entries, loaded)
