"""Optimisation: ZeRO data parallelism over the DP group (stages 0-3), AdamW, global-norm
clipping across TP and DP, Megatron's LR schedule, and the fp16 loss scaler.

The engine in layers (docs/zero.md): ``layout`` (shapes only) -> ``bucket_comm`` and
``grad_buffer`` (gradients, bucket hooks, their DP collectives) -> ``sharded_adamw``
(torch's functional AdamW on owned slices) -> the backends ``zero.FlatZero`` (stages 0/1),
``fsdp.FSDPZero`` (2/3) and ``deepspeed_engine.DeepSpeedBackend`` (optional), each a
``backend.DataParallelBackend`` -> ``engine.Engine``, what the training loop drives."""

from .backend import DataParallelBackend
from .clip import clip_coefficient, clip_grad_norm_, global_norm
from .engine import Engine, build_engine
from .scaler import DynamicLossScaler
from .schedule import DECAY_STYLES, LRSchedule
from .zero import FlatLayout, partition_report, plan_flat_layout

__all__ = ["Engine", "build_engine", "DataParallelBackend", "LRSchedule", "DECAY_STYLES", "DynamicLossScaler",
           "clip_grad_norm_", "clip_coefficient", "global_norm", "plan_flat_layout", "partition_report",
           "FlatLayout"]
