"""``meta.json``, the manifest of a checkpoint, as dataclasses: what each key holds, read and written here.

Every writer (a training save, ``tnlg convert`` from a checkpoint, from Hugging Face or from Megatron-LM)
builds a :class:`Manifest`; every reader gets one from :meth:`Manifest.read`. The sections of a fixed
shape are dataclasses too (:class:`Layout`, :class:`OptimizerState`, :class:`Schedule`,
:class:`RngLayout`, :class:`Pipeline`, :class:`OptimFile`); the others stay the JSON they are: the
model's ``config`` (:meth:`tnlg.config.GPTConfig.to_dict`), the run's ``options``, its ``data``, the
``tokenizer``'s own description, and ``params`` (per parameter its partition record,
:func:`tnlg.checkpoint.reshard.param_records`, plus ``pp_rank`` at PP > 1).

The file is written byte for byte as the dict-building writers before these classes wrote it
(``tests/test_manifest.py`` compares against their files): a record keeps the order of the keys it was
read (or built by a converter) with in ``key_order``, so a manifest read and written again is
unchanged; one built by a training save writes its fields in their declared order, leaving out the
sections a save only writes when they apply (``pipeline``, ``converted_from``). Keys this tnlg does not
know (a newer writer's) are kept in ``extra`` and written back. Formats 1 (tnlg 0.1: no ``sha256``, no
``optim_files``) and 2 read alike.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from typing import ClassVar, Mapping, Optional, TypeVar, Union

from ..errors import UserError
from ..io import unsafe_name

T = TypeVar("T")


def need(value: Optional[T], what: str) -> T:
    """``value``, which a manifest records; one clear error naming the entry where it is missing (a
    ``meta.json`` written by hand, or by a writer that left it out)."""
    if value is None:
        raise UserError(f"the checkpoint's manifest (meta.json) records no {what}; a tnlg checkpoint records it, "
                        f"so this one is incomplete. Point at an intact checkpoint.")
    return value

__all__ = ["FORMAT", "READABLE_FORMATS", "META", "Manifest", "Layout", "OptimizerState", "Schedule", "RngLayout",
           "Pipeline", "OptimFile", "CONVERTED_KEYS"]

FORMAT = "tnlg.checkpoint/2"
READABLE_FORMATS = ("tnlg.checkpoint/1", FORMAT)
META = "meta.json"
MAX_BYTES = 256 * 2**20  # a meta.json larger than this is not one (17B at TP 8 x DP 64: about 10 MiB)
_BOOKKEEPING = ("extra", "key_order")


@dataclass
class _Record:
    """A JSON object as a dataclass. ``extra``: keys this tnlg does not know, kept as read; ``key_order``:
    the order of the keys as read (or as a converter writes them), ``()`` for the fields' own order."""

    extra: dict = field(default_factory=dict, repr=False, compare=False)
    key_order: tuple = field(default=(), repr=False, compare=False)

    _ALWAYS: ClassVar[tuple] = ()  # fields written even when None (built without a key order)
    _NESTED: ClassVar[dict] = {}   # field -> record class of its value
    _NESTED_MAPS: ClassVar[dict] = {}  # field -> record class of each value of its mapping

    @classmethod
    def names(cls) -> list[str]:
        """The keys this record has fields for, in the order a record built without a key order writes them."""
        return [f.name for f in dataclasses.fields(cls) if f.name not in _BOOKKEEPING]

    @classmethod
    def from_dict(cls, d: Mapping, where: str = "meta.json"):
        """The record of a JSON object; a section that should be an object and is not is a :class:`UserError`."""
        known = set(cls.names())
        values = {k: cls._decode(k, v, where) for k, v in d.items() if k in known}
        return cls(**values, extra={k: v for k, v in d.items() if k not in known}, key_order=tuple(d))

    @classmethod
    def _decode(cls, key: str, value, where: str):
        """A JSON value as the field ``key`` holds it: a nested record, a mapping of records, or as it is."""
        if value is None or (key not in cls._NESTED and key not in cls._NESTED_MAPS):
            return value
        if not isinstance(value, dict):
            raise UserError(f"{where!r} is corrupt: its {key!r} entry is not a mapping.")
        if key in cls._NESTED:
            return cls._NESTED[key].from_dict(value, where)
        return {k: cls._decode_item(key, v, where) for k, v in value.items()}

    @classmethod
    def _decode_item(cls, key: str, value, where: str):
        if not isinstance(value, dict):
            raise UserError(f"{where!r} is corrupt: an entry of its {key!r} section is not a mapping.")
        return cls._NESTED_MAPS[key].from_dict(value, where)

    def _keys(self) -> list[str]:
        """The keys written, in order (see the module docstring)."""
        fields = [f for f in dataclasses.fields(self) if f.name not in _BOOKKEEPING]
        if not self.key_order:
            keys = [f.name for f in fields if f.name in self._ALWAYS or getattr(self, f.name) is not None]
        else:
            keys = list(self.key_order) + [f.name for f in fields if f.name not in self.key_order
                                           and getattr(self, f.name) != _default(f)]
        return keys + [k for k in self.extra if k not in keys]

    def to_dict(self) -> dict:
        """The JSON object (nested records as objects), keys in the order described above."""
        known = set(self.names())
        return {k: _encode(getattr(self, k)) if k in known else self.extra[k]
                for k in self._keys() if k in known or k in self.extra}

    def replace(self, **changes):
        """A copy with ``changes`` (its key order kept: a field set anew is written after the others)."""
        return dataclasses.replace(self, **changes)

    def extended(self, **changes):
        """A copy with ``changes``, the keys it writes now keeping their places and the changed ones after them,
        also when ``None`` (as ``dict(d, **changes)`` orders a dict's keys)."""
        keys = self._keys()
        return dataclasses.replace(self, **changes, key_order=tuple(keys + [k for k in changes if k not in keys]))

    def without(self, *names: str):
        """A copy with the fields ``names`` back at their defaults and left out of the file."""
        defaults = {f.name: _default(f) for f in dataclasses.fields(self) if f.name in names}
        return dataclasses.replace(self, **defaults, key_order=tuple(k for k in self.key_order if k not in names))


