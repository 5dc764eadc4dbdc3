"""Generic file I/O: one atomic write, one file lock, one checksum, one way to say a write failed, one rule
for the file names a file on disk gives (:func:`unsafe_name`, :func:`confined_path`).

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
import shutil
from pathlib import Path
from typing import IO, Iterator, Optional, Union

__all__ = ["atomic_output", "atomic_write", "file_lock", "file_sha256", "fsync_dir", "temporary_name",
           "umask_file_mode", "give_umask_mode", "write_failure", "stdout_name", "unsafe_name", "confined_path"]

PathLike = Union[str, Path]
# a file name a folder's own index may give (a checkpoint manifest's files, a torch.distributed.checkpoint
# store's data files, a datasets folder's state.json): letters, digits, '_', '.', '-', not starting with '.' or '-'
_PLAIN_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,254}$")


def temporary_name(path: PathLike) -> str:
    """The temporary name :func:`atomic_output` writes ``path`` under (unique per process)."""
    return f"{os.fspath(path)}.tmp-{os.getpid()}"


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


def write_failure(exc: OSError, path: PathLike) -> str:
    """``could not write 'PATH': <error> (errno E) (N MiB free of M MiB on that filesystem).``: what a
    failed write of file or folder ``path`` says (a full disk, a quota, EIO, permissions)."""
    path = os.fspath(path)
    where = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
    try:
        usage = shutil.disk_usage(where if os.path.isdir(where) else "/")
        free = f" ({usage.free / 2**20:.1f} MiB free of {usage.total / 2**20:.1f} MiB on that filesystem)"
    except OSError:
        free = ""
    what = exc.strerror or type(exc).__name__
    return f"could not write {path!r}: {what} (errno {exc.errno}){free}."


def stdout_name() -> str:
    """The file standard output was redirected to (where Linux says it), else ``"standard output"``."""
    try:
        return os.readlink("/proc/self/fd/1")
    except OSError:
        return "standard output"


def unsafe_name(name) -> Optional[str]:
    """Why ``name``, read from a file (a manifest, an index, a dataset's ``state.json``), cannot name a
    file inside that file's folder; ``None`` when it can. A name it can is a plain file name: a string of
    letters, digits, ``_``, ``.`` and ``-`` of at most 255 characters, not starting with ``.`` or ``-``,
    without ``..``: so no path separator, not absolute, no way up."""
    if not isinstance(name, str):
        return f"it is not a string but a JSON {type(name).__name__}"
    if not _PLAIN_NAME.match(name) or ".." in name:
        return "a file name there is a plain name inside the folder (no '/', no '..', not absolute)"
    return None


def confined_path(folder: PathLike, name) -> str:
    """``folder/name`` for a ``name`` read from a file in ``folder``, where it is a plain name
    (:func:`unsafe_name`) and the path, symbolic links followed, stays inside ``folder``; otherwise a
    ``ValueError`` saying why (its caller names the file that gave the name)."""
    why = unsafe_name(name)
    if why is not None:
        raise ValueError(f"the name {name!r}: {why}")
    path = os.path.join(os.fspath(folder), name)
    real, inside = os.path.realpath(path), os.path.realpath(folder)
    if os.path.dirname(real) != inside:
        raise ValueError(f"the name {name!r} is a symbolic link to {real!r}, outside the folder")
    return path
