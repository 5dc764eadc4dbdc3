"""Options written once: a dataclass field per option, with its flag, help and checks in the field's
metadata; the argument parser, the config-file keys and the resume checks are read from the fields.

Torch-free: ``tnlg pretrain --help`` builds its parser from these fields.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import Iterable, Optional

from ..config import flag_of, option, option_fields
from ..errors import UserError

__all__ = ["option", "flag_of", "option_fields", "add_options", "shown", "given_flag", "check_declared"]


def shown(v) -> str:
    """A default as ``--help`` writes it."""
    return f"{v:g}" if isinstance(v, float) else repr(v) if isinstance(v, str) else str(v)


def _value_type(cls, f: dataclasses.Field):
    """The scalar type of a field (``Optional[int]`` -> int) and whether it takes a list."""
    hint = typing.get_type_hints(cls)[f.name]
    if typing.get_origin(hint) is typing.Union:  # Optional[X] -> X
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    if typing.get_origin(hint) is list:
        return typing.get_args(hint)[0], True
    return hint, False


def add_options(group, cls, builtin: dict, names: Optional[Iterable[str]] = None,
                defaults: Optional[dict] = None) -> None:
    """Add the flags of options dataclass ``cls`` to ``group`` (with ``names``: those fields only). Defaults
    are ``argparse.SUPPRESS``: a namespace holds exactly what was given. Each help ends with the default of
    every run (``defaults``: what ``--help`` says instead, by field name) and, where it differs, the
    built-in job's (``builtin``: what ``--help`` says of the built-in job's values)."""
    wanted = None if names is None else set(names)
    for f in option_fields(cls):
        m = f.metadata
        if not m.get("cli", True) or (wanted is not None and f.name not in wanted):
            continue
        typ, many = _value_type(cls, f)
        kw: dict = dict(default=argparse.SUPPRESS, dest=f.name)
        if typ is bool:
            kw["action"] = "store_false" if m["negative"] else "store_true"
            flags = (m["negative"],) if m["negative"] else (m["flags"] or (flag_of(f.name),))
            kw["help"] = m["help"] or None
            group.add_argument(*flags, **kw)
            if m["negative"] and m["flags"]:  # the positive spelling too (it sets the default, as Megatron's)
                group.add_argument(*m["flags"], action="store_true", default=argparse.SUPPRESS, dest=f.name,
                                   help=argparse.SUPPRESS)
            continue
        if many:
            kw["nargs"] = "+"
        if typ in (int, float):  # (a list of numbers: each one)
            kw["type"] = typ
        for k in ("choices", "metavar"):
            if m.get(k) is not None:
                kw[k] = m[k]
        every, words = (defaults or {}).get(f.name, m["every"]), builtin.get(f.name)
        default = f.default if f.default is not dataclasses.MISSING else None
        if every is None and default is not None:
            every = shown(default)
        parts = ([f"default {every}"] if every else []) + ([f"built-in job {words}"] if words else [])
        text = m["help"] + (f" ({'; '.join(parts)})" if parts else "")
        kw["help"] = text.strip() or None
        group.add_argument(*(m["flags"] or (flag_of(f.name),)), **kw)


def given_flag(f: dataclasses.Field) -> str:
    """The flag errors name for declared field ``f``: its first spelling (``--no-x`` for a negative)."""
    return (f.metadata["flags"] or (f.metadata["negative"] or flag_of(f.name),))[0]


def check_declared(cls, values: dict) -> None:
    """Each of ``values`` (by field name of the declared dataclass ``cls``) by its field's check: a
    :class:`UserError` naming the flag, the value and what it must be."""
    for f in dataclasses.fields(cls):
        check = f.metadata.get("check")
        wrong = check(values[f.name]) if check and f.name in values else None
        if wrong:
            raise UserError(f"{given_flag(f)} must {wrong}, got {values[f.name]!r}.")
