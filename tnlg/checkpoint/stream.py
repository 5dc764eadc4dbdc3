"""Safetensors files written one tensor at a time (hashed as they are written), and read back piecewise.

``safetensors.torch.save_file`` needs every tensor in memory at once (and copies them to
the host together): at T-NLG scale a rank's shard of weights or optimizer states is tens
of GB. The format is simple enough to write in a stream: an 8-byte little-endian header
length, a JSON header naming every tensor's dtype, shape and ``[begin, end)`` byte range
in the data section, then the raw little-endian bytes of each tensor back to back. The
header is known from shapes alone, so :class:`StreamWriter` writes it first and then each
tensor as it is produced (moved to the host one at a time), hashing as it writes.

:class:`SafetensorsReader` reads them back with plain positioned reads of exactly the
bytes asked for (a tensor, or a range of rows), not through a memory map: pages of a
mapped file that has been read count in the process's resident memory, so at T-NLG scale
a load through ``safe_open`` would show the whole checkpoint in every rank's RSS.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from typing import Optional, Sequence

import torch

from ..io import temporary_name

__all__ = ["StreamWriter", "SafetensorsReader", "SAFETENSORS_DTYPES"]

SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                      torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                      torch.uint8: "U8"}


class StreamWriter:
    """Write ``specs`` = ``[(key, shape, dtype), ...]`` to ``path`` in that order.

    ``write(key, tensor)`` must be called once per spec, in order; ``close()`` fsyncs,
    renames the temporary file (:func:`tnlg.io.temporary_name`) to ``path`` and returns
    ``(size, sha256 hex)``. Extra memory:
    one tensor's host copy (none for a contiguous CPU tensor).
    """

    def __init__(self, path: str, specs: Sequence[tuple[str, Sequence[int], torch.dtype]],
                 metadata: Optional[dict] = None):
        header: dict = {}
        offset = 0
        for key, shape, dtype in specs:
            if dtype not in SAFETENSORS_DTYPES:
                raise ValueError(f"tensor {key!r}: dtype {dtype} cannot be stored in safetensors.")
            nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            header[key] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": [int(s) for s in shape],
                           "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        if metadata:
            header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned
        self.path, self.tmp = path, temporary_name(path)
        self.specs, self.next = list(specs), 0
        self.sha = hashlib.sha256()
        self.f = open(self.tmp, "wb")
        self._write(struct.pack("<Q", len(raw)) + raw)

    def _write(self, data) -> None:
        self.f.write(data)
        self.sha.update(data)

    def write(self, key: str, tensor: torch.Tensor) -> None:
        want_key, shape, dtype = self.specs[self.next]
        if key != want_key or tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
            raise ValueError(f"stream write {self.next}: got {key!r} {tuple(tensor.shape)} {tensor.dtype}, "
                             f"expected {want_key!r} {tuple(shape)} {dtype}.")
        t = tensor.detach().to("cpu").contiguous().reshape(-1)
        if t.numel():
            self._write(memoryview(t.view(torch.uint8).numpy()))  # type: ignore[arg-type]  # numpy's stubs: ndarray is a Buffer only for Python >= 3.12
        self.next += 1

    def close(self) -> tuple[int, str]:
        if self.next != len(self.specs):
            self.abort()
            raise ValueError(f"stream closed after {self.next} of {len(self.specs)} tensors.")
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        os.replace(self.tmp, self.path)  # the caller fsyncs the folder once, after all its files
        return os.path.getsize(self.path), self.sha.hexdigest()

    def abort(self) -> None:
        self.f.close()
        if os.path.exists(self.tmp):
            os.remove(self.tmp)


_TORCH_DTYPES = {v: k for k, v in SAFETENSORS_DTYPES.items()}


class SafetensorsReader:
    """Random access to a safetensors file: ``keys()``, ``get_tensor(key)`` and
    ``get_slice(key)[a:b]`` (rows ``a:b``; a tuple index slicing one later dimension reads
    the tensor and narrows it). Each call reads only the bytes it returns. Raises
    ``ValueError`` for a file whose header is not valid safetensors."""

    def __init__(self, path: str):
        self.path = path
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise ValueError("file shorter than a safetensors header")
            (n,) = struct.unpack("<Q", raw)
            if n > size - 8:
                raise ValueError(f"header of {n} bytes does not fit in a file of {size} bytes")
            header = json.loads(f.read(n))
        self.data_start = 8 + n
        self.metadata = header.pop("__metadata__", {}) or {}
        self.entries = header
        for key, e in header.items():
            begin, end = e["data_offsets"]
            if e["dtype"] not in _TORCH_DTYPES or end > size - self.data_start or begin > end:
                raise ValueError(f"tensor {key!r}: bad entry {e}")

    def keys(self):
        return list(self.entries)

    def _read(self, key: str, first_row: int = 0, rows: Optional[int] = None) -> torch.Tensor:
        if key not in self.entries:
            raise KeyError(key)
        e = self.entries[key]
        dtype, shape = _TORCH_DTYPES[e["dtype"]], list(e["shape"])
        elem = torch.empty((), dtype=dtype).element_size()
        row_numel = math.prod(shape[1:]) if shape else 1
        total_rows = shape[0] if shape else 1
        rows = total_rows - first_row if rows is None else rows
        if first_row < 0 or rows < 0 or first_row + rows > total_rows:
            raise IndexError(f"rows {first_row}:{first_row + rows} of {key!r} with {total_rows} rows")
        out = torch.empty(rows * row_numel, dtype=dtype)
        if out.numel():
            with open(self.path, "rb") as f:
                f.seek(self.data_start + e["data_offsets"][0] + first_row * row_numel * elem)
                view = memoryview(out.view(torch.uint8).numpy())  # type: ignore[arg-type]  # (as above)
                if f.readinto(view) != len(view):
                    raise ValueError(f"{self.path!r} is truncated inside tensor {key!r}")
        return out.view([rows] + shape[1:]) if shape else out.view([])

    def get_tensor(self, key: str) -> torch.Tensor:
        return self._read(key)

    def get_slice(self, key: str) -> "_Slice":
        return _Slice(self, key)


class _Slice:
    def __init__(self, reader: SafetensorsReader, key: str):
        self.reader, self.key = reader, key

    def __getitem__(self, idx) -> torch.Tensor:
        if isinstance(idx, slice):
            idx = (idx,)
        first = idx[0] if idx else slice(None)
        rest_full = all(isinstance(s, slice) and s == slice(None) for s in idx[1:])
        if isinstance(first, slice) and first.step in (None, 1) and rest_full:
            rows = self.reader.entries[self.key]["shape"][0]
            a, b, _ = first.indices(rows)
            return self.reader._read(self.key, a, max(0, b - a))
        return self.reader._read(self.key)[idx].clone()
