"""Where a checkpoint's files live, the ``latest`` pointer, ``meta.json``, and the file checks.

Layout of a checkpoint root (Megatron's naming)::

    ROOT/latest_checkpointed_iteration.txt   "300" (written last, atomically)
    ROOT/iter_0000300/meta.json              what, how split, manifest of every file (written by rank 0)
    ROOT/iter_0000300/model_tp00.safetensors this TP rank's weight shards (replicated ones in tp00 only)
    ROOT/iter_0000300/optim_tp00_dp000.safetensors  the Adam moments (and fp32 master weights) this
                                             (TP, DP) rank owns: flat pieces of its TP shards
    ROOT/iter_0000300/rng_dp000_tp00.pt      each rank's RNG states (tensors and numbers only)

An iteration directory is first written as ``iter_0000300.tmp`` (with a
``.tnlg-save`` marker file inside, so only a save's own debris is ever removed) and
renamed when every rank has finished, so a directory named ``iter_*`` is always
complete. ``meta.json`` records every file's size and SHA-256; loading checks both.
Format 1 (one ``optim_tpXX.safetensors`` per TP rank with whole per-parameter
moments, written by tnlg 0.1) still loads.
"""

from __future__ import annotations

import os
import re
import shutil
import time
import uuid
from typing import Optional

from ..errors import UserError
from ..io import atomic_write, file_sha256
from .manifest import FORMAT, META, READABLE_FORMATS, Manifest

__all__ = ["FORMAT", "LATEST", "META", "iter_dir_name", "stage_tag", "model_file", "optim_file", "rng_file",
           "read_latest", "write_latest", "list_iterations", "has_checkpoint", "resolve", "read_meta",
           "check_files", "earlier_iterations", "verify_checksums", "meta_digest", "complete_iterations", "last_checkpoint",
           "remove_tree", "remove_debris", "trash_name", "make_save_dir", "is_ours", "is_tnlg_iteration", "exchange",
           "lock_root", "LOCK", "MARKER", "READABLE_FORMATS"]

LATEST = "latest_checkpointed_iteration.txt"
MARKER = ".tnlg-save"  # inside every directory a save creates; only such directories are ever removed
ITER_RE = re.compile(r"^iter_(\d{7,})$")


def iter_dir_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def stage_tag(pp_rank: int, pp_size: int) -> Optional[int]:
    """The pipeline rank in file names: ``None`` (no ``ppYY_`` part) at PP 1, whose names stay those of
    checkpoints written before pipelines existed."""
    return None if pp_size == 1 else pp_rank


def _pp(pp_rank: Optional[int]) -> str:
    return "" if pp_rank is None else f"pp{pp_rank:02d}_"


def model_file(tp_rank: int, pp_rank: Optional[int] = None, ep_rank: Optional[int] = None) -> str:
    """``model_tpXX`` (PP 1) or ``model_ppYY_tpXX`` (the weights pipeline stage YY stores); with ``ep_rank``
    (a checkpoint saved at EP > 1) ``model_[ppYY_]tpXX_epZZ``: the routed experts expert-parallel rank ZZ
    holds."""
    ep = "" if ep_rank is None else f"_ep{ep_rank:02d}"
    return f"model_{_pp(pp_rank)}tp{tp_rank:02d}{ep}.safetensors"


def optim_file(tp_rank: int, dp_rank: Optional[int] = None, pp_rank: Optional[int] = None) -> str:
    """Format 2: ``optim_[ppYY_]tpXX_dpZZZ`` (what that rank owns); ``dp_rank=None``: format 1's per-TP file."""
    if dp_rank is None:
        return f"optim_tp{tp_rank:02d}.safetensors"
    return f"optim_{_pp(pp_rank)}tp{tp_rank:02d}_dp{dp_rank:03d}.safetensors"


def rng_file(dp_rank: int, tp_rank: int, pp_rank: Optional[int] = None) -> str:
    return f"rng_{_pp(pp_rank)}dp{dp_rank:03d}_tp{tp_rank:02d}.pt"


TRASH_PREFIX = ".tnlg-trash-"  # a directory of ours being removed (renamed first: a crash leaves known debris)
NEW_PREFIX = ".tnlg-new-"      # a save directory being created (renamed to iter_N.tmp once it holds the marker)


def trash_name(root: str) -> str:
    """A fresh name in ``root`` for a directory of ours on its way out."""
    return os.path.join(root, f"{TRASH_PREFIX}{uuid.uuid4().hex[:12]}")


