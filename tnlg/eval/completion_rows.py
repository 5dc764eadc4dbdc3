"""The rows ``tnlg eval --task generate`` scores, from JSON Lines, Parquet or a ``datasets`` folder (the one rows
reader, :mod:`tnlg.data.rows`): ``{"prompt": str, "completion": str}`` (TRL's names; ``"response"`` a
synonym), the completion being the reference or a list of references; or a conversation ``{"messages":
[...]}`` as fine-tuning reads it (:func:`tnlg.data.sft_rows.conversation`), whose last assistant turn is
the reference and the turns before it the prompt (:func:`tnlg.data.chat.prompt_segments`). Other keys are
ignored; blank lines are skipped; a null in a table is an absent field. Every fault is one
:class:`~tnlg.errors.UserError` in the reader's format (``FILE:LINE`` or ``FILE:row N``), raised before any
model is loaded."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Optional

from ..data.rows import RowFormat, Where, iter_rows
from ..data.sft_rows import conversation

__all__ = ["CompletionRow", "read_completion_rows", "FORMAT"]

FORMAT = RowFormat("--task generate data", 'a row is {"prompt": str, "completion": str} ("response" instead of '
                   '"completion" is accepted; the completion may be a list of reference strings) or {"messages": '
                   '[{"role": ..., "content": str}, ...]} ending with the assistant turn that is the reference')


@dataclass(frozen=True)
class CompletionRow:
    """One example: the prompt (text, or ``None`` for a conversation), its references (at least one), where
    it came from, and for a conversation its turns, the last one the assistant's reference."""

    prompt: Optional[str]
    references: tuple[str, ...]
    where: Where
    messages: Optional[tuple[tuple[str, str], ...]] = None


def _references(obj: dict, where: Where) -> tuple[str, ...]:
    keys = [k for k in ("completion", "response") if obj.get(k) is not None]
    if len(keys) != 1:
        found = "both" if keys else f"neither (its keys: {sorted(obj)})"
        raise FORMAT.error(where, f'this row has {found} of "completion" and "response": give exactly one')
    value = obj[keys[0]]
    refs = [value] if isinstance(value, str) else value
    if not isinstance(refs, list) or not refs or not all(isinstance(r, str) for r in refs):
        raise FORMAT.error(where, f'"{keys[0]}" must be a string or a non-empty list of strings, got '
                                  f"{json.dumps(value)[:80]}")
    _check_references(refs, keys[0], where)
    return tuple(refs)


def _check_references(refs: list, key: str, where: Where) -> None:
    if not all(r.strip() for r in refs):
        raise FORMAT.error(where, f"{key} holds an empty reference; every reference needs text (an empty one "
                                  "scores 0 whatever is generated)")


def _row(obj, where: Where) -> CompletionRow:
    if not isinstance(obj, dict):
        raise FORMAT.error(where, f"this row is a JSON {type(obj).__name__}, not an object")
    if obj.get("messages") is not None:
        turns = conversation(obj["messages"], str(where), FORMAT)
        _check_references([turns[-1][1]], "the last assistant turn", where)
        return CompletionRow(None, (turns[-1][1],), where, turns)
    if not isinstance(obj.get("prompt"), str):
        got = "no \"prompt\"" if obj.get("prompt") is None else f'"prompt" {json.dumps(obj["prompt"])[:40]}'
        raise FORMAT.error(where, f'this row has {got}: it needs a "prompt" string')
    return CompletionRow(obj["prompt"], _references(obj, where), where)


def read_completion_rows(path: str) -> list[CompletionRow]:
    """Every row of ``path`` (JSON Lines, Parquet or a ``datasets`` folder) as a :class:`CompletionRow`."""
    rows = [_row(obj, where) for where, obj in iter_rows(path, FORMAT)]
    if not rows:
        raise FORMAT.file_error(path, "has no rows (it is empty or blank)")
    return rows
