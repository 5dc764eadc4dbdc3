"""The options of one ``tnlg pretrain`` run: the components composed, and the checks across them."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from ..config import GPTConfig, divisors
from ..errors import UserError
from .components import (COMPONENTS, CheckpointOptions, DataOptions, LoggingOptions, ModelOptions,
                         ParallelOptions, PrecisionOptions, ScheduleOptions)
from .fields import option_fields
from .context import check_context_parallel_options
from .pipeline import check_pipeline

__all__ = ["Options", "OPTION_NAMES", "option_defaults", "model_config"]

# every option's name -> the component that holds it
_OWNER = {f.name: attr for attr, cls, _ in COMPONENTS for f in option_fields(cls)}
OPTION_NAMES = tuple(_OWNER)


def option_defaults() -> dict:
    """Every option's default (``--preset`` and ``--config``: None)."""
    out = dict(preset=None, config=None)
    for _, cls, _ in COMPONENTS:
        for f in option_fields(cls):
            out[f.name] = f.default_factory() if f.default is dataclasses.MISSING else f.default
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
        self.check_layout(world_size)
        self.data.check_files()
        self.checkpoint.check_load()
        self.logging.check_loggers()

    def check_layout(self, world_size: Optional[int]) -> None:
        """The pipeline's layout and, on ``world_size`` processes (when known), TP, PP and the global batch
        against them: at resolve, and again once the processes joined (a layout resolve did not know)."""
        check_pipeline(self, world_size)
        if world_size is None:
            return
        tp, pp = self.parallel.tensor_model_parallel_size, self.parallel.pipeline_model_parallel_size
        micro, gbs = self.schedule.micro_batch_size, self.schedule.global_batch_size
        if world_size % tp:
            valid = divisors(world_size)
            raise UserError(f"--tensor-model-parallel-size {tp} does not divide the {world_size} processes; "
                            f"valid sizes for {world_size} processes: {valid}.")
        cp = self.parallel.context_parallel_size
        if (world_size // tp) % (pp * cp):
            raise UserError(f"--context-parallel-size {cp} x --pipeline-model-parallel-size {pp} does not divide "
                            f"the {world_size} processes / --tensor-model-parallel-size {tp} = {world_size // tp}: "
                            f"the world is TP x CP x DP x PP. Valid CP sizes here: {divisors(world_size // (tp * pp))}.")
        dp = world_size // (tp * pp * cp)  # (check_pipeline: PP divides the rest)
        if gbs % (micro * dp):
            raise UserError(
                f"--global-batch-size {gbs} is not divisible by --micro-batch-size {micro} x data-parallel size "
                f"{dp} (= {micro * dp}); the global batch is micro batch x DP x accumulation steps. Try "
                f"--global-batch-size {max(1, gbs // (micro * dp)) * micro * dp}.")


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
