"""``torch.save`` to a file path, where a failed write is the ``OSError`` itself.

torch's zip writer turns a failed write (a full disk, a quota) into ``RuntimeError("[enforce fail at
inline_container.cc:...] unexpected pos ...")``, with no errno and no path, whether it is given a path or a
file object: the commands' one paragraph for a full disk (``tnlg.cli``) would become a traceback. :func:`save`
writes through a file object that records the ``OSError`` its ``write`` raised, and raises that error (with
the path) in place of torch's; :func:`write` does the same into a file already open (a checkpoint's RNG
file, written atomically). The state is streamed to the file, not serialised in memory first (a Megatron
rank file of a 17B model is gigabytes). Tensors and files only: no communication.
"""

from __future__ import annotations

import contextlib
import os
from typing import IO, Any, Optional

import torch

__all__ = ["save", "write"]


class _Recording:
    """A binary file's ``write`` and ``flush``, noting the first ``OSError`` a write raised."""

    def __init__(self, f: IO[bytes]):
        self.f: IO[bytes] = f
        self.error: Optional[OSError] = None

    def write(self, data) -> int:
        try:
            return self.f.write(data)
        except OSError as err:
            self.error = self.error or err
            raise

    def flush(self) -> None:
        self.f.flush()


def write(obj: Any, f: IO[bytes], path: str) -> None:
    """``torch.save(obj, f)`` into the open binary file ``f``, flushed (``path``: its name in messages); a failed
    write raises its ``OSError`` (``filename`` set to ``path`` where it has none), not torch's
    ``RuntimeError``."""
    recording = _Recording(f)
    try:
        torch.save(obj, recording)  # type: ignore[arg-type]  # a file-like object: write and flush
        f.flush()  # what the file object still buffers: a full disk may show only here
        return
    except RuntimeError:
        if recording.error is None:  # not a failed write: torch's own error
            raise
        err = recording.error
    except OSError as failed:
        err = failed
    if err.filename is None:
        err.filename = os.fspath(path)
    raise err from None


def save(obj: Any, path: str) -> None:
    """``torch.save(obj, path)`` through :func:`write`; on a failure the partial file is removed."""
    opened = False
    try:
        with open(path, "wb") as f:
            opened = True
            write(obj, f, path)
    except BaseException:
        if opened:
            with contextlib.suppress(OSError):
                os.remove(path)
        raise
