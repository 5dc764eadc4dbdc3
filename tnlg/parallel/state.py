"""Parallel layout: which ranks form tensor-parallel (TP), data-parallel (DP) and pipeline (PP) groups.

Layout (Megatron's): world = PP x DP x TP with TP innermost, then DP, then PP:
``rank = pp_rank * (dp * tp) + dp_rank * tp + tp_rank``. TP ranks are contiguous, so
ranks ``0..tp-1`` form the first TP group, ``tp..2tp-1`` the second, and so on; the DP
group of a rank is every rank of its pipeline stage with the same TP rank
(``tp_rank, tp_rank + tp, ...`` at PP 1); the PP group is every rank with the same
``(dp_rank, tp_rank)`` (one per stage, ``dp * tp`` apart). With TP inside a node and DP
across nodes, TP traffic (two all-reduces per layer per pass) stays on the fast links.
The *embedding group* of a rank on the first or last stage is that pair of ranks of its
PP group (Megatron's): the tied word embedding's gradient is all-reduced over it.
At PP 1 every rank, group and size is what it was before pipelines existed.

Context parallelism (CP, :mod:`tnlg.parallel.context`) sits between TP and DP, as in megatron-core's
default order ``tp-cp-ep-dp-pp`` (``parallel_state.initialize_model_parallel``): world = TP x CP x DP x PP,
``rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank``.
The CP group is every rank with the same ``(pp_rank, dp_rank, tp_rank)`` (``tp`` apart); the DP group
then holds the ranks with the same ``(pp_rank, cp_rank, tp_rank)`` (they read different samples), and
the gradient reduction spans DP x CP (``dp_cp_group``, megatron-core's ``DATA_PARALLEL_GROUP_WITH_CP``:
every rank of a stage with the same TP rank): :meth:`ParallelState.for_gradients` is the state the
data-parallel engine takes. At CP 1 every rank, group and size is what it was before CP existed.

Expert parallelism (EP, :func:`init_expert_parallel`) is carved from DP x CP as megatron-core folds it: an EP
group is EP consecutive DP x CP ranks of one TP rank and stage (they hold different experts), the
expert-data-parallel group the ranks holding the same experts (``ps.group("ep")``, ``ps.group("edp")``; the
experts' gradients are reduced over the latter, ``for_gradients("expert")``). At EP 1 nothing changes.

There are no module globals: a :class:`ParallelState` object is passed to
every layer that communicates. A *virtual* state (no processes, no groups)
lets a model shard be built on the meta device for planning; building works,
communicating raises.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from ..errors import UserError, agreed
from ..layout import AXES, EXPERT_AXES, ParallelDims, World, check_expert_parallel_size

__all__ = ["ParallelState", "init_parallel", "init_expert_parallel", "expert_group_ranks", "EXPERT_AXES", "destroy_parallel", "pick_device", "is_distributed", "max_over_world",
           "agree_on_failure", "from_rank0", "GRADIENT_AXES"]

# the axis each kind of parameter's gradients are averaged (and ZeRO-partitioned) over: every dense parameter
# is replicated over DP x CP; an expert's parameters over the expert-data-parallel ranks (DP x CP / EP: the ranks
# that hold the same experts, megatron-core's "MoE parallel folding"; tnlg.parallel.experts)
GRADIENT_AXES = {"dense": "dp_cp", "expert": "edp"}



@dataclass
class ParallelState:
    """Ranks, sizes and process groups of one process in a (PP x DP x TP) layout.

    ``tp_group``/``dp_group``/``pp_group``/``embedding_group`` are ``None`` for a virtual state
    or where the group has a single member (collectives over one rank are skipped).
    """

    tp_rank: int = 0
    tp_size: int = 1
    dp_rank: int = 0
    dp_size: int = 1
    tp_group: Optional[dist.ProcessGroup] = None
    dp_group: Optional[dist.ProcessGroup] = None
    device: torch.device = torch.device("cpu")
    virtual: bool = False
    pp_rank: int = 0
    pp_size: int = 1
    pp_group: Optional[dist.ProcessGroup] = None
    embedding_group: Optional[dist.ProcessGroup] = None
    cp_rank: int = 0
    cp_size: int = 1
    cp_group: Optional[dist.ProcessGroup] = None
    dp_cp_group: Optional[dist.ProcessGroup] = None
    ep_size: int = 1
    ep_group: Optional[dist.ProcessGroup] = None
    edp_group: Optional[dist.ProcessGroup] = None

    def size(self, axis: str) -> int:
        """The size of the named axis (:data:`AXES`: ``"tp"``, ``"cp"``, ``"dp"``, ``"pp"``; or a gradient
        kind's reduction, :data:`GRADIENT_AXES`: ``"dp_cp"``)."""
        return self._axis(axis)[1]

    def rank_in(self, axis: str) -> int:
        """This process's rank along the named axis (see :meth:`size`)."""
        return self._axis(axis)[0]

    def group(self, axis: str) -> Optional[dist.ProcessGroup]:
        """The process group of the named axis (see :meth:`size`; also ``"embedding"``, the first and last
        pipeline stage), ``None`` where it has one member or the state is virtual."""
        if axis == "embedding":
            return self.embedding_group
        return self._axis(axis)[2]

    def _axis(self, axis: str) -> tuple[int, int, Optional[dist.ProcessGroup]]:
        if axis in AXES:
            return getattr(self, f"{axis}_rank"), getattr(self, f"{axis}_size"), getattr(self, f"{axis}_group")
        if axis == "dp_cp":  # DP x CP, CP inside (the rank order)
            group = self.dp_cp_group if self.cp_size > 1 else self.dp_group
            return self.dp_rank * self.cp_size + self.cp_rank, self.dp_size * self.cp_size, group
        if axis in EXPERT_AXES:  # carved from DP x CP, EP innermost
            rank, size = self.dp_rank * self.cp_size + self.cp_rank, self.dp_size * self.cp_size
            if axis == "ep":
                return rank % self.ep_size, self.ep_size, self.ep_group
            edp = self.edp_group if self.ep_size > 1 else self._axis("dp_cp")[2]
            return rank // self.ep_size, size // self.ep_size, edp
        raise ValueError(f"no parallel axis {axis!r}; valid: {', '.join(AXES)}, dp_cp, ep, edp, embedding.")

    @property
    def dims(self) -> ParallelDims:
        """The layout's sizes (:class:`~tnlg.layout.ParallelDims`)."""
        return ParallelDims(tp=self.tp_size, cp=self.cp_size, dp=self.dp_size, pp=self.pp_size)

    @property
    def rank(self) -> int:
        """Global rank in the TP-contiguous layout (TP innermost, then CP, then DP, then PP)."""
        return self.dims.rank(tp=self.tp_rank, cp=self.cp_rank, dp=self.dp_rank, pp=self.pp_rank)

    @property
    def world_size(self) -> int:
        return self.dims.world

    def for_gradients(self, kind: str = "dense") -> "ParallelState":
        """The state the data-parallel engine reduces the gradients of ``kind`` parameters over
        (:data:`GRADIENT_AXES`), as its "DP": dense parameters over DP x CP (every CP rank holds the same
        weights and a part of each sequence, so gradients are averaged over both, and ZeRO partitions over
        both, as megatron-core's distributed optimizer does); ``self`` at CP 1. Expert parameters (``"expert"``)
        over the expert-data-parallel ranks (DP x CP / EP), which hold the same experts."""
        if kind not in GRADIENT_AXES:
            raise ValueError(f"no gradient reduction for parameters of kind {kind!r}; valid: "
                             f"{', '.join(GRADIENT_AXES)}.")
        axis = GRADIENT_AXES[kind]
        if self.size(axis) == self.dp_size and (kind == "dense" or self.ep_size == 1):
            return self
        return dataclasses.replace(self, dp_rank=self.rank_in(axis), dp_size=self.size(axis),
                                   dp_group=self.group(axis), cp_rank=0, cp_size=1, cp_group=None, dp_cp_group=None)

    @property
    def tp_src_rank(self) -> int:
        """Global rank of TP rank 0 in this rank's TP group."""
        return self.rank - self.tp_rank

    @property
    def is_first_stage(self) -> bool:
        """This rank holds the first pipeline stage (the embedding); always true at PP 1."""
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        """This rank holds the last pipeline stage (final LayerNorm, LM head, loss); always true at PP 1."""
        return self.pp_rank == self.pp_size - 1

    @property
    def is_first(self) -> bool:
        """True on the one rank that should print or write shared files."""
        return self.rank == 0

    @classmethod
    def single(cls, device: torch.device | str = "cpu") -> "ParallelState":
        """One process, no parallelism (TP = DP = 1)."""
        return cls(device=torch.device(device))

    @classmethod
    def for_virtual_rank(cls, tp_size: int, tp_rank: int = 0, dp_size: int = 1,
                         dp_rank: int = 0) -> "ParallelState":
        """A state for a rank that does not exist: build shards on meta to plan memory.

        >>> with torch.device("meta"):
        ...     shard = GPT(GPTConfig.preset("tnlg-17b"), ParallelState.for_virtual_rank(4, 2))
        """
        _check_rank("tp_size", tp_size, "tp_rank", tp_rank)
        _check_rank("dp_size", dp_size, "dp_rank", dp_rank)
        return cls(tp_rank=tp_rank, tp_size=tp_size, dp_rank=dp_rank, dp_size=dp_size,
                   device=torch.device("meta"), virtual=True)

    def describe(self) -> str:
        pp = f"pp {self.pp_rank}/{self.pp_size}, " if self.pp_size > 1 else ""
        pp += f"cp {self.cp_rank}/{self.cp_size}, " if self.cp_size > 1 else ""
        return (f"rank {self.rank}/{self.world_size}: {pp}tp {self.tp_rank}/{self.tp_size}, "
                f"dp {self.dp_rank}/{self.dp_size}, device {self.device}")


def _check_rank(size_name: str, size: int, rank_name: str, rank: int) -> None:
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"{size_name} must be a positive integer, got {size!r}.")
    if not isinstance(rank, int) or not 0 <= rank < size:
        raise ValueError(f"{rank_name} must be in [0, {size - 1}] for {size_name}={size}, got {rank!r}.")


