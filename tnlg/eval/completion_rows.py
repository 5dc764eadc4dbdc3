"""The rows ``tnlg eval --task generate`` scores: JSON Lines of ``{"prompt": str, "completion": str}``
(TRL's names; ``"response"`` a synonym), the completion being the reference, or a list of references.
Other keys are ignored; blank lines are skipped. Every fault is one :class:`~tnlg.errors.UserError`
naming the line, raised before any model is loaded."""

from __future__ import annotations

import json
from dataclasses import dataclass

from ..errors import UserError

__all__ = ["CompletionRow", "read_completion_rows"]

_EXPECTED = ('each line must be an object {"prompt": "...", "completion": "..."} ("response" instead of '
             '"completion" is accepted; the completion may be a list of reference strings)')


@dataclass(frozen=True)
class CompletionRow:
    """One example: the prompt, its references (at least one) and the line it came from."""

    prompt: str
    references: tuple[str, ...]
    line: int


def _references(obj: dict, where: str) -> tuple[str, ...]:
    keys = [k for k in ("completion", "response") if k in obj]
    if len(keys) != 1:
        found = "both" if keys else f"neither (its keys: {sorted(obj)})"
        raise UserError(f'{where} has {found} of "completion" and "response": give exactly one; {_EXPECTED}.')
    value = obj[keys[0]]
    refs = [value] if isinstance(value, str) else value
    if not isinstance(refs, list) or not refs or not all(isinstance(r, str) for r in refs):
        raise UserError(f'{where}: "{keys[0]}" must be a string or a non-empty list of strings, got '
                        f"{json.dumps(value)[:80]}.")
    if not all(r.strip() for r in refs):
        raise UserError(f'{where}: "{keys[0]}" holds an empty reference; every reference needs text (an '
                        "empty one scores 0 whatever is generated).")
    return tuple(refs)


def read_completion_rows(path: str) -> list[CompletionRow]:
    """Every non-blank line of the JSON Lines file ``path`` as a :class:`CompletionRow`."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        raise UserError(f"data file {path!r} does not exist; --task generate reads a JSON Lines file where "
                        f"{_EXPECTED}.") from None
    except IsADirectoryError:
        raise UserError(f"data file {path!r} is a folder; --task generate reads one JSON Lines file.") from None
    except (OSError, UnicodeDecodeError) as err:
        raise UserError(f"cannot read data file {path!r} as UTF-8 text: {err}.") from None
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"line {number} of {path!r}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as err:
            raise UserError(f"{where} is not valid JSON ({err.msg}); {_EXPECTED}.") from None
        if not isinstance(obj, dict):
            raise UserError(f"{where} is a JSON {type(obj).__name__}, not an object; {_EXPECTED}.")
        if not isinstance(obj.get("prompt"), str):
            got = "no \"prompt\"" if "prompt" not in obj else f'"prompt" {json.dumps(obj["prompt"])[:40]}'
            raise UserError(f'{where} has {got}: it needs a "prompt" string; {_EXPECTED}.')
        rows.append(CompletionRow(obj["prompt"], _references(obj, where), number))
    if not rows:
        raise UserError(f"data file {path!r} holds no rows (it is empty or blank); {_EXPECTED}.")
    return rows