def remove_tree(path: str) -> None:
    """Remove a directory tnlg wrote: renamed to a trash name first (atomic), then deleted, so a crash
    at any point leaves either the directory as it was or debris the next save recognises."""
    trash = trash_name(os.path.dirname(os.path.abspath(path)))
    try:
        os.rename(path, trash)
    except FileNotFoundError:
        return
    except OSError:  # (another filesystem's rules): delete in place
        trash = path
    shutil.rmtree(trash, ignore_errors=True)


def remove_debris(root: str) -> list[str]:
    """Remove what crashed saves left in ``root`` and return the names removed. Only tnlg's own debris:
    directories with tnlg's temporary names (``.tnlg-new-*``, ``.tnlg-trash-*``), ``iter_*`` names that
    are not committed iterations and hold the save marker, ``iter_*.replaced.tmp`` holding a tnlg
    manifest (an older tnlg's replaced save). An unmarked ``iter_*.tmp`` is someone else's: kept (a save of
    that iteration then stops with a clear error)."""
    removed = []
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name)
        if not os.path.isdir(path) or os.path.islink(path):
            continue
        if name.startswith((TRASH_PREFIX, NEW_PREFIX)):
            shutil.rmtree(path, ignore_errors=True)
        elif name.startswith("iter_") and not ITER_RE.match(name) and is_ours(path):
            remove_tree(path)
        elif re.match(r"^iter_\d{7,}\.replaced\.tmp$", name) and is_tnlg_iteration(path):
            remove_tree(path)
        else:
            continue
        removed.append(name)
    return removed


def list_iterations(root: str) -> list[int]:
    """Iterations with a committed directory under ``root``, ascending."""
    if not os.path.isdir(root):
        return []
    out = []
    for name in os.listdir(root):
        m = ITER_RE.match(name)
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
    atomic_write(os.path.join(root, LATEST), f"{iteration}\n")


def has_checkpoint(root: Optional[str]) -> bool:
    """True when ``root`` holds a ``latest`` pointer, committed ``iter_*`` directories, or is itself an
    iteration directory (``*.tmp`` debris of a crashed save does not count)."""
    if not root or not os.path.isdir(root):
        return False
    return (os.path.isfile(os.path.join(root, LATEST)) or os.path.isfile(os.path.join(root, META))
            or bool(list_iterations(root)))


def resolve(path: str, what: str = "--load", notes: Optional[list] = None) -> Optional[str]:
    """The iteration directory ``path`` designates: ``path`` itself when it holds ``meta.json``,
    else the one its ``latest`` pointer names. ``None`` for a root with no checkpoint at all
    (no pointer and no ``iter_*`` directory): the caller starts from scratch.

    Without a usable pointer (missing, or naming an incomplete directory) the newest complete
    iteration (manifest sizes checked) is chosen and a line saying so is appended to ``notes``.
    Raises :class:`UserError` for a missing path, when no iteration is complete, and for a Hugging Face
    folder (``config.json`` and no checkpoint), which is never read as an empty root.
    """
    if not os.path.isdir(path):
        raise UserError(f"{what} {path!r} is not a directory.")
    if os.path.isfile(os.path.join(path, META)):
        return path
    latest = read_latest(path)
    iters = list_iterations(path)
    if latest is None and not iters:
        if os.path.isfile(os.path.join(path, "config.json")):  # not "no checkpoint yet": a stranger's model
            raise UserError(f"{what} {path!r} is a Hugging Face model folder (config.json), not a tnlg checkpoint; "
                            f"reading it as an empty root would start from random weights. Fine-tune from it with "
                            f"`tnlg finetune --load {path}`, or convert it first: `tnlg convert --from hf {path} "
                            f"--to DIR`, then give DIR.")
        return None
    d = None if latest is None else os.path.join(path, iter_dir_name(latest))
    if d is not None and os.path.isfile(os.path.join(d, META)):
        return d
    # No usable pointer: a save crashed between committing its directory and writing the pointer
    # (or the pointer names a directory that is gone). Resume from the newest complete iteration.
    complete = complete_iterations(path)
    folders = (os.path.join(path, iter_dir_name(i)) for i in iters)  # (the pointer's, when it is a folder, too)
    megatron = None if complete else next((f for f in folders if _megatron_files(f)), None)
    if megatron is not None:
        raise UserError(f"{what} {path!r} is a Megatron-LM checkpoint ({megatron!r} holds Megatron's files, no "
                        f"{META}), not a tnlg checkpoint. Fine-tune from it with `tnlg finetune --load {path}`, or "
                        f"convert it first: `tnlg convert --from megatron {path} --to DIR`, then give DIR.")
    if not complete:
        why = ("is missing" if d is None else
               f"points at iteration {latest}, but {d!r} " +
               (f"has no {META}" if os.path.isdir(d) else "does not exist"))
        raise UserError(f"{what} {path!r}: {LATEST} {why}, and none of the iteration directories there "
                        f"({iters or 'none'}) is complete (all manifest files present at their sizes). "
                        f"Point {what} at an intact checkpoint.")
    chosen = os.path.join(path, iter_dir_name(complete[-1]))
    if notes is not None:
        notes.append(f"note: {os.path.join(path, LATEST)!r} "
                     f"{'is missing' if latest is None else f'names iteration {latest}, which is not complete'}; "
                     f"resuming from the newest complete iteration, {complete[-1]} ({chosen}).")
    return chosen


