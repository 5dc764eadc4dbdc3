"""The tokenizer a dataset was written with: a small JSON sidecar beside Megatron's ``.bin/.idx``.

``tnlg preprocess`` writes ``PREFIX.tnlg-tokenizer.json`` next to ``PREFIX.bin`` and ``PREFIX.idx``
(which stay byte-identical to Megatron's): the tokenizer's kind, vocabulary size and the sha256 of
its model file(s) (their contents, not their paths). ``tnlg pretrain`` and ``tnlg eval --task loss``
compare it with the tokenizer they were given and refuse a mismatch, naming both: two tokenizers
with the same vocabulary size would otherwise train on ids that mean other words, silently.
Data without a sidecar (written by Megatron, or by an older tnlg) is accepted with a one-line note.
A checkpoint records its tokenizer's :meth:`Tokenizer.describe` in ``meta.json``: ``tnlg eval`` and
``tnlg generate`` compare a ``--tokenizer-model`` with it the same way (:func:`check_recorded`).
No collectives.
"""

from __future__ import annotations

import json
import os
from typing import Optional

from ..errors import UserError
from ..io import atomic_write

__all__ = ["SIDECAR_SUFFIX", "sidecar_path", "fingerprint", "write_sidecar", "check_sidecar", "check_recorded"]

SIDECAR_SUFFIX = ".tnlg-tokenizer.json"
_KEYS = ("kind", "vocab_size", "sha256")


def sidecar_path(prefix: str) -> str:
    return os.fspath(prefix) + SIDECAR_SUFFIX


def fingerprint(tokenizer) -> dict:
    """``{kind, vocab_size, sha256}`` of a loaded tokenizer (:meth:`Tokenizer.describe` without its path)."""
    spec = tokenizer.describe()
    return {"kind": spec.get("kind", type(tokenizer).__name__), "vocab_size": tokenizer.vocab_size,
            "sha256": spec.get("sha256")}


def write_sidecar(prefix: str, tokenizer) -> str:
    """Write ``PREFIX.tnlg-tokenizer.json`` (atomically); return its path."""
    path = sidecar_path(prefix)
    atomic_write(path, json.dumps(fingerprint(tokenizer), indent=1) + "\n")
    return path


def _describe(fp: dict) -> str:
    sha = fp["sha256"] if isinstance(fp["sha256"], str) else "+".join(map(str, fp["sha256"] or ["none"]))
    return f"{fp['kind']}, {fp['vocab_size']} tokens, sha256 {sha[:16]}..."


def _wrong_value(recorded: dict) -> Optional[str]:
    """What is wrong with a record's values (``None``: each of the type :func:`fingerprint` writes): ``kind``
    a string, ``vocab_size`` a whole number, ``sha256`` a hex string or a list of them (or null)."""
    sha = recorded["sha256"]
    if not isinstance(recorded["kind"], str):
        return f"its kind is {type(recorded['kind']).__name__}, not a string"
    if not isinstance(recorded["vocab_size"], int) or isinstance(recorded["vocab_size"], bool):
        return f"its vocab_size is {type(recorded['vocab_size']).__name__}, not a whole number"
    if not (sha is None or isinstance(sha, str) or (isinstance(sha, list) and all(isinstance(x, str) for x in sha))):
        return f"its sha256 is {sha!r:.40}, not a SHA-256 hex string or a list of them"
    return None


def check_sidecar(prefix: str, tokenizer, flag: str = "--tokenizer-model") -> Optional[str]:
    """``None`` when ``prefix``'s sidecar names ``tokenizer``; a one-line note when there is no sidecar;
    a :class:`UserError` naming both tokenizers when they differ (or when the sidecar is unreadable)."""
    path = sidecar_path(prefix)
    if not os.path.exists(path):
        return (f"note: {prefix} has no {SIDECAR_SUFFIX} (not written by `tnlg preprocess`): its tokenizer "
                f"cannot be checked against {flag}.")
    try:
        with open(path, encoding="utf-8") as f:
            recorded = json.load(f)
        recorded = {k: recorded[k] for k in _KEYS}
        wrong = _wrong_value(recorded)
        if wrong:
            raise ValueError(wrong)
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as e:
        raise UserError(f"{path} is not a tokenizer record written by `tnlg preprocess` ({str(e)[:200]}); delete "
                        f"it to use {prefix} without the check, or preprocess the data again.") from None
    given = fingerprint(tokenizer)
    if recorded != given:
        raise UserError(f"dataset {prefix} was tokenized with another tokenizer ({_describe(recorded)}, recorded "
                        f"in {path}) than {flag} {tokenizer.describe().get('path')!r} ({_describe(given)}): its "
                        f"token ids would mean other words. Pass the tokenizer the data was preprocessed with, or "
                        f"preprocess the data again with this one.")
    return None


def check_recorded(recorded: Optional[dict], tokenizer, where: str, flag: str = "--tokenizer-model") -> None:
    """A :class:`UserError` naming both when ``tokenizer`` is not the one ``recorded`` (a checkpoint's
    record of the tokenizer it was trained with: a :meth:`Tokenizer.describe`) by kind, vocabulary size or
    file contents; nothing when they agree or when there is no record with a checksum to compare."""
    if not recorded or not recorded.get("sha256"):
        return
    saved = {"kind": recorded.get("kind"), "vocab_size": recorded.get("vocab_size"), "sha256": recorded["sha256"]}
    given = fingerprint(tokenizer)
    if saved["vocab_size"] is None:  # an older record without the size: compare what it has
        given["vocab_size"] = None
    if saved == given:
        return
    name = recorded.get("path") or recorded.get("vocab_file") or "?"
    raise UserError(f"{where} was trained with another tokenizer ({_describe(saved)}: {name!r}, recorded in the "
                    f"checkpoint) than {flag} {tokenizer.describe().get('path') or tokenizer.describe().get('vocab_file')!r} "
                    f"({_describe(given)}): its token ids would mean other words. Leave out {flag} to use the "
                    f"checkpoint's own tokenizer, or pass a copy of that file.")
