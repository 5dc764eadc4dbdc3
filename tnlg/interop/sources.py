"""What a model folder is, and whether it is still the same one: the kind of a ``--load`` (a tnlg checkpoint, a
Hugging Face folder, a Megatron-LM checkpoint) and its identity.

**The identity** (:class:`Source`) is the folder's resolved path (``os.path.realpath``; for a checkpoint root,
the iteration folder it designates) and a fingerprint of the files that decide its weights:

* a Hugging Face folder: ``config.json`` (its bytes hashed) and every weight file (``*.safetensors``,
  ``*.bin``, ``*.pt``, ``*.pth`` and their ``*.index.json``), each by name, size and modification time;
* a checkpoint (tnlg or Megatron-LM): every file under its iteration folder by relative name, size and
  modification time, and a tnlg checkpoint's ``meta.json`` hashed.

Why names, sizes and times rather than a hash of the weights: at 17B parameters the weights are 34 GB, which
take minutes to hash (as long as the conversion itself), and every launch, and every worker, checks the
identity again; a ``stat`` per file takes microseconds. It is sound for what it guards: a file that is
rewritten (``save_pretrained``, a new Megatron save, a copy over it) gets a new modification time, so
another model in the same place disagrees; a copy that keeps the times (``cp -a``, ``rsync -a``, ``mv``) holds
the same bytes and agrees; a copy that does not keep them disagrees, which errs on the safe side (the user is
asked, never trained from other weights). The small files that describe the model are hashed, so an edited
``config.json`` disagrees even where a tool kept its time.

Torch-free.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass

from ..checkpoint.files import META, resolve
from ..errors import UserError

__all__ = ["Source", "KINDS", "source_kind", "identify"]

# what each kind is called in messages
KINDS = {"ckpt": "tnlg checkpoint", "hf": "Hugging Face folder", "megatron": "Megatron-LM checkpoint"}
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".index.json")


@dataclass(frozen=True)
class Source:
    """A model folder's identity: its ``kind`` (:data:`KINDS`), its resolved ``path`` and the ``fingerprint``
    of the ``files`` that decide its weights (module docstring)."""

    kind: str
    path: str
    fingerprint: str
    files: int

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d) -> "Source":
        """A recorded identity (:meth:`to_dict`); ``ValueError`` for anything else."""
        if not isinstance(d, dict) or set(d) != {"kind", "path", "fingerprint", "files"} or d["kind"] not in KINDS \
                or not all(isinstance(d[k], str) for k in ("path", "fingerprint")) or type(d["files"]) is not int:
            raise ValueError("not a model folder's identity")
        return cls(**d)

    def same_model(self, other: "Source") -> bool:
        """Whether ``other`` holds the same weights: the same kind and fingerprint (a folder moved, or copied
        with its times kept, is the same model at another path)."""
        return (self.kind, self.fingerprint) == (other.kind, other.fingerprint)

    def describe(self) -> str:
        return f"the {KINDS[self.kind]} {self.path} ({self.files} files, fingerprint {self.fingerprint[:12]})"


def source_kind(path: str, flag: str = "--load") -> str:
    """``ckpt`` (tnlg), ``hf`` or ``megatron``: what the folder ``path`` holds (one paragraph if it is none)."""
    if not os.path.isdir(path):
        raise UserError(f"{flag} {path!r} is not a directory; give a tnlg checkpoint, a Hugging Face folder or a "
                        f"Megatron-LM checkpoint.")
    if os.path.isfile(os.path.join(path, "config.json")):
        return "hf"
    if os.path.isfile(os.path.join(path, META)) or any(
            os.path.isfile(os.path.join(path, d, META)) for d in os.listdir(path) if d.startswith("iter_")):
        resolve(path, flag)  # a tnlg root: its pointer and iterations checked (one paragraph if broken)
        return "ckpt"
    return "megatron"  # (Megatron-LM's layout: the same pointer file, iter_* folders without meta.json)


def identify(path: str, kind: str, flag: str = "--load") -> Source:
    """The identity of the folder ``path`` of kind ``kind`` (:func:`source_kind`): module docstring."""
    if kind == "hf":
        folder = os.path.realpath(path)
        names = sorted(n for n in os.listdir(folder) if n.endswith(_WEIGHT_SUFFIXES)
                       and os.path.isfile(os.path.join(folder, n)))
        hashed = ["config.json"]
    else:
        if kind == "ckpt":
            iter_dir = resolve(path, flag)
            if iter_dir is None:
                raise UserError(f"{flag} {path!r} holds no checkpoint.")
        else:
            from .megatron.importer import iteration_dir
            iter_dir = iteration_dir(path)
        folder = os.path.realpath(iter_dir)
        names = sorted(os.path.relpath(os.path.join(d, f), folder) for d, _, fs in os.walk(folder) for f in fs)
        hashed = [META] if kind == "ckpt" else []
    stamps = []
    for name in names:
        st = os.stat(os.path.join(folder, name))
        stamps.append([name, st.st_size, st.st_mtime_ns])
    digests = {}
    for name in hashed:
        with open(os.path.join(folder, name), "rb") as f:
            digests[name] = hashlib.sha256(f.read()).hexdigest()
    what = json.dumps({"kind": kind, "files": stamps, "hashed": digests}, sort_keys=True)
    return Source(kind, folder, hashlib.sha256(what.encode()).hexdigest(), len(names) + len(set(hashed) - set(names)))