def pick_device(choice: Optional[str] = None) -> torch.device:
    """The device type to train on: ``cuda`` when a GPU is present, else ``cpu``; ``choice``
    (``"cpu"``/``"cuda"``, e.g. ``--device``) overrides. ``cuda`` without a GPU is a clear error."""
    if choice in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if choice not in ("cpu", "cuda"):
        raise UserError(f"--device {choice!r} is not supported; valid: cpu, cuda (default: cuda when a GPU is "
                        f"present, else cpu).")
    if choice == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: no CUDA GPU is visible to this process (torch.cuda.is_available() is "
                        "False; check CUDA_VISIBLE_DEVICES and that the CUDA build of torch is installed). "
                        "Use --device cpu, or leave --device out to pick what is present.")
    return torch.device(choice)


def _device_for_backend(backend: str) -> torch.device:
    """NCCL -> the CUDA device of LOCAL_RANK; anything else -> CPU. Nothing hard-coded."""
    if backend == "nccl":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def _check_layout(world_size: int, tensor_parallel_size: int, pipeline_parallel_size: int = 1,
                  context_parallel_size: int = 1) -> ParallelDims:
    """The layout of these sizes on ``world_size`` processes (:meth:`ParallelDims.of`: one message naming the
    size that does not fit and the valid ones; a :class:`UserError`, so a ``ValueError``)."""
    return ParallelDims.of(World(world_size, f"the world size {world_size}", keyword=True), tensor_parallel_size,
                           pipeline_parallel_size, context_parallel_size)


