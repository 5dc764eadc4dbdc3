"""How torch's OpenMP threads wait: briefly, so that a step does not collapse on a busy machine.

torch's CPU wheels run their intra-op parallel regions on GNU OpenMP (libgomp). At the end of each region
a thread that finished its share waits for the others, and libgomp's default wait spins for
``GOMP_SPINCOUNT`` = 300,000 iterations before it sleeps, unless it sees more threads than CPUs, when it
spins 1,000 ("throttled"). It counts only its own threads: when other processes keep the cores busy (a
shared workstation, a CI runner, the other ranks of a job with more processes than cores), each spinning
thread burns the time slice that the thread it waits for, or another process, needs, and every one of a
step's thousands of short regions (the casts of a bf16 autocast step especially) pays a scheduler quantum.

Measured on the 2-core AMD EPYC (AVX-512 BF16) development machine, a 2-layer, hidden-512 tnlg GPT,
bf16 autocast, 2 threads, forward + backward + AdamW step, 2 extra busy-loop processes: 3.5-6.9 s per
step with libgomp's default, 1.2-1.8 s with ``OMP_WAIT_POLICY=PASSIVE`` and 1.5-1.8 s with
``GOMP_SPINCOUNT=1000``; under the same load the share of the step in the flash-attention kernel stayed
small (81-355 ms), the growth was in every operator (matmuls, copies). So the cause was the wait, not
the attention kernel, and the fix is the setting libgomp itself uses when it knows it is oversubscribed:
``GOMP_SPINCOUNT=1000``, which still spins for a few microseconds between back-to-back regions on a quiet
machine.

libgomp reads its environment once, when it is loaded (at ``import torch``), so
:func:`set_wait_policy` must run before torch is imported: ``tnlg``'s command line does it first thing,
and the launcher's workers inherit it. A user's own ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` is left
alone. Other OpenMP runtimes (Intel's ``KMP_BLOCKTIME``, LLVM's) do not read ``GOMP_SPINCOUNT``.
"""

from __future__ import annotations

import os
import sys
from typing import MutableMapping, Optional

__all__ = ["SPIN_COUNT", "WAIT_VARIABLES", "set_wait_policy", "torch_loaded"]

SPIN_COUNT = "1000"  # libgomp's own spin count for an oversubscribed team
WAIT_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def set_wait_policy(env: Optional[MutableMapping[str, str]] = None) -> bool:
    """Set ``GOMP_SPINCOUNT`` in ``env`` (default: this process's environment) unless one of
    :data:`WAIT_VARIABLES` is set there already. Returns whether it set it. For this process's own
    environment it has effect only before ``import torch`` (later, only on processes started after it)."""
    target = os.environ if env is None else env
    if any(name in target for name in WAIT_VARIABLES):
        return False
    target["GOMP_SPINCOUNT"] = SPIN_COUNT
    return True


def torch_loaded() -> bool:
    """Whether torch (and so libgomp, which has read its settings) is already loaded in this process."""
    return "torch" in sys.modules
