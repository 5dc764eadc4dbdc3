"""tnlg: Megatron-style tensor parallelism composed with ZeRO data parallelism, for GPT pretraining.

The public names below are imported on first use (PEP 562), so ``import tnlg``
and ``tnlg --help`` do not pay for importing torch.

``import tnlg`` before ``import torch`` gives torch's OpenMP threads the short wait the ``tnlg`` command
gives them (``GOMP_SPINCOUNT=1000`` unless ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` is set): libgomp reads
it once, when torch loads it, and with its default spin-wait a step is several times slower on a busy
machine (:mod:`tnlg.runtime.threads` has the measurements). Imported after torch, tnlg cannot change it
any more and says so in one warning.

``tnlg.init_parallel`` then gives the process the rest of what a ``tnlg`` command's worker runs with: its
intra-op threads (the cores shared among the local processes) and a CPU heap that keeps freed blocks
(:mod:`tnlg.parallel.process_settings`).
"""

from __future__ import annotations

import importlib
import os
import sys
import warnings
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# OpenMP's wait policy; its one home: tnlg.runtime.threads re-exports these for the command line
SPIN_COUNT = "1000"  # libgomp's own spin count for an oversubscribed team
WAIT_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
LATE_IMPORT_WARNING = (
    "torch was imported before tnlg, so its OpenMP threads spin-wait (libgomp's default, read when torch "
    "loaded it), which makes a step several times slower on a busy machine: import tnlg before torch, or set "
    "GOMP_SPINCOUNT=1000 (or OMP_WAIT_POLICY=PASSIVE) in the environment before Python starts.")


def set_wait_policy(env=None) -> bool:
    """Set ``GOMP_SPINCOUNT`` in ``env`` (default: this process's environment) unless one of
    :data:`WAIT_VARIABLES` is set there already. Returns whether it set it. For this process's own
    environment it has effect only before ``import torch`` (later, only on processes started after it)."""
    target = os.environ if env is None else env
    if any(name in target for name in WAIT_VARIABLES):
        return False
    target["GOMP_SPINCOUNT"] = SPIN_COUNT
    return True


def spinning_libgomp_loaded() -> bool:
    """Whether this process has loaded GNU OpenMP (torch's CPU wheels bring it) without a wait setting of
    the user's: its threads then spin the default 300,000 iterations. Linux only (``/proc/self/maps``)."""
    if any(name in os.environ for name in WAIT_VARIABLES):
        return False
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            return "libgomp" in f.read()
    except OSError:
        return False


def _apply_wait_policy() -> None:
    """Before torch: set the policy. After torch (whose libgomp has read its settings at load): a warning,
    once, when its threads spin; measured, a ``GOMP_SPINCOUNT`` set after ``import torch`` changes nothing,
    even before the first parallel region."""
    if "torch" not in sys.modules:
        set_wait_policy()
    elif spinning_libgomp_loaded():
        warnings.warn(LATE_IMPORT_WARNING, RuntimeWarning, stacklevel=3)


_apply_wait_policy()

# public name -> submodule that defines it
_EXPORTS = {
    "GPTConfig": "config", "partition_sizes": "config",
    "GPT": "model", "KVCache": "model", "gather_logits": "parallel", "parameter_counts": "plan.counts",
    "generate": "generation", "generate_ids": "generation", "load": "generation.loading",
    "ColumnParallelLinear": "parallel", "ParallelState": "parallel", "RowParallelLinear": "parallel",
    "VocabParallelEmbedding": "parallel", "destroy_parallel": "parallel",
    "init_parallel": "parallel.process_settings",  # the groups, then the settings a command's worker has
    "vocab_parallel_cross_entropy": "parallel",
}

__all__ = ["GPTConfig", "GPT", "KVCache", "ParallelState", "init_parallel", "destroy_parallel",
           "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding",
           "vocab_parallel_cross_entropy", "gather_logits", "parameter_counts", "partition_sizes",
           "generate", "generate_ids", "load"]


# subpackages and modules reachable as ``tnlg.NAME`` after a plain ``import tnlg`` (imported on first use)
_SUBMODULES = ("checkpoint", "commands", "data", "eval", "generation", "interop", "io", "optim", "options", "parallel",
               "plan", "runtime", "training")




def __getattr__(name: str):
    if name in _SUBMODULES:  # (tnlg.interop.hf & co: the subpackage's own __getattr__)
        return importlib.import_module(f".{name}", __name__)  # binds itself on the package
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tnlg' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # for type checkers and IDEs
    from .config import GPTConfig, partition_sizes
    from .generation import generate, generate_ids
    from .generation.loading import load
    from .model import GPT, KVCache
    from .parallel import (ColumnParallelLinear, ParallelState, RowParallelLinear, VocabParallelEmbedding,
                           destroy_parallel, gather_logits, vocab_parallel_cross_entropy)
    from .parallel.process_settings import init_parallel
    from .plan.counts import parameter_counts
