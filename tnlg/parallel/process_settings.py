"""What tnlg sets in each process that trains or runs a model: the one list, for a command's workers and for a
user's own process alike.

* **OpenMP's wait** (``GOMP_SPINCOUNT``, :mod:`tnlg.runtime.threads`): read by libgomp once, when torch loads
  it, so it is set before that, by ``import tnlg`` (and the ``tnlg`` command line); the launcher's workers
  inherit it.
* **Intra-op threads** (:func:`local_threads`): this machine's cores shared evenly among its local processes
  (``LOCAL_WORLD_SIZE``, which ``torchrun`` and tnlg's launcher set), whatever ``OMP_NUM_THREADS`` said.
* **The CPU heap** (:mod:`tnlg.parallel.heap`): glibc's malloc keeps freed blocks for the next step, unless the
  environment sets its thresholds itself.

A command's worker gets the last two from :func:`tnlg.runtime.launch.join`; a user's script gets them from
:func:`init_parallel`, which is ``tnlg.init_parallel``: :func:`tnlg.parallel.state.init_parallel` (the groups
alone, for harnesses that choose their own threads, as :mod:`tnlg.runtime.spawn` does) followed by
:func:`apply_process_settings`. So a script of the README's shape (``import tnlg, torch``, ``tnlg.init_parallel``)
runs its step with the settings the command's step runs with (``tests/test_process_settings.py`` compares what
each process sees, under ``torchrun`` and alone); a different thread count is chosen by calling
``torch.set_num_threads`` after it. The interop pool and the allocator of a GPU are torch's own in both.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from .state import ParallelState

__all__ = ["local_threads", "apply_process_settings", "init_parallel"]


def local_threads() -> int:
    """Intra-op threads per rank: the cores shared evenly among the local processes."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(1, (os.cpu_count() or 1) // local)


def apply_process_settings(device_type: str) -> None:
    """Give this process tnlg's settings: :func:`local_threads` intra-op threads and, on a CPU (``device_type``
    ``"cpu"``), a heap that keeps freed blocks (:func:`tnlg.parallel.heap.keep_freed_blocks`)."""
    import torch

    from .heap import keep_freed_blocks
    torch.set_num_threads(local_threads())
    if device_type == "cpu":
        keep_freed_blocks()


def init_parallel(tensor_parallel_size: int = 1, backend: Optional[str] = None,
                  timeout: timedelta = timedelta(minutes=10), init_method: Optional[str] = None,
                  device: Optional[str] = None, pipeline_parallel_size: int = 1,
                  context_parallel_size: int = 1) -> "ParallelState":
    """``tnlg.init_parallel``: this process's TP, CP, DP and PP groups and :class:`~tnlg.parallel.ParallelState`
    (:func:`tnlg.parallel.state.init_parallel`, the same arguments: under ``torchrun``, with a default group that
    exists already, or a plain process of its own), then the settings a ``tnlg`` command's worker runs with
    (:func:`apply_process_settings`: its intra-op threads, its CPU heap). Every rank must call it (``new_group``
    is collective). To run with another number of threads, call ``torch.set_num_threads`` after it."""
    from .state import init_parallel as make_groups
    ps = make_groups(tensor_parallel_size, backend=backend, timeout=timeout, init_method=init_method, device=device,
                     pipeline_parallel_size=pipeline_parallel_size, context_parallel_size=context_parallel_size)
    apply_process_settings(ps.device.type)
    return ps
