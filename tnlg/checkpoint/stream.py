"""Safetensors files written one tensor at a time, with their SHA-256, and the streamed checksum.

``safetensors.torch.save_file`` needs every tensor in memory at once (and copies them to
the host together): at T-NLG scale a rank's shard of weights or optimizer states is tens
of GB. The format is simple enough to write in a stream: an 8-byte little-endian header
length, a JSON header naming every tensor's dtype, shape and ``[begin, end)`` byte range
in the data section, then the raw little-endian bytes of each tensor back to back. The
header is known from shapes alone, so :class:`StreamWriter` writes it first and then each
tensor as it is produced (moved to the host one at a time), hashing as it writes. Files
are read back with ``safetensors.safe_open`` (memory-mapped, slices read lazily).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from typing import Optional, Sequence

import torch

__all__ = ["StreamWriter", "file_sha256", "SAFETENSORS_DTYPES"]

SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                      torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                      torch.uint8: "U8"}


class StreamWriter:
    """Write ``specs`` = ``[(key, shape, dtype), ...]`` to ``path`` in that order.

    ``write(key, tensor)`` must be called once per spec, in order; ``close()`` fsyncs,
    renames the temporary file to ``path`` and returns ``(size, sha256 hex)``. Extra memory:
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
        self.path, self.tmp = path, f"{path}.tmp-{os.getpid()}"
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
            self._write(memoryview(t.view(torch.uint8).numpy()))
        self.next += 1

    def close(self) -> tuple[int, str]:
        if self.next != len(self.specs):
            self.abort()
            raise ValueError(f"stream closed after {self.next} of {len(self.specs)} tensors.")
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        os.replace(self.tmp, self.path)
        return os.path.getsize(self.path), self.sha.hexdigest()

    def abort(self) -> None:
        self.f.close()
        if os.path.exists(self.tmp):
            os.remove(self.tmp)


def file_sha256(path: str, chunk: int = 8 * 2**20) -> str:
    """SHA-256 of a file, read in chunks (constant memory)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            block = f.read(chunk)
            if not block:
                return h.hexdigest()
            h.update(block)
