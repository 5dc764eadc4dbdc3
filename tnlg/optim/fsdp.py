"""ZeRO stages 2 and 3 through PyTorch FSDP2 (``fully_shard``) on the data-parallel group.

FSDP only sees a 1-D :class:`~torch.distributed.device_mesh.DeviceMesh` built
from ``ps.dp_group`` (``DeviceMesh.from_group``), so it shards this rank's TP
shard of every parameter over the DP peers (same TP rank, identical shapes),
along dim 0 (``Shard(0)``; uneven sizes allowed). The model's own TP
collectives keep using the TP groups; during forward/backward FSDP hands the
layers plain (unsharded, TP-local) tensors, so tensor parallelism composes
unchanged.

Sharding units: every module that is an element of an ``nn.ModuleList`` (the
transformer blocks of GPT), then the root (embeddings, final LayerNorm, LM head).

Collectives (DP group) per training step:

* stage 2 (``reshard_after_forward=False``): per unit, one all-gather of its
  parameters in forward (kept until the unit's backward) and one
  reduce-scatter of its gradients (averaged over DP) in backward, overlapped
  by FSDP's prefetching. Gradients persist only as shards (``Psi / dp``).
* stage 3 (``reshard_after_forward=True``): as stage 2 but parameters are
  freed after each unit's forward and all-gathered again in backward
  (3 units of traffic instead of 2).
* gradient accumulation: ``set_requires_gradient_sync(False)`` on all but the
  last micro step, so no reduce-scatter runs then (unsharded gradients
  accumulate locally meanwhile).
* ``step()``: gradient norm (local squared sums of the gradient shards,
  all-reduced over DP, sharded ones also over TP), then AdamW on the local
  shards; no parameter communication (the next forward all-gathers).

The ``tp_sharded`` (and ``partition_*``) attributes of the original
parameters are copied onto FSDP's sharded parameters, which FSDP creates anew.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn

from ..errors import UserError
from ..parallel.state import ParallelState
from .zero import _check_states, _tp_flag, adamw_update_, default_decay

__all__ = ["FSDPZero", "fsdp_units"]

_TP_ATTRS = ("tp_sharded", "partition_dim", "partition_sizes", "full_size")


def fsdp_units(model: nn.Module) -> list[nn.Module]:
    """Modules wrapped as their own FSDP unit: the elements of every ``nn.ModuleList``."""
    units = []
    for m in model.modules():
        if isinstance(m, nn.ModuleList):
            units.extend(m)
    return units


class FSDPZero:
    """Stage 2 or 3: FSDP2 sharding of parameters/gradients over DP, AdamW on the local shards."""

    impl = "fsdp"
    grads_sharded_over_dp = True

    def __init__(self, model: nn.Module, ps: ParallelState, stage: int, *, betas=(0.9, 0.95), eps=1e-8,
                 weight_decay: float = 0.0, decay_fn: Callable[[str, torch.Tensor], bool] = default_decay):
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard

        if stage not in (2, 3):
            raise ValueError(f"FSDPZero implements ZeRO stages 2 and 3, got {stage}.")
        if ps.dp_size < 2 or ps.dp_group is None:
            raise ValueError("FSDP sharding needs a data-parallel group of at least 2 ranks.")
        self.ps, self.stage = ps, stage
        self.beta1, self.beta2 = float(betas[0]), float(betas[1])
        self.eps, self.weight_decay = float(eps), float(weight_decay)

        before = [(n, p) for n, p in model.named_parameters()]
        attrs = {n: {k: getattr(p, k) for k in _TP_ATTRS if hasattr(p, k)} for n, p in before}
        flags = {n: _tp_flag(n, p, ps) for n, p in before}
        decay = {n: bool(decay_fn(n, p)) for n, p in before}
        self.full_numel = {n: p.numel() for n, p in before}
        self.mesh = DeviceMesh.from_group(ps.dp_group, device_type=ps.device.type)
        reshard = stage == 3
        for unit in fsdp_units(model):
            fully_shard(unit, mesh=self.mesh, reshard_after_forward=reshard)
        fully_shard(model, mesh=self.mesh, reshard_after_forward=reshard)
        self.model = model

        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad and p.numel() > 0]
        if not named:
            raise UserError("the model has no trainable parameters: nothing to optimise.")
        for n, p in model.named_parameters():
            for k, v in attrs.get(n, {}).items():
                setattr(p, k, v)
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.tp_sharded = [flags[n] for n in self.names]
        self.decay = [decay[n] for n in self.names]
        self.exp_avg = [torch.zeros_like(p.to_local(), dtype=torch.float32) for p in self.params]
        self.exp_avg_sq = [torch.zeros_like(p.to_local(), dtype=torch.float32) for p in self.params]
        self.master = [None if p.dtype == torch.float32 else p.to_local().detach().float() for p in self.params]

    # ----------------------------------------------------------------- gradient sync
    def set_sync(self, is_last: bool) -> None:
        self.model.set_requires_gradient_sync(is_last)

    def finish_grad_sync(self) -> None:
        """Nothing to wait for: FSDP's post-backward callback finishes the reduce-scatters."""

    def _local_grads(self):
        for p in self.params:
            yield None if p.grad is None else p.grad.to_local()

    def grad_pieces(self):
        for g, f in zip(self._local_grads(), self.tp_sharded):
            if g is not None:
                yield g, f

    @torch.no_grad()
    def scale_grads_(self, factor: float) -> None:
        for g in self._local_grads():
            if g is not None:
                g.mul_(factor)

    @torch.no_grad()
    def adam_step(self, lr: float, step: int) -> None:
        for i, p in enumerate(self.params):
            if p.grad is None:
                continue  # unused parameter: no gradient this step (torch.optim also skips it)
            local, grad = p.to_local(), p.grad.to_local()
            runs = [(0, local.numel())] if self.decay[i] else []
            target = local if self.master[i] is None else self.master[i]
            adamw_update_(target, grad.float() if self.master[i] is not None else grad, self.exp_avg[i],
                          self.exp_avg_sq[i], step, lr, self.beta1, self.beta2, self.eps, runs, self.weight_decay)
            if self.master[i] is not None:
                local.copy_(target)

    def gather_params(self) -> None:
        """Nothing: FSDP all-gathers parameters in the next forward."""

    @torch.no_grad()
    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    # ----------------------------------------------------------------- state exchange
    def _full(self, local: torch.Tensor, p) -> torch.Tensor:
        from torch.distributed.tensor import DTensor
        d = DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                               stride=p.stride())
        return d.full_tensor()

    def _local_of(self, full: torch.Tensor, p) -> torch.Tensor:
        from torch.distributed.tensor import distribute_tensor
        return distribute_tensor(full.to(p.device), p.device_mesh, p.placements, src_data_rank=None).to_local()

    @torch.no_grad()
    def optimizer_state_by_param(self) -> dict:
        """Full (over DP) fp32 states per parameter; all-gathers over DP (collective)."""
        return {n: dict(exp_avg=self._full(m, p).clone(), exp_avg_sq=self._full(v, p).clone())
                for n, p, m, v in zip(self.names, self.params, self.exp_avg, self.exp_avg_sq)}

    @torch.no_grad()
    def load_optimizer_state_by_param(self, states: dict) -> None:
        _check_states(states, dict(zip(self.names, self.params)))
        for n, p, m, v in zip(self.names, self.params, self.exp_avg, self.exp_avg_sq):
            m.copy_(self._local_of(states[n]["exp_avg"].float(), p))
            v.copy_(self._local_of(states[n]["exp_avg_sq"].float(), p))
        self.refresh_master()

    @torch.no_grad()
    def refresh_master(self) -> None:
        for p, mst in zip(self.params, self.master):
            if mst is not None:
                mst.copy_(p.to_local())

    @torch.no_grad()
    def model_state_by_param(self) -> dict:
        """Full (over DP) parameters of this TP shard; all-gathers over DP (collective)."""
        return {n: p.full_tensor().clone() for n, p in zip(self.names, self.params)}

    @torch.no_grad()
    def load_model_state_by_param(self, tensors: dict) -> None:
        for n, p in zip(self.names, self.params):
            if n not in tensors or tuple(tensors[n].shape) != tuple(p.shape):
                raise UserError(f"parameter {n!r}: expected a tensor of shape {tuple(p.shape)}, got "
                                f"{'nothing' if n not in tensors else tuple(tensors[n].shape)}.")
            p.to_local().copy_(self._local_of(tensors[n].to(p.dtype), p))
        self.refresh_master()

    def memory_report(self) -> dict:
        """Bytes this rank holds across a step. Parameters: the local shards, plus (stage 2) the
        unsharded copy FSDP keeps from a unit's forward until its backward; gradients: shards;
        optimizer: Adam states of the shards (+ fp32 master for low-precision parameters)."""
        shard = sum(p.to_local().numel() * p.element_size() for p in self.params)
        full = sum(p.numel() * p.element_size() for p in self.params)
        grads = sum(p.to_local().numel() * p.element_size() for p in self.params)
        optim = sum(m.numel() * 8 for m in self.exp_avg) + sum(0 if m is None else m.numel() * 4
                                                                for m in self.master)
        return dict(param_bytes=shard + (full if self.stage == 2 else 0), grad_bytes=grads, optim_bytes=optim,
                    param_shard_bytes=shard, numel=sum(p.numel() for p in self.params),
                    owned_numel=sum(p.to_local().numel() for p in self.params))
