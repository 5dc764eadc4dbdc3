"""The options of one ``tnlg pretrain`` run: the components composed, and the checks across them."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

from ..config import GPTConfig
from ..errors import UserError
from .components import (COMPONENTS, AdapterOptions, CheckpointOptions, DataOptions, LoggingOptions, ModelOptions,
                         ParallelOptions, PrecisionOptions, ScheduleOptions)
from .fields import option_fields
from .context import check_context_parallel_options
from .experts import check_expert_options, check_expert_sharding
from ..layout import ParallelDims, World, check_expert_parallel_size
from .pipeline import check_pipeline, virtual_stages

__all__ = ["Options", "OPTION_NAMES", "MUST_MATCH", "option_defaults", "model_config"]

# every option's name -> the component that holds it
_OWNER = {f.name: attr for attr, cls, _ in COMPONENTS for f in option_fields(cls)}
OPTION_NAMES = tuple(_OWNER)
# the options marked must_match (tnlg.options.DataOptions): they define the samples, so a resumed run gives the
# checkpoint's (handed to tnlg.checkpoint as data: the checkpoint package does not import the options)
MUST_MATCH = tuple(f.name for _, cls, _ in COMPONENTS for f in option_fields(cls) if f.metadata["must_match"])


def option_defaults() -> dict:
    """Every option's default (``--preset`` and ``--config``: None)."""
    out: dict[str, Any] = dict(preset=None, config=None)
    for _, cls, _ in COMPONENTS:
        for f in option_fields(cls):
            factory = f.default_factory
            out[f.name] = factory() if f.default is dataclasses.MISSING and callable(factory) else f.default
    return out


