"""Leaving a distributed worker process without the exit-time abort.

About one run in 14-55 of a successful multi-process job ended with ``terminate called without an
active exception`` (SIGABRT, exit code -6) after its work was done: the C++ side of
torch.distributed (gloo's threads, the rendezvous store) was torn down during interpreter
finalisation and static destruction, when its threads can no longer take the GIL
(pytorch/pytorch#190489). Destroying the groups first (the documented shutdown) still left a
crash in 50 runs, so a worker whose results are written leaves with :func:`leave`: groups
destroyed and collected, logs and streams flushed, then ``os._exit`` so no finalisation is left
to race. Both the launched ``tnlg`` workers (:mod:`tnlg.cli`) and the test and benchmark harness
(:mod:`tnlg.runtime.spawn`, whose spawned workers otherwise exit through ``sys.exit``) use it;
``scripts/exit_stress.py`` counts such exits.

This module imports nothing heavy, so ``tnlg --help`` stays fast.
"""

from __future__ import annotations

import os
import sys
from typing import NoReturn

__all__ = ["destroy_process_groups", "leave"]


def destroy_process_groups() -> None:
    """Destroy this process's process groups while the interpreter is fully alive."""
    if "torch.distributed" not in sys.modules:  # nothing to do, and nothing to import
        return
    import gc

    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        gc.collect()  # anything that still held a group or a pending work object goes now


def leave(status: int, *, destroy: bool = True) -> NoReturn:
    """Exit this process now with ``status``, after the groups are gone and output is flushed.

    ``destroy=False`` skips the teardown, for a process whose peer is gone (a hung collective):
    destroying its groups could block.
    """
    if destroy:
        destroy_process_groups()
    import logging
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more can be said
            pass
    os._exit(status)
