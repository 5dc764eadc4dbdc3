"""Sharding metadata: how a tensor-parallel parameter maps to the full, unsplit tensor.

Every parameter of a TP model carries the attributes named in :data:`TP_ATTRS`:

* ``tp_sharded``: ``True`` when split over the TP group (``False`` = replicated);
* ``partition_dim``: the split dimension;
* ``partition_sizes``: every rank's size along it (may be uneven, or padded);
* ``full_size``: the real (unpadded) size of that dimension;
* ``partition_offsets``: where every rank's slice starts along it, set only where slices may overlap
  (key/value groups that several TP ranks hold, :func:`tnlg.config.group_ranges`): such a *shared*
  slice is replicated on the ranks that hold it (its gradient is summed over exactly them by the
  layer), and the gradient norm counts its rows once, on the lowest rank holding them
  (:func:`counted_rows`);
* ``expert_split``: a mixture of experts' expert parameter, ``(ep_rank, ep_size)``: its dim 0 (the experts)
  holds this expert-parallel rank's ``1 / ep_size`` of them, consecutive (:mod:`tnlg.parallel.experts`).
  :func:`full_shape`, :func:`shard_of` and :func:`gather_full` (so the full state dict) include the EP split;
  a :class:`ShardSpec` describes the TP split and says whether dim 0 holds the experts (``experts``), which
  checkpoints split over the EP ranks of a run (:mod:`tnlg.checkpoint.reshard`).

Layers set them (:func:`mark_sharded`, :func:`mark_replicated`); initialisation,
checkpoints, resharding, the data-parallel engines and the planner read them through
the helpers here, so there is one definition of a split. The marks are plain attributes of the tensor (so they
travel with it, and :func:`copy_tp_attributes` moves them onto a re-created parameter); torch's stubs do not
declare them, so the helpers here read each through one typed accessor (``_sharded``, ``_dim``, ``_sizes``,
``_full_size``, ``_offsets``), and :meth:`ShardSpec.of` reads them all into a frozen spec. A parameter may carry
``tp_sharded`` alone (the gradient norm needs no more); a reader that needs a mark it lacks raises
``AttributeError``.

A *full state dict* maps every parameter name to the tensor TP=1 would hold, without
vocabulary padding. It does not depend on the TP size, so it is the exchange format
for Hugging Face conversion and checkpoint resharding (:func:`full_state_dict`,
:func:`load_full_state_dict`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from ..errors import UserError
from .mappings import all_gather_uneven
from .state import ParallelState

__all__ = ["TP_ATTRS", "ShardSpec", "mark_replicated", "mark_sharded", "is_tp_sharded", "copy_tp_attributes",
           "full_shape", "shard_of", "counted_rows", "uncounted_elements", "gather_full", "full_state_dict", "load_full_state_dict"]

TP_ATTRS = ("tp_sharded", "partition_dim", "partition_sizes", "full_size", "partition_offsets", "expert_split")
"""The attributes that describe a parameter's split (the module docstring explains each)."""


@dataclass(frozen=True)
class ShardSpec:
    """How one parameter is split over TP, for every TP rank at once.

    ``shape``: the full (unsplit, unpadded) shape; ``dim``: the split dimension (``None``:
    replicated); ``sizes``: every rank's size along ``dim`` (their sum may exceed
    ``shape[dim]`` by padding, e.g. vocabulary rows); ``offsets``: where each rank's slice starts,
    given only for slices that may overlap (default: back to back); ``experts``: dim 0 holds a mixture of
    experts' routed experts (``shape[0]`` all of them), which expert parallelism splits over its EP ranks.
    """

    shape: tuple[int, ...]
    dim: Optional[int] = None
    sizes: tuple[int, ...] = ()
    offsets: tuple[int, ...] = ()
    experts: bool = False

    def start(self, tp_rank: int) -> int:
        """Where TP rank ``tp_rank``'s slice starts along ``dim``."""
        return self.offsets[tp_rank] if self.offsets else sum(self.sizes[:tp_rank])

    @property
    def sharded(self) -> bool:
        return self.dim is not None

    def local_shape(self, tp_rank: int) -> tuple[int, ...]:
        """The shape of TP rank ``tp_rank``'s shard."""
        shape = list(self.shape)
        if self.dim is not None:
            shape[self.dim] = self.sizes[tp_rank]
        return tuple(shape)

    def mark(self, param: nn.Parameter) -> nn.Parameter:
        """Set ``param``'s sharding attributes (:data:`TP_ATTRS`) from this spec."""
        if self.dim is None:
            return mark_replicated(param)
        return mark_sharded(param, self.dim, self.sizes, self.shape[self.dim], self.offsets)

    def parameter(self, tp_rank: int, device=None, dtype=None) -> nn.Parameter:
        """A new (uninitialised) parameter of TP rank ``tp_rank``'s shape, marked with this spec."""
        return self.mark(nn.Parameter(torch.empty(self.local_shape(tp_rank), device=device, dtype=dtype)))

    @classmethod
    def of(cls, param: torch.Tensor) -> "ShardSpec":
        """The spec a marked parameter carries."""
        experts = hasattr(param, "expert_split")
        if not _sharded(param):
            return cls(full_shape(param), experts=experts)
        return cls(full_shape(param), _dim(param), _sizes(param), _offsets(param), experts)

    def record(self, tp_rank: int) -> dict:
        """The JSON record checkpoints keep (``shape``, ``local``, ``sharded``; for a split parameter
        ``dim``, ``sizes`` and ``full_size``; ``experts`` for a mixture of experts' routed experts)."""
        rec = dict(shape=list(self.shape), local=list(self.local_shape(tp_rank)), sharded=self.sharded)
        if self.dim is not None:
            rec.update(dim=self.dim, sizes=list(self.sizes), full_size=self.shape[self.dim])
            if self.offsets:
                rec["offsets"] = list(self.offsets)
        if self.experts:
            rec["experts"] = True
        return rec


