"""Reading Megatron's pickled files without running code from them.

Megatron-LM writes three kinds of pickles: the legacy per-rank ``model_optim_rng.pt`` and the
``common.pt`` of a ``torch_dist`` checkpoint (``torch.save``), and the ``.metadata`` index of
``torch.distributed.checkpoint`` (plain ``pickle``). None is unpickled freely here:

* ``.pt`` files go through ``torch.load(weights_only=True)``. The one class whose contents are
  needed is ``argparse.Namespace`` (the saved ``args``), allowed as itself. Objects Megatron stores
  beside the weights that a conversion never reads (its enums and config dataclasses in ``args``,
  the NumPy / ``random`` RNG states, ``pathlib`` paths, Transformer Engine's ``BytesIO`` extra
  state) are rebuilt as an inert :class:`Skipped` record that keeps only the name: the named
  class is never imported or called. Any other global is refused, naming it.
* ``.metadata`` goes through a ``pickle.Unpickler`` whose ``find_class`` returns only the
  dataclasses of the index (``torch.distributed.checkpoint.metadata``, ``filesystem._StorageInfo``,
  the ``planner`` save plans it records) and a few torch value types (the restricted-globals
  pattern of Python's ``pickle`` documentation).
"""

from __future__ import annotations

import argparse
import enum
import io
import pickle
import re
from typing import Optional

import torch

from ...errors import UserError

__all__ = ["Skipped", "load_pt", "load_dcp_metadata", "load_chunk", "reason", "runs_code", "shown"]

# modules whose objects may sit beside the weights in a Megatron file, rebuilt inert (never imported)
_SKIPPED_MODULES = ("megatron.", "numpy.", "pathlib.", "signal.", "types.", "io.", "_io.", "_codecs.",
                    "transformer_engine.", "enum.", "datetime.", "apex.")


class Skipped:
    """Base of the inert records (module docstring): constructing one, its ``__new__`` and its
    ``__setstate__`` keep nothing; ``skipped_name`` is the global it stands for."""

    skipped_name = ""

    def __new__(cls, *args, **kwargs):
        return object.__new__(cls)

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state) -> None:
        pass

    def __repr__(self) -> str:
        return f"<skipped {self.skipped_name}>"

    _made: dict = {}

    @classmethod
    def standing_for(cls, name: str) -> type:
        """The inert class that stands for the global ``name`` (one per name: ``torch.serialization``
        maps each allowed name to a class)."""
        if name not in cls._made:
            cls._made[name] = type(name.rpartition(".")[2], (cls,), {"skipped_name": name})
        return cls._made[name]


# torch's refusals name the global: "Unsupported global: GLOBAL m.n was not an allowed global ..." or,
# for the modules it blocks outright, "Trying to load unsupported GLOBAL m.n whose module m is blocked"
_UNSUPPORTED = re.compile(r"GLOBAL (\S+?)(?: was not| whose module)")
# globals whose only use in a pickle is to run code when it is loaded
_CODE_MODULES = ("os", "posix", "nt", "sys", "subprocess", "builtins", "__builtin__", "runpy", "importlib", "pty",
                 "shutil", "socket", "ctypes", "code", "codeop", "pickle", "_pickle", "marshal", "commands",
                 "webbrowser", "operator", "functools", "multiprocessing", "threading", "_thread", "asyncio")
# the sentences of torch's weights-only refusals that tell a user how to turn the protection off
_ADVICE = re.compile(r"weights_only|safe_globals|trusted source|torch\.load|documentation|PyTorch 2\.6",
                     re.IGNORECASE)


def shown(value: object, limit: int = 60) -> str:
    """``value`` (read from a file: any type, any size, any graph) for a message: the repr of a short
    plain value, else its type; never a walk of a container (a crafted graph can be endless)."""
    if isinstance(value, bool) or value is None or isinstance(value, float):
        text = repr(value)
    elif isinstance(value, int):
        text = repr(value) if abs(value) < 10 ** 30 else f"an integer of {value.bit_length()} bits"
    elif isinstance(value, (str, bytes)):
        text = repr(value[:limit])
    else:
        return f"a {type(value).__name__}"
    return text if len(text) <= limit else text[:limit - 3] + "..."


def runs_code(name: str) -> bool:
    """Whether the global ``name`` (``module.attr``) is one a pickle names only to run code."""
    return name.split(".", 1)[0] in _CODE_MODULES or name in ("torch._C._dynamo", "torch.load")


def _code(path: str, what: str, name: str) -> UserError:
    return UserError(f"{what} {path!r} asks to run code when it is unpickled (it calls {name[:80]}): a checkpoint "
                     "holds data, and tnlg never runs code from one. The file is not a Megatron checkpoint, or it was "
                     "tampered with; do not load it with other tools either. Nothing was written.")