def _default(f: dataclasses.Field):
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def _encode(value):
    if isinstance(value, _Record):
        return value.to_dict()
    if isinstance(value, dict):
        return {k: _encode(v) for k, v in value.items()}
    return value


@dataclass
class Layout(_Record):
    """``layout``: the sizes the checkpoint was saved at and the weights' dtype (``"float32"``, ``"bfloat16"``);
    ``pp`` only at PP > 1, ``ep`` (the expert-parallel size: the files ``model_..._epYY`` hold EP rank YY's
    experts) only at EP > 1. A converter's manifest has ``param_dtype`` alone until it is written."""
    tp: Optional[int] = None
    dp: Optional[int] = None
    world: Optional[int] = None
    param_dtype: Optional[str] = None
    pp: Optional[int] = None
    ep: Optional[int] = None

    @property
    def pp_size(self) -> int:
        return int(self.pp or 1)

    @property
    def ep_size(self) -> int:
        return int(self.ep or 1)


@dataclass
class OptimizerState(_Record):
    """``optimizer``: whether optimizer states are stored (``present``) and what they were stepped with: Adam's
    step count, the ZeRO stage, betas, eps, weight decay, the fp16 loss scaler's state (``None`` without
    one); ``converted`` for states imported from Megatron-LM."""
    _ALWAYS: ClassVar[tuple] = ("present",)
    present: bool = False
    num_steps: Optional[int] = None
    zero_stage: Optional[int] = None
    betas: Optional[list] = None
    eps: Optional[float] = None
    weight_decay: Optional[float] = None
    loss_scaler: Optional[dict] = None
    converted: Optional[bool] = None


@dataclass
class Schedule(_Record):
    """``schedule``: the LR schedule's position (``num_steps``, where a resume continues it) and the flags
    that shaped it."""
    _ALWAYS: ClassVar[tuple] = ("num_steps", "max_lr", "min_lr", "warmup_iters", "decay_iters", "decay_style")
    num_steps: Optional[int] = None
    max_lr: Optional[float] = None
    min_lr: Optional[float] = None
    warmup_iters: Optional[int] = None
    decay_iters: Optional[int] = None
    decay_style: Optional[str] = None


@dataclass
class RngLayout(_Record):
    """``rng``: the sizes of the layout whose ranks wrote ``rng_*`` files (``pp`` only at PP > 1)."""
    tp: Optional[int] = None
    dp: Optional[int] = None
    pp: Optional[int] = None


@dataclass
class Pipeline(_Record):
    """``pipeline`` (PP > 1 only): the stage count and, per pipeline rank, the global layers of each of its
    model chunks."""
    _ALWAYS: ClassVar[tuple] = ("pp", "stages")
    pp: Optional[int] = None
    stages: Optional[list] = None


