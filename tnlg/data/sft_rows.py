"""Fine-tuning rows: ``{"prompt", "completion"}`` (``"response"`` a synonym) or ``{"messages": [...]}``, read
from JSON Lines, Parquet and ``datasets`` folders and checked (docs/finetune.md).

Rows are read by the one rows reader (:mod:`.rows`), so a bad one is one :class:`UserError` in its format,
``FILE:LINE`` (JSON Lines, lines counted from 1) or ``FILE:row N`` (tables, rows counted from 0), what is
wrong and what a valid row holds, before any token is made. A conversation is an optional ``system`` turn,
then ``user`` and ``assistant`` turns alternating, starting with ``user`` and ending with ``assistant``;
every ``content`` a string, every assistant turn non-empty. No collectives; pyarrow only for tables.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Optional

from .rows import JSONL_SUFFIXES, RowFormat, iter_rows, rows_kind

__all__ = ["SFTRow", "read_rows", "row_from_object", "conversation", "ROLES", "FORMAT"]

ROLES = ("system", "user", "assistant")
_FIELDS = ('{"prompt": str, "completion": str} ("response" may stand for "completion") or {"messages": '
           '[{"role": "system"|"user"|"assistant", "content": str}, ...]}')
FORMAT = RowFormat("fine-tuning data", f"a fine-tuning row is {_FIELDS}",
                   "Nothing was read further; fix the row or remove it.")


@dataclass(frozen=True)
class SFTRow:
    """One checked sample: a prompt and its completion, or a conversation (``messages``)."""

    where: str  # "file:line" or "file:row N", for messages about this row
    prompt: Optional[str] = None
    completion: Optional[str] = None
    messages: Optional[tuple[tuple[str, str], ...]] = None  # (role, content) pairs


def _string(obj: dict, key: str, where: str, fmt: RowFormat, what: str = "") -> str:
    value = obj[key]
    if not isinstance(value, str):
        raise fmt.error(where, f"the value of {what}{key!r} is a {type(value).__name__}, not a string")
    return value


def conversation(value: Any, where: str, fmt: RowFormat = FORMAT) -> tuple[tuple[str, str], ...]:
    """A ``messages`` value as ``(role, content)`` pairs, checked (see the module docstring); a
    :meth:`RowFormat.error` of ``fmt`` naming ``where`` and the turn."""
    if not isinstance(value, (list, tuple)) or not value:
        raise fmt.error(where, f"'messages' is {'empty' if isinstance(value, (list, tuple)) else type(value).__name__}, "
                               "not a non-empty list of turns")
    turns = []
    for i, turn in enumerate(value):
        if not isinstance(turn, dict) or "role" not in turn or "content" not in turn:
            raise fmt.error(where, f"turn {i} of 'messages' is {json.dumps(turn, default=str)[:80]}, not an object "
                                   "with 'role' and 'content'")
        role = turn["role"]
        if role not in ROLES:
            raise fmt.error(where, f"turn {i} has role {role!r}; the roles are {list(ROLES)}")
        turns.append((role, _string(turn, "content", where, fmt, f"turn {i}'s ")))
    _check_order([r for r, _ in turns], where, fmt)
    for i, (role, content) in enumerate(turns):
        if role == "assistant" and content == "":
            raise fmt.error(where, f"turn {i} (assistant) is empty; every assistant turn is trained on and needs "
                                   "text")
    return tuple(turns)


def _check_order(roles: list[str], where: str, fmt: RowFormat) -> None:
    """An optional system turn first, then user/assistant alternating from user, ending with assistant."""
    body = roles[1:] if roles[0] == "system" else roles
    for i, role in enumerate(body):
        want = "user" if i % 2 == 0 else "assistant"
        if role != want:
            k = i + len(roles) - len(body)
            raise fmt.error(where, f"turn {k} is {role!r} where {want!r} is due (roles {roles}); a conversation is "
                                   "an optional system turn, then user and assistant turns alternating, starting "
                                   "with user")
    if not body or body[-1] != "assistant":
        raise fmt.error(where, f"the conversation ends with {roles[-1]!r} (roles {roles}); it must end with an "
                               "assistant turn, the text trained on")


def row_from_object(obj: Any, where: str) -> SFTRow:
    """One row (a parsed JSON object or a table row as a dict), checked; a :class:`UserError` naming ``where``."""
    if not isinstance(obj, dict):
        raise FORMAT.error(where, f"expected a JSON object, got {type(obj).__name__}")
    if obj.get("messages") is not None:
        return SFTRow(where, messages=conversation(obj["messages"], where))
    answers = [k for k in ("completion", "response") if obj.get(k) is not None]
    if obj.get("prompt") is None or not answers:
        raise FORMAT.error(where, f"this row has the fields {sorted(obj)[:10]}, without "
                                  f"{'a completion' if obj.get('prompt') is not None else 'prompt and completion'}")
    if len(answers) == 2:
        raise FORMAT.error(where, "this row has both 'completion' and 'response' (synonyms); keep one")
    completion = _string(obj, answers[0], where, FORMAT)
    if completion == "":
        raise FORMAT.error(where, f"the {answers[0]!r} is empty; the loss is on the completion, so it needs text")
    return SFTRow(where, prompt=_string(obj, "prompt", where, FORMAT), completion=completion)


def read_rows(path: str) -> list[SFTRow]:
    """Every row of one input (JSON Lines, Parquet or a ``datasets`` folder), checked, in order."""
    path = os.fspath(path)
    if path.lower().endswith(".txt"):
        raise FORMAT.file_error(path, f"is a .txt file; give JSON Lines ({', '.join(JSONL_SUFFIXES)}), Parquet or "
                                      "a `datasets` folder")
    if rows_kind(path) == "jsonl" and not path.lower().endswith(JSONL_SUFFIXES):
        raise FORMAT.file_error(path, f"has an unknown extension; give JSON Lines ({', '.join(JSONL_SUFFIXES)}), "
                                      "Parquet (.parquet) or a `datasets` folder")
    rows = [row_from_object(obj, str(where)) for where, obj in iter_rows(path, FORMAT)]
    if not rows:
        raise FORMAT.file_error(path, "has no rows (it is empty or blank)")
    return rows