def _allow(allowed: dict, name: str, path: str, what: str) -> None:
    """Admit global ``name``: ``argparse.Namespace`` as itself, a skippable one inert, else refuse."""
    if name == "argparse.Namespace":
        allowed[name] = argparse.Namespace
    elif name == "builtins.getattr":  # how Python 3.12+ and some 3.11 builds pickle an enum member
        allowed[name] = (_safe_getattr(path, what), name)
    elif runs_code(name):
        raise _code(path, what, name)
    elif name.startswith(_SKIPPED_MODULES):
        allowed[name] = (Skipped.standing_for(name), name)
    else:
        raise UserError(f"{what} {path!r} holds an object of {name[:80]}, which a Megatron checkpoint does not need "
                        "and tnlg does not unpickle (only argparse.Namespace and Megatron's own records are read, "
                        "without running code). Nothing was written.")


def _member_of(cls: object, name: object) -> Optional[enum.Enum]:
    """``getattr(cls, name)`` where ``cls`` is an enum and ``name`` one of its members, else None: all a
    pickle's ``builtins.getattr`` may do here (how Python 3.12+ and some 3.11 builds pickle a member)."""
    if isinstance(cls, type) and issubclass(cls, enum.Enum) and isinstance(name, str) and name in cls.__members__:
        return cls[name]
    return None


def _safe_getattr(path: str, what: str):
    """The ``getattr`` a ``.pt`` file may call: on an inert record's class (a skipped enum, such as
    Megatron's ``AttnBackend`` in ``args``), giving an inert record, or for a member of an enum the
    loader already admits, giving that member; any other call is refused as code."""
    def member(cls, name):
        if isinstance(cls, type) and issubclass(cls, Skipped) and isinstance(name, str):
            return Skipped.standing_for(f"{cls.skipped_name}.{name[:80]}")()
        found = _member_of(cls, name)  # a member of an enum the loader already admits (torch's own)
        if found is not None:
            return found
        raise _code(path, what, f"builtins.getattr on {shown(cls)}")
    member.__module__, member.__qualname__ = "builtins", "getattr"
    return member


def load_pt(path: str, what: str) -> dict:
    """``torch.load(path, weights_only=True, mmap=True)`` with ``argparse.Namespace`` allowed and the
    skippable Megatron objects inert (module docstring). Tensors stay memory-mapped: a caller touches
    only what it reads. A file of torch < 1.6's format is loaded whole (no memory map; its globals
    are learnt from the loader's refusals). ``what`` names the file in errors."""
    allowed: dict = {}
    try:
        for name in torch.serialization.get_unsafe_globals_in_checkpoint(path):
            _allow(allowed, name, path, what)
        zip_format = True
    except UserError:
        raise
    except Exception:  # noqa: BLE001 - not a zip file: the old format, or damaged (torch.load says which)
        zip_format = False
    if not zip_format:  # read whole anyway: from memory, so a crafted length reads only what the file has
        with open(path, "rb") as f:
            whole = f.read()
    for _ in range(64):
        try:
            with torch.serialization.safe_globals(list(allowed.values())):
                if not zip_format:
                    return torch.load(io.BytesIO(whole), map_location="cpu", weights_only=True)
                return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except pickle.UnpicklingError as exc:
            found = _UNSUPPORTED.search(str(exc))
            if found is None or found.group(1) in allowed:
                raise _damaged(path, what, exc) from None
            _allow(allowed, found.group(1), path, what)
        except Exception as exc:  # noqa: BLE001
            raise _damaged(path, what, exc) from None
    raise _damaged(path, what, RuntimeError("too many kinds of objects"))


def reason(exc: BaseException) -> str:
    """What went wrong, in torch's or Python's words, less any advice to load the file without
    ``weights_only`` (the protection that refused it), on one line, at most 200 characters."""
    sentences = re.split(r"(?<=[.!?])\s+", " ".join(str(exc).split()))
    kept = " ".join(s for s in sentences if s and not _ADVICE.search(s))
    return f"{type(exc).__name__}: {kept[:200] or 'no details'}"


def _damaged(path: str, what: str, exc: BaseException) -> UserError:
    return UserError(f"{what} {path!r} cannot be loaded ({reason(exc)}); it is damaged, truncated or not a Megatron "
                     "checkpoint file. Nothing was written.")


# --------------------------------------------------------------------------- torch.distributed.checkpoint