@dataclass
class OptimFile(_Record):
    """An entry of ``optim_files``: the (TP, DP) rank that wrote the file, the states it holds (``kinds``)
    and its pieces, per parameter ``[lo, length]`` of the flattened TP shard; ``pp_rank`` at PP > 1."""
    _ALWAYS: ClassVar[tuple] = ("tp_rank", "dp_rank", "kinds", "pieces")
    tp_rank: Optional[int] = None
    dp_rank: Optional[int] = None
    kinds: Optional[list] = None
    pieces: Optional[dict] = None
    pp_rank: Optional[int] = None


# The keys of a converted checkpoint's manifest in the order the converters have always written them (the
# offline writer then adds params, files, sha256, optim_files and rng): Hugging Face's; Megatron-LM's
# has "torch" before "converted_from".
CONVERTED_KEYS = ("format", "iteration", "consumed_samples", "config", "options", "data", "tokenizer", "layout",
                  "optimizer", "schedule", "converted_from", "torch")


@dataclass
class Manifest(_Record):
    """``meta.json`` of one iteration directory (the fields in the order a training save writes them)."""
    _ALWAYS: ClassVar[tuple] = ("format", "iteration", "consumed_samples", "config", "options", "data", "tokenizer",
                                "layout", "params", "optimizer", "rng", "schedule", "files", "sha256",
                                "optim_files", "created", "torch")
    _NESTED: ClassVar[dict] = dict(layout=Layout, optimizer=OptimizerState, schedule=Schedule, rng=RngLayout,
                                   pipeline=Pipeline)
    _NESTED_MAPS: ClassVar[dict] = dict(optim_files=OptimFile)
    format: Optional[str] = None
    iteration: Optional[int] = None
    consumed_samples: int = 0
    config: Optional[dict] = None             # GPTConfig.to_dict() (older checkpoints lack later fields)
    options: Optional[dict] = None            # the run's options (tnlg.checkpoint.compat.options_record)
    data: Optional[dict] = None               # the datasets (tnlg.checkpoint.compat.data_record)
    tokenizer: Optional[dict] = None          # the tokenizer's describe(), what load_tokenizer reads
    layout: Layout = field(default_factory=Layout)
    params: dict = field(default_factory=dict)  # name -> partition record (+ pp_rank at PP > 1)
    buffers: Optional[dict] = None              # name -> {shape, dtype[, pp_rank]}: the model's saved buffers
    optimizer: OptimizerState = field(default_factory=OptimizerState)
    rng: Optional[RngLayout] = None
    schedule: Optional[Schedule] = None
    pipeline: Optional[Pipeline] = None
    files: dict = field(default_factory=dict)   # file name -> size in bytes (every file of the iteration)
    sha256: Optional[dict] = None               # file name -> SHA-256 (format 2)
    optim_files: Optional[dict] = None          # file name -> OptimFile (format 2)
    created: Optional[str] = None
    torch: Optional[str] = None
    converted_from: Optional[dict] = None       # where tnlg convert read it (a checkpoint, hf, megatron)
    adapters: Optional[dict] = None             # a LoRA run's: its adapters' settings and its frozen base (params: the adapters)

    # ----------------------------------------------------------------------- reading and writing

    @classmethod
    def of(cls, meta: Union["Manifest", Mapping]) -> "Manifest":
        """``meta`` itself, or the manifest of a ``meta.json``-shaped dict."""
        return meta if isinstance(meta, Manifest) else cls.from_dict(meta)

    @classmethod
    def read(cls, iter_dir: str, complete: bool = True) -> "Manifest":
        """Parse and check ``meta.json`` of an iteration directory (JSON only: nothing is executed).
        ``complete``: it must have the sections every checkpoint has (``False``: only the format and the
        file names are checked, as for a manifest written by hand to carry options)."""
        path = os.path.join(iter_dir, META)
        meta = _read_json(path, iter_dir)
        if not isinstance(meta, dict) or meta.get("format") not in READABLE_FORMATS:
            raise UserError(f"{path!r} has format {meta.get('format') if isinstance(meta, dict) else None!r}; "
                            f"this tnlg reads {' and '.join(map(repr, READABLE_FORMATS))}.")
        _check_names(meta, path)
        for key in ("iteration", "config", "layout", "params", "files", "optimizer") if complete else ():
            if meta.get(key) is None:
                raise UserError(f"{path!r} is corrupt: it has no {key!r} entry; the checkpoint cannot be used.")
        _check_values(meta, path)
        return cls.from_dict(meta, path)

    def to_json(self) -> str:
        """``meta.json``'s text."""
        return json.dumps(self.to_dict(), indent=1)

    # ----------------------------------------------------------------------- what readers ask

    @property
    def has_optimizer(self) -> bool:
        """Whether the checkpoint stores optimizer states."""
        return bool(self.optimizer.present)

    @property
    def schedule_steps(self) -> int:
        """The LR schedule's position a checkpoint resumes at: ``schedule.num_steps`` where recorded (it
        differs from Adam's step count in a converted checkpoint without or with fresh moments), else the
        optimizer's step count (0 without one)."""
        if self.schedule is not None and self.schedule.num_steps is not None:
            return int(self.schedule.num_steps)
        return int(need(self.optimizer.num_steps, "optimizer.num_steps")) if self.has_optimizer else 0

    def check_holds_weights(self, where: str) -> None:
        """A :class:`UserError` when this is a LoRA run's checkpoint (``adapters``): its parameters are the adapters
        alone, not a model's weights to load, convert or fine-tune."""
        a = self.adapters
        if a is None:
            return
        base = (a.get("base") or {}).get("path") if isinstance(a.get("base"), dict) else None
        raise UserError(f"{where} is the checkpoint of a LoRA run: it holds rank-{a.get('rank')} adapters and their "
                        f"optimizer state, not the model's weights (its frozen base is {base!r}). Give the base as the "
                        "model, with the adapters as --load-adapter SAVE/adapter (PEFT's folder the run wrote beside "
                        "it), or merge them first: tnlg convert --from BASE --merge-lora SAVE/adapter --to DIR. "
                        "Nothing was loaded.")

    def stage_of(self, name: str) -> Optional[int]:
        """The pipeline stage whose files hold parameter ``name`` (``None``: a checkpoint saved at PP 1)."""
        return self.params[name].get("pp_rank")


