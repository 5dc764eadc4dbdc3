"""User-facing errors: one clear paragraph, no traceback, non-zero exit."""


class UserError(ValueError):
    """Bad input from the user (flags, files, configs). The CLI prints it as one paragraph
    on stderr and exits with status 2; library callers get a ``ValueError``."""
