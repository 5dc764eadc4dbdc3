"""A CPU worker's heap keeps freed blocks (tnlg.parallel.heap): a 64 MiB buffer freed and allocated again is
not handed back to the system and faulted in again, as glibc's default does for a block above its mapping
threshold; a user's own malloc setting is left alone."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tnlg.runtime.spawn import checkout_env

_BODY = """
import os, sys
from tnlg.parallel.heap import keep_freed_blocks

def resident() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

applied = keep_freed_blocks() if sys.argv[1] == "keep" else False
block = bytearray(64 << 20)  # zero-filled: every page touched
before = resident()
del block
print(int(applied), (before - resident()) >> 20)
"""


def _run(mode: str, **env) -> tuple[bool, int]:
    out = subprocess.run([sys.executable, "-c", _BODY, mode], env=checkout_env(**env), capture_output=True,
                         text=True, timeout=120, check=True).stdout.split()
    return out[0] == "1", int(out[1])


@pytest.mark.skipif(not sys.platform.startswith("linux") or os.confstr("CS_GNU_LIBC_VERSION") is None,
                    reason="glibc's malloc (Linux) only")
def test_freed_blocks_stay_in_the_heap_unless_the_user_set_malloc_thresholds():
    applied, returned = _run("default")
    assert not applied and returned >= 63, returned  # glibc's default: the freed block (MiB) is unmapped at once
    applied, returned = _run("keep")
    assert applied and returned <= 1, returned
    for env in (dict(MALLOC_MMAP_THRESHOLD_="65536"), dict(GLIBC_TUNABLES="glibc.malloc.trim_threshold=0")):
        applied, returned = _run("keep", **env)
        assert not applied and returned >= 63, (env, returned)  # the user's setting (both return it) stands
