"""The checks of ``--pipeline-model-parallel-size`` and its companions, before any process does work.

Torch-free (``tnlg pretrain --help`` and option checks import this): the layer split is checked
with the same arithmetic :mod:`tnlg.parallel.pipeline` uses. The stages against the processes, and the
micro batches against the stages, are the layout's (:class:`tnlg.layout.ParallelDims`).
"""

from __future__ import annotations

from ..config import divisors, stage_layer_counts
from ..errors import UserError

__all__ = ["check_pipeline", "check_stage_count", "interleaved_chunks", "virtual_stages", "UNSUPPORTED"]

# what --pp > 1 does not run with yet: (is it set in the run's Options?, what to write)
UNSUPPORTED = (
    (lambda o: o.parallel.zero_impl == "deepspeed", lambda o: "--zero-impl deepspeed (DeepSpeed pipelines with its "
     "own engine, which tnlg does not drive; tnlg's pipeline runs with --zero-impl tnlg)"),
)


def virtual_stages(par, num_layers: int) -> int:
    """Model chunks per pipeline rank of the layout ``par`` (:class:`~tnlg.options.ParallelOptions`) for a
    model of ``num_layers`` (1 unless interleaved)."""
    n, pp = par.num_layers_per_virtual_pipeline_stage, par.pipeline_model_parallel_size
    return 1 if par.pipeline_schedule != "interleaved" or n is None else num_layers // (pp * n)


def check_pipeline(o) -> None:
    """A clear :class:`UserError` for a pipeline of options ``o`` (:class:`~tnlg.options.Options`) that
    cannot run: its flags without stages, what it does not run with, its layer split."""
    par = o.parallel
    pp = par.pipeline_model_parallel_size
    extras = [flag for flag, set_ in (("--pipeline-schedule " + par.pipeline_schedule,
                                       par.pipeline_schedule != "1f1b"),
                                      ("--decoder-first-pipeline-num-layers", par.decoder_first_pipeline_num_layers),
                                      ("--decoder-last-pipeline-num-layers", par.decoder_last_pipeline_num_layers))
              if set_]
    if pp == 1:
        if extras:
            raise UserError(f"{extras[0]} needs --pipeline-model-parallel-size > 1 (a pipeline); this run has "
                            f"one stage. Give --pp P, or drop the flag.")
        return
    bad = [what(o) for is_set, what in UNSUPPORTED if is_set(o)]
    if bad:
        raise UserError(f"{', '.join(bad)} is not supported with --pipeline-model-parallel-size > 1 yet (--pp "
                        f"{pp}). Pipelines train fp32, bf16 or fp16 with ZeRO 0-3, TP (sequence parallelism too), "
                        f"DP and recomputation, with checkpoints, validation and the final sample "
                        f"(docs/pipeline.md); drop those options or use --pp 1.")
    _check_layers(par, o.model.num_layers)


def interleaved_chunks(n: int, pp: int, layers: int) -> int:
    """Model chunks per pipeline rank of the interleaved schedule, ``layers / (pp x n)`` for ``n`` layers
    per chunk; one message when ``n`` does not divide the layers per stage (``tnlg plan``'s check too)."""
    if layers % pp or (layers // pp) % n:
        valid = divisors(layers // pp) if layers % pp == 0 else []
        raise UserError(f"--num-layers-per-virtual-pipeline-stage {n} does not divide the {layers / pp:g} layers per "
                        f"stage ({layers} layers / --pp {pp}); valid: "
                        f"{valid or f'none: the interleaved schedule needs --pp dividing {layers}'}.")
    return layers // (pp * n)


def check_stage_count(pp: int, layers: int) -> None:
    """Every stage needs a layer (also ``tnlg eval``/``generate``'s check against a checkpoint's layers)."""
    if pp > layers:
        raise UserError(f"--pipeline-model-parallel-size {pp} is more stages than the model's {layers} layers; "
                        f"every stage needs at least one layer: valid sizes are 1 to {layers}.")


def _check_layers(par, layers: int) -> None:
    pp, n = par.pipeline_model_parallel_size, par.num_layers_per_virtual_pipeline_stage
    check_stage_count(pp, layers)
    if par.pipeline_schedule == "interleaved":
        if n is None:
            raise UserError("--pipeline-schedule interleaved needs --num-layers-per-virtual-pipeline-stage N "
                            "(the layers of each model chunk).")
        if par.decoder_first_pipeline_num_layers or par.decoder_last_pipeline_num_layers:
            raise UserError("--decoder-first/last-pipeline-num-layers is not supported with the interleaved "
                            "schedule yet (its chunks are equal); drop it or use --pipeline-schedule 1f1b.")
        interleaved_chunks(n, pp, layers)
    elif n is not None:
        raise UserError(f"--num-layers-per-virtual-pipeline-stage runs the interleaved schedule, not "
                        f"--pipeline-schedule {par.pipeline_schedule}; drop one of them.")
    if par.pipeline_schedule != "interleaved":
        stage_layer_counts(layers, pp, par.decoder_first_pipeline_num_layers, par.decoder_last_pipeline_num_layers)