def init_parallel(tensor_parallel_size: int = 1, backend: Optional[str] = None,
                  timeout: timedelta = timedelta(minutes=10),
                  init_method: Optional[str] = None, device: Optional[str] = None,
                  pipeline_parallel_size: int = 1, context_parallel_size: int = 1) -> ParallelState:
    """Create the TP, CP, DP and PP groups and return this process's :class:`ParallelState`.

    Works in three situations:

    * a default process group already exists (tests, notebooks): it is used as is;
    * under ``torchrun`` (``RANK``/``WORLD_SIZE`` in the environment): the default
      group is initialised from the environment (or ``init_method``); under tnlg's own
      launcher, from the loopback store it serves (``TNLG_STORE``, :func:`tnlg.runtime.launch.loopback_store`);
    * a plain single process with no launcher: world of one, no process group.

    ``device`` (``"cpu"``/``"cuda"``, default: CUDA when available, see :func:`pick_device`)
    picks the backend when none is given: NCCL for CUDA, gloo for CPU; one process (no
    launcher, or ``torchrun`` with one process) trains on ``cuda:LOCAL_RANK`` when the device
    is CUDA. The ``timeout`` bounds every collective, so a hung peer fails instead of stalling.
    Every rank must call this (``new_group`` is collective).
    """
    if dist.is_available() and dist.is_initialized():
        world, rank = dist.get_world_size(), dist.get_rank()
        backend = dist.get_backend()
    elif "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1 or init_method:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        _check_layout(world, tensor_parallel_size, pipeline_parallel_size, context_parallel_size)
        backend = backend or ("nccl" if pick_device(device).type == "cuda" else "gloo")
        store = None if init_method else _launcher_store(timeout)
        if store is not None:
            dist.init_process_group(backend=backend, store=store, rank=int(os.environ["RANK"]),
                                    world_size=world, timeout=timeout)
        else:
            dist.init_process_group(backend=backend, init_method=init_method or "env://", timeout=timeout)
        world, rank = dist.get_world_size(), dist.get_rank()
    else:
        _check_layout(1, tensor_parallel_size, pipeline_parallel_size, context_parallel_size)
        backend = backend or ("nccl" if pick_device(device).type == "cuda" else "gloo")
        return ParallelState(device=_device_for_backend(backend))

    dims = _check_layout(world, tensor_parallel_size, pipeline_parallel_size, context_parallel_size)
    groups = _new_groups(rank, dims.tp, dims.dp, dims.pp, timeout, dims.cp)
    return ParallelState(tp_size=dims.tp, dp_size=dims.dp, pp_size=dims.pp, cp_size=dims.cp,
                         **dims.coordinates(rank), **groups, device=_device_for_backend(backend))