def _read_json(path: str, iter_dir: str):
    """The JSON value of ``meta.json`` at ``path`` (at most :data:`MAX_BYTES`, nested at most as deep as
    Python's parser goes), or a :class:`UserError` saying what is wrong with the file."""
    try:
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size > MAX_BYTES:
                raise UserError(f"{path!r} is {os.fstat(f.fileno()).st_size:,} bytes, more than any tnlg "
                                f"manifest ({MAX_BYTES // 2**20} MiB at most); it is not one. The checkpoint cannot "
                                f"be used.")
            return json.loads(f.read().decode("utf-8"))
    except FileNotFoundError:
        raise UserError(f"{iter_dir!r} is not a tnlg checkpoint: it has no {META}.") from None
    except IsADirectoryError:
        raise UserError(f"{path!r} is a folder, not a file; the checkpoint cannot be used.") from None
    except (ValueError, UnicodeDecodeError) as exc:  # (json.JSONDecodeError is a ValueError)
        raise UserError(f"{path!r} is corrupt ({exc}); the checkpoint cannot be used.") from None
    except RecursionError:
        raise UserError(f"{path!r} is corrupt: its JSON is nested deeper than any manifest; the checkpoint "
                        f"cannot be used.") from None


def _check_names(meta: dict, path: str) -> None:
    """Every file a manifest names is a plain name inside its folder (:func:`tnlg.io.unsafe_name`: no path
    separator, no ``..``, not absolute; a manifest is data from disk: it must not make a load open files
    elsewhere)."""
    for section in ("files", "sha256", "optim_files"):
        entries = meta.get(section) or {}
        if not isinstance(entries, dict):
            raise UserError(f"{path!r} is corrupt: its {section!r} entry is not a mapping of file names.")
        for name in entries:
            if unsafe_name(name) is not None:
                raise UserError(f"{path!r} names the file {name!r} in {section!r}: a checkpoint's files are "
                                f"plain names inside its own folder (no '/', no '..', not absolute); this "
                                f"manifest was not written by tnlg or was tampered with. Nothing was loaded.")


def _whole(v) -> bool:
    return type(v) is int and 0 <= v < 2**63


def _positive(v) -> bool:
    return _whole(v) and v >= 1


def _number(v) -> bool:
    return type(v) in (int, float) and math.isfinite(v)


def _of(kind):
    return lambda v: isinstance(v, kind)


