"""What the training log divides by: FLOPs per iteration (the planner's formula), the measured matmul peak,
and the peak memory of this rank.

MFU counts the model's FLOPs (Narayanan et al. 2021, eq. 3, any ``--ffn-hidden-size``;
:mod:`tnlg.plan.flops`); HFU counts the FLOPs executed, the recomputed forward included.
Both divide by the per-rank peak measured here (or ``--peak-tflops``).
"""

from __future__ import annotations

import math
import resource
import time
from typing import Optional

import torch
import torch.distributed as dist

# FLOPs of one iteration: the planner's formula, its one home. recompute=False gives the model FLOPs
# (the MFU numerator); recompute=True adds the recomputed forward, the executed FLOPs of HFU.
from ..plan.flops import flops_per_iteration as iteration_flops

__all__ = ["iteration_flops", "measure_peak_tflops", "peak_memory_bytes"]


def measure_peak_tflops(dtype: torch.dtype, device: torch.device, n: Optional[int] = None, trials: int = 5,
                        min_seconds: float = 0.15) -> float:
    """Dense ``n x n`` matmul rate of one rank (its threads, the training dtype): the MFU denominator.

    One short matmul timed at start made MFU swing from 15% to 62% between identical runs: it caught
    the other ranks of the machine busy or idle by chance. Here, when a process group exists, every
    rank times the same number of matmuls at the same moment (a barrier before each trial), so the
    ranks share the cores as they do in training, and a trial ends when the slowest rank is done; a
    trial lasts at least ``min_seconds``, and the fastest of ``trials`` counts (the same on every rank).
    Operands come from a private generator: the global RNG streams are not touched. Collective
    (world): a MAX all-reduce of the repetitions, then per trial a barrier and a MAX all-reduce.
    """
    n = n or (8192 if device.type == "cuda" else 1024)
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, generator=gen).to(dtype)
    b = torch.randn(n, n, device=device, generator=gen).to(dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    group = dist.is_available() and dist.is_initialized()

    def timed(reps: int) -> float:
        sync()
        t = time.perf_counter()
        for _ in range(reps):
            torch.mm(a, b)
        sync()
        return time.perf_counter() - t

    timed(1)  # warm-up (library initialisation)
    reps = torch.tensor([max(1, math.ceil(min_seconds / max(timed(1), 1e-6)))], dtype=torch.float64, device=device)
    if group:
        dist.all_reduce(reps, op=dist.ReduceOp.MAX)  # the same work on every rank
    best = math.inf
    for _ in range(trials):
        if group:
            dist.barrier()
        dt = torch.tensor([timed(int(reps.item()))], dtype=torch.float64, device=device)
        if group:  # the trial ends when the last rank is done: no rank counts the others' idle time
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        best = min(best, dt.item() / int(reps.item()))
    return 2.0 * n ** 3 / best / 1e12


def peak_memory_bytes(device: torch.device) -> int:
    """Peak allocated bytes on a GPU; on a CPU the process's peak resident set."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux: KiB