def _megatron_files(iter_dir: str) -> bool:
    """Whether an iteration folder holds Megatron-LM's files: legacy ``mp_rank_*`` folders, or torch_dist's
    ``.metadata``."""
    try:
        names = os.listdir(iter_dir)
    except OSError:
        return False
    return ".metadata" in names or any(n.startswith("mp_rank_") for n in names)


def no_weights(path: str, what: str = "--load") -> UserError:
    """The paragraph for a run that takes only the weights (fine-tuning) from a root holding no checkpoint:
    refused, where a resume of the run's own ``--save`` starts from scratch."""
    return UserError(f"{what} {path!r} holds no checkpoint (no {LATEST} and no iter_* directory), and a fine-tuning "
                     f"run takes its starting weights from there: it would train from random weights instead. Give "
                     f"the folder of a tnlg checkpoint (or tnlg finetune --load a Hugging Face folder or a Megatron-LM "
                     f"checkpoint, which it converts).")


def read_meta(iter_dir: str) -> dict:
    """``meta.json`` of an iteration directory as the JSON object it is (its format and file names checked:
    :meth:`~tnlg.checkpoint.manifest.Manifest.read` with ``complete=False``; tnlg itself reads the typed
    manifest)."""
    return Manifest.read(iter_dir, complete=False).to_dict()


def meta_digest(iter_dir: str) -> str:
    """The SHA-256 of an iteration directory's ``meta.json`` (how ranks check they see the same manifest)."""
    path = os.path.join(iter_dir, META)
    if not os.path.isfile(path):
        raise UserError(f"{iter_dir!r} is not a tnlg checkpoint: it has no {META}.")
    return file_sha256(path)


def check_files(iter_dir: str, meta, kinds: tuple[str, ...] = ("model", "optim", "rng"), hint: bool = True) -> None:
    """Every file of the manifest (a :class:`Manifest` or its dict; of the given kinds) exists with its
    recorded size, else a :class:`UserError` naming the first missing or truncated one (and, with ``hint``,
    the earlier complete iterations that would resume: :func:`earlier_iterations`)."""
    for name, size in sorted(Manifest.of(meta).files.items()):
        if not name.startswith(kinds):
            continue
        path = os.path.join(iter_dir, name)
        if not os.path.isfile(path):
            raise UserError(f"checkpoint {iter_dir!r} is missing {name!r} (listed in its {META}); it was "
                            f"copied incompletely or damaged. Nothing was loaded."
                            + (earlier_iterations(iter_dir) if hint else ""))
        have = os.path.getsize(path)
        if have != size:
            raise UserError(f"checkpoint file {path!r} has {have} bytes but {size} were written "
                            f"({'truncated' if have < size else 'changed'}); it was copied incompletely or "
                            f"damaged. Nothing was loaded." + (earlier_iterations(iter_dir) if hint else ""))


def earlier_iterations(iter_dir: str) -> str:
    """The sentence that ends the error of a damaged iteration directory ``ROOT/iter_N``: the complete
    iterations before N in ROOT (their files all of their recorded sizes) and the ``--load`` that resumes
    from the newest of them; or that there is none. Empty when ``iter_dir`` is not an ``iter_*`` directory."""
    root, name = os.path.split(os.path.normpath(iter_dir))
    match = ITER_RE.match(name)
    if not match:
        return ""
    earlier = [it for it in complete_iterations(root) if it < int(match.group(1))]
    if not earlier:
        return f" {root!r} holds no earlier complete iteration to resume from."
    return (f" Earlier complete iterations in {root!r}: {', '.join(iter_dir_name(it) for it in earlier)}; "
            f"--load {os.path.join(root, iter_dir_name(earlier[-1]))} resumes from the newest of them.")


