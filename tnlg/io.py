"""Generic file I/O: one atomic write, one file lock, one checksum.

Every file tnlg writes (checkpoint manifests, metrics, plots, indexes, tokenizer exports, cached
datasets) goes through :func:`atomic_output`: it is written under a temporary name in the same
folder, flushed and fsynced, then renamed over the final name, and the folder is fsynced, so a
reader (or a crash) sees either the old file or the complete new one, never a torn one. The file
gets the mode the umask gives a new file (0644 under the usual umask 022), like any other. A failure
inside the ``with`` body removes the temporary file and leaves the final name as it was.

This module imports only the standard library.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
from pathlib import Path
from typing import IO, Iterator, Optional, Union

__all__ = ["atomic_output", "atomic_write", "file_lock", "file_sha256", "fsync_dir", "temporary_name",
           "umask_file_mode", "give_umask_mode", "is_plain_name", "confined_path"]

PathLike = Union[str, Path]

# a file name a folder's own index may give (a checkpoint manifest's files, a torch.distributed.checkpoint
# store's data files): letters, digits, '_', '.', '-', not starting with '.' or '-'
_PLAIN_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")


def temporary_name(path: PathLike) -> str:
    """The temporary name :func:`atomic_output` writes ``path`` under (unique per process)."""
    return f"{os.fspath(path)}.tmp-{os.getpid()}"


def is_plain_name(name: object) -> bool:
    """Whether ``name`` (read from a file: any type) is a plain file name: a string of letters, digits,
    ``_``, ``.`` and ``-`` without ``..``, so no path separator, not absolute, not a parent folder."""
    return isinstance(name, str) and len(name) <= 255 and bool(_PLAIN_NAME.match(name)) and ".." not in name


def confined_path(folder: PathLike, name: object) -> Optional[str]:
    """The path of the file ``name`` inside ``folder`` where ``name`` is a plain name
    (:func:`is_plain_name`) that does not lead outside ``folder`` through a symbolic link; else ``None``
    (the caller says why, without looking at whatever the name would reach). Nothing is opened."""
    if not isinstance(name, str) or not is_plain_name(name):
        return None
    path = os.path.join(os.fspath(folder), name)
    real_folder = os.path.realpath(folder)
    if os.path.dirname(os.path.realpath(path)) != real_folder:
        return None
    return path


def umask_file_mode() -> int:
    """The mode a new file gets from this process: ``0o666`` less the umask (``0o644`` under the usual
    ``022``), read without changing it where ``/proc`` says it (Linux), else by setting it back at once."""
    try:
        with open("/proc/self/status") as f:
            umask = next(int(line.split()[1], 8) for line in f if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError, IndexError):
        umask = os.umask(0o022)
        os.umask(umask)
    return 0o666 & ~umask


def give_umask_mode(folder: PathLike) -> None:
    """Give every file directly in ``folder`` the umask's mode (:func:`umask_file_mode`): libraries that
    write through ``tempfile.mkstemp`` and a rename (``transformers``' ``save_pretrained``) leave 0600,
    which other users of a shared cluster cannot read."""
    mode = umask_file_mode()
    for entry in os.scandir(folder):
        if entry.is_file(follow_symlinks=False):
            os.chmod(entry.path, mode)


def fsync_dir(path: PathLike) -> None:
    """Make a rename inside folder ``path`` durable (best effort: not every filesystem allows it)."""
    try:
        fd = os.open(os.fspath(path), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_output(path: PathLike, mode: str = "w", *, durable: bool = True) -> Iterator[IO]:
    """Open a temporary file for writing; on success it replaces ``path`` atomically.

    ``mode`` is ``"w"`` (text) or ``"wb"`` (binary). ``durable=False`` skips the fsyncs (for
    caches that can be rebuilt). On an exception the temporary file is removed and re-raised.
    """
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_output: mode must be 'w' or 'wb', got {mode!r}")
    path = os.fspath(path)
    tmp = temporary_name(path)
    try:
        with open(tmp, mode) as f:
            # the umask's mode, whatever a leftover temporary file of the same name had
            os.fchmod(f.fileno(), umask_file_mode())
            yield f
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    if durable:
        fsync_dir(os.path.dirname(os.path.abspath(path)))


def atomic_write(path: PathLike, data: Union[str, bytes], *, durable: bool = True) -> None:
    """Write ``data`` (text or bytes) to ``path`` atomically (see :func:`atomic_output`)."""
    with atomic_output(path, "wb" if isinstance(data, bytes) else "w", durable=durable) as f:
        f.write(data)


def file_sha256(path: PathLike, chunk: int = 8 * 2**20) -> str:
    """SHA-256 hex digest of a file, read in chunks (constant memory)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(chunk), b""):
            h.update(block)
    return h.hexdigest()


@contextlib.contextmanager
def file_lock(path: PathLike) -> Iterator[None]:
    """Exclusive advisory lock on ``path`` (created if needed) for the ``with`` body.

    Uses ``fcntl.flock`` where available; elsewhere it is a no-op, and the atomic renames of every
    writer still keep readers from seeing partial files.
    """
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows
        yield
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)
