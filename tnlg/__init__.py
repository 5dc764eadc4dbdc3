"""tnlg: Megatron-style tensor parallelism composed with ZeRO data parallelism, for GPT pretraining.

The public names below are imported on first use (PEP 562), so ``import tnlg``
and ``tnlg --help`` do not pay for importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# public name -> submodule that defines it
_EXPORTS = {
    "GPTConfig": "config", "partition_sizes": "config",
    "GPT": "model", "KVCache": "model", "gather_logits": "parallel", "parameter_counts": "plan.counts",
    "generate": "generation", "generate_ids": "generation", "load": "generation.loading",
    "ColumnParallelLinear": "parallel", "ParallelState": "parallel", "RowParallelLinear": "parallel",
    "VocabParallelEmbedding": "parallel", "destroy_parallel": "parallel", "init_parallel": "parallel",
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
    if name in _SUBMODULES:
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
                           destroy_parallel, gather_logits, init_parallel, vocab_parallel_cross_entropy)
    from .plan.counts import parameter_counts
