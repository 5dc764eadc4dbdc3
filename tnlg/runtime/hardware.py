"""Is bf16 fast here? A few-millisecond probe, checked before any work starts.

CPUs differ: with AVX-512 BF16 or AMX (and, emulated, on most AVX-512 parts) a bf16
matrix multiply runs at or above the fp32 rate; on an AVX2-only CPU torch falls
back to a generic kernel and bf16 runs 20-100x slower than fp32 (measured: 0.9
GFLOP/s against 108 for fp32 at 1024 x 1024 on an AVX2 EPYC). Training with
``--bf16`` there does not fail, it crawls. :func:`cpu_bf16` times small fp32 and
bf16 matmuls on one thread (``n = 128``, about 3 ms; a slow verdict is confirmed at
``n = 256``, under 0.1 s on the slow path) and
:func:`check_bf16` refuses ``--bf16`` with the measured figures when bf16 is more
than :data:`SLOW_FACTOR` times slower, unless ``TNLG_ALLOW_SLOW_BF16=1``.
"""

from __future__ import annotations

import functools
import os
import sys
import time
from dataclasses import dataclass

from ..errors import UserError

__all__ = ["MatmulProbe", "cpu_bf16", "fast_bf16_cpu", "bf16_skip_reason", "check_bf16", "SLOW_FACTOR"]

SLOW_FACTOR = 4.0  # bf16 slower than fp32 by more than this: refuse (the fast paths are >= 0.5x fp32's rate)
ALLOW_ENV = "TNLG_ALLOW_SLOW_BF16"


@dataclass(frozen=True)
class MatmulProbe:
    """Best-of-``reps`` rates of an ``n x n`` matmul on one thread."""

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


def _rates(n: int, reps: int) -> tuple[float, float]:
    """Best-of-``reps`` fp32 and bf16 rates (GFLOP/s), the two interleaved so that a busy moment of a
    shared machine does not fall on one dtype only."""
    import torch

    gen = torch.Generator().manual_seed(0)  # the global RNG streams stay untouched
    pairs = {}
    for dtype in (torch.float32, torch.bfloat16):
        a = torch.randn(n, n, generator=gen).to(dtype)
        b = torch.randn(n, n, generator=gen).to(dtype)
        torch.mm(a, b)  # warm-up (library initialisation)
        pairs[dtype] = (a, b)
    best = {dtype: float("inf") for dtype in pairs}
    for _ in range(reps):
        for dtype, (a, b) in pairs.items():
            t = time.perf_counter()
            torch.mm(a, b)
            best[dtype] = min(best[dtype], time.perf_counter() - t)
    f32, bf16 = (2.0 * n ** 3 / max(best[d], 1e-9) / 1e9 for d in (torch.float32, torch.bfloat16))
    return f32, bf16


@functools.lru_cache(maxsize=None)
def cpu_bf16(n: int = 128, reps: int = 5) -> MatmulProbe:
    """Probe this CPU: fp32 and bf16 matmul rates (a few milliseconds). A slow verdict at ``n = 128`` is
    confirmed at ``n = 256`` before it counts (a refusal must not come from a busy moment). Cached."""
    import torch

    def probe(size: int, count: int) -> MatmulProbe:
        fp32, bf16 = _rates(size, count)
        return MatmulProbe(capability=torch.backends.cpu.get_cpu_capability(), n=size, threads=1,
                           fp32_gflops=fp32, bf16_gflops=bf16)

    # one thread: the kernel's speed, not how long a busy machine takes to wake a second thread
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        first = probe(n, reps)
        return first if first.fast else probe(2 * n, reps)
    finally:
        torch.set_num_threads(threads)


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
