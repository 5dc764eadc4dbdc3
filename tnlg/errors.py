"""User-facing errors: one clear paragraph, no traceback, non-zero exit; and the closest valid names
of a mistyped one, for those paragraphs."""

import difflib


class UserError(ValueError):
    """Bad input from the user (flags, files, configs). The CLI prints it as one paragraph
    on stderr and exits with status 2; library callers get a ``ValueError``.

    ``agreed`` is True on an error every rank raises alike, after the ranks agreed on it (one
    collective): rank 0 alone prints it (see :mod:`tnlg.runtime.failures`)."""

    agreed = False


def agreed(exc: BaseException) -> BaseException:
    """``exc``, marked as raised on every rank alike (rank 0 alone prints it)."""
    exc.agreed = True  # type: ignore[attr-defined]  # a marker on any exception
    return exc


def closest(word: str, valid) -> list:
    """The names in ``valid`` as close to ``word`` as the closest one (difflib's ratio within 0.05 of the
    best, and at least 0.6), best first, at most 3: what a "did you mean" offers."""
    ratios = sorted(((difflib.SequenceMatcher(None, word, v).ratio(), v) for v in map(str, valid)), reverse=True)
    return [v for r, v in ratios if r >= max(0.6, ratios[0][0] - 0.05)][:3] if ratios else []