def _new_groups(rank: int, tp: int, dp: int, pp: int, timeout: timedelta, cp: int = 1) -> dict:
    """This rank's TP, DP, PP, embedding, CP and DP x CP groups (``None`` where a group would have one member).

    ``new_group`` is collective: every rank creates every group, in the same order (at PP 1 and CP 1 the
    same calls as before pipelines and CP existed)."""
    mine: dict = dict(tp_group=None, dp_group=None, pp_group=None, embedding_group=None, cp_group=None,
                      dp_cp_group=None)
    for key, size, all_ranks in group_ranks(tp, dp, pp, cp):
        for ranks in all_ranks:
            g = dist.new_group(ranks, timeout=timeout) if size > 1 else None
            if rank in ranks:
                mine[key] = g
    return mine


def group_ranks(tp: int, dp: int, pp: int, cp: int = 1) -> list[tuple[str, int, list[list[int]]]]:
    """``(group name, size, every group's ranks)`` in creation order (``new_group`` is called in this order)."""
    dims = ParallelDims(tp=tp, cp=cp, dp=dp, pp=pp)

    def at(p, d, t, c=0):
        return dims.rank(tp=t, cp=c, dp=d, pp=p)
    every = [(p, d, c) for p in range(pp) for d in range(dp) for c in range(cp)]
    layouts = [("tp_group", tp, [[at(p, d, t, c) for t in range(tp)] for p, d, c in every]),
               ("dp_group", dp, [[at(p, d, t, c) for d in range(dp)] for p in range(pp) for c in range(cp)
                                 for t in range(tp)]),
               ("pp_group", pp, [[at(p, d, t, c) for p in range(pp)] for d in range(dp) for c in range(cp)
                                 for t in range(tp)]),
               ("embedding_group", pp, [[at(0, d, t, c), at(pp - 1, d, t, c)] for d in range(dp) for c in range(cp)
                                        for t in range(tp)])]
    if cp > 1:
        layouts += [("cp_group", cp, [[at(p, d, t, c) for c in range(cp)] for p in range(pp) for d in range(dp)
                                      for t in range(tp)]),
                    ("dp_cp_group", dp * cp, [[at(p, d, t, c) for d in range(dp) for c in range(cp)]
                                              for p in range(pp) for t in range(tp)])]
    return layouts


