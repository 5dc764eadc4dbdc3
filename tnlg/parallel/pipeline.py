"""Pipeline stages of the GPT: which layers each stage holds.

The split (Megatron's, :func:`tnlg.config.stage_layer_counts`): the ``L`` transformer layers go over ``P`` stages as evenly as possible,
larger stages first (78 layers over 4 stages: 20, 20, 19, 19); ``first``/``last``
(``--decoder-first-pipeline-num-layers`` / ``--decoder-last-pipeline-num-layers``) fix the layers
of the stages that also hold the embedding and the LM head, the rest go evenly over the others.
With ``v`` virtual stages per rank (interleaved 1F1B, ``--num-layers-per-virtual-pipeline-stage
n``: ``v = L / (P n)``) the model is cut into ``P v`` chunks of ``n`` layers; chunk ``c`` runs on
pipeline rank ``c % P`` (Megatron's order: rank 0 holds chunks 0, P, 2P, ...).

The module of one rank's stages, built from the GPT's own pieces, is
:class:`tnlg.model.stage.StageModel`; torch's schedules run it (:mod:`.pipeline_schedule`).
"""

from __future__ import annotations

from typing import Optional

from ..config import stage_layer_counts

__all__ = ["chunk_layers"]


def chunk_layers(num_layers: int, stages: int, virtual: int = 1, first: Optional[int] = None,
                 last: Optional[int] = None) -> list[range]:
    """The global layer indices of every model chunk, in pipeline order (``stages * virtual`` chunks)."""
    if virtual == 1:
        counts = stage_layer_counts(num_layers, stages, first, last)
    else:  # interleaved: equal chunks (checked by the options)
        counts = [num_layers // (stages * virtual)] * (stages * virtual)
    starts = [sum(counts[:c]) for c in range(len(counts))]
    return [range(a, a + n) for a, n in zip(starts, counts)]
