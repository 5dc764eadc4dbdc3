"""Launching local worker processes with torch's own elastic launcher (what ``torchrun`` runs).

A command that accepts ``--nproc-per-node N`` calls :func:`maybe_launch` in the
launching process after validating its options. Under ``torchrun`` (or with
N = 1) it returns ``None`` and the caller runs in-process; otherwise it runs
``python -m tnlg <command> <same args>`` in N processes through
``torch.distributed.launcher.api.elastic_launch`` (c10d rendezvous on
loopback; ``max_restarts`` restarts the whole group after a failure, as
``torchrun --max-restarts`` does) and returns the exit status.
"""

from __future__ import annotations

import os
import socket
import sys
import uuid
from typing import Optional

__all__ = ["under_launcher", "maybe_launch", "local_threads"]


def under_launcher() -> bool:
    """True inside a process started by torchrun / elastic_launch."""
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def launcher_world_size() -> Optional[int]:
    return int(os.environ["WORLD_SIZE"]) if under_launcher() else None


def local_threads() -> int:
    """Intra-op threads per rank: the cores shared evenly among the local processes."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(1, (os.cpu_count() or 1) // local)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _strip(argv: list[str], flags: tuple[str, ...]) -> list[str]:
    """``argv`` without the given flags and their values (``--flag V`` or ``--flag=V``)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in flags:
            skip = True
            continue
        if any(a.startswith(f + "=") for f in flags):
            continue
        out.append(a)
    return out


def maybe_launch(command: str, argv: list[str], nproc: int, max_restarts: int = 0) -> Optional[int]:
    """Run ``tnlg <command> argv`` on ``nproc`` local processes, or return ``None`` to run here."""
    if under_launcher() or nproc == 1:
        return None
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=uuid.uuid4().hex[:12],
                          rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{_free_port()}",
                          max_restarts=max_restarts, monitor_interval=0.2, start_method="spawn")
    child_args = ["-m", "tnlg", command, *_strip(argv, ("--nproc-per-node", "--max-restarts"))]
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    # a restarted group must not reuse the dead group's shared rendezvous store (pytorch/pytorch#135712)
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    try:
        elastic_launch(config, sys.executable)(*child_args)
    except ChildFailedError as err:
        rank, first = err.get_first_failure()  # the root cause, not the peers it took down
        print(f"tnlg {command}: worker rank {rank} failed with exit code {first.exitcode}; "
              f"its output is above.", file=sys.stderr)
        return first.exitcode if first.exitcode > 0 else 1
    return 0
