"""Measured memory, to check the planner's formulas against what the code really allocates.

:class:`AllocationTracker` is a ``TorchDispatchMode`` that sees every tensor an operator
creates while it is active (forward, backward, recomputation, collectives' buffers) and
frees it from its count when the last reference to its storage goes. It reports the peak
of those bytes and the bytes alive at marked points. It works on any device (CPU
included, which has no allocator statistics) and counts exact tensor bytes: no allocator
caching or fragmentation. Storages that existed before (parameters, their pre-allocated
gradients, the input) are not counted, nor are views and in-place results of them.

    tracker = AllocationTracker()
    with tracker:
        loss = model(tokens, labels=labels)
        tracker.mark("after_forward")
        loss.backward()
    tracker.peak, tracker.marks["after_forward"]

which :func:`tracked_step` does for a model called as ``model(tokens, labels=labels)``.

Slow (a Python call per operator): for measurements, not for timed runs.
"""

from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["AllocationTracker", "tracked_step"]


class AllocationTracker(TorchDispatchMode):
    """Peak and current bytes of the tensors created while active (see the module docstring)."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.current = 0
        self.peak = 0
        self.marks: dict[str, int] = {}

    def _sweep(self) -> None:
        for key, (ref, n) in list(self.live.items()):
            if ref.expired():
                del self.live[key]
                self.current -= n

    def mark(self, name: str) -> int:
        """Record (and return) the bytes alive now under ``name``."""
        self._sweep()
        self.marks[name] = self.current
        return self.current

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor) and t.device.type != "meta"}
        out = func(*args, **kwargs)
        self._sweep()
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            st = t.untyped_storage()
            key = st.data_ptr()
            if key == 0 or key in inputs or key in self.live:
                continue
            self.live[key] = (StorageWeakRef(st), st.nbytes())
            self.current += st.nbytes()
        self.peak = max(self.peak, self.current)
        return out


def tracked_step(model, tokens: torch.Tensor, labels: torch.Tensor) -> AllocationTracker:
    """One forward and backward of ``model(tokens, labels=labels)`` under a fresh tracker, with the
    bytes alive after the forward (what is kept for backward) marked ``"after_forward"``.

    Run a warm-up step first, and give parameters their gradients beforehand, so that lazy
    initialisations and gradient buffers are not counted as activations.
    """
    tracker = AllocationTracker()
    with tracker:
        loss = model(tokens, labels=labels)
        tracker.mark("after_forward")
        loss.backward()
        del loss
    return tracker
