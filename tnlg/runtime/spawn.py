"""Run a function on N local gloo processes: the harness of tests and benchmarks.

``run_distributed(fn, world_size, tp, *args)`` spawns ``world_size`` processes,
each with one intra-op thread (two ranks on two cores), a ``file://``
rendezvous in a fresh temporary directory (no port races) and a process-group
timeout (a hang fails fast). Each calls ``fn(ps, *args)`` with its
:class:`~tnlg.parallel.state.ParallelState` and the return values come back
as a list indexed by global rank. A worker's exception is re-raised here with
the worker's traceback; the other workers are stopped as soon as it exits
(``torch.multiprocessing`` terminates them), so a failure on one rank never
waits for the process-group timeout, whether its peers sit in a collective or not.

``run_tnlg(argv, cwd)`` runs the ``tnlg`` command of this checkout in a subprocess, as a user would,
and returns its output (it must succeed, without a traceback).
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import tempfile
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..io import atomic_write
from ..parallel.state import init_parallel
from ..parallel.heap import keep_freed_blocks
from .process_exit import leave

__all__ = ["run_distributed", "run_tnlg", "checkout_env"]


class WorkerError(RuntimeError):
    pass


def checkout_env(**extra: str) -> dict:
    """This process's environment with this checkout first on ``PYTHONPATH`` (subprocesses import it)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout
    return dict(os.environ, **extra, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))


def run_tnlg(argv: list, cwd, env: dict | None = None, timeout: float = 600) -> str:
    """``python -m tnlg *argv`` in ``cwd`` (environment ``env``, default :func:`checkout_env`); its stdout
    and stderr, asserting exit status 0 and no traceback."""
    proc = subprocess.run([sys.executable, "-m", "tnlg", *map(str, argv)], cwd=str(cwd), env=env or checkout_env(),
                          capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "Traceback" not in out, out[-4000:]
    return out


def _write_result(path: str, result: tuple) -> None:
    """Atomically (not durably): a worker terminated mid-write leaves no torn file."""
    atomic_write(path, pickle.dumps(result), durable=False)


def _worker(rank: int, fn: Callable, world_size: int, tp: int, tmp: str, timeout_s: float,
            threads: int, args: tuple) -> None:
    torch.set_num_threads(threads)
    keep_freed_blocks()  # as a command's CPU worker does (tnlg.runtime.launch.join)
    os.environ["LOCAL_WORLD_SIZE"] = str(world_size)  # code that sizes thread pools per local rank sees it
    result_path = os.path.join(tmp, f"result_{rank}.pkl")
    status = 1
    try:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 'rdzv')}",
                                rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s))
        ps = init_parallel(tensor_parallel_size=tp, timeout=timedelta(seconds=timeout_s))
        out = fn(ps, *args)
        _write_result(result_path, ("ok", out))
        status = 0
    except BaseException:  # noqa: BLE001 - report every failure to the parent
        _write_result(result_path, ("error", traceback.format_exc()))
    # A spawned worker would otherwise leave through sys.exit and interpreter finalisation, where
    # gloo's threads abort about one exit in 50 (SIGABRT after the work is done): see process_exit.
    # After a failure the groups are left alone, since a peer may be gone and teardown could block.
    leave(status, destroy=status == 0)


def run_distributed(fn: Callable[..., Any], world_size: int, tp: int = 1, *args: Any,
                    timeout_s: float = 60.0, threads: int = 1) -> list[Any]:
    """Run ``fn(ps, *args)`` on ``world_size`` gloo processes with TP size ``tp``.

    ``fn`` must be importable (a module-level function). Returns the per-rank
    results in rank order; raises :class:`WorkerError` carrying the first failing
    worker's traceback.
    """
    with tempfile.TemporaryDirectory(prefix="tnlg_dist_") as tmp:
        try:
            mp.start_processes(_worker, args=(fn, world_size, tp, tmp, timeout_s, threads, args),
                               nprocs=world_size, join=True, start_method="spawn")
        except Exception as exc:  # collect the workers' own tracebacks
            errors = []
            for rank in range(world_size):
                path = os.path.join(tmp, f"result_{rank}.pkl")
                if os.path.exists(path):
                    with open(path, "rb") as f:
                        status, payload = pickle.load(f)
                    if status == "error":
                        errors.append(f"rank {rank} failed:\n{payload}")
            if errors:  # every failing rank: the first to fail may not be the lowest rank
                raise WorkerError("\n".join(errors)) from exc
            raise
        results = []
        for rank in range(world_size):
            with open(os.path.join(tmp, f"result_{rank}.pkl"), "rb") as f:
                results.append(pickle.load(f)[1])
        return results
