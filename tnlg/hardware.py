"""Is bf16 fast here? A few-millisecond probe, checked before any work starts.

CPUs differ: with AVX-512 BF16 or AMX (and, emulated, on most AVX-512 parts) a bf16
matrix multiply runs at or above the fp32 rate; on an AVX2-only CPU torch falls
back to a generic kernel and bf16 runs 20-100x slower than fp32 (measured: 0.9
GFLOP/s against 108 for fp32 at 1024 x 1024 on an AVX2 EPYC). Training with
``--bf16`` there does not fail, it crawls. :func:`cpu_bf16` times one small fp32
and one bf16 matmul (``n = 128``: under 10 ms even on the slow path) and
:func:`check_bf16` refuses ``--bf16`` with the measured figures when bf16 is more
than :data:`SLOW_FACTOR` times slower, unless ``TNLG_ALLOW_SLOW_BF16=1``.
"""

from __future__ import annotations

import functools
import os
import sys
import time
from dataclasses import dataclass

__all__ = ["MatmulProbe", "cpu_bf16", "fast_bf16_cpu", "bf16_skip_reason", "check_bf16", "SLOW_FACTOR"]

SLOW_FACTOR = 4.0  # bf16 slower than fp32 by more than this: refuse (the fast paths are >= 0.5x fp32's rate)
ALLOW_ENV = "TNLG_ALLOW_SLOW_BF16"


@dataclass(frozen=True)
class MatmulProbe:
    """Best-of-``reps`` rates of an ``n x n`` matmul on this process's threads."""

    capability: str          # torch.backends.cpu.get_cpu_capability(): "AVX512", "AVX2", "DEFAULT", ...
    n: int
    threads: int
    fp32_gflops: float
    bf16_gflops: float

    @property
    def slowdown(self) -> float:
        return self.fp32_gflops / max(self.bf16_gflops, 1e-9)

    @property
    def fast(self) -> bool:
        return self.slowdown <= SLOW_FACTOR

    def figures(self) -> str:
        return (f"a {self.n} x {self.n} bf16 matmul ran at {self.bf16_gflops:.1f} GFLOP/s against "
                f"{self.fp32_gflops:.1f} in fp32 ({self.slowdown:.0f}x slower; {self.threads} thread(s), "
                f"torch CPU capability {self.capability})")


def _rate(dtype, n: int, reps: int) -> float:
    import torch

    gen = torch.Generator().manual_seed(0)  # the global RNG streams stay untouched
    a = torch.randn(n, n, generator=gen).to(dtype)
    b = torch.randn(n, n, generator=gen).to(dtype)
    torch.mm(a, b)  # warm-up (library initialisation)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t)
    return 2.0 * n ** 3 / max(best, 1e-9) / 1e9


@functools.lru_cache(maxsize=None)
def cpu_bf16(n: int = 128, reps: int = 3) -> MatmulProbe:
    """Probe this CPU once per process: fp32 and bf16 matmul rates (a few milliseconds)."""
    import torch

    return MatmulProbe(capability=torch.backends.cpu.get_cpu_capability(), n=n, threads=torch.get_num_threads(),
                       fp32_gflops=_rate(torch.float32, n, reps), bf16_gflops=_rate(torch.bfloat16, n, reps))


def fast_bf16_cpu() -> bool:
    """Whether bf16 matmuls on this CPU run near the fp32 rate (tests and benchmarks skip otherwise)."""
    return cpu_bf16().fast


def bf16_skip_reason() -> str:
    """Why bf16 work is skipped on this CPU, with the measured figures (for pytest skips and benchmarks)."""
    return f"bf16 is slow on this CPU: {cpu_bf16().figures()}; no AVX-512 BF16/AMX kernels"


def check_bf16(device_type: str = "cpu", flag: str = "--bf16") -> None:
    """Refuse ``flag`` before any work starts where bf16 matmuls are far slower than fp32.

    On a CPU: the probe above (``TNLG_ALLOW_SLOW_BF16=1`` turns the refusal into a warning). On a
    GPU: one without native bf16 (compute capability below 8.0, e.g. V100) is refused likewise.
    """
    from .errors import UserError

    if device_type == "cuda":
        import torch
        major, minor = torch.cuda.get_device_capability()
        if major < 8:
            raise UserError(f"{flag}: this GPU ({torch.cuda.get_device_name()}, compute capability {major}.{minor}) "
                            f"has no bf16 tensor cores; bf16 would be emulated and slow. Use --fp16 (dynamic loss "
                            f"scaling) or fp32.")
        return
    probe = cpu_bf16()
    if probe.fast:
        return
    text = (f"{flag} on this CPU would be about {probe.slowdown:.0f}x slower than fp32: {probe.figures()}. "
            f"It has no bf16 matrix instructions (AVX-512 BF16 or AMX), so torch falls back to a generic kernel.")
    if os.environ.get(ALLOW_ENV) == "1":
        if os.environ.get("RANK", "0") == "0":
            print(f"warning: {text} Continuing because {ALLOW_ENV}=1.", file=sys.stderr, flush=True)
        return
    raise UserError(f"{text} Train in fp32 (drop {flag}), or on a GPU; set {ALLOW_ENV}=1 to run it anyway.")
