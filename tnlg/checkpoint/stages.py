"""Pipeline stages in a checkpoint: which stage stores each parameter, and what a save records of them.

At PP > 1 each pipeline rank holds a :class:`tnlg.model.stage.StageModel`, a subset of the
GPT's parameters under the GPT's names; with tied embeddings the last stage also holds a copy of
``transformer.wte.weight`` (marked ``pipeline_duplicate``), equal to the first stage's by
construction (their gradients are all-reduced before every step). A save stores every parameter
once: each stage its own, the tied copy not at all (:func:`stored_names`). ``meta.json`` then
gains, at PP > 1 only (a PP 1 manifest is what it was before pipelines existed):

* ``params[name]["pp_rank"]``: the stage whose ``model_ppYY_tpXX`` / ``optim_ppYY_tpXX_dpZZZ``
  files hold the parameter (:func:`assign_stages`);
* ``pipeline``: ``pp`` (the stage count) and ``stages``, per pipeline rank the global layer
  indices of its model chunks (one chunk, or ``v`` with the interleaved schedule);
* ``layout["pp"]`` and ``rng["pp"]``.

A load finds each of its parameters by name, so any stage split reads any other; the last stage's
tied copy reads the first stage's stored tensor and Adam moments, so the copies are equal again.
"""

from __future__ import annotations

from typing import Optional

from ..errors import UserError
from .manifest import Manifest, Pipeline, need

__all__ = ["chunk_layers_of", "stored_names", "stage_record", "assign_stages", "saved_stage", "describe_stages"]


def chunk_layers_of(model, num_layers: int) -> list[list[int]]:
    """The global layer indices of each of this rank's model chunks (a GPT: one chunk of every layer)."""
    chunks = getattr(model, "chunk_ranges", None)
    return [list(range(num_layers))] if chunks is None else [list(r) for r in chunks]


def stored_names(model, engine_names: list[str], records: dict) -> list[str]:
    """The parameters this rank's stage stores: the engine's, without a pipeline duplicate (the last
    stage's tied word embedding). Every one must be a parameter of the GPT (``records``)."""
    duplicates = {n for n, p in model.named_parameters() if getattr(p, "pipeline_duplicate", False)}
    unknown = sorted(set(engine_names) - set(records))
    if unknown:
        raise RuntimeError(f"engine parameters {unknown[:4]} are not parameters of the model's partition "
                           f"records; cannot save.")
    return [n for n in engine_names if n not in duplicates]


def stage_record(pp_rank: int, pp_size: int, chunks: list[list[int]], names: list[str]) -> Optional[dict]:
    """What one rank tells rank 0 of its stage at a save (``None`` at PP 1)."""
    return None if pp_size == 1 else dict(pp_rank=pp_rank, chunks=chunks, names=names)


def assign_stages(records: dict, gathered: list[Optional[dict]]) -> tuple[dict, Optional[Pipeline]]:
    """Rank 0, from every rank's :func:`stage_record`: the ``params`` records with each parameter's
    ``pp_rank``, and the ``pipeline`` section (``None`` at PP 1, and the records unchanged). A parameter
    no stage stores, or two stages store, is a :class:`UserError` (the save is abandoned)."""
    stages = [g for g in gathered if g is not None]
    if not stages:
        return records, None
    pp = 1 + max(g["pp_rank"] for g in stages)
    owner: dict[str, int] = {}
    chunks: list = [None] * pp
    for g in stages:
        chunks[g["pp_rank"]] = g["chunks"]
        for n in g["names"]:
            if owner.setdefault(n, g["pp_rank"]) != g["pp_rank"]:
                raise UserError(f"parameter {n!r} is stored by pipeline stages {owner[n]} and {g['pp_rank']}; "
                                f"the checkpoint cannot be written.")
    missing = sorted(set(records) - set(owner))
    if missing:
        raise UserError(f"no pipeline stage holds the parameters {missing[:4]}; the checkpoint cannot be written.")
    params = {n: dict(r, pp_rank=owner[n]) for n, r in records.items()}
    return params, Pipeline(pp=pp, stages=chunks)


def saved_stage(manifest: Manifest, pp_rank: int) -> tuple[int, list]:
    """``(stage count, layer chunks of stage pp_rank)`` of the checkpoint (a PP 1 checkpoint: one stage of
    every layer); ``[]`` for a stage it does not have."""
    pipe = manifest.pipeline
    if not pipe:
        return 1, [list(range(int(need(manifest.config, "config")["num_layers"])))] if pp_rank == 0 else []
    stages = need(pipe.stages, "pipeline.stages")
    return int(need(pipe.pp, "pipeline.pp")), (stages[pp_rank] if pp_rank < len(stages) else [])


def describe_stages(manifest: Manifest) -> str:
    """``PP=2: stage 0 layers 0-1 (+ embedding), stage 1 layers 2-3 (+ LM head)`` (``tnlg checkpoint info``)."""
    pipe = manifest.pipeline
    if not pipe:
        return "PP=1"
    stages = need(pipe.stages, "pipeline.stages")
    last = len(stages) - 1

    def span(layers: list[int]) -> str:
        return f"{layers[0]}-{layers[-1]}" if len(layers) > 1 else f"{layers[0]}"

    parts = []
    for r, chunks in enumerate(stages):
        ends = [what for what, yes in (("embedding", r == 0), ("LM head", r == last)) if yes]
        parts.append(f"stage {r} layers {', '.join(span(c) for c in chunks)}"
                     + (f" (+ {' and '.join(ends)})" if ends else ""))
    return f"PP={pipe.pp}: " + "; ".join(parts)
