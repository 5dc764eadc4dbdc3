"""The tokenizer a dataset was written with: a small JSON sidecar beside Megatron's ``.bin/.idx``.

``tnlg preprocess`` writes ``PREFIX.tnlg-tokenizer.json`` next to ``PREFIX.bin`` and ``PREFIX.idx``
(which stay byte-identical to Megatron's): the tokenizer's kind, vocabulary size and the sha256 of
its model file(s) (their contents, not their paths). ``tnlg pretrain`` and ``tnlg eval --task loss``
compare it with the tokenizer they were given and refuse a mismatch, naming both: two tokenizers
with the same vocabulary size would otherwise train on ids that mean other words, silently.
Data without a sidecar (written by Megatron, or by an older tnlg) is accepted with a one-line note.
A checkpoint records its tokenizer's :meth:`Tokenizer.describe` in ``meta.json``, and a Hugging Face folder
ships its tokenizer's files: ``tnlg finetune``, ``eval``, ``generate``, ``serve`` and ``convert --from hf``
compare a ``--tokenizer-model`` with the model's own the same way and refuse another one, naming both, unless
``--allow-other-tokenizer`` says so (then they note it) (:func:`check_recorded`).
No collectives.
"""

from __future__ import annotations

import json
import os
from typing import Optional

from ..errors import UserError
from ..io import atomic_write

__all__ = ["SIDECAR_SUFFIX", "ALLOW_FLAG", "sidecar_path", "fingerprint", "write_sidecar", "check_sidecar",
           "check_recorded"]

SIDECAR_SUFFIX = ".tnlg-tokenizer.json"
_KEYS = ("kind", "vocab_size", "sha256")
# the flag that lets a command use a tokenizer other than the model's own (check_recorded)
ALLOW_FLAG = "--allow-other-tokenizer"


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


def check_recorded(recorded, tokenizer, where: str, flag: str = "--tokenizer-model", allow: bool = False,
                   whose: str = "recorded in the checkpoint", after: str = "") -> Optional[str]:
    """``tokenizer`` (a ``--tokenizer-model``) against the model's own tokenizer: ``recorded`` is one
    :meth:`Tokenizer.describe` record or a list of them (a checkpoint's record in ``meta.json``; the tokenizer
    files a Hugging Face folder ships, where one tokenizer may come in several forms), ``whose`` says where
    they come from. ``None`` when it is one of them by kind, vocabulary size and file contents, or when there
    is no record with a checksum to compare; otherwise a :class:`UserError` naming both (``after``: a last
    sentence), or with ``allow`` (:data:`ALLOW_FLAG`) a one-line note to print instead."""
    records = [r for r in ([recorded] if isinstance(recorded, dict) else recorded or []) if r and r.get("sha256")]
    if not records:
        return None
    given = fingerprint(tokenizer)
    if any(_same(r, given) for r in records):
        return None
    theirs = " or ".join(f"{_describe(_fingerprint_of(r))}: {_path_of(r)!r}" for r in records)
    name = _path_of(tokenizer.describe())
    if allow:
        return (f"note: {flag} {name!r} ({_describe(given)}) is not the tokenizer of {where} ({theirs}, {whose}); "
                f"using it, as {ALLOW_FLAG} says: its token ids mean what the model learned only where its "
                f"vocabulary was mapped onto the model's.")
    raise UserError(f"{where} was trained with another tokenizer ({theirs}, {whose}) than {flag} {name!r} "
                    f"({_describe(given)}): its token ids would mean other words. Leave out {flag} to use the "
                    f"model's own tokenizer, or pass a copy of its files; to use this one on purpose (a vocabulary "
                    f"mapped onto the model's), add {ALLOW_FLAG}." + (f" {after}" if after else ""))


def _fingerprint_of(recorded: dict) -> dict:
    return {"kind": recorded.get("kind"), "vocab_size": recorded.get("vocab_size"), "sha256": recorded["sha256"]}


def _same(recorded: dict, given: dict) -> bool:
    """Whether a record names the tokenizer ``given`` (a :func:`fingerprint`); an older record without the
    vocabulary size is compared by what it has."""
    saved = _fingerprint_of(recorded)
    return saved == ({**given, "vocab_size": None} if saved["vocab_size"] is None else given)


def _path_of(spec: dict) -> str:
    return spec.get("path") or spec.get("vocab_file") or "?"
