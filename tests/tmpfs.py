"""A real, small filesystem for the disk-full tests: a tmpfs mounted on a new folder (root only)."""

from __future__ import annotations

import os
import subprocess

import pytest


def mount_tmpfs(mnt, size: str) -> None:
    """Mount a tmpfs of ``size`` (``mount -o size=``: ``64k``, ``3m``) on the new folder ``mnt``, or skip the test
    where that is not allowed (not root, no mount); the caller unmounts it (:func:`unmount`)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")


def unmount(mnt) -> None:
    subprocess.run(["umount", str(mnt)], check=False)
