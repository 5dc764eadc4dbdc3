"""The tests' worker pool (``tests/pool.py``) gives a body what a fresh worker would: whatever an earlier call
left behind (seeds, a default dtype, grad mode, the environment, the working directory) is gone, each rank's
start seeds (torch's, Python's ``random``, numpy's) are its own (the workers are forked from one forkserver: a
forked child that kept its parent's would draw the same numbers on every rank), and intra-op threads work after
the fork."""

from __future__ import annotations

import os
import random

import numpy as np
import torch

from .pool import run_distributed


def _leave_state_behind(ps, folder):
    torch.manual_seed(5)
    random.seed(5)
    np.random.seed(5)
    torch.set_default_dtype(torch.float64)
    torch.set_grad_enabled(False)
    torch.set_num_threads(2)
    os.environ["TNLG_POOL_LEFTOVER"] = "1"
    os.chdir(folder)
    return os.getpid()


def _what_a_body_sees(ps):
    return dict(pid=os.getpid(), rand=torch.rand(2).tolist(), dtype=torch.get_default_dtype(),
                grad=torch.is_grad_enabled(), threads=torch.get_num_threads(), cwd=os.getcwd(),
                leftover=os.environ.get("TNLG_POOL_LEFTOVER"), marker=os.environ.get("TNLG_POOL_MARKER"),
                python_random=random.random(), numpy_random=np.random.random())


def test_a_call_sees_none_of_what_the_previous_call_left(tmp_path, monkeypatch):
    before = run_distributed(_what_a_body_sees, 2, 1)
    pids = run_distributed(_leave_state_behind, 2, 1, str(tmp_path))
    monkeypatch.setenv("TNLG_POOL_MARKER", "this call")
    seen = run_distributed(_what_a_body_sees, 2, 1)
    left = torch.rand(2, generator=torch.Generator().manual_seed(5)).tolist()  # what the seed left would draw
    assert [s["pid"] for s in seen] == pids == [s["pid"] for s in before]  # the same live workers, all calls
    for b, s in zip(before, seen):
        # each call starts at the worker's start seeds
        assert s["rand"] == b["rand"] != left and (s["python_random"], s["numpy_random"]) == (b["python_random"],
                                                                                              b["numpy_random"])
        assert s["dtype"] == torch.float32 and s["grad"] and s["threads"] == 1
        assert s["cwd"] == os.getcwd() and s["leftover"] is None and s["marker"] == "this call"
    # each rank's start seeds are its own, as a new process's are
    for key in ("rand", "python_random", "numpy_random"):
        assert seen[0][key] != seen[1][key], key


def _threaded_matmul(ps):
    a = torch.randn(512, 512, generator=torch.Generator().manual_seed(0))
    return torch.get_num_threads(), (a @ a).sum().item()


def test_intra_op_threads_work_in_a_forked_worker():
    """A body asking for 2 threads gets them and its matmul (libgomp's parallel region, first run in the
    worker, never in the forkserver) finishes with the one-thread result of the test process."""
    results = run_distributed(_threaded_matmul, 2, 1, threads=2, timeout_s=60)
    a = torch.randn(512, 512, generator=torch.Generator().manual_seed(0))
    expected = (a @ a).sum().item()
    for threads, total in results:
        assert threads == 2 and abs(total - expected) <= 1e-3 * abs(expected) + 1e-2