def verify_checksums(iter_dir: str, meta, names) -> None:
    """The SHA-256 of each named file equals the manifest's (format 2; format 1 has none), else a
    :class:`UserError` naming the file. Reads each file once in chunks (constant memory)."""
    sums = Manifest.of(meta).sha256 or {}
    for name in sorted(set(names)):
        if name in sums and file_sha256(os.path.join(iter_dir, name)) != sums[name]:
            raise UserError(f"checkpoint file {os.path.join(iter_dir, name)!r} does not match the SHA-256 "
                            f"recorded when it was written (a bit flip or a partial copy with the right size); "
                            f"it cannot be trusted. Nothing was loaded. Copy the file again, or resume from an "
                            f"earlier iteration." + earlier_iterations(iter_dir))


def complete_iterations(root: str) -> list[int]:
    """Committed iterations whose ``meta.json`` parses and whose files all have their manifest
    sizes, ascending (cheap: no checksums)."""
    out = []
    for it in list_iterations(root):
        d = os.path.join(root, iter_dir_name(it))
        try:
            check_files(d, Manifest.read(d), ("model", "optim", "rng"), hint=False)
        except UserError:
            continue
        out.append(it)
    return out


def last_checkpoint(save: Optional[str]) -> Optional[int]:
    """The iteration a resume from the root ``save`` would load: the ``latest`` pointer's when complete,
    else the newest complete one (``None``: no checkpoint there)."""
    if not save or not os.path.isdir(save):
        return None
    try:
        latest = read_latest(save)
    except UserError:
        latest = None
    done = complete_iterations(save)
    return latest if latest in done else (done[-1] if done else None)


def make_save_dir(path: str) -> None:
    """Create a directory for a save in progress, with the marker that makes it ours: made under a
    temporary name of ours and renamed once the marker is in (no crash leaves it unmarked)."""
    root = os.path.dirname(os.path.abspath(path))
    if os.path.lexists(path):
        raise UserError(f"cannot save into {path!r}: it exists and was not written by a tnlg save (it holds "
                        f"no {MARKER} marker), so it is left alone. Move it out of {root!r} and resume.")
    staging = os.path.join(root, f"{NEW_PREFIX}{uuid.uuid4().hex[:12]}")
    os.makedirs(staging)
    with open(os.path.join(staging, MARKER), "w") as f:
        f.write("written by a tnlg checkpoint save; removed when the save completes or is superseded\n")
    os.rename(staging, path)


LOCK = ".tnlg-lock"  # in a save root: held (flock) by rank 0 of the one job that saves there


def lock_root(root: str, probe: bool = False):
    """Take the save root's lock for this process (creating ``root``); returns the open lock file, whose
    lock lasts until it is closed or the process ends. A root another live job holds is a
    :class:`UserError` naming that job (its pid, host and start time, as it wrote them).

    ``probe=True`` only checks that no job holds it, writing nothing (no folder, no file); returns
    ``None``."""
    import fcntl
    import socket
    path = os.path.join(root, LOCK)
    if probe and not os.path.isfile(path):
        return None  # nobody ever locked it
    if not probe:
        os.makedirs(root, exist_ok=True)
    f = open(path, "r" if probe else "a+")
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "a process that did not say which"
        f.close()
        raise UserError(f"--save {root!r} is in use by another tnlg job ({holder}): two jobs saving into one "
                        f"folder would remove each other's saves in progress and fight over {LATEST}. Stop that "
                        f"job, or give this one another --save.") from None
    if probe:
        f.close()
        return None
    f.seek(0)
    f.truncate()
    f.write(f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    f.flush()
    return f


def is_tnlg_iteration(path: str) -> bool:
    """True for an iteration directory whose manifest is tnlg's (``--keep-last`` removes no other)."""
    try:
        Manifest.read(path, complete=False)
    except (UserError, OSError):
        return False
    return True


def is_ours(path: str) -> bool:
    """True for a directory a tnlg save created (it holds the marker)."""
    return os.path.isfile(os.path.join(path, MARKER))


def exchange(a: str, b: str) -> bool:
    """Atomically swap two directory entries (Linux ``renameat2(RENAME_EXCHANGE)``); ``False``
    where the system cannot (the caller falls back to two renames)."""
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0
