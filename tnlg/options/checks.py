"""The checks the options dataclasses share, with the messages ``tnlg pretrain`` prints."""

from __future__ import annotations

from ..errors import UserError
from .fields import flag_of

__all__ = ["is_int", "positive_int", "nonnegative_int", "optional_positive_int"]


def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def positive_int(obj, *names: str) -> None:
    for name in names:
        v = getattr(obj, name)
        if not is_int(v) or v < 1:
            raise UserError(f"{flag_of(name)} must be a positive integer, got {v!r}.")


def optional_positive_int(obj, *names: str) -> None:
    """``None`` (the option's default words apply) or a positive integer."""
    for name in names:
        v = getattr(obj, name)
        if v is not None and (not isinstance(v, int) or v < 1):
            raise UserError(f"{flag_of(name)} must be a positive integer, got {v!r}.")


def nonnegative_int(obj, *names: str) -> None:
    for name in names:
        v = getattr(obj, name)
        if not isinstance(v, int) or v < 0:
            raise UserError(f"{flag_of(name)} must be an integer >= 0, got {v!r}.")