def _mark(param: torch.Tensor, key: str) -> Any:
    return getattr(param, key)


def _sharded(param: torch.Tensor) -> bool:
    """The ``tp_sharded`` mark (``False`` when absent)."""
    return bool(getattr(param, "tp_sharded", False))


def _dim(param: torch.Tensor) -> int:
    return int(_mark(param, "partition_dim"))


def _sizes(param: torch.Tensor) -> tuple[int, ...]:
    return tuple(int(s) for s in _mark(param, "partition_sizes"))


def _full_size(param: torch.Tensor) -> int:
    return int(_mark(param, "full_size"))


def _offsets(param: torch.Tensor) -> tuple[int, ...]:
    """The ``partition_offsets`` mark (``()`` when absent: slices back to back)."""
    return tuple(int(o) for o in getattr(param, "partition_offsets", ()) or ())


def _set_marks(param: nn.Parameter, **marks: object) -> nn.Parameter:
    for key, value in marks.items():
        setattr(param, key, value)
    return param


def mark_replicated(param: nn.Parameter) -> nn.Parameter:
    """Mark ``param`` as replicated over the TP group (every rank holds the full tensor)."""
    return _set_marks(param, tp_sharded=False)


def mark_sharded(param: nn.Parameter, dim: int, sizes: Sequence[int], full_size: int,
                 offsets: Sequence[int] = ()) -> nn.Parameter:
    """Mark ``param`` as this rank's shard along ``dim``; ``sizes``: every rank's size along it
    (their sum may exceed ``full_size`` by padding); ``offsets``: where each slice starts, for slices
    that may overlap (default: back to back)."""
    return _set_marks(param, tp_sharded=True, partition_dim=dim, partition_sizes=tuple(sizes), full_size=full_size,
                      partition_offsets=tuple(offsets))


def _starts(param: torch.Tensor) -> list[int]:
    offsets, sizes = _offsets(param), _sizes(param)
    return list(offsets) if offsets else [sum(sizes[:r]) for r in range(len(sizes))]


