"""Fine-tuning rows: ``{"prompt", "completion"}`` (``"response"`` a synonym) or ``{"messages": [...]}``, read
from JSON Lines, Parquet and ``datasets`` folders and checked (docs/finetune.md).

Every row is validated when it is read, so a bad one is one :class:`UserError` naming the file, the line
(JSON Lines, counted from 1) or the row (tables, counted from 0) and what a valid row holds, before any
token is made. A conversation is an optional ``system`` turn, then ``user`` and ``assistant`` turns
alternating, starting with ``user`` and ending with ``assistant``; every ``content`` a string, every
assistant turn non-empty. No collectives; pyarrow only for tables.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Iterator, Optional

from ..errors import UserError
from .inputs import JSONL_SUFFIXES, input_kind
from .tables import iter_table_rows

__all__ = ["SFTRow", "read_rows", "row_from_object", "ROLES"]

ROLES = ("system", "user", "assistant")
_FIELDS = ('{"prompt": str, "completion": str} ("response" may stand for "completion") or {"messages": '
           '[{"role": "system"|"user"|"assistant", "content": str}, ...]}')


@dataclass(frozen=True)
class SFTRow:
    """One checked sample: a prompt and its completion, or a conversation (``messages``)."""

    where: str  # "file:line" or "file row N", for messages about this row
    prompt: Optional[str] = None
    completion: Optional[str] = None
    messages: Optional[tuple[tuple[str, str], ...]] = None  # (role, content) pairs


def _bad(where: str, problem: str) -> UserError:
    return UserError(f"{where}: {problem}. A fine-tuning row is {_FIELDS}. Nothing was read further; fix the "
                     f"row or remove it.")


def _string(obj: dict, key: str, where: str) -> str:
    value = obj[key]
    if not isinstance(value, str):
        raise _bad(where, f"the value of {key!r} is a {type(value).__name__}, not a string")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:
        raise _bad(where, f"the value of {key!r} holds {value[err.start]!r} at character {err.start}, half of a "
                          f"UTF-16 surrogate pair, which is no character") from None
    return value


def _messages(value: Any, where: str) -> tuple[tuple[str, str], ...]:
    if not isinstance(value, (list, tuple)) or not value:
        raise _bad(where, f"'messages' is {'empty' if isinstance(value, (list, tuple)) else type(value).__name__}, "
                          "not a non-empty list of turns")
    turns = []
    for i, turn in enumerate(value):
        if not isinstance(turn, dict) or "role" not in turn or "content" not in turn:
            raise _bad(where, f"turn {i} of 'messages' is {json.dumps(turn, default=str)[:80]}, not an object "
                              "with 'role' and 'content'")
        role = turn["role"]
        if role not in ROLES:
            raise _bad(where, f"turn {i} has role {role!r}; the roles are {list(ROLES)}")
        turns.append((role, _string(turn, "content", f"{where} turn {i}")))
    _check_order([r for r, _ in turns], where)
    for i, (role, content) in enumerate(turns):
        if role == "assistant" and content == "":
            raise _bad(where, f"turn {i} (assistant) is empty; every assistant turn is trained on and needs text")
    return tuple(turns)


def _check_order(roles: list[str], where: str) -> None:
    """An optional system turn first, then user/assistant alternating from user, ending with assistant."""
    body = roles[1:] if roles[0] == "system" else roles
    for i, role in enumerate(body):
        want = "user" if i % 2 == 0 else "assistant"
        if role != want:
            k = i + len(roles) - len(body)
            raise _bad(where, f"turn {k} is {role!r} where {want!r} is due (roles {roles}); a conversation is an "
                              "optional system turn, then user and assistant turns alternating, starting with user")
    if not body or body[-1] != "assistant":
        raise _bad(where, f"the conversation ends with {roles[-1]!r} (roles {roles}); it must end with an "
                          "assistant turn, the text trained on")


def row_from_object(obj: Any, where: str) -> SFTRow:
    """One row (a parsed JSON object or a table row as a dict), checked; a :class:`UserError` naming ``where``."""
    if not isinstance(obj, dict):
        raise _bad(where, f"expected a JSON object, got {type(obj).__name__}")
    if obj.get("messages") is not None:
        return SFTRow(where, messages=_messages(obj["messages"], where))
    answers = [k for k in ("completion", "response") if obj.get(k) is not None]
    if "prompt" not in obj or obj["prompt"] is None or not answers:
        raise _bad(where, f"this row has the fields {sorted(obj)[:10]}, without "
                          f"{'a completion' if obj.get('prompt') is not None else 'prompt and completion'}")
    if len(answers) == 2:
        raise _bad(where, "this row has both 'completion' and 'response' (synonyms); keep one")
    completion = _string(obj, answers[0], where)
    if completion == "":
        raise _bad(where, f"the {answers[0]!r} is empty; the loss is on the completion, so it needs text")
    return SFTRow(where, prompt=_string(obj, "prompt", where), completion=completion)


def _jsonl_rows(path: str) -> Iterator[SFTRow]:
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(raw)
            except (ValueError, RecursionError) as err:
                raise _bad(where, f"malformed JSON ({getattr(err, 'msg', type(err).__name__)})") from None
            yield row_from_object(obj, where)


def _table_rows(path: str) -> Iterator[SFTRow]:
    from .tables import _schema  # the schema of a Parquet file or of a datasets folder's first file
    names = _schema(path, input_kind(path)).names
    if "messages" in names:
        columns = ["messages"]
    else:
        columns = [c for c in ("prompt", "completion", "response") if c in names]
        if "prompt" not in columns or len(columns) < 2:
            raise UserError(f"table {path!r} has the columns {names}; a fine-tuning table has {_FIELDS} as "
                            "columns. Nothing was read.")
    for first, per_column in iter_table_rows(path, columns):
        for i, values in enumerate(zip(*per_column)):
            yield row_from_object(dict(zip(columns, values)), f"{path} row {first + i}")


def read_rows(path: str) -> list[SFTRow]:
    """Every row of one input (JSON Lines, Parquet or a ``datasets`` folder), checked, in order."""
    path = os.fspath(path)
    kind = input_kind(path) if not path.lower().endswith(JSONL_SUFFIXES) else "jsonl"
    if kind == "txt":
        raise UserError(f"fine-tuning data {path!r} is a .txt file; give JSON Lines ({', '.join(JSONL_SUFFIXES)}), "
                        "Parquet or a `datasets` folder of rows such as " + _FIELDS + ".")
    if kind != "arrow" and not os.path.isfile(path):
        raise UserError(f"fine-tuning data {path!r} does not exist or is not a file.")
    rows = list(_jsonl_rows(path) if kind == "jsonl" else _table_rows(path))
    if not rows:
        raise UserError(f"fine-tuning data {path!r} has no rows (the file is empty or blank); a row is {_FIELDS}.")
    return rows
