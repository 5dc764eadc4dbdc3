"""Where this rank's pipeline stages are in their schedule: what a hang report and an error say at PP > 1.

torch's schedules run a stage's actions themselves (post the receives, forward, send, backward), so
tnlg cannot note them from outside; :class:`RecordedStage` is torch's ``PipelineStage`` noting, in
this process's :class:`StageProgress`, each receive it posts (the activations of micro batch ``k``
from the previous stage, or their gradient from the next) and each forward and backward as it
starts (which uses up the receive it needed). At a hang the receives posted and not yet used are
what the rank waits for, and the action started last is where its schedule stood (micro batches
are counted from 0 within the step, as torch's schedules count them).

:meth:`StageProgress.place` names the rank's ``(pp, dp, tp)`` coordinates and the layers of its
stages; each rank writes it once to the rendezvous store when its pipeline is built (one
``set``), so that rank 0 can name a rank that hangs and never answers (:func:`place_of`, read by
:mod:`tnlg.runtime.hang` and :mod:`tnlg.runtime.failures`). Nothing else is communicated: the record costs a
few dictionary operations per micro batch.
"""

from __future__ import annotations

import os
from typing import Optional

from torch.distributed.pipelining import PipelineStage

__all__ = ["StageProgress", "RecordedStage", "current", "place_of"]

_KINDS = {"forward": "the activations", "backward": "the gradient"}  # what a receive before each brings
_current: list = [None]  # this process's StageProgress (the pipeline built last)


def _tag() -> str:
    return f"tnlg/pipeline/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def _layers(r: range) -> str:
    return f"layer {r.start}" if len(r) == 1 else f"layers {r.start}-{r.stop - 1}"


class StageProgress:
    """One rank's stages (index -> layers), its receives posted and not yet used, the action started last."""

    def __init__(self, model):
        ps = model.ps
        self.model, self.ps, self.rank = model, ps, ps.rank
        self.coords = (ps.pp_rank, ps.dp_rank, ps.tp_rank)
        self.stages: dict[int, range] = {}
        self.num_stages = ps.pp_size
        self.pending: dict[tuple[int, int, str], None] = {}  # (stage, micro batch, "forward"/"backward"), in order
        self.last: Optional[tuple[int, int, str]] = None

    def add_stage(self, index: int, num_stages: int, layers: range) -> None:
        self.stages[index], self.num_stages = layers, num_stages
        try:  # the place, for rank 0 to name this rank should it hang (the store outlives a stopped rank)
            from torch.distributed.distributed_c10d import _get_default_store
            _get_default_store().set(f"{_tag()}/place/{self.rank}", self.place())
        except Exception:  # noqa: BLE001 - no store (a virtual state): the report names the coordinates only
            pass

    def stage_rank(self, stage: int) -> int:
        """The global rank of pipeline stage ``stage`` in this rank's pipeline group."""
        return self.rank + (stage % self.ps.pp_size - self.ps.pp_rank) * self.ps.dp_size * self.ps.tp_size

    def place(self) -> str:
        """``pp 1, dp 0, tp 0: pipeline stage 1 of 2, layers 2-3`` (several stages when interleaved)."""
        p, d, t = self.coords
        if len(self.stages) == 1:
            (stage, layers), = self.stages.items()
            return f"pp {p}, dp {d}, tp {t}: pipeline stage {stage} of {self.num_stages}, {_layers(layers)}"
        stages = ", ".join(f"{s} ({_layers(r)})" for s, r in sorted(self.stages.items()))
        return f"pp {p}, dp {d}, tp {t}: pipeline stages {stages} of {self.num_stages}"

    def expect(self, stage: int, micro_batch: int, kind: str) -> None:
        self.pending[(stage, micro_batch, kind)] = None

    def start(self, stage: int, micro_batch: int, kind: str) -> None:
        self.pending.pop((stage, micro_batch, kind), None)
        self.last = (stage, micro_batch, kind)

    def _receive(self, stage: int, micro_batch: int, kind: str) -> str:
        peer = stage - 1 if kind == "forward" else stage + 1
        return (f"{_KINDS[kind]} of micro batch {micro_batch} from stage {peer} (rank {self.stage_rank(peer)})"
                + (f" for stage {stage}" if len(self.stages) > 1 else ""))

    def state(self) -> str:
        """What the rank waits for and which action it started last, e.g. ``waits for the gradient of micro
        batch 1 from stage 1 (rank 1) (started last: the forward of micro batch 2)``."""
        waits = [self._receive(*key) for key in self.pending]
        text = "has no receive pending" if not waits else f"waits for {' or '.join(waits)}"
        if self.last is None:
            return text + " (started: nothing yet)"
        stage, mb, kind = self.last
        return text + f" (started last: the {kind} of micro batch {mb}" \
                      f"{f' on stage {stage}' if len(self.stages) > 1 else ''})"

    def words(self) -> str:
        """``rank R (<place>) <state>``: what this rank says of itself at a hang."""
        return f"rank {self.rank} ({self.place()}) {self.state()}"


class RecordedStage(PipelineStage):
    """torch's ``PipelineStage`` over a :class:`~tnlg.model.stage.PipelineChunk`, noting its receives
    and actions in this process's :class:`StageProgress` (the same arguments as ``PipelineStage``)."""

    def __init__(self, submodule, stage_index: int, num_stages: int, device, **kwargs):
        super().__init__(submodule, stage_index, num_stages, device, **kwargs)
        model = submodule.stage
        if _current[0] is None or _current[0].model is not model:
            _current[0] = StageProgress(model)
        self.progress = _current[0]
        self.progress.add_stage(stage_index, num_stages, submodule.layers)

    def get_fwd_recv_ops(self, fwd_chunk_id: int):
        ops = super().get_fwd_recv_ops(fwd_chunk_id)
        if ops:
            self.progress.expect(self.stage_index, fwd_chunk_id, "forward")
        return ops

    def get_bwd_recv_ops(self, bwd_chunk_id: int):
        ops = super().get_bwd_recv_ops(bwd_chunk_id)
        if ops:
            self.progress.expect(self.stage_index, bwd_chunk_id, "backward")
        return ops

    def forward_one_chunk(self, fwd_chunk_id: int, *args, **kwargs):
        self.progress.start(self.stage_index, fwd_chunk_id, "forward")
        return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

    def backward_one_chunk(self, bwd_chunk_id: int, *args, **kwargs):
        self.progress.start(self.stage_index, bwd_chunk_id, "backward")
        return super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)


def current() -> Optional[StageProgress]:
    """This process's record (``None``: it built no pipeline)."""
    return _current[0]


def place_of(rank: int, store=None) -> Optional[str]:
    """Rank ``rank``'s place (:meth:`StageProgress.place`): this process's own, or what that rank wrote to
    ``store`` (default: the rendezvous store) when it built its pipeline; ``None``: unknown, or this
    process built no pipeline (then none of its job's ranks did)."""
    mine = _current[0]
    if mine is None or mine.rank == rank:
        return None if mine is None else mine.place()
    if store is None:
        from torch.distributed.distributed_c10d import _get_default_store
        store = _get_default_store()
    key = f"{_tag()}/place/{rank}"
    return store.get(key).decode() if store.check([key]) else None
