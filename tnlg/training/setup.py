"""What a training run is built from: the process groups, the model inside its data-parallel engine, the
pipeline schedule and the datasets (the learning-rate schedule: :meth:`tnlg.options.ScheduleOptions.lr_schedule`)."""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
import torch.distributed as dist

from ..config import GPTConfig
from ..data.gpt_dataset import build_train_valid_test_datasets
from ..errors import UserError
from ..model import GPT
from ..optim import DynamicLossScaler
from ..optim import build_engine as build_tnlg_engine
from ..options import Options, ParallelOptions, PrecisionOptions
from ..options.pipeline import virtual_stages
from ..model.stage import StageModel
from ..parallel.pipeline import chunk_layers
from ..parallel.state import ParallelState, init_expert_parallel
from ..runtime.launch import join

if TYPE_CHECKING:  # torch's pipelining imports torch._dynamo (1.3 CPU-s): loaded only by a pipeline's run
    from ..parallel.pipeline_schedule import Pipeline

__all__ = ["init_run", "precision", "build_engine", "build_pipeline", "build_datasets", "packing_line"]


def init_run(o: Options) -> tuple[ParallelState, int]:
    """Join the process groups (threads: this machine's cores shared among its ranks) and settle the global
    batch; return ``(ps, accumulation steps)``."""
    par, sch = o.parallel, o.schedule
    ps = join(par.tensor_model_parallel_size, timeout=timedelta(minutes=par.distributed_timeout_minutes),
              device=o.precision.device, pipeline_parallel_size=par.pipeline_model_parallel_size,
              context_parallel_size=par.context_parallel_size)
    ps = init_expert_parallel(ps, par.expert_model_parallel_size)  # (EP 1: ps as it was)
    if sch.global_batch_size is None:  # Megatron's default, when resolve did not know the layout
        sch.global_batch_size = sch.micro_batch_size * ps.dp_size
    dims = o.check_layout(ps.world_size)  # the global batch and the stages' micro batches, now that DP is known
    assert dims is not None and dims.dp == ps.dp_size  # (the groups were made from the same sizes)
    return ps, dims.micro_batches(sch.global_batch_size, sch.micro_batch_size)


def precision(p: PrecisionOptions) -> Optional[torch.dtype]:
    """The autocast dtype of ``--bf16`` / ``--fp16`` (``None``: fp32)."""
    return torch.bfloat16 if p.bf16 else (torch.float16 if p.fp16 else None)


def build_engine(o: Options, cfg: GPTConfig, ps: ParallelState, accum: int):
    """The model inside its data-parallel engine (ours: FlatZero or FSDP2; or DeepSpeed's), with AdamW of
    ``o.schedule``, ZeRO of ``o.parallel`` and the dtypes of ``o.precision``."""
    sch, par, prec = o.schedule, o.parallel, o.precision
    autocast = precision(prec)
    scaler = DynamicLossScaler() if prec.fp16 else None
    build: Callable[..., Any]
    model: torch.nn.Module
    extra: dict[str, Any]
    if o.adapters.enabled:  # a frozen base read from --load, the adapters alone in the engine
        from .adapters import adapted_model
        build, (model, _) = build_tnlg_engine, adapted_model(o, cfg, ps, stage_chunks(par, cfg, ps))
        extra = dict(param_dtype=autocast)
    elif par.zero_impl == "deepspeed":  # optional engine: DeepSpeed's ZeRO over our TP/DP groups (fp32 params)
        from ..optim.deepspeed_engine import build_deepspeed_engine as build
        model, extra = GPT(cfg, ps), dict(micro_batch_size=sch.micro_batch_size)
    else:
        # built on the meta device and materialised by the engine straight into its (16-bit, for
        # --bf16/--fp16) flat buffers: no transient copy of the model at start-up
        build, model = build_tnlg_engine, (GPT(cfg, ps, device="meta") if ps.pp_size == 1 else
                                           StageModel(cfg, ps, stage_chunks(par, cfg, ps), device="meta"))
        extra = dict(param_dtype=autocast, accumulate_grads_in_fp32=prec.accumulate_allreduce_grads_in_fp32)
    # the gradients are reduced (and ZeRO partitions) over DP x CP: ps.for_gradients() (ps itself at CP 1)
    return build(model, ps.for_gradients(), par.zero_stage, lr=sch.lr, weight_decay=sch.weight_decay,
                 betas=(sch.adam_beta1, sch.adam_beta2), eps=sch.adam_eps, clip_grad=sch.clip_grad,
                 grad_accum_steps=accum, bucket_size_mb=par.bucket_size_mb, loss_scaler=scaler, **extra)


