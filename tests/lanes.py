"""How the suite shares two cores under pytest-xdist (``python -m pytest -q -n 2``, the README's command 2).

The suite is CPU-bound, but not evenly: the modules in :data:`WAITS` mostly wait (for a process group's
timeout, a signal's effect, a rank that is gone, fresh processes importing torch one after the other) and
keep about one core busy, the others keep both busy. xdist's own schedules mix them by name or by size:
two modules of waits side by side leave the cores idle, two of work halve each test's speed. Here the
modules of waits run one after the other on one worker as a single unit, "waits", while the other worker
runs the modules of work, the longest first (:data:`LONGEST`); each module of work is one unit, so its
module fixtures run once, on one worker, as in a run without xdist. A worker done with its unit takes the
next one in this order.

(xdist's ``--dist loadgroup`` would say this with marks, but under pytest 9 it cannot rename the node ids
it groups by, so this is a scheduler of its own: :class:`Lanes`, from ``pytest_xdist_make_scheduler``.)
"""

from __future__ import annotations

# The modules that mostly wait (measured alone: 0.6 to 1.4 of 2 cores busy, ~1.1 on average), in file order.
WAITS = ("test_bench_peers", "test_bench_user_script", "test_failures", "test_faults", "test_finetune_cli",
         "test_fuzz_readers", "test_gpu_check", "test_hang", "test_imports", "test_inference_faults",
         "test_interrupt", "test_megatron_bad_input", "test_memory_scale", "test_process_settings", "test_setup_memory",
         "test_threads")
# The modules of work that take longest, longest first (the rest follow in file order).
LONGEST = ("test_pipeline_inference", "test_pipeline_compile", "test_pretrain_e2e", "test_compile", "test_launch",
           "test_finetune", "test_simulate", "test_checkpoint", "test_context_parallel_training",
           "test_fuzz_megatron", "test_pipeline", "test_resume", "test_attention_training")


def module_of(nodeid: str) -> str:
    """``tests/test_x.py::test_y[a]`` -> ``test_x``."""
    return nodeid.split("::", 1)[0].rpartition("/")[2].removesuffix(".py")


def unit_of(nodeid: str) -> str:
    """The unit of scheduling a test belongs to: ``waits`` or its module."""
    module = module_of(nodeid)
    return "waits" if module in WAITS else module


def order(items: list) -> None:
    """Sort a worker's collected tests into the lanes' order, in place: the waits first (the first worker
    takes them), then the longest modules of work; stable, so each module keeps its tests' order."""
    def rank(item):
        module = module_of(item.nodeid)
        return (0, 0) if module in WAITS else (1, LONGEST.index(module)) if module in LONGEST else (2, 0)
    items.sort(key=rank)


def scheduler(config, log):
    """xdist's scope schedule with :func:`unit_of` as the scope, in the collected order (:func:`order`)."""
    from xdist.scheduler import LoadScopeScheduling

    class Lanes(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid)

    config.option.loadscopereorder = False  # the order of :func:`order`, not xdist's (largest unit first)
    return Lanes(config, log)