@dataclass(slots=True)
class Options:
    """One run's options: a component each (``o.schedule.lr``, ``o.parallel.zero_stage``), plus ``preset``,
    ``config``, ``builtin_job`` (whether the built-in job's defaults applied) and ``checkpoint_args`` (what
    ``--use-checkpoint-args`` took). Slotted: an option set by its bare name (``o.lr = ...``) is refused,
    not kept beside the component that owns it. :meth:`flat` and :meth:`from_flat` give and take every
    option by name (what a checkpoint records, what the parser and config files hold)."""
    model: ModelOptions
    schedule: ScheduleOptions
    parallel: ParallelOptions
    data: DataOptions
    precision: PrecisionOptions
    logging: LoggingOptions
    checkpoint: CheckpointOptions
    adapters: AdapterOptions = dataclasses.field(default_factory=AdapterOptions)
    preset: Optional[str] = None
    config: Optional[str] = None
    builtin_job: bool = False
    checkpoint_args: Optional[dict] = None  # with --use-checkpoint-args: what was taken (options.recorded)

    @classmethod
    def from_flat(cls, values: dict, **extra) -> "Options":
        """Build (and so validate) every component from flat ``values``, in the order of :data:`COMPONENTS`
        with the run length first (the first error a user can make)."""
        parts = {}
        for attr, comp, _ in sorted(COMPONENTS, key=lambda c: c[0] != "schedule"):
            parts[attr] = comp(**{f.name: values[f.name] for f in option_fields(comp) if f.name in values})
        return cls(**parts, **extra)

    def flat(self) -> dict:
        """Every option by name (and ``preset``, ``config``, ``builtin_job``)."""
        out = dict(preset=self.preset, config=self.config, builtin_job=self.builtin_job)
        out.update({name: getattr(getattr(self, attr), name) for name, attr in _OWNER.items()})
        return out

    def check(self, world_size: Optional[int]) -> None:
        """The checks across components, the layout on ``world_size`` processes (when known), and the
        files the run will read."""
        par, prec = self.parallel, self.precision
        self.check_adapters()  # (first: LoRA with DeepSpeed is refused by name, installed or not)
        if par.zero_impl == "deepspeed":
            from ..optim.deepspeed_engine import check_deepspeed_options
            check_deepspeed_options(par.zero_stage, fp16=prec.fp16)  # installed, stage 1-3, no --fp16
        prec.check_device()
        if prec.accumulate_allreduce_grads_in_fp32 and par.zero_stage >= 2:
            raise UserError(f"--accumulate-allreduce-grads-in-fp32 is implemented for ZeRO stages 0 and 1, not "
                            f"for --zero-stage {par.zero_stage} (FSDP2 keeps gradients in the parameters' "
                            f"16-bit dtype). Drop the flag or use --zero-stage 1.")
        try:
            model_config(self, vocab_size=1).check_tensor_parallel(par.tensor_model_parallel_size)
        except ValueError as exc:
            raise UserError(str(exc)) from None
        check_context_parallel_options(self)
        check_expert_options(self)
        self.check_layout(world_size)
        self.data.check_files()
        self.checkpoint.check_load()
        self.logging.check_loggers()

    def check_adapters(self) -> None:
        """LoRA: fine-tuning only (``tnlg finetune``, or ``--finetune``), on the layouts built so far."""
        a, par = self.adapters, self.parallel
        if not a.enabled:
            return
        flag = "--lora-rank" if a.lora_rank is not None else "--load-adapter"
        if not self.checkpoint.finetune:
            raise UserError(f"{flag} trains adapters on a frozen pretrained model: that is tnlg finetune (or "
                            "tnlg pretrain --load DIR --finetune); a pretraining run trains every weight. Drop the "
                            "--lora-* flags or run tnlg finetune.")
        unbuilt = [(what, value) for what, value, on in (
            ("--zero-impl", par.zero_impl, par.zero_impl == "deepspeed"),
            ("--num-experts", self.model.num_experts, self.model.num_experts is not None)) if on]
        if unbuilt:
            named = ", ".join(f"{w} {v}".strip() for w, v in unbuilt)
            raise UserError(f"{flag} is not built yet with {named}: LoRA runs at any tensor-parallel (with or "
                            "without --sequence-parallel), context-parallel, pipeline-parallel and data-parallel size "
                            "with ZeRO 0-3, in fp32, bf16 or fp16 (a 16-bit frozen base), on dense models (adapters on "
                            "a mixture of experts' routed experts are not built). Drop "
                            f"{named} or the adapters.")
        # (the targets and the rank against the model: tnlg.interop.peft.check_adapter_options, by the command)

    def check_layout(self, world_size: Optional[int]) -> Optional[ParallelDims]:
        """The pipeline's layout and, on ``world_size`` processes (when known), the parallel sizes and the
        global batch against them: at resolve, and again once the processes joined (a layout resolve did not
        know). Returns the layout on ``world_size`` (``None`` when unknown)."""
        check_pipeline(self)
        if world_size is None:
            return None
        dims = self.dims(world_size)
        if self.parallel.expert_model_parallel_size > 1:  # (EP 1: no experts split, whatever the model)
            check_expert_parallel_size(self.parallel.expert_model_parallel_size, dims.dp, dims.cp,
                                       f" of {dims.describe()}")
            check_expert_sharding(self, dims.dp, dims.cp)
        micro, gbs = self.schedule.micro_batch_size, self.schedule.global_batch_size
        assert gbs is not None  # (the default, micro batch x DP, is set once the layout is known)
        if dims.pp > 1:
            dims.pipeline_micro_batches(gbs, micro, self.parallel.pipeline_schedule)
        else:
            dims.micro_batches(gbs, micro)
        return dims

    def dims(self, world_size: int) -> ParallelDims:
        """This run's layout on ``world_size`` processes: one message for a size that does not fit, listing
        the sizes that would (TP up to the head count, CP whose 2 x CP chunks divide the sequence)."""
        par, m = self.parallel, self.model
        return ParallelDims.of(World.processes(world_size), par.tensor_model_parallel_size,
                               par.pipeline_model_parallel_size, par.context_parallel_size,
                               vp=virtual_stages(par, m.num_layers), max_tp=m.num_attention_heads,
                               cp_fits=lambda c: m.seq_length % (2 * c) == 0)


def model_config(o: Options, vocab_size: int) -> GPTConfig:
    """The :class:`GPTConfig` that options ``o`` describe: the model's fields (every ``ModelOptions``
    field is one), and how it runs (sequence parallelism, recomputation, the seed)."""
    m, prec = o.model, o.precision
    fields = {f.name: getattr(m, f.name) for f in option_fields(type(m))}
    try:
        return GPTConfig(**fields, vocab_size=vocab_size, recompute_activations=bool(prec.recompute_activations),
                         recompute_granularity=prec.recompute_granularity,
                         sequence_parallel=bool(o.parallel.sequence_parallel), seed=o.data.seed)
    except ValueError as exc:
        raise UserError(str(exc)) from None