def _dcp_classes() -> dict[tuple[str, str], object]:
    from torch.distributed.checkpoint import filesystem, metadata, planner
    out: dict[tuple[str, str], object] = {}
    for module, names in ((metadata, ("Metadata", "TensorStorageMetadata", "TensorProperties", "ChunkStorageMetadata",
                                      "BytesStorageMetadata", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")),
                          (filesystem, ("_StorageInfo",)),
                          (planner, ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData"))):
        for n in names:
            if hasattr(module, n):
                out[(module.__name__, n)] = getattr(module, n)
    out[("torch", "Size")] = torch.Size
    out[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
    out[("collections", "OrderedDict")] = __import__("collections").OrderedDict
    for name in ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool",
                 "strided", "contiguous_format", "preserve_format", "channels_last"):
        out[("torch", name)] = getattr(torch, name)
    return out


class _DCPUnpickler(pickle._Unpickler):
    """Python's own unpickler (its memo is a dict: a crafted memo index allocates nothing), reading from
    the file's bytes in memory (a crafted length reads what is there), giving only the index's classes."""

    classes: dict = {}
    # BYTEARRAY8 allocates the length it reads before reading it; an index holds no bytearray
    dispatch = {k: v for k, v in pickle._Unpickler.dispatch.items()
                if k not in (pickle.BYTEARRAY8[0], pickle.NEXT_BUFFER[0], pickle.READONLY_BUFFER[0])}

    def find_class(self, module: str, name: str):
        key = (module, name)
        if key in self.classes:
            return self.classes[key]
        if key == ("builtins", "getattr"):  # how Python 3.12+ (and some 3.11 builds) pickle an enum member
            return self._enum_member
        raise _Refused(f"{module}.{name}")

    def _enum_member(self, cls, name):
        """``getattr(cls, name)`` only where ``cls`` is one of the index's own enums and ``name`` one of its
        members (``_MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT``): any other use of getattr is refused."""
        member = _member_of(cls, name) if cls in self.classes.values() else None
        if member is None:
            raise _Refused("builtins.getattr")
        return member


class _Refused(pickle.UnpicklingError):
    """A global the index's unpickler does not give (``args[0]``: its name)."""


def load_dcp_metadata(path: str):
    """The ``torch.distributed.checkpoint.metadata.Metadata`` pickled in ``path`` (restricted globals)."""
    from torch.distributed.checkpoint.metadata import Metadata
    _DCPUnpickler.classes = _dcp_classes()
    try:
        with open(path, "rb") as f:
            meta = _DCPUnpickler(io.BytesIO(f.read())).load()
    except _Refused as exc:
        name = exc.args[0]
        if runs_code(name):
            raise _code(path, "torch_dist index", name) from None
        raise UserError(f"torch_dist index {path!r} holds an object of {name[:80]}, which is not part of a "
                        "torch.distributed.checkpoint index; it is not one, or it was tampered with. Nothing was "
                        "written.") from None
    except Exception as exc:  # noqa: BLE001 - any failure of a damaged pickle
        raise UserError(f"torch_dist index {path!r} cannot be read ({reason(exc)}); it is damaged or truncated, or "
                        "not a torch.distributed.checkpoint index. Nothing was written.") from None
    if not isinstance(meta, Metadata):
        raise UserError(f"torch_dist index {path!r} holds a {type(meta).__name__}, not a torch.distributed.checkpoint "
                        "Metadata; it is damaged or not a torch_dist index. Nothing was written.")
    return meta


def load_chunk(path: str, offset: int, length: int, what: str):
    """One chunk of a ``.distcp`` file: ``length`` bytes at ``offset``, a ``torch.save`` stream, loaded
    with ``weights_only`` and no other global (a global that runs code is named as such)."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read(length)
        if len(data) != length:
            raise EOFError(f"{len(data)} of {length} bytes at offset {offset}")
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise UserError(f"{what}: file {path!r} named by the torch_dist index is missing. Nothing was written.") \
            from None
    except pickle.UnpicklingError as exc:
        found = _UNSUPPORTED.search(str(exc))
        if found is not None and runs_code(found.group(1)):
            raise _code(path, f"{what}: torch_dist data file", found.group(1)) from None
        if found is not None:
            raise UserError(f"{what}: {path!r} holds an object of {found.group(1)[:80]} where a chunk of tensor data "
                            "belongs; it is not a torch_dist data file, or it was tampered with. Nothing was "
                            "written.") from None
        raise _chunk_damaged(path, what, exc) from None
    except Exception as exc:  # noqa: BLE001
        raise _chunk_damaged(path, what, exc) from None


def _chunk_damaged(path: str, what: str, exc: BaseException) -> UserError:
    return UserError(f"{what}: {path!r} cannot be read ({reason(exc)}); it is damaged or truncated. Nothing was "
                     "written.")
