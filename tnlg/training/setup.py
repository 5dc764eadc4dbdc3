"""What a training run is built from: the process groups, the model inside its data-parallel engine, the
learning-rate schedule and the datasets."""

from __future__ import annotations

from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from ..config import GPTConfig
from ..data.gpt_dataset import build_train_valid_test_datasets
from ..errors import UserError
from ..runtime.launch import join
from ..model import GPT
from ..optim import DynamicLossScaler, LRSchedule
from ..optim import build_engine as build_tnlg_engine
from ..options import Options
from ..options.pipeline import check_pipeline, virtual_stages
from ..parallel.pipeline import StageModel, chunk_layers
from ..parallel.pipeline_schedule import Pipeline
from ..parallel.state import ParallelState

__all__ = ["init_run", "precision", "build_engine", "build_pipeline", "build_schedule", "build_datasets"]


def init_run(o: Options) -> tuple[ParallelState, int]:
    """Join the process groups (threads: this machine's cores shared among its ranks) and settle the global
    batch; return ``(ps, accumulation steps)``."""
    ps = join(o.tensor_model_parallel_size, timeout=timedelta(minutes=o.distributed_timeout_minutes), device=o.device,
              pipeline_parallel_size=o.pipeline_model_parallel_size)
    if o.global_batch_size is None:  # Megatron's default, when resolve did not know the layout
        o.global_batch_size = o.micro_batch_size * ps.dp_size
    if o.global_batch_size % (o.micro_batch_size * ps.dp_size):
        raise UserError(f"--global-batch-size {o.global_batch_size} is not divisible by --micro-batch-size "
                        f"{o.micro_batch_size} x data-parallel size {ps.dp_size}.")
    check_pipeline(o, ps.world_size)  # the micro batches per step against the stages, now that DP is known
    return ps, o.global_batch_size // (o.micro_batch_size * ps.dp_size)


def precision(o: Options) -> Optional[torch.dtype]:
    """The autocast dtype of ``--bf16`` / ``--fp16`` (``None``: fp32)."""
    return torch.bfloat16 if o.bf16 else (torch.float16 if o.fp16 else None)


def build_engine(o: Options, cfg: GPTConfig, ps: ParallelState, accum: int):
    """The model inside its data-parallel engine (ours: FlatZero or FSDP2; or DeepSpeed's)."""
    autocast = precision(o)
    scaler = DynamicLossScaler() if o.fp16 else None
    if o.zero_impl == "deepspeed":  # optional engine: DeepSpeed's ZeRO over our TP/DP groups (fp32 params)
        from ..optim.deepspeed_engine import build_deepspeed_engine as build
        model, extra = GPT(cfg, ps), dict(micro_batch_size=o.micro_batch_size)
    else:
        # built on the meta device and materialised by the engine straight into its (16-bit, for
        # --bf16/--fp16) flat buffers: no transient copy of the model at start-up
        build, model = build_tnlg_engine, (GPT(cfg, ps, device="meta") if ps.pp_size == 1 else
                                           StageModel(cfg, ps, stage_chunks(o, ps), device="meta"))
        extra = dict(param_dtype=autocast, accumulate_grads_in_fp32=o.accumulate_allreduce_grads_in_fp32)
    return build(model, ps, o.zero_stage, lr=o.lr, weight_decay=o.weight_decay, betas=(o.adam_beta1, o.adam_beta2),
                 eps=o.adam_eps, clip_grad=o.clip_grad, grad_accum_steps=accum, bucket_size_mb=o.bucket_size_mb,
                 loss_scaler=scaler, **extra)


def stage_chunks(o: Options, ps: ParallelState) -> list[range]:
    """The layers of this pipeline rank's model chunks (one, or ``v`` for the interleaved schedule)."""
    chunks = chunk_layers(o.num_layers, ps.pp_size, virtual_stages(o), o.decoder_first_pipeline_num_layers,
                          o.decoder_last_pipeline_num_layers)
    return [r for c, r in enumerate(chunks) if c % ps.pp_size == ps.pp_rank]


def build_pipeline(o: Options, model, ps: ParallelState, accum: int) -> Optional[Pipeline]:
    """The pipeline schedule of ``accum`` micro batches over the engine's stage model; ``None`` at PP 1."""
    return Pipeline(model, accum, o.pipeline_schedule) if ps.pp_size > 1 else None


def build_schedule(o: Options) -> LRSchedule:
    """Megatron's learning-rate schedule over the count of optimizer steps taken."""
    return LRSchedule(max_lr=o.lr, min_lr=o.min_lr, warmup_iters=o.lr_warmup_iters,
                      decay_iters=o.lr_decay_iters or o.train_iters, decay_style=o.lr_decay_style)


def build_datasets(o: Options, cfg: GPTConfig, tokenizer) -> tuple:
    """``(train, valid)``: Megatron's blended datasets of ``--data-path`` (rank 0 builds missing index
    files; the others wait at a barrier)."""
    gbs = o.global_batch_size
    evals = (o.train_iters // o.eval_interval + 1) * o.eval_iters * gbs if o.eval_interval else 0
    barrier = (lambda: dist.barrier()) if dist.is_initialized() else None
    train_ds, valid_ds, _test_ds = build_train_valid_test_datasets(
        o.data_path, o.split, cfg.seq_length, (o.train_iters * gbs, evals, o.eval_iters * gbs), o.seed,
        cache_dir=o.data_cache_path, eod_id=tokenizer.eod_id, eod_mask_loss=o.eod_mask_loss,
        reset_position_ids=o.reset_position_ids, reset_attention_mask=o.reset_attention_mask,
        vocab_size=tokenizer.vocab_size, barrier=barrier)
    if train_ds is None:
        raise UserError(f"--split {o.split!r} leaves no documents for training.")
    return train_ds, valid_ds
