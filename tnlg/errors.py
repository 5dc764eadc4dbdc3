"""User-facing errors: one clear paragraph, no traceback, non-zero exit."""


class UserError(ValueError):
    """Bad input from the user (flags, files, configs). The CLI prints it as one paragraph
    on stderr and exits with status 2; library callers get a ``ValueError``.

    ``agreed`` is True on an error every rank raises alike, after the ranks agreed on it (one
    collective): rank 0 alone prints it (see :mod:`tnlg.failures`)."""

    agreed = False


def agreed(exc: BaseException) -> BaseException:
    """``exc``, marked as raised on every rank alike (rank 0 alone prints it)."""
    exc.agreed = True
    return exc
