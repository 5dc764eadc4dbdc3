"""The flat gradient buffer of ZeRO stages 0 and 1, and the bucket hooks that start its reduction.

Every trainable parameter's ``.grad`` is a view into one flat buffer laid out as the
parameter buffer (:mod:`tnlg.optim.layout`: backward order, buckets of whole parameters,
each padded to a multiple of the number of owners). Autograd accumulates into those
views in place, so gradient accumulation over micro batches costs no copies.

Communication (DP group only; the model's TP collectives use the TP group):

* accumulation micro steps (all but the last, ``set_sync(False)``): none;
* the last micro step, during backward: as soon as every parameter of a bucket has its
  gradient (``register_post_accumulate_grad_hook``), the bucket's reduction is launched
  asynchronously (:meth:`tnlg.optim.bucket_comm.BucketComm.reduce`: all-reduce at
  stage 0, reduce-scatter into the owned slice at stage 1), overlapping the rest of
  backward. Buckets launch strictly in index order, so every rank issues the same
  sequence;
* :meth:`GradBuffer.finish_grad_sync` (at the step): launches the buckets whose
  parameters got no gradient (unused), in order, and waits for every reduction.

``dtype`` wider than the parameters' (fp32 gradients for 16-bit parameters, Megatron's
``main_grad``): autograd's 16-bit ``.grad`` is added into the fp32 view by the hook and
dropped, so accumulation and reduction are fp32.

Lifetime: a parameter's hooks are held by autograd (C++), out of the garbage collector's
sight, so a hook that captured the buffer would keep it (and the whole engine) alive for as
long as the parameter lives, and a cycle through it could never be collected. The hooks hold
only a weak reference to their :class:`GradBuffer`; :meth:`GradBuffer.close` removes them
and drops the ``.grad`` views, after which the buffer's memory returns as soon as the
engine is dropped.
"""

from __future__ import annotations

import weakref
from typing import Sequence

import torch

from .bucket_comm import BucketComm
from .layout import FlatLayout

__all__ = ["GradBuffer"]


class GradBuffer:
    """Flat gradients of ``params`` (in ``layout`` order), bucket hooks and their reductions."""

    def __init__(self, params: Sequence[torch.Tensor], layout: FlatLayout, dtype: torch.dtype,
                 device: torch.device, comm: BucketComm):
        self.layout, self.comm, self.params = layout, comm, list(params)
        self.buffer = torch.zeros(layout.total_numel, dtype=dtype, device=device)
        self.separate = any(p.dtype != dtype for p in self.params)  # .grad folded in by the hook, then dropped
        self.views = [self.buffer[off:off + p.numel()].view(p.shape)
                      for p, off in zip(self.params, layout.param_offsets)]
        if not self.separate:
            for p, v in zip(self.params, self.views):
                p.grad = v
        self.param_bucket = [0] * len(self.params)
        for b in layout.buckets:
            for i in b.params:
                self.param_bucket[i] = b.index
        self._sync = True
        self._reset_sync_state()
        self._hooks = [p.register_post_accumulate_grad_hook(self._make_hook(i)) for i, p in enumerate(self.params)]

    def _reset_sync_state(self) -> None:
        self._pending = [len(b.params) for b in self.layout.buckets]
        self._next = 0
        self._works: list = []

    def _make_hook(self, i: int):
        owner = weakref.ref(self)  # not ``self``: autograd holds the hook (see the module docstring)

        def hook(param: torch.Tensor) -> None:
            buf = owner()
            if buf is not None:  # else the buffer is gone (closed or dropped): nothing to accumulate into
                buf._accumulated(i, param)
        return hook

    def _accumulated(self, i: int, param: torch.Tensor) -> None:
        """Parameter ``i``'s gradient is complete for this backward: fold it into its view, and
        launch the buckets that became ready."""
        view = self.views[i]
        g = param.grad
        if self.separate:  # 16-bit .grad -> fp32 main gradient, then drop the 16-bit one
            if g is not None:
                with torch.no_grad():
                    view.add_(g)
                param.grad = None
        elif g is None or g.data_ptr() != view.data_ptr():
            # .grad was replaced (set_to_none, or out-of-place accumulation): fold it back in.
            with torch.no_grad():
                if g is None:
                    view.zero_()
                else:
                    view.copy_(g)
            param.grad = view
        if self._sync:
            self._pending[self.param_bucket[i]] -= 1
            self._launch_ready(in_backward=True)

    def _launch_ready(self, in_backward: bool) -> None:
        while self._next < len(self.layout.buckets) and self._pending[self._next] <= 0:
            self._works += self.comm.reduce(self.buffer, self.layout.buckets[self._next], in_backward)
            self._next += 1

    def set_sync(self, is_last: bool) -> None:
        """Called before each micro step's backward: communicate only on the last one."""
        self._sync = is_last
        if is_last:
            self._reset_sync_state()

    def finish_grad_sync(self) -> None:
        """Launch buckets whose parameters got no gradient (unused), in order; wait for all."""
        for k in range(self._next, len(self.layout.buckets)):
            self._pending[k] = 0
        self._launch_ready(in_backward=False)
        for w in self._works:
            w.wait()
        self._works = []

    @torch.no_grad()
    def zero_grad(self) -> None:
        """Zero the buffer in place and point every ``.grad`` back at its view (no ``.grad`` when separate)."""
        self.buffer.zero_()
        for p, v in zip(self.params, self.views):
            if self.separate:
                p.grad = None
            elif p.grad is None or p.grad.data_ptr() != v.data_ptr():
                p.grad = v

    def close(self) -> None:
        """Remove the hooks and the ``.grad`` views into the buffer; unusable afterwards."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        for p, v in zip(self.params, self.views):
            if p.grad is not None and p.grad.data_ptr() == v.data_ptr():
                p.grad = None
        self.views, self.params = [], []
