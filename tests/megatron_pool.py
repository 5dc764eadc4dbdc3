"""megatron-core's reference bodies on the tests' persistent worker pools (:mod:`tests.pool`).

A process that imports megatron-core pays about 3.3 CPU-s for it (torch's own 0.9 aside), and these tests make
about 20 multi-process calls: on fresh processes that import was most of the optional packages' pass. On the
pool each worker imports it once. What megatron-core keeps in module globals between calls is reset after every
call, as a fresh process would have none of it: its model-parallel groups and ranks (``destroy_model_parallel``:
the pool destroys the call's groups, which those globals would otherwise still name), its global memory buffer,
its micro-batch calculator, and the queue of the Manager process its torch_dist writer starts (the pool ends a
call's child processes). A call that fails ends the pool anyway (a new one starts for the next call).

``run_distributed`` here has :func:`tests.pool.run_distributed`'s signature.
"""

from __future__ import annotations

import sys
from typing import Any, Callable

from .pool import run_distributed as _run_on_pool

__all__ = ["run_distributed"]


def _reset_megatron() -> None:
    state = sys.modules.get("megatron.core.parallel_state")
    if state is not None:
        state.destroy_model_parallel()
    calculator = sys.modules.get("megatron.core.num_microbatches_calculator")
    if calculator is not None:
        calculator.destroy_num_microbatches_calculator()
    writer = sys.modules.get("megatron.core.dist_checkpointing.strategies.filesystem_async")
    if writer is not None:  # its Manager process's queue: the pool ends a call's child processes
        writer._results_queue = None


def _body(ps, fn: Callable, *args) -> Any:
    try:
        return fn(ps, *args)
    finally:
        _reset_megatron()


def run_distributed(fn: Callable, world_size: int, tp: int, *args, **kwargs) -> list:
    return _run_on_pool(_body, world_size, tp, fn, *args, **kwargs)
