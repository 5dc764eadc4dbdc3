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


@dataclass
class Options:
    """One run's options: a component each, plus ``preset``, ``config``, ``builtin_job`` (whether the
    built-in job's defaults applied) and ``checkpoint_args`` (what ``--use-checkpoint-args`` took). Every
    option also reads and writes as a flat attribute (``o.lr`` is ``o.schedule.lr``): code that takes the
    whole run's options needs no map of components."""
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

    def __getattr__(self, name):  # only for names that are not attributes of their own: the options
        owner = _OWNER.get(name)
        if owner is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(getattr(self, owner), name)

    def __setattr__(self, name, value):
        owner = _OWNER.get(name)
        if owner is not None and owner in self.__dict__:
            setattr(self.__dict__[owner], name, value)
        else:
            object.__setattr__(self, name, value)

    def check(self, world_size: Optional[int]) -> None:
        """The checks across components, the layout on ``world_size`` processes (when known), and the
        files the run will read."""
        if self.zero_impl == "deepspeed":
            from ..optim.deepspeed_engine import check_deepspeed_options
            check_deepspeed_options(self.zero_stage, fp16=self.fp16)  # installed, stage 1-3, no --fp16
        self.precision.check_device()
        if self.accumulate_allreduce_grads_in_fp32 and self.zero_stage >= 2:
            raise UserError(f"--accumulate-allreduce-grads-in-fp32 is implemented for ZeRO stages 0 and 1, not "
                            f"for --zero-stage {self.zero_stage} (FSDP2 keeps gradients in the parameters' "
                            f"16-bit dtype). Drop the flag or use --zero-stage 1.")
        try:
            model_config(self, vocab_size=1).check_tensor_parallel(self.tensor_model_parallel_size)
        except ValueError as exc:
            raise UserError(str(exc)) from None
        check_pipeline(self, world_size)
        if world_size is not None:
            self._check_layout(world_size)
        self.data.check_files()
        self.checkpoint.check_load()
        self.logging.check_loggers()

    def _check_layout(self, world_size: int) -> None:
        tp, micro, gbs = self.tensor_model_parallel_size, self.micro_batch_size, self.global_batch_size
        if world_size % tp:
            valid = divisors(world_size)
            raise UserError(f"--tensor-model-parallel-size {tp} does not divide the {world_size} processes; "
                            f"valid sizes for {world_size} processes: {valid}.")
        dp = world_size // (tp * self.pipeline_model_parallel_size)  # (check_pipeline: PP divides the rest)
        if gbs % (micro * dp):
            raise UserError(
                f"--global-batch-size {gbs} is not divisible by --micro-batch-size {micro} x data-parallel size "
                f"{dp} (= {micro * dp}); the global batch is micro batch x DP x accumulation steps. Try "
                f"--global-batch-size {max(1, gbs // (micro * dp)) * micro * dp}.")


def model_config(o, vocab_size: int) -> GPTConfig:
    """The :class:`GPTConfig` that options ``o`` (:class:`Options`, or any object with its attributes) describe."""
    try:
        return GPTConfig(num_layers=o.num_layers, hidden_size=o.hidden_size,
                         num_attention_heads=o.num_attention_heads, seq_length=o.seq_length,
                         vocab_size=vocab_size, ffn_hidden_size=o.ffn_hidden_size,
                         hidden_dropout=o.hidden_dropout, attention_dropout=o.attention_dropout,
                         init_method_std=o.init_method_std, openai_gelu=bool(o.openai_gelu),
                         untie_embeddings_and_output_weights=bool(o.untie_embeddings_and_output_weights),
                         recompute_activations=bool(o.recompute_activations),
                         recompute_granularity=o.recompute_granularity,
                         sequence_parallel=bool(o.sequence_parallel), seed=o.seed)
    except ValueError as exc:
        raise UserError(str(exc)) from None
