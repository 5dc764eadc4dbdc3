"""What DeepSpeed is handed, in its own terms: our process groups as Megatron's ``mpu``
(:class:`TnlgMPU`, :func:`real_groups`), and our GPT as the loop sees it behind DeepSpeed's
engine (:class:`DeepSpeedModel`). Imports no DeepSpeed: the engine module does, on demand.

Collectives: :func:`real_groups` creates one-rank process groups (``new_group``, collective
over the world) where the parallel state has none; nothing else communicates.
"""

from __future__ import annotations

import torch.distributed as dist
import torch.nn as nn

from ..parallel.state import ParallelState

__all__ = ["TnlgMPU", "real_groups", "DeepSpeedModel"]


class TnlgMPU:
    """Megatron's ``mpu`` interface over a :class:`ParallelState`, for ``deepspeed.initialize(mpu=...)``.

    ``tp_group``/``dp_group`` must be real process groups (a group of one rank
    included); no pipeline parallelism (size 1). The methods are listed in :data:`_MPU_METHODS`.
    """

    def __init__(self, ps: ParallelState, tp_group, dp_group):
        self.ps, self.tp_group, self.dp_group = ps, tp_group, dp_group


# Megatron's mpu method -> what it returns. Tensor parallelism under its old ("model parallel")
# and new ("tensor model parallel") names; data parallelism; no pipeline parallelism.
_MPU_METHODS = {}
for _prefix in ("get_model_parallel", "get_tensor_model_parallel"):
    _MPU_METHODS.update({f"{_prefix}_group": lambda m: m.tp_group,
                         f"{_prefix}_world_size": lambda m: m.ps.tp_size,
                         f"{_prefix}_rank": lambda m: m.ps.tp_rank,
                         f"{_prefix}_src_rank": lambda m: m.ps.tp_src_rank})
_MPU_METHODS.update(get_data_parallel_group=lambda m: m.dp_group,
                    get_data_parallel_world_size=lambda m: m.ps.dp_size,
                    get_data_parallel_rank=lambda m: m.ps.dp_rank,
                    get_pipeline_model_parallel_world_size=lambda m: 1,
                    get_pipeline_model_parallel_rank=lambda m: 0)
for _name, _method in _MPU_METHODS.items():
    setattr(TnlgMPU, _name, _method)


def real_groups(ps: ParallelState):
    """(tp_group, dp_group) as process groups, creating one-rank groups where ``ps`` has ``None``.

    Collective over the world when a size is 1 (``new_group`` runs on every rank
    for every rank's singleton, in the same order). A single process without a
    process group gets a world of one (gloo, in-memory store) first.
    """
    if not dist.is_initialized():
        if ps.world_size != 1:
            raise RuntimeError("the DeepSpeed engine needs torch.distributed initialised for "
                               f"{ps.world_size} processes (init_parallel does it).")
        dist.init_process_group("gloo" if ps.device.type == "cpu" else "nccl", store=dist.HashStore(),
                                rank=0, world_size=1)
    tp_group, dp_group = ps.tp_group, ps.dp_group
    if tp_group is None or dp_group is None:
        rank, singleton = dist.get_rank(), None
        for r in range(dist.get_world_size()):
            g = dist.new_group([r])
            if r == rank:
                singleton = g
        tp_group = tp_group or singleton
        dp_group = dp_group or singleton
    return tp_group, dp_group


class DeepSpeedModel(nn.Module):
    """Our GPT as the training loop sees it, called through DeepSpeed's engine.

    DeepSpeed's ``forward`` arms the backward hooks its ZeRO optimizer needs, so
    calls go through it; everything else is the GPT's own: attributes
    (``config``, ``ps``, ``tp_random``; DeepSpeed's engine has a ``config`` of
    its own, hence this wrapper), parameters under the same names, and
    ``train``/``eval``.
    """

    def __init__(self, ds_engine):
        super().__init__()
        self.__dict__["_ds"] = ds_engine  # not a registered submodule: parameter names keep no prefix
        self.training = ds_engine.module.training

    @property
    def module(self) -> nn.Module:
        return self._ds.module

    def forward(self, *args, **kwargs):
        return self._ds(*args, **kwargs)

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["_ds"].module, name)

    def train(self, mode: bool = True) -> "DeepSpeedModel":
        self._ds.train(mode)
        self.training = mode
        return self

    def named_parameters(self, *args, **kwargs):
        return self.module.named_parameters(*args, **kwargs)

    def parameters(self, recurse: bool = True):
        return self.module.parameters(recurse)

    def named_buffers(self, *args, **kwargs):
        return self.module.named_buffers(*args, **kwargs)

    def buffers(self, recurse: bool = True):
        return self.module.buffers(recurse)

    def named_modules(self, *args, **kwargs):
        return self.module.named_modules(*args, **kwargs)

    def modules(self):  # type: ignore[override]  # (the wrapped module's, as every other walk here)
        return self.module.modules()

    def children(self):
        return self.module.children()

    def named_children(self):
        return self.module.named_children()

    def state_dict(self, *args, **kwargs):
        return self.module.state_dict(*args, **kwargs)