_WORDS = {_whole: "a whole number >= 0", _positive: "a whole number >= 1", _number: "a finite number"}
_DICT, _STR, _LIST, _BOOL = _of(dict), _of(str), _of(list), _of(bool)
_WORDS.update({_DICT: "a mapping", _STR: "a string", _LIST: "a list", _BOOL: "true or false"})
# per section (None: the top level) the type of each value, where present and not null
_TYPES = {None: dict(iteration=_whole, consumed_samples=_whole, config=_DICT, options=_DICT, data=_DICT,
                     tokenizer=_DICT, params=_DICT, buffers=_DICT, files=_DICT, sha256=_DICT, created=_STR, torch=_STR,
                     converted_from=_DICT, adapters=_DICT),
          "layout": dict(tp=_positive, dp=_positive, world=_positive, pp=_positive, ep=_positive, param_dtype=_STR),
          "optimizer": dict(present=_BOOL, num_steps=_whole, zero_stage=_whole, betas=_LIST, eps=_number,
                            weight_decay=_number, loss_scaler=_DICT, converted=_BOOL),
          "schedule": dict(num_steps=_whole, max_lr=_number, min_lr=_number, warmup_iters=_whole,
                           decay_iters=_whole, decay_style=_STR),
          "rng": dict(tp=_positive, dp=_positive, pp=_positive),
          "pipeline": dict(pp=_positive, stages=_LIST)}
_PARAM = dict(shape=_LIST, sharded=_BOOL, dim=_whole, sizes=_LIST, full_size=_whole, pp_rank=_whole, experts=_BOOL)
_BUFFER = dict(shape=_LIST, dtype=_STR, pp_rank=_whole)
_OPTIM_FILE = dict(tp_rank=_whole, dp_rank=_whole, pp_rank=_whole, kinds=_LIST, pieces=_DICT)


def _check_record(record: dict, types: dict, where: str, path: str) -> None:
    for key, ok in types.items():
        value = record.get(key)
        if value is not None and not ok(value):
            raise UserError(f"{path!r} is corrupt: {where}{key!r} is {_shown(value)}, not {_WORDS[ok]}; the "
                            f"checkpoint cannot be used.")


def _shown(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _check_values(meta: dict, path: str) -> None:
    """Each value tnlg reads is of its type (counts whole numbers >= 0, sizes >= 1, sections mappings, every
    file size a whole number, every parameter's shape a list of whole numbers), else a :class:`UserError`
    naming the entry and what it holds."""
    for section, types in _TYPES.items():
        record = meta if section is None else meta.get(section)
        if record is not None and not isinstance(record, dict):
            raise UserError(f"{path!r} is corrupt: its {section!r} entry is not a mapping.")
        if record is not None:
            _check_record(record, types, "" if section is None else f"{section!r}: ", path)
    for name, size in (meta.get("files") or {}).items():
        _check_record({"size": size}, {"size": _whole}, f"the file {name!r}: ", path)
    for name, digest in (meta.get("sha256") or {}).items():
        _check_record({"sha256": digest}, {"sha256": _STR}, f"the file {name!r}: ", path)
    for name, rec in (meta.get("params") or {}).items():
        if not isinstance(rec, dict):
            raise UserError(f"{path!r} is corrupt: the parameter {name!r} is {_shown(rec)}, not a mapping; the "
                            f"checkpoint cannot be used.")
        _check_record(rec, _PARAM, f"the parameter {name!r}: ", path)
        shape, sizes = rec.get("shape") or [], rec.get("sizes") or []
        if not all(_whole(d) and d < 2**40 for d in shape) or len(shape) > 8 or math.prod(shape) >= 2**48:
            raise UserError(f"{path!r} is corrupt: the parameter {name!r} has shape {_shown(shape)}, not a list of "
                            f"at most 8 sizes whose product is a tensor's size; the checkpoint cannot be used.")
        # sizes: the split dimension's part on each tensor-parallel rank (one per rank, adding up to that dimension)
        if not all(_whole(d) and d < 2**40 for d in sizes) or len(sizes) > 2**16 or sum(sizes) >= 2**40:
            raise UserError(f"{path!r} is corrupt: the parameter {name!r} has sizes {_shown(sizes)}, not a list of "
                            f"each tensor-parallel rank's part (at most 65536 whole numbers); the checkpoint cannot "
                            f"be used.")
    for name, rec in (meta.get("buffers") or {}).items():
        if not isinstance(rec, dict):
            raise UserError(f"{path!r} is corrupt: the buffer {name!r} is {_shown(rec)}, not a mapping; the "
                            f"checkpoint cannot be used.")
        _check_record(rec, _BUFFER, f"the buffer {name!r}: ", path)
        shape = rec.get("shape") or []
        if not all(_whole(d) and d < 2**40 for d in shape) or len(shape) > 8 or math.prod(shape) >= 2**40:
            raise UserError(f"{path!r} is corrupt: the buffer {name!r} has shape {_shown(shape)}, not a tensor's; "
                            f"the checkpoint cannot be used.")
    for name, rec in (meta.get("optim_files") or {}).items():
        if isinstance(rec, dict):
            _check_record(rec, _OPTIM_FILE, f"the optimizer file {name!r}: ", path)