def uncounted_elements(param: torch.Tensor, tp_rank: int) -> int:
    """How many leading elements of TP rank ``tp_rank``'s flattened slice the gradient norm leaves out
    (rows a lower rank holds too, :func:`counted_rows`; split along dim 0 only); 0 for every other parameter."""
    if not _offsets(param):
        return 0
    if _dim(param) != 0:
        raise ValueError("a shared (overlapping) slice must be split along dim 0.")
    lo, _ = counted_rows(param, tp_rank)
    return lo * (param.numel() // max(1, int(param.shape[0])))


def counted_rows(param: torch.Tensor, tp_rank: int) -> tuple[int, int]:
    """The part ``[lo, hi)`` along ``partition_dim`` of TP rank ``tp_rank``'s slice that it counts in the
    gradient norm: all of it, but for a shared slice (``partition_offsets``) only what no lower rank holds."""
    size = _sizes(param)[tp_rank] if _sharded(param) else 0
    if not _offsets(param):
        return 0, size
    starts, sizes = _starts(param), _sizes(param)
    below = max((starts[r] + sizes[r] for r in range(tp_rank)), default=0)
    return min(size, max(0, below - starts[tp_rank])), size


def is_tp_sharded(name: str, param: torch.Tensor, ps: ParallelState) -> bool:
    """Whether ``param`` is split over TP. A parameter without the mark is an error when TP > 1
    (the gradient norm and checkpoints would count it wrongly) and replicated at TP 1."""
    flag = getattr(param, "tp_sharded", None)
    if flag is None:
        if ps.tp_size > 1:
            raise UserError(
                f"parameter {name!r} has no 'tp_sharded' attribute; with tensor parallelism every parameter "
                f"must say whether it is split over TP ranks (True) or replicated (False), so the gradient "
                f"norm counts it correctly. Mark it with tnlg.parallel.sharding.mark_sharded/mark_replicated.")
        return False
    return bool(flag)


def copy_tp_attributes(src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """Copy the sharding attributes ``src`` has onto ``dst`` (e.g. a parameter re-created by a wrapper)."""
    for key in TP_ATTRS:
        if hasattr(src, key):
            setattr(dst, key, getattr(src, key))
    return dst


def _expert_split(param: torch.Tensor) -> tuple[int, int]:
    """The ``expert_split`` mark, ``(ep_rank, ep_size)`` (``(0, 1)``: not split over EP)."""
    rank, size = getattr(param, "expert_split", (0, 1))
    return int(rank), int(size)


def full_shape(param: torch.Tensor) -> tuple[int, ...]:
    """Shape of the full (unsplit, unpadded) tensor this parameter is a shard of (over TP, and EP for experts)."""
    shape = list(param.shape)
    if _sharded(param):
        shape[_dim(param)] = _full_size(param)
    if shape:
        shape[0] *= _expert_split(param)[1]
    return tuple(shape)


def shard_of(full: torch.Tensor, param: torch.Tensor, tp_rank: int) -> torch.Tensor:
    """This rank's shard of a full tensor: this EP rank's experts (``expert_split``), then the slice along
    ``partition_dim``, zero-padding if needed. No communication."""
    ep_rank, ep = _expert_split(param)
    if ep > 1:
        full = full.narrow(0, ep_rank * (full.shape[0] // ep), full.shape[0] // ep)
    if not _sharded(param):
        return full
    dim, sizes, starts = _dim(param), _sizes(param), _starts(param)
    padded_total = max(a + n for a, n in zip(starts, sizes))
    if full.shape[dim] < padded_total:  # padded rows (vocabulary): zeros beyond full_size
        pad_shape = list(full.shape)
        pad_shape[dim] = padded_total - full.shape[dim]
        full = torch.cat([full, full.new_zeros(pad_shape)], dim=dim)
    return full.narrow(dim, starts[tp_rank], sizes[tp_rank])


def gather_full(shard: torch.Tensor, param: torch.Tensor, ps: ParallelState) -> torch.Tensor:
    """The full tensor of a (possibly split) parameter: all-gather over TP along its
    ``partition_dim`` (uneven sizes allowed), padding removed; an expert parameter's EP ranks' experts
    concatenated (an all-gather over the EP group). Collective over TP (and EP)."""
    ep = _expert_split(param)[1]
    if ep > 1 and ps.group("ep") is not None:
        parts = [torch.empty_like(shard) for _ in range(ep)]
        dist.all_gather(parts, shard.contiguous(), group=ps.group("ep"))
        shard = torch.cat(parts)
    if not _sharded(param):
        return shard
    dim = _dim(param)
    if ps.tp_size > 1:
        shard = all_gather_uneven(shard.detach(), _sizes(param), dim, ps.tp_group)
        if _offsets(param):  # overlapping slices: each rank's rows no lower rank has
            pieces = shard.split(list(_sizes(param)), dim)
            shard = torch.cat([p.narrow(dim, lo, hi - lo) for r, p in enumerate(pieces)
                               for lo, hi in [counted_rows(param, r)]], dim)
    return shard.narrow(dim, 0, _full_size(param))


@torch.no_grad()
def full_state_dict(model: nn.Module, ps: ParallelState) -> dict[str, torch.Tensor]:
    """Every parameter as its full TP=1 tensor (one all-gather over TP per split parameter; all
    TP ranks get it)."""
    return {name: gather_full(p.detach(), p, ps).clone() for name, p in model.named_parameters()}


@torch.no_grad()
def load_full_state_dict(model: nn.Module, full: Mapping[str, torch.Tensor], ps: ParallelState) -> None:
    """Copy this rank's slice of every full tensor into the model (no communication).

    Names and full shapes must match exactly; a mismatch is a ``ValueError`` naming it.
    """
    params = dict(model.named_parameters())
    missing, unexpected = sorted(set(params) - set(full)), sorted(set(full) - set(params))
    if missing or unexpected:
        raise ValueError(f"state dict does not match the model: missing {missing[:5]}"
                         f"{'...' if len(missing) > 5 else ''}, unexpected {unexpected[:5]}"
                         f"{'...' if len(unexpected) > 5 else ''}.")
    for name, p in params.items():
        expected = full_shape(p)
        if tuple(full[name].shape) != expected:
            raise ValueError(f"parameter {name!r} has shape {tuple(full[name].shape)} in the state dict but "
                             f"the model expects the full shape {expected}.")
        p.copy_(shard_of(full[name].to(p.dtype), p, ps.tp_rank))
