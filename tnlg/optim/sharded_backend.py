"""What our two backends (:class:`~tnlg.optim.zero.FlatZero`, :class:`~tnlg.optim.fsdp.FSDPZero`) share.

Both hold gradients that this rank can read (full at stage 0, the owned slices or FSDP
shards at stages 1-3) and step ``torch.optim.AdamW`` on the pieces they own
(:mod:`tnlg.optim.sharded_adamw`), so the step and the by-parameter state exchange are
written once here, on top of a few primitives each backend provides:

* ``finish_grad_sync()`` — wait for the gradient reduction of the last micro step;
* ``grad_pieces()`` — ``(gradient tensor, tp_sharded)`` for what this rank holds;
* ``grads_sharded_over_dp`` — True when DP ranks hold disjoint gradient pieces;
* ``adam_step(lr, grad_factor)`` (AdamW on ``grad_factor * grad``: the clipping coefficient
  over the loss scale, folded into the fused kernel) and ``owned_pieces()``.

Collectives of :meth:`ShardedBackend.step`: the backend's wait for the gradient reduction;
the gradient norm (:mod:`tnlg.optim.clip`: an fp64 all-reduce over DP of both sums where
gradients are sharded, one over TP of the sharded sum; the one host read of the step); then whatever ``adam_step`` runs
(flat stage 1: all-gather of the parameters).
"""

from __future__ import annotations

from typing import Iterable, Optional, Sequence

import torch
import torch.distributed as dist

from ..errors import UserError
from ..parallel.state import ParallelState
from .backend import StepResult, clipped_step
from .clip import global_norm_and, squared_sums

__all__ = ["ShardedBackend", "check_shape"]


class ShardedBackend:
    """The step and the state exchange of a backend built on owned pieces (see the module docstring)."""

    ps: ParallelState
    names: list[str]
    params: Sequence[torch.Tensor]
    _index: dict[str, int]
    grads_sharded_over_dp: bool   # every DP rank holds a different part of the gradients (the norm's sum)
    pieces_sharded_over_dp: bool  # ... of the optimizer states

    # each backend's own (FlatZero, FSDPZero): the reduction, the gradients it owns, its AdamW, its pieces
    def set_sync(self, is_last: bool) -> None:
        raise NotImplementedError

    def finish_grad_sync(self) -> None:
        raise NotImplementedError

    def grad_pieces(self) -> Iterable[tuple[torch.Tensor, bool]]:
        raise NotImplementedError

    def adam_step(self, lr: float, grad_factor: float = 1.0) -> None:
        raise NotImplementedError

    def owned_pieces(self) -> list[dict]:
        raise NotImplementedError

    def backward(self, loss: torch.Tensor, factor: float, is_last: bool) -> None:
        """Backward of ``loss * factor``; the backend's gradient reduction runs only when ``is_last``."""
        self.set_sync(is_last)
        (loss if factor == 1.0 else loss * factor).backward()

    def step(self, lr: float, clip_grad: float, loss_scale: float,
             loss: Optional[torch.Tensor] = None) -> StepResult:
        """Wait for the reduction, norm (unscaled by ``loss_scale``; ``loss`` read with it, in the step's
        one host synchronisation), then clip and AdamW unless the norm or the loss is inf/NaN."""
        self.finish_grad_sync()
        sh, rep = squared_sums(self.grad_pieces())
        norm, loss_value = global_norm_and(sh, rep, self.ps, self.grads_sharded_over_dp, loss)
        return clipped_step(norm, loss_value, loss_scale, clip_grad, lambda factor: self.adam_step(lr, factor))

    def param_shapes(self) -> dict[str, tuple]:
        return {n: tuple(p.shape) for n, p in zip(self.names, self.params)}

    def _selected(self, names):
        """``(name, parameter)`` of the named parameters, in the backend's order."""
        wanted = set(names)
        return ((n, p) for n, p in zip(self.names, self.params) if n in wanted)

    def _checked(self, name: str, value: torch.Tensor) -> torch.Tensor:
        """Parameter ``name``, after checking that ``value`` has its shape."""
        p = self.params[self._index[name]]
        check_shape(name, value, p.shape)
        return p

    @torch.no_grad()
    def optimizer_state_by_param(self) -> dict[str, dict]:
        """Full per-parameter Adam moments from the owned pieces: zero-filled tensors, this rank's
        pieces copied in, then (states partitioned over DP) one all-reduce per parameter and moment."""
        out = {n: dict(exp_avg=torch.zeros(s, device=self.ps.device), exp_avg_sq=torch.zeros(s, device=self.ps.device))
               for n, s in self.param_shapes().items()}
        for pc in self.owned_pieces():
            for k in ("exp_avg", "exp_avg_sq"):
                out[pc["name"]][k].view(-1)[pc["lo"]:pc["lo"] + pc["length"]].copy_(pc[k])
        if self.pieces_sharded_over_dp:
            for n in self.names:
                group = self.state_group(n)
                for k in ("exp_avg", "exp_avg_sq") if group is not None else ():
                    dist.all_reduce(out[n][k], group=group)
        return out

    def state_group(self, name: str):
        """The ranks parameter ``name``'s optimizer state is partitioned over: DP (x CP) (FSDP2 shards a mixture of
        experts' routed experts over their expert-DP ranks instead: :mod:`tnlg.optim.fsdp`)."""
        return self.ps.dp_group

    @torch.no_grad()
    def load_optimizer_state_by_param(self, states: dict) -> None:
        """Copy this rank's pieces out of full per-parameter moments; no communication."""
        for pc in self.owned_pieces():
            for k in ("exp_avg", "exp_avg_sq"):
                pc[k].copy_(states[pc["name"]][k].detach().reshape(-1)[pc["lo"]:pc["lo"] + pc["length"]])

    def close(self) -> None:
        """Release what ties the backend to the model's parameters (hooks, ``.grad``); each backend
        says what that is. Unusable afterwards."""
        raise NotImplementedError


def check_shape(name: str, value: torch.Tensor, shape) -> None:
    """A clear :class:`UserError` unless ``value`` has this TP shard's ``shape``."""
    if tuple(value.shape) != tuple(shape):
        raise UserError(f"parameter {name!r}: expected a tensor of shape {tuple(shape)}, got "
                        f"{tuple(value.shape)}.")