def expert_group_ranks(tp: int, cp: int, dp: int, pp: int, ep: int) -> list[tuple[str, int, list[list[int]]]]:
    """``(group name, size, every group's ranks)`` of the expert axes (:data:`EXPERT_AXES`) in creation order:
    per pipeline stage and TP rank, the DP x CP ranks (CP inside) cut into EP groups of ``ep`` consecutive ones,
    and the expert-DP groups of the ranks with the same EP rank."""
    dims = ParallelDims(tp=tp, cp=cp, dp=dp, pp=pp)
    n = dp * cp
    eps, edps = [], []
    for p in range(pp):
        for t in range(tp):
            ranks = [dims.rank(tp=t, cp=i % cp, dp=i // cp, pp=p) for i in range(n)]
            eps += [ranks[g * ep:(g + 1) * ep] for g in range(n // ep)]
            edps += [ranks[e::ep] for e in range(ep)]
    return [("ep_group", ep, eps), ("edp_group", n // ep, edps)]


def init_expert_parallel(ps: ParallelState, expert_parallel_size: int,
                         timeout: timedelta = timedelta(minutes=10)) -> ParallelState:
    """``ps`` with the expert-parallel and expert-data-parallel groups of ``expert_parallel_size`` (EP
    carved from DP x CP, :func:`expert_group_ranks`). Collective over the world (``new_group``) when EP > 1
    or expert-DP > 1; one :class:`UserError` when EP does not divide DP x CP."""
    ep = expert_parallel_size
    check_expert_parallel_size(ep, ps.dp_size, ps.cp_size)
    if ep == 1:
        return dataclasses.replace(ps, ep_size=1, ep_group=None, edp_group=None)
    mine: dict = dict(ep_group=None, edp_group=None)
    if not ps.virtual:
        for key, size, all_ranks in expert_group_ranks(ps.tp_size, ps.cp_size, ps.dp_size, ps.pp_size, ep):
            for ranks in all_ranks:
                g = dist.new_group(ranks, timeout=timeout) if size > 1 else None
                if ps.rank in ranks:
                    mine[key] = g
    return dataclasses.replace(ps, ep_size=ep, **mine)


def _launcher_store(timeout: timedelta):
    """The store of tnlg's own launcher (``TNLG_STORE``, served on loopback by the launching process), under
    a prefix of this attempt of the group; ``None`` elsewhere (torchrun: ``env://``)."""
    endpoint = os.environ.get("TNLG_STORE")
    if not endpoint:
        return None
    host, port = endpoint.rsplit(":", 1)
    store = dist.TCPStore(host, int(port), is_master=False, timeout=timeout)
    return dist.PrefixStore(f"tnlg/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/", store)


def is_distributed() -> bool:
    """Whether this process is one of several in an initialised default process group."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def max_over_world(value: float, device: torch.device) -> float:
    """The largest ``value`` of all processes (one MAX all-reduce of a number on ``device`` over the
    world; no communication in a single process): how ranks agree on a failure or a signal."""
    t = torch.tensor([float(value)], device=device)
    if is_distributed():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def from_rank0(obj):
    """Rank 0's ``obj`` on every rank (one ``broadcast_object_list`` over the world; none in one process):
    how the ranks act on one decision instead of each making its own."""
    if not is_distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def agree_on_failure(error: Optional[BaseException], what: str) -> None:
    """Raise the same :class:`UserError` on every rank when ``error`` is set on any (``None``: this rank
    succeeded); one ``all_gather_object`` of each rank's message over the world (none in a single process).

    The message names the failing ranks and what each said (one line per distinct message), so the
    user sees which rank's file was bad whichever rank prints it; it is marked agreed (rank 0 prints
    it, once). ``what`` is what failed ("loading the checkpoint")."""
    text = None if error is None else str(error)
    if is_distributed():
        texts: list = [None] * dist.get_world_size()
        dist.all_gather_object(texts, text)
    else:
        texts = [text]
    failed = [(r, t) for r, t in enumerate(texts) if t is not None]
    if not failed:
        return
    if len(texts) == 1:
        raise agreed(error if isinstance(error, UserError) else UserError(text))
    by_text: dict[str, list[int]] = {}
    for r, t in failed:
        by_text.setdefault(t, []).append(r)
    if len(by_text) == 1 and len(failed) == len(texts):  # the same on every rank: the message says it all
        raise agreed(UserError(failed[0][1]))
    lines = [f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: {t}" for t, rs in by_text.items()]
    raise agreed(UserError(f"{what} failed on {len(failed)} of {len(texts)} ranks; " + " ".join(lines)))


def destroy_parallel() -> None:
    """Tear down the default process group (and with it the TP/DP groups), if any."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
