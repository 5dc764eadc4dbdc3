"""A launched worker ends with its launcher: no orphan keeps training after the launcher is killed.

tnlg's launcher (:mod:`.launch`) runs torch's elastic agent in its own process and starts each worker
there (``subprocess.Popen`` in a new session, so a terminal's Ctrl-C reaches only the launcher, which
forwards it). SIGINT, SIGTERM and SIGHUP to the launcher are forwarded to the workers; SIGKILL (the
out-of-memory killer, a scheduler's hard kill, a closed SSH session's kill) cannot be, and the
workers, in sessions of their own, would run on with ppid 1, saving into ``--save`` and holding its
lock. So each worker, first thing (:func:`end_with_launcher`, from :func:`tnlg.cli.main`):

* on Linux asks the kernel for SIGKILL when its parent dies (``prctl(PR_SET_PDEATHSIG)``). The kernel
  sends it when the *thread* that started the worker ends: the agent starts (and restarts) workers
  from the thread that called the launcher, which outlives them; a worker killed this way releases its
  locks at once (``flock`` ends with the process), and the save it was writing is left as
  ``iter_N.tmp``, which the next save removes (:func:`tnlg.checkpoint.files.remove_debris`);
* elsewhere (no ``prctl``) runs a watchdog thread that looks at ``os.getppid()`` every
  :data:`POLL_S` seconds and, once it changed, says so on stderr and leaves at once
  (:func:`tnlg.runtime.process_exit.leave`, without tearing down its groups: a peer may be gone);
* checks once, after either, that the parent is still the launcher (it may have died before).

The launcher names itself in :data:`LAUNCHER_PID_ENV`; the worker takes the variable out of its
environment, so processes the worker starts do not watch a process that is not their parent. Under
``torchrun`` (no variable) the worker watches the parent it starts with (torchrun's agent).

This module imports only the standard library.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
from typing import Optional

__all__ = ["LAUNCHER_PID_ENV", "end_with_launcher", "set_parent_death_signal"]

LAUNCHER_PID_ENV = "TNLG_LAUNCHER_PID"  # set by tnlg.runtime.launch for its workers: the launcher's pid
POLL_S = 0.25  # how often the portable watchdog looks at the parent pid
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def set_parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent (thread) ends; ``False`` where that
    cannot be asked (not Linux, no libc ``prctl``, or it refused)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _parent_gone(launcher: int) -> None:
    from .process_exit import leave
    rank = os.environ.get("RANK", "?")
    print(f"tnlg: the launcher (pid {launcher}) is gone without stopping its workers (killed from outside); "
          f"worker rank {rank} (pid {os.getpid()}) stops now. The last completed checkpoint is intact.",
          file=sys.stderr, flush=True)
    leave(1, destroy=False)


def _watch(launcher: int) -> None:
    while os.getppid() == launcher:
        time.sleep(POLL_S)
    _parent_gone(launcher)


def end_with_launcher(use_prctl: bool = True) -> Optional[str]:
    """In a launched worker (torch elastic's variables set): end this process when its launcher dies, by
    the kernel's parent-death signal or (``use_prctl=False``, or where that is not available) a watchdog
    thread. Returns how (``"prctl"`` or ``"watchdog"``), ``None`` when this is no launched worker."""
    named = os.environ.pop(LAUNCHER_PID_ENV, "")
    if "TORCHELASTIC_RUN_ID" not in os.environ and not named:
        return None
    launcher = int(named) if named.isdigit() else os.getppid()
    if launcher <= 1:  # started by init, or the launcher already gone before it could be named
        return None
    how = "prctl" if use_prctl and set_parent_death_signal() else "watchdog"
    if how == "watchdog":
        threading.Thread(target=_watch, args=(launcher,), daemon=True, name="tnlg-launcher-watch").start()
    if os.getppid() != launcher:  # the launcher died before the request above took effect
        _parent_gone(launcher)
    return how
