"""Persistent gloo worker pools for the tests' distributed bodies: one live process group per world size
for the whole pytest session, instead of a spawn, a rendezvous and a new group for every call.

``run_distributed(fn, world_size, tp, *args)`` has :func:`tnlg.runtime.spawn.run_distributed`'s contract
(``fn(ps, *args)`` on every rank with its :class:`~tnlg.parallel.state.ParallelState`; the results in
rank order; a :class:`WorkerError` carrying every failing rank's traceback), and sends the call to the
pool of ``world_size`` workers started on first use (PyTorch's ``MultiProcContinuousTest`` keeps one
process group per test class; this keeps one per world size for the session).

The workers are forked from a forkserver (one per test process, multiprocessing's ``forkserver`` start
method) that imported torch, the torch.distributed modules the bodies use (pipelining, DTensor, FSDP2) and
tnlg's model and training step once (``_PRELOAD``): a spawned worker paid 2-3 CPU-s to import them, and a
session starts about 50 workers (one pool per world size and xdist worker, a new pool after each failing
call), which was a tenth of the suite's CPU on 2 cores. Forking a process that has imported torch, but run
no parallel region and started no group, is what a DataLoader worker does; the forkserver itself never runs a
collective or a kernel.

What a body sees is what a fresh worker gives it:

- a fresh :class:`ParallelState` (its TP/DP/PP/CP subgroups are created for the call, with the call's
  ``timeout_s``, and destroyed after it); the world group is the pool's;
- torch's default generator, Python's ``random`` and numpy's global generator as a new process starts them
  (each worker's own, drawn when it starts; every call starts from them), ``threads`` intra-op threads, fp32 as
  the default dtype, gradients enabled, no compiled code (``torch._dynamo.reset()`` at every call: dynamo is
  preloaded, and a reset costs microseconds), the parent's environment and working directory at the call;
- the modules of ``_PRELOAD`` already imported (a fresh worker imports them on first use);
- its own children (writer processes a body leaves behind) terminated when it ends;
- what it writes to file descriptors 1 and 2 written by the parent to its own once the call ends (rank by
  rank), so ``capfd`` reads it as it read a fresh worker's output.

A call that fails on any rank ends the whole pool at once (its peers may sit in a collective): the
error comes back with every failing rank's traceback and the next call starts a new pool; so does a
call interrupted from outside (pytest-timeout) or a body that replaced the world group
(``destroy_process_group``). ``fresh=True``, or ``TNLG_TEST_FRESH=1`` in the environment for every
call, runs the call on new processes (:func:`tnlg.runtime.spawn.run_distributed`) as before: tests of
faults, signals, exits and launchers use fresh processes anyway (they do not come through here).
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import pickle
import shutil
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

from tnlg.runtime.spawn import WorkerError
from tnlg.runtime.spawn import run_distributed as run_fresh

__all__ = ["run_distributed", "shutdown_pools"]

WORLD_TIMEOUT_S = 120.0  # the pool's world group (a body's own subgroups take the call's timeout_s)
_GRACE_S = 2.0  # after the first failing rank, how long the others' tracebacks are waited for

# What the pool's workers import before they are forked, once per test process (the forkserver's preload):
# tnlg first (it sets libgomp's wait policy before torch loads libgomp), this module last (the workers'
# target); a name that cannot be imported is skipped by the forkserver, and then imported by each worker
_PRELOAD = ["tnlg", "torch", "torch.distributed", "torch.distributed.pipelining", "torch.distributed.tensor",
            "torch.distributed.fsdp", "tnlg.model", "tnlg.parallel.state", "tnlg.training.step", __name__]


def _start_state() -> dict:
    """This worker's start: torch's seed and Python's and numpy's random states, each drawn anew from the
    operating system as a new process draws them (a forked child keeps its forkserver's torch and numpy
    states, where a new process seeds torch's default generator afresh)."""
    import random

    import numpy as np
    import torch
    torch.seed()
    random.seed()
    np.random.seed()
    return dict(torch=torch.initial_seed(), random=random.getstate(), numpy=np.random.get_state())


def _reset(start: dict, threads: int, environ: dict, cwd: str) -> None:
    """The state a fresh worker starts with: its start seeds (:func:`_start_state`), ``threads``, fp32,
    gradients on, and the parent's environment and working directory as they are at the call (a spawned
    worker inherits them)."""
    import random

    import numpy as np
    import torch
    torch.manual_seed(start["torch"])
    random.setstate(start["random"])
    np.random.set_state(start["numpy"])
    torch.set_num_threads(threads)
    torch.set_default_dtype(torch.float32)
    torch.set_grad_enabled(True)
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is not None:  # an earlier call's compiled code, guards and counters (a fresh worker has none)
        dynamo.reset()
    if dict(os.environ) != environ:
        os.environ.clear()
        os.environ.update(environ)
    if os.getcwd() != cwd:
        os.chdir(cwd)


def _forget_meshes() -> None:
    """Drop DTensor's caches (FSDP2's ZeRO 2/3): they key on a ``DeviceMesh``, whose equality ignores its
    process groups, and keep the first equal mesh they saw, so a later call's equal mesh would reach a
    destroyed group by its name ("Could not resolve the process group registered under the name ...")."""
    redistribute = sys.modules.get("torch.distributed.tensor._redistribute")
    if redistribute is not None:
        redistribute._gen_transform_infos.cache_clear()
        redistribute.clear_redistribute_planner_cache()
    api = sys.modules.get("torch.distributed.tensor._api")
    if api is not None:
        propagator = api.DTensor._op_dispatcher.sharding_propagator
        propagator.propagate_op_sharding.cache_clear()
        propagator._propagate_tensor_meta_cached.cache_clear()
        import torch
        clear_native = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
        if clear_native is not None:  # the dispatch fast path's own cache (C++)
            clear_native()


@contextlib.contextmanager
def _captured(folder: str, rank: int):
    """The call's writes to file descriptors 1 and 2 (Python's and C's), into ``output`` once it ends: a
    test reads a fresh worker's output with ``capfd``, whose redirection a pool started earlier does not
    inherit, so the parent writes it to its own descriptors (:meth:`_Pool.run`)."""
    output: list[bytes] = []
    files = [open(os.path.join(folder, f"fd{fd}_rank{rank}"), "w+b") for fd in (1, 2)]
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    for fd, f in zip((1, 2), files):
        os.dup2(f.fileno(), fd)
    try:
        yield output
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, old, f in zip((1, 2), saved, files):
            os.dup2(old, fd)
            os.close(old)
            f.seek(0)
            output.append(f.read())
            f.close()


def _serve(rank: int, world_size: int, rdzv: str, conn) -> None:
    """A pool worker: join the pool's group, then run calls until told to stop (``None``)."""
    import torch
    import torch.distributed as dist

    from tnlg.parallel.state import init_parallel
    from tnlg.parallel.heap import keep_freed_blocks
    from tnlg.runtime.process_exit import leave
    torch.set_num_threads(1)
    keep_freed_blocks()  # as a command's CPU worker does (tnlg.runtime.launch.join)
    os.environ["LOCAL_WORLD_SIZE"] = str(world_size)  # code that sizes thread pools per local rank sees it
    dist.init_process_group("gloo", init_method=f"file://{rdzv}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=WORLD_TIMEOUT_S))
    world = dist.group.WORLD
    start = _start_state()
    while True:
        task = pickle.loads(conn.recv_bytes())
        if task is None:
            break
        fn, tp, args, timeout_s, threads, environ, cwd = task
        _reset(start, threads, dict(environ, LOCAL_WORLD_SIZE=str(world_size)), cwd)
        groups = set(dist.distributed_c10d._world.pg_map)
        with _captured(os.path.dirname(rdzv), rank) as output:
            try:
                ps = init_parallel(tensor_parallel_size=tp, timeout=timedelta(seconds=timeout_s))
                reply: tuple = ("ok", fn(ps, *args))
            except BaseException:  # noqa: BLE001 - report every failure to the parent
                reply = ("error", traceback.format_exc())
        for child in mp.active_children():
            child.terminate()
        intact = dist.is_initialized() and dist.group.WORLD is world
        if intact and reply[0] == "ok":
            for group in set(dist.distributed_c10d._world.pg_map) - groups:
                dist.destroy_process_group(group)
            _forget_meshes()
        try:
            payload = pickle.dumps(reply + (intact, output))
        except Exception:  # noqa: BLE001 - an unpicklable result is the body's error, reported as one
            payload = pickle.dumps(("error", traceback.format_exc(), intact, output))
        conn.send_bytes(payload)
        if not intact or reply[0] != "ok":  # the parent ends this pool; a failed rank's peers may be inside a
            leave(1, destroy=False)        # collective, and destroying the groups could block
    leave(0, destroy=True)


class _Pool:
    """``world_size`` live workers with one process group among them."""

    def __init__(self, world_size: int):
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(_PRELOAD)
        self.world_size = world_size
        self.tmp = tempfile.mkdtemp(prefix=f"tnlg_pool{world_size}_")
        self.conns, self.procs = [], []
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            # not daemonic: a body may start processes of its own (megatron-core's checkpoint writer starts a
            # multiprocessing Manager), which a daemonic process may not; shutdown_pools ends the pools at exit,
            # and a worker whose parent is gone ends at its next read of the pipe
            proc = ctx.Process(target=_serve, args=(rank, world_size, os.path.join(self.tmp, "rdzv"), child),
                               daemon=False, name=f"tnlg-pool{world_size}-rank{rank}")
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)

    def run(self, fn: Callable, tp: int, args: tuple, timeout_s: float, threads: int) -> tuple[list, bool]:
        """The call's per-rank replies; ``bool``: the pool can take another call."""
        task = pickle.dumps((fn, tp, args, timeout_s, threads, dict(os.environ), os.getcwd()))
        for conn in self.conns:
            conn.send_bytes(task)
        replies: dict[int, tuple] = {}
        waiting = {conn: rank for rank, conn in enumerate(self.conns)}
        sentinels = {proc.sentinel: rank for rank, proc in enumerate(self.procs)}
        deadline = None
        while waiting:
            ready = mpc.wait(list(waiting) + list(sentinels), timeout=None if deadline is None
                             else max(0.0, deadline - time.monotonic()))
            if not ready:
                break  # the grace period after a failure is over: the rest are stuck
            for obj in ready:
                if obj in waiting:
                    rank = waiting.pop(obj)
                    try:
                        replies[rank] = pickle.loads(obj.recv_bytes())
                    except (EOFError, OSError):
                        replies[rank] = ("error", "the worker exited without replying", False)
                elif obj in sentinels:
                    rank = sentinels.pop(obj)
                    conn = self.conns[rank]
                    if conn in waiting and not conn.poll():
                        waiting.pop(conn)
                        replies[rank] = ("error", f"the worker exited (exit code {self.procs[rank].exitcode}) "
                                                  "without replying", False)
            if deadline is None and any(r[0] != "ok" for r in replies.values()):
                deadline = time.monotonic() + _GRACE_S
        for rank in sorted(replies):  # what each rank printed, as a fresh worker's output would have reached us
            for fd, data in zip((1, 2), replies[rank][3] if len(replies[rank]) > 3 else ()):
                if data:
                    os.write(fd, data)
        errors = [f"rank {rank} failed:\n{replies[rank][1]}" for rank in sorted(replies) if replies[rank][0] != "ok"]
        if errors:
            raise WorkerError("\n".join(errors))
        return [replies[rank][1] for rank in range(self.world_size)], all(r[2] for r in replies.values())

    def close(self, graceful: bool = True) -> None:
        if graceful:
            for conn in self.conns:
                try:
                    conn.send_bytes(pickle.dumps(None))
                except OSError:
                    pass
            for proc in self.procs:
                proc.join(timeout=10)
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=10)
        for conn in self.conns:
            conn.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


_POOLS: dict[int, _Pool] = {}


def run_distributed(fn: Callable[..., Any], world_size: int, tp: int = 1, *args: Any, timeout_s: float = 60.0,
                    threads: int = 1, fresh: bool = False) -> list[Any]:
    """``fn(ps, *args)`` on the pool of ``world_size`` workers (module docstring); the per-rank results."""
    if fresh or os.environ.get("TNLG_TEST_FRESH") == "1":
        return run_fresh(fn, world_size, tp, *args, timeout_s=timeout_s, threads=threads)
    pool = _POOLS.get(world_size)
    if pool is None:
        pool = _POOLS[world_size] = _Pool(world_size)
    keep = False
    try:
        results, keep = pool.run(fn, tp, args, timeout_s, threads)
        return results
    finally:
        if not keep:  # failed, interrupted, or the body replaced the world group: a new pool next time
            _POOLS.pop(world_size, None)
            pool.close(graceful=False)


def shutdown_pools() -> None:
    """Stop every pool (the end of the session)."""
    while _POOLS:
        _POOLS.popitem()[1].close()


atexit.register(shutdown_pools)
