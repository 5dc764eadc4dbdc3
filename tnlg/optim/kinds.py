"""One data-parallel backend per kind of parameter, stepped as one: the dense parameters reduced (and ZeRO-1
partitioned) over DP x CP, a mixture of experts' parameters over the expert-data-parallel ranks
(:data:`tnlg.parallel.state.GRADIENT_AXES`, megatron-core's expert-DP group), with expert parallelism.

:class:`KindsBackend` holds a :class:`~tnlg.optim.zero.FlatZero` per kind (stage 0 or 1), each over its own
group (:meth:`ParallelState.for_gradients`), and steps them together: both reductions finish, then one global
gradient norm, one clipping coefficient and both AdamW updates. The norm's sum of squares is the dense one's
(as :func:`tnlg.optim.clip.global_norm` sums it: over DP where partitioned, the split parameters over TP)
plus the experts' (every expert parameter is split over TP, and over EP: summed over the expert-DP ranks
where partitioned, then over TP and EP), then summed over the pipeline stages once (a stage without experts,
whose engine has one :class:`FlatZero`, takes part in that one sum as well), so it equals the norm of one
process holding the whole model. Collectives of the step: each kind's bucket reductions; fp64 scalars'
all-reduces: DP and TP for the dense sum, expert-DP, TP and EP for the experts', PP for the total; stage 1's
parameter all-gathers per kind.

At EP 1 the expert-DP ranks are the DP x CP ranks and the engine uses one :class:`FlatZero` (nothing
changes); ZeRO 2 and 3 with EP > 1 are FSDP2's, the experts sharded over their own mesh (:mod:`tnlg.optim.fsdp`).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from ..parallel.state import ParallelState
from .backend import StepResult, clipped_step

from .clip import global_sum_of_squares, norm_and, squared_sums, summed_sum_of_squares
from .zero import FlatZero

__all__ = ["KindsBackend", "is_expert", "needs_kinds"]


def is_expert(name: str, param: torch.Tensor) -> bool:
    """Whether ``param`` is of gradient kind ``"expert"`` (a routed expert's, split over EP)."""
    return getattr(param, "gradient_kind", "dense") == "expert"


def needs_kinds(model: nn.Module, ps: ParallelState, zero_stage: int) -> bool:
    """Whether ``model`` needs a flat backend per gradient kind: expert parameters split over EP > 1 ranks, at
    ZeRO 0 or 1 (at 2 and 3 FSDP2 shards the experts over their own mesh: :mod:`tnlg.optim.fsdp`)."""
    experts = ps.ep_size > 1 and any(is_expert(n, p) for n, p in model.named_parameters())
    return experts and not (zero_stage >= 2 and ps.dp_size > 1)


class KindsBackend:
    """The dense and the expert parameters' :class:`FlatZero` backends, stepped as one (module docstring)."""

    impl = "flat"

    def __init__(self, model: nn.Module, ps: ParallelState, stage: int, **kw):
        self.ps, self.stage = ps, stage
        self.dense = FlatZero(model, ps.for_gradients("dense"), stage, select=lambda n, p: not is_expert(n, p), **kw)
        self.expert = FlatZero(model, ps.for_gradients("expert"), stage, select=is_expert, **kw)
        self.parts = (self.dense, self.expert)
        self.names = self.dense.names + self.expert.names
        self.dtype = self.dense.dtype
        self.pieces_sharded_over_dp = self.dense.pieces_sharded_over_dp

    @property
    def model(self) -> nn.Module:
        return self.dense.model

    # ----------------------------------------------------------------- training
    def set_sync(self, is_last: bool) -> None:
        for b in self.parts:
            b.set_sync(is_last)

    def backward(self, loss: torch.Tensor, factor: float, is_last: bool) -> None:
        self.set_sync(is_last)
        (loss if factor == 1.0 else loss * factor).backward()

    def _expert_sq(self) -> torch.Tensor:
        """The experts' sum of squares over the whole model (expert-DP where partitioned, TP, EP)."""
        eps = self.expert.ps
        groups = ([eps.dp_group] if self.expert.grads_sharded_over_dp else []) + [self.ps.tp_group, self.ps.ep_group]
        return summed_sum_of_squares(self.expert.grad_pieces(), self.ps.device, groups)

    def step(self, lr: float, clip_grad: float, loss_scale: float,
             loss: Optional[torch.Tensor] = None) -> StepResult:
        """Both reductions, one norm (unscaled by ``loss_scale``; ``loss`` read with it), clipping, both
        AdamW updates unless the norm or the loss is inf/NaN."""
        for b in self.parts:
            b.finish_grad_sync()
        dense_sq = global_sum_of_squares(*squared_sums(self.dense.grad_pieces()), self.dense.ps,
                                         self.dense.grads_sharded_over_dp, over_pp=False)
        total = dense_sq + self._expert_sq().to(dense_sq)
        if self.ps.pp_size > 1:  # (each stage holds different layers)
            dist.all_reduce(total, group=self.ps.pp_group)
        norm, loss_value = norm_and(total, loss)

        def update(factor: float) -> None:
            for b in self.parts:
                b.adam_step(lr, factor)
        return clipped_step(norm, loss_value, loss_scale, clip_grad, update)

    def zero_grad(self) -> None:
        for b in self.parts:
            b.zero_grad()

    def set_step(self, step: int) -> None:
        for b in self.parts:
            b.set_step(step)

    def grad_view(self, name: str) -> torch.Tensor:
        return self._owner(name).grad_view(name)

    def _owner(self, name: str) -> FlatZero:
        return self.dense if name in self.dense._index else self.expert

    # ----------------------------------------------------------------- state (what checkpoints save and load)
    def param_shapes(self) -> dict[str, tuple]:
        return {**self.dense.param_shapes(), **self.expert.param_shapes()}

    def owned_pieces(self) -> list[dict]:
        """Both kinds' pieces (``FlatZero.owned_pieces``), each tagged with its gradient ``kind`` and whether that
        kind's pieces are ``sharded`` over its gradient ranks (the expert-DP ranks may be one where DP x CP is
        not, so each kind says it: a checkpoint writes an unsharded kind from its group's rank 0)."""
        return [dict(pc, kind=kind, sharded=part.pieces_sharded_over_dp)
                for kind, part in (("dense", self.dense), ("expert", self.expert)) for pc in part.owned_pieces()]

    def optimizer_state_by_param(self) -> dict[str, dict]:
        return {**self.dense.optimizer_state_by_param(), **self.expert.optimizer_state_by_param()}

    def load_optimizer_state_by_param(self, states: dict) -> None:
        for b in self.parts:
            b.load_optimizer_state_by_param({n: states[n] for n in b.names})

    def param_tensors(self, names):
        wanted = set(names)
        for b in self.parts:
            yield from b.param_tensors([n for n in b.names if n in wanted])

    def load_param(self, name: str, value: torch.Tensor) -> None:
        self._owner(name).load_param(name, value)

    def gather_params(self) -> None:
        for b in self.parts:
            b.gather_params()

    def refresh_master(self) -> None:
        for b in self.parts:
            b.refresh_master()

    def memory_report(self) -> dict:
        a, b = self.dense.memory_report(), self.expert.memory_report()
        return {k: a[k] + b[k] if isinstance(a[k], int) else a[k] for k in a}

    def close(self) -> None:
        for b in self.parts:
            b.close()
