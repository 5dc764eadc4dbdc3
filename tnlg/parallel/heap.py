"""The CPU heap of a worker: glibc's malloc told to keep freed blocks for the next step.

glibc maps each large block afresh (``mmap`` above a threshold that starts at 128 KiB and adapts up to
32 MiB) and returns the free top of its heap to the system (``M_TRIM_THRESHOLD``, twice the mapping
threshold). A training step frees and allocates the same large activation and gradient buffers every
iteration, so by default many of them are mapped, unmapped and faulted in again each step.
:func:`keep_freed_blocks` sets both thresholds (``mallopt``) in a CPU worker. Measured on a 2-core AMD EPYC
(2026-12-05, 60 iterations of the built-in job, three alternated pairs, median ms per iteration): at 4
processes (TP 2 x DP 2) 212-220 ms with glibc's defaults and 197-200 ms with this setting (system time
7.2-7.7 s against 6.1-6.3 s), at TP 1 in bf16 98-124 ms against 93-106 ms (page faults, the same in
every kernel); the peak RSS is unchanged (326.6 vs 326.0 MiB).

What it costs: memory freed between steps stays in the process (its peak is unchanged: the same
buffers are live at the peak either way). Blocks above :data:`THRESHOLD_BYTES` are still mapped and
returned when freed. A user's own setting (``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_`` or
``GLIBC_TUNABLES`` with a ``glibc.malloc`` tunable in the environment) is left alone, and so is any
C library that is not glibc. GPU memory is the caching allocator's and is not affected.
"""

from __future__ import annotations

import os

__all__ = ["THRESHOLD_BYTES", "keep_freed_blocks", "release_freed_memory", "user_heap_setting"]

THRESHOLD_BYTES = 1 << 30  # mapping and trim thresholds: blocks up to 1 GiB are kept in the heap
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's <malloc.h>
_USER_VARIABLES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")


def user_heap_setting() -> bool:
    """Whether the environment sets glibc's malloc thresholds itself."""
    return any(name in os.environ for name in _USER_VARIABLES) or "glibc.malloc" in os.environ.get(
        "GLIBC_TUNABLES", "")


def _glibc():
    """The C library when it is glibc (``mallopt``, ``malloc_trim``), else ``None``."""
    import ctypes
    try:
        libc = ctypes.CDLL("libc.so.6")
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


def keep_freed_blocks() -> bool:
    """Set glibc's mapping and trim thresholds to :data:`THRESHOLD_BYTES` in this process, unless the
    environment sets them (:func:`user_heap_setting`) or the C library is not glibc. Returns whether
    it set them. Affects allocations made after the call."""
    libc = None if user_heap_setting() else _glibc()
    if libc is None:
        return False
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, THRESHOLD_BYTES)) and bool(libc.mallopt(_M_TRIM_THRESHOLD,
                                                                                        THRESHOLD_BYTES))


def release_freed_memory() -> None:
    """Collect garbage, then hand the heap's free pages back to the system (glibc's ``malloc_trim``, which
    ignores the trim threshold above), so that a reading of the process's memory counts what is alive, not
    what was freed."""
    import gc
    gc.collect()
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)
