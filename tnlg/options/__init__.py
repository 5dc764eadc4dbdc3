"""Typed options of ``tnlg pretrain``: a dataclass per component (:mod:`.components`) composed into
:class:`Options` (:mod:`.run`); flags, help, config-file keys and resume checks are derived from the
fields (:mod:`.fields`). Torch-free: the ``--help`` path imports it."""

from .components import (COMPONENTS, DEFAULT_NPROC, CheckpointOptions, DataOptions, LoggingOptions, ModelOptions,
                         ParallelOptions, PrecisionOptions, ScheduleOptions)
from .run import MUST_MATCH, OPTION_NAMES, Options, model_config, option_defaults

__all__ = ["Options", "ModelOptions", "ScheduleOptions", "ParallelOptions", "DataOptions", "PrecisionOptions",
           "LoggingOptions", "CheckpointOptions", "COMPONENTS", "OPTION_NAMES", "MUST_MATCH", "DEFAULT_NPROC", "option_defaults",
           "model_config"]
