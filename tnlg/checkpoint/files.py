"""Where a checkpoint's files live, the ``latest`` pointer, ``meta.json``, and the file checks.

Layout of a checkpoint root (Megatron's naming)::

    ROOT/latest_checkpointed_iteration.txt   "300" (written last, atomically)
    ROOT/iter_0000300/meta.json              what, how split, manifest of every file (written by rank 0)
    ROOT/iter_0000300/model_tp00.safetensors this TP rank's weight shards (replicated ones in tp00 only)
    ROOT/iter_0000300/optim_tp00.safetensors Adam moments, same split as the weights
    ROOT/iter_0000300/rng_dp000_tp00.pt      each rank's RNG states (tensors and numbers only)

An iteration directory is first written as ``iter_0000300.tmp`` and renamed when
every rank has finished, so a directory named ``iter_*`` is always complete.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from typing import Optional

from ..errors import UserError

__all__ = ["FORMAT", "LATEST", "META", "iter_dir_name", "model_file", "optim_file", "rng_file",
           "read_latest", "write_latest", "list_iterations", "has_checkpoint", "resolve", "read_meta",
           "check_files", "atomic_write_text", "fsync_dir", "remove_tree"]

FORMAT = "tnlg.checkpoint/1"
LATEST = "latest_checkpointed_iteration.txt"
META = "meta.json"
_ITER_RE = re.compile(r"^iter_(\d{7,})$")


def iter_dir_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def model_file(tp_rank: int) -> str:
    return f"model_tp{tp_rank:02d}.safetensors"


def optim_file(tp_rank: int) -> str:
    return f"optim_tp{tp_rank:02d}.safetensors"


def rng_file(dp_rank: int, tp_rank: int) -> str:
    return f"rng_dp{dp_rank:03d}_tp{tp_rank:02d}.pt"


def fsync_dir(path: str) -> None:
    """Make a rename inside ``path`` durable (best effort: not every filesystem allows it)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_text(path: str, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file, fsync and ``os.replace``."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def remove_tree(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


def list_iterations(root: str) -> list[int]:
    """Iterations with a committed directory under ``root``, ascending."""
    if not os.path.isdir(root):
        return []
    out = []
    for name in os.listdir(root):
        m = _ITER_RE.match(name)
        if m and os.path.isdir(os.path.join(root, name)):
            out.append(int(m.group(1)))
    return sorted(out)


def read_latest(root: str) -> Optional[int]:
    """The iteration ``latest_checkpointed_iteration.txt`` names; ``None`` without the file.

    A file that does not hold an iteration number is a :class:`UserError`.
    """
    path = os.path.join(root, LATEST)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        text = f.read().strip()
    if not text.isdigit():
        raise UserError(f"checkpoint pointer {path!r} holds {text[:40]!r}, not an iteration number; it was "
                        f"not written by tnlg or is corrupt. Committed iterations in {root!r}: "
                        f"{list_iterations(root) or 'none'}; point --load at one of those iter_* directories.")
    return int(text)


def write_latest(root: str, iteration: int) -> None:
    atomic_write_text(os.path.join(root, LATEST), f"{iteration}\n")


def has_checkpoint(root: Optional[str]) -> bool:
    """True when ``root`` holds a ``latest`` pointer, committed ``iter_*`` directories, or is itself an
    iteration directory (``*.tmp`` debris of a crashed save does not count)."""
    if not root or not os.path.isdir(root):
        return False
    return (os.path.isfile(os.path.join(root, LATEST)) or os.path.isfile(os.path.join(root, META))
            or bool(list_iterations(root)))


def resolve(path: str, what: str = "--load") -> Optional[str]:
    """The iteration directory ``path`` designates: ``path`` itself when it holds ``meta.json``,
    else the one its ``latest`` pointer names. ``None`` for a root with no checkpoint at all
    (no pointer and no ``iter_*`` directory): the caller starts from scratch.

    Raises :class:`UserError` for a missing path, a pointer naming a missing directory,
    or committed iterations without a pointer.
    """
    if not os.path.isdir(path):
        raise UserError(f"{what} {path!r} is not a directory.")
    if os.path.isfile(os.path.join(path, META)):
        return path
    latest = read_latest(path)
    iters = list_iterations(path)
    if latest is None:
        if not iters:
            return None
        raise UserError(f"{what} {path!r} has checkpoint directories (iterations {iters}) but no {LATEST}; "
                        f"it is not clear which to load. Point {what} at one of them, e.g. "
                        f"{os.path.join(path, iter_dir_name(iters[-1]))!r}.")
    d = os.path.join(path, iter_dir_name(latest))
    if not os.path.isfile(os.path.join(d, META)):
        raise UserError(f"{os.path.join(path, LATEST)!r} points at iteration {latest}, but {d!r} "
                        f"{'has no ' + META if os.path.isdir(d) else 'does not exist'}. Committed iterations "
                        f"there: {iters or 'none'}. Point {what} at one of those iter_* directories, or "
                        f"fix the pointer file.")
    return d


def read_meta(iter_dir: str) -> dict:
    """Parse ``meta.json`` of an iteration directory (JSON only: nothing is executed)."""
    path = os.path.join(iter_dir, META)
    try:
        with open(path) as f:
            meta = json.load(f)
    except FileNotFoundError:
        raise UserError(f"{iter_dir!r} is not a tnlg checkpoint: it has no {META}.") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"{path!r} is corrupt ({exc}); the checkpoint cannot be used.") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise UserError(f"{path!r} has format {meta.get('format') if isinstance(meta, dict) else None!r}; "
                        f"this tnlg reads {FORMAT!r}.")
    return meta


def check_files(iter_dir: str, meta: dict, kinds: tuple[str, ...] = ("model", "optim", "rng")) -> None:
    """Every file of the manifest (of the given kinds) exists with its recorded size, else a
    :class:`UserError` naming the first missing or truncated one."""
    for name, size in sorted(meta["files"].items()):
        if not name.startswith(kinds):
            continue
        path = os.path.join(iter_dir, name)
        if not os.path.isfile(path):
            raise UserError(f"checkpoint {iter_dir!r} is missing {name!r} (listed in its {META}); it was "
                            f"copied incompletely or damaged. Nothing was loaded.")
        have = os.path.getsize(path)
        if have != size:
            raise UserError(f"checkpoint file {path!r} has {have} bytes but {size} were written "
                            f"({'truncated' if have < size else 'changed'}); it was copied incompletely or "
                            f"damaged. Nothing was loaded.")