def stage_chunks(par: ParallelOptions, cfg: GPTConfig, ps: ParallelState) -> list[range]:
    """The layers of this pipeline rank's model chunks (one, or ``v`` for the interleaved schedule)."""
    chunks = chunk_layers(cfg.num_layers, ps.pp_size, virtual_stages(par, cfg.num_layers),
                          par.decoder_first_pipeline_num_layers, par.decoder_last_pipeline_num_layers)
    return [r for c, r in enumerate(chunks) if c % ps.pp_size == ps.pp_rank]


def build_pipeline(par: ParallelOptions, model, ps: ParallelState, accum: int) -> Optional[Pipeline]:
    """The pipeline schedule of ``accum`` micro batches over the engine's stage model; ``None`` at PP 1."""
    if ps.pp_size == 1:
        return None
    from ..parallel.pipeline_schedule import Pipeline
    return Pipeline(model, accum, par.pipeline_schedule)


def build_datasets(o: Options, cfg: GPTConfig, tokenizer) -> tuple:
    """``(train, valid)``: Megatron's blended datasets of ``--data-path`` (rank 0 builds missing index
    files; the others wait at a barrier), sized for the run's batches and validations."""
    d, gbs, iters, log = o.data, o.schedule.global_batch_size, o.schedule.train_iters, o.logging
    assert gbs is not None and iters is not None  # (init_run; required)
    # --eval-iters unset: the whole validation split once (a count of 0 builds one pass)
    per_eval = 0 if log.eval_iters is None else log.eval_iters * gbs
    evals = (iters // log.eval_interval + 1) * per_eval if log.eval_interval else 0
    barrier = (lambda: dist.barrier()) if dist.is_initialized() else None
    if d.sft_data_path is not None:  # (its validation set: one pass, the most a validation reads)
        return _sft_datasets(o, cfg, tokenizer, iters * gbs, 0, barrier)
    assert d.data_path is not None  # (pretrain)
    train_ds, valid_ds, _test_ds = build_train_valid_test_datasets(
        d.data_path, d.split, cfg.seq_length, (iters * gbs, evals, per_eval), d.seed,
        cache_dir=d.data_cache_path, eod_id=tokenizer.eod_id, eod_mask_loss=d.eod_mask_loss,
        reset_position_ids=d.reset_position_ids, reset_attention_mask=d.reset_attention_mask,
        vocab_size=tokenizer.vocab_size, barrier=barrier)
    if train_ds is None:
        raise UserError(f"--split {d.split!r} leaves no documents for training.")
    return train_ds, valid_ds


def _sft_datasets(o: Options, cfg: GPTConfig, tokenizer, train_samples: int, valid_samples: int, barrier) -> tuple:
    """``(train, valid)`` of fine-tuning rows (:mod:`tnlg.data.sft`); rank 0 says how the samples were packed."""
    from ..data.sft import build_sft_datasets
    d = o.data
    assert d.sft_data_path is not None
    train_ds, valid_ds, report = build_sft_datasets(
        d.sft_data_path, d.sft_valid_data_path, tokenizer, cfg.seq_length, train_samples=train_samples,
        valid_samples=valid_samples, seed=d.seed, packing=d.packing, loss_on_prompt=d.sft_loss_on_prompt,
        cache_dir=d.data_cache_path, barrier=barrier)
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(packing_line(report), flush=True)
    return train_ds, valid_ds


def packing_line(report) -> str:
    """What rank 0 says of the fine-tuning rows (:class:`tnlg.data.sft.SFTReport`): how they were packed and,
    where rows had ``messages``, which chat template rendered them ("no chat template": prompt/completion
    rows only)."""
    used = list(dict.fromkeys(r.template for r in (report, report.valid) if r is not None and r.template))
    return report.line() + ("; conversations rendered with " + " and ".join(used) if used else
                            "; no chat template (prompt/completion rows)")
