"""Where tnlg's data files live: the files shipped in ``tnlg/data/corpus/`` and the cache folder
(which also holds matplotlib's font cache when tnlg draws a plot).

A leaf module (standard library only), so that the tokenizer (which knows the shipped
model as ``"builtin"``), the GPT dataset (which caches index arrays) and the corpus
(which prepares the shipped texts) can all name these places without importing each
other. What the files hold is described in :mod:`tnlg.data.corpus`.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["CORPUS_DIR", "ARCHIVE", "TOKENIZER_MODEL", "LICENSE_NOTES", "default_cache_dir",
           "matplotlib_in_cache_dir"]

CORPUS_DIR = Path(__file__).resolve().parent / "corpus"
ARCHIVE = CORPUS_DIR / "shakespeare_milton.tar.xz"
TOKENIZER_MODEL = CORPUS_DIR / "shakespeare_milton_bpe4096.model"
LICENSE_NOTES = CORPUS_DIR / "LICENSE.md"


def default_cache_dir() -> Path:
    """``$TNLG_CACHE`` if set, else ``~/.cache/tnlg`` (``$XDG_CACHE_HOME/tnlg`` when that is set)."""
    env = os.environ.get("TNLG_CACHE")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "tnlg"


def matplotlib_in_cache_dir() -> None:
    """Point matplotlib's config and font cache (``MPLCONFIGDIR``, else ``~/.cache/matplotlib`` or
    ``~/.config/matplotlib``) at ``<cache>/matplotlib``, the one cache folder tnlg documents, unless
    the user chose a folder. Call it before the first ``import matplotlib``."""
    if not os.environ.get("MPLCONFIGDIR"):
        folder = default_cache_dir() / "matplotlib"
        folder.mkdir(parents=True, exist_ok=True)
        os.environ["MPLCONFIGDIR"] = str(folder)
