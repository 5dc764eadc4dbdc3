"""``torch.save`` to a file path, where a failed write is the ``OSError`` itself.

torch's zip writer turns a failed write (a full disk, a quota) into ``RuntimeError("[enforce fail at
inline_container.cc:...] unexpected pos ...")``, with no errno and no path, whether it is given a path or a
file object: the commands' one paragraph for a full disk (``tnlg.cli``) would become a traceback. :func:`save`
writes through a file object that records the ``OSError`` its ``write`` raised, and raises that error (with
the path) in place of torch's. The state is streamed to the file, not serialised in memory first (a Megatron
rank file of a 17B model is gigabytes). Tensors and files only: no communication.
"""

from __future__ import annotations

import contextlib
import os
from typing import IO, Any, Optional

import torch

__all__ = ["save"]


class _Recording:
    """A binary file's ``write`` and ``flush``, noting the first ``OSError`` a write raised."""

    def __init__(self, f: IO[bytes]):
        self.f, self.error = f, None  # type: IO[bytes], Optional[OSError]

    def write(self, data) -> int:
        try:
            return self.f.write(data)
        except OSError as err:
            self.error = self.error or err
            raise

    def flush(self) -> None:
        self.f.flush()


def save(obj: Any, path: str) -> None:
    """``torch.save(obj, path)``; a failed write raises its ``OSError`` (``filename`` set to ``path``) and
    removes the partial file."""
    recording: Optional[_Recording] = None
    try:
        with open(path, "wb") as f:
            recording = _Recording(f)
            torch.save(obj, recording)  # type: ignore[arg-type]  # a file-like object: write and flush
    except (RuntimeError, OSError) as err:
        if recording is not None:
            with contextlib.suppress(OSError):
                os.remove(path)
        cause = recording.error if recording is not None and recording.error is not None else None
        if cause is None:
            if isinstance(err, OSError) and err.filename is None:
                err.filename = os.fspath(path)
            raise
        if cause.filename is None:
            cause.filename = os.fspath(path)
        raise cause from None
