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

libgomp reads its environment once, when it is loaded (at ``import torch``), so the setting must come
before torch is imported. ``import tnlg`` does it (:func:`tnlg.set_wait_policy`, in the package's
``__init__``, so that a user's script that imports tnlg first gets it), the ``tnlg`` command line too, and
the launcher's workers inherit it. A user's own ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` is left alone.
Other OpenMP runtimes (Intel's ``KMP_BLOCKTIME``, LLVM's) do not read ``GOMP_SPINCOUNT``.

After ``import torch`` nothing applies any more, measured (2026-12-04, the 2-core AMD EPYC, 2 threads, 300 adds of
200k floats per round, 2 busy-loop processes): ``GOMP_SPINCOUNT=1000`` set before ``import torch`` gave
rounds of 36-40 ms every time; set after ``import torch`` but before the first parallel region, rounds of
3 ms (spinning, when the other thread is on a core) to 936 ms (when it is not), the same as not setting it
(3-1343 ms). libgomp's spin count is a hidden variable of a stripped library, with no API. So a tnlg
imported after torch warns once (:data:`tnlg.LATE_IMPORT_WARNING`) when libgomp is loaded and neither
variable is set, naming what to do.
"""

from __future__ import annotations

import sys

from .. import LATE_IMPORT_WARNING, SPIN_COUNT, WAIT_VARIABLES, set_wait_policy, spinning_libgomp_loaded

__all__ = ["SPIN_COUNT", "WAIT_VARIABLES", "LATE_IMPORT_WARNING", "set_wait_policy", "spinning_libgomp_loaded",
           "torch_loaded"]


def torch_loaded() -> bool:
    """Whether torch (and so libgomp, which has read its settings) is already loaded in this process."""
    return "torch" in sys.modules
