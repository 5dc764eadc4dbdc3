"""Parsing and printing of sizes: bytes (``32GB``, ``32GiB``, ``80G``) and counts (``7.5e9``).

Decimal units follow the ZeRO paper and GPU datasheets (GB = 1e9 bytes);
binary units (GiB = 2**30) are accepted when spelled with an ``i``.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

from ..errors import UserError

__all__ = ["parse_bytes", "parse_count", "format_gb", "format_count", "GB"]

GB = 10**9

_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
    "ki": 2**10, "kib": 2**10, "mi": 2**20, "mib": 2**20, "gi": 2**30, "gib": 2**30, "ti": 2**40, "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_bytes(text: str, option: str = "--gpu-memory") -> int:
    """``"32GB"`` -> 32e9, ``"32GiB"`` -> 32 * 2**30, ``"80G"`` -> 80e9, ``"34359738368"`` -> bytes.

    Raises :class:`UserError` naming the value and the accepted forms.
    """
    match = _SIZE_RE.match(str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise UserError(
            f"{option} {text!r} is not a memory size. Give a number with an optional unit: "
            f"plain bytes (34359738368), decimal units (32GB, 80G, 512MB; 1 GB = 1e9 bytes) or "
            f"binary units (32GiB; 1 GiB = 2**30 bytes).")
    value = int(Decimal(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise UserError(f"{option} {text!r} must be a positive memory size, e.g. 32GB.")
    return value


def parse_count(text: str, option: str = "--params") -> int:
    """A positive whole number in plain or scientific notation: ``7.5e9``, ``1.28e+11``, ``1000000``."""
    try:
        value = Decimal(str(text).strip().replace("_", ""))
    except InvalidOperation:
        value = None
    if value is None or not value.is_finite() or value <= 0 or value != value.to_integral_value():
        raise UserError(
            f"{option} {text!r} is not a positive whole number. Use plain or scientific notation, "
            f"e.g. 7500000000, 7.5e9 or 1.28e+11.")
    return int(value)


def format_gb(n_bytes: float, digits: int = 2) -> str:
    """Bytes as decimal GB (1 GB = 1e9 bytes, as in the ZeRO paper)."""
    return f"{n_bytes / GB:,.{digits}f} GB"


def format_count(n: float) -> str:
    """A parameter count with a readable suffix: 17.18B, 1.11B, 355.0M."""
    for div, suffix in ((10**12, "T"), (10**9, "B"), (10**6, "M"), (10**3, "K")):
        if abs(n) >= div:
            return f"{n / div:.2f}{suffix}"
    return str(int(n))
