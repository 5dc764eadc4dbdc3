"""TP-independent storage: each TP rank's shards plus the partition sizes, re-sliced on load.

Every split parameter is stored as the shard its TP rank held (with the
vocabulary padding of that TP size); ``meta.json`` records, per parameter, the
split dimension, every rank's size along it and the real (unpadded) size. To
load at another TP size, a rank computes the range of the full tensor its new
shard covers and copies the overlapping parts of the old shards (read with
positioned reads of the overlapping rows only, :class:`~tnlg.checkpoint.stream.SafetensorsReader`); rows
past the real size (new vocabulary padding) are zero. Replicated parameters
(LayerNorms, position embedding, row-parallel biases) are stored once, in the
TP-rank-0 file. Uneven splits (28 heads over 8 ranks) need nothing special:
the sizes come from the same :func:`tnlg.config.partition_sizes` the layers use.

Expert parallelism: a mixture of experts' routed-expert parameters (records marked ``experts``) have all
``E`` experts along dim 0 in the manifest, whatever the EP size. A run at EP > 1 stores each EP rank's
consecutive ``E / EP`` experts (its TP shard of them) in its own file, ``model_..._epYY`` (``layout.ep``
records the EP size), and its optimizer pieces in the coordinates of the flattened TP shard of *all* the
experts (an EP rank's flattened shard is the contiguous range starting at :func:`flat_offset`, dim 0 being the
outermost), so the optimizer files of any EP size tile the same ranges as the ZeRO pieces of any DP size
do. A rank loading at any EP size reads the experts it holds (:func:`expert_span`) from the files whose
experts overlap them, each re-sliced over TP as any parameter.

Pipeline stages change nothing in the tensors: a checkpoint saved at PP > 1 records, per
parameter, the stage whose files hold it (``pp_rank``, :meth:`.Manifest.stage_of`); every parameter is
stored once (the last stage's tied copy of the word embedding is not written), so a loading
rank finds each of its parameters by the GPT's name, whatever stages either side has.
"""

from __future__ import annotations

import math
import os
from typing import Mapping, Optional

import torch

from ..errors import UserError
from ..parallel.sharding import ShardSpec
from .files import earlier_iterations
from .manifest import Manifest, need
from .stream import SafetensorsReader

__all__ = ["partition_info", "source_tp_ranks", "source_files", "targets_for", "full_targets", "param_records",
           "names_for_rank", "check_same_params", "slice_full", "expert_span", "flat_offset", "ShardReader",
           "OptimReader"]


def partition_info(layout: Mapping[str, ShardSpec], tp_rank: int) -> dict[str, dict]:
    """Per parameter of the TP rank's shard: ``shape`` (full, unpadded), ``local`` (this shard),
    ``sharded``, and for split ones ``dim``, ``sizes`` (every rank's, padded) and ``full_size``.
    ``layout``: how every parameter splits over the TP size, by name (the model's own description,
    :meth:`tnlg.model.GPT.describe`, handed in by the caller: the checkpoint builds no model)."""
    return {name: spec.record(tp_rank) for name, spec in layout.items()}


def param_records(layout: Mapping[str, ShardSpec]) -> dict[str, dict]:
    """The ``params`` section of ``meta.json`` for a checkpoint written at the TP size of ``layout``."""
    return {name: {k: v for k, v in rec.items() if k != "local"}
            for name, rec in partition_info(layout, 0).items()}


def starts(rec: dict) -> list[int]:
    """Where every rank's shard of a split parameter starts along its dimension: the record's ``offsets``
    (slices that may overlap: key/value groups several TP ranks hold), else the sizes back to back."""
    if rec.get("offsets"):
        return [int(o) for o in rec["offsets"]]
    return [sum(rec["sizes"][:r]) for r in range(len(rec["sizes"]))]


def expert_span(target: dict) -> Optional[tuple[int, int]]:
    """The experts ``[a, b)`` a target of a routed-expert parameter holds (EP rank ``ep_rank`` of ``ep_size``:
    its consecutive ``E / ep_size``; all ``E`` without them); ``None`` for every other parameter."""
    if not target.get("experts"):
        return None
    n = int(target["shape"][0]) // int(target.get("ep_size", 1))
    first = int(target.get("ep_rank", 0)) * n
    return first, first + n


def flat_offset(target: dict) -> int:
    """Where a target's flattened shard starts in the flattened TP shard of all the experts (0 for every other
    parameter, and at EP 1): optimizer pieces are stored in these coordinates (module docstring)."""
    span = expert_span(target)
    return 0 if span is None else span[0] * math.prod(int(d) for d in target["local"][1:])


def expert_blocks(meta: Manifest, name: str) -> list[tuple[Optional[int], int, int]]:
    """How the checkpoint's files hold parameter ``name`` along dim 0: ``(EP rank of the file, first expert,
    end)`` per file, ``(None, 0, rows)`` where one file per TP rank holds it all (every parameter but the
    routed experts of a checkpoint saved at EP > 1)."""
    rec, ep = meta.params[name], meta.layout.ep_size
    rows = int(rec["shape"][0]) if rec.get("shape") else 1
    if not rec.get("experts") or ep == 1:
        return [(None, 0, rows)]
    n = rows // ep
    return [(s, s * n, (s + 1) * n) for s in range(ep)]


def source_files(meta, name: str, target: dict, file_of) -> set[str]:
    """The model files a target of parameter ``name`` reads from (``file_of(tp_rank, stage[, ep_rank])``): those
    of the stored TP shards it overlaps, and of a routed-expert parameter saved at EP > 1 only the EP ranks'
    whose experts it holds."""
    m = Manifest.of(meta)
    span = expert_span(target) or (0, 1 << 62)
    stage = m.stage_of(name)
    eps = [s for s, a, b in expert_blocks(m, name) if a < span[1] and span[0] < b]
    return {file_of(r, stage) if s is None else file_of(r, stage, s)
            for r in source_tp_ranks(m.params[name], target) for s in eps}


def source_tp_ranks(src: dict, target: dict) -> list[int]:
    """The stored TP ranks whose shards of a parameter (``src``: its ``meta.json`` record) overlap the
    shard ``target`` describes (a :func:`targets_for` record); ``[0]`` for a replicated parameter."""
    if not src["sharded"]:
        return [0]
    start = starts(target)[target["tp_rank"]]
    stop, out = start + target["local"][target["dim"]], []
    for r, (a, size) in enumerate(zip(starts(src), src["sizes"])):
        if a < stop and start < a + size:
            out.append(r)
    return out


class ShardReader:
    """Reads the tensors a TP rank needs from the per-TP-rank files of one kind (``model``/``optim``).

    ``tensor(key, name, target)`` returns the shard described by ``target`` (a
    :func:`partition_info` record) of the stored tensor ``key`` of parameter
    ``name``, assembled from the overlapping stored shards. ``meta``: the checkpoint's
    :class:`~.manifest.Manifest` (or its dict).
    """

    def __init__(self, iter_dir: str, meta, file_of):
        self.iter_dir, self.meta, self.file_of = iter_dir, Manifest.of(meta), file_of
        self.src_tp = int(need(self.meta.layout.tp, "layout.tp"))
        self._open: dict[str, object] = {}

    def _file(self, tp_rank: int, name: str, ep_rank: Optional[int] = None):
        """The open file of TP rank ``tp_rank`` holding parameter ``name`` (``file_of(tp_rank, pipeline
        stage)``: the stage the manifest records for it, ``None`` at PP 1; ``file_of(tp_rank, stage, ep_rank)``
        for EP rank ``ep_rank``'s experts) and its name."""
        stage = self.meta.stage_of(name)
        fname = self.file_of(tp_rank, stage) if ep_rank is None else self.file_of(tp_rank, stage, ep_rank)
        if fname not in self._open:
            path = os.path.join(self.iter_dir, fname)
            try:
                self._open[fname] = SafetensorsReader(path)
            except Exception as exc:  # noqa: BLE001 - any parse failure means a damaged file
                raise UserError(f"checkpoint file {path!r} cannot be read ({exc}); it is damaged or "
                                f"truncated. Nothing was loaded." + earlier_iterations(self.iter_dir)) from None
        return self._open[fname], fname

    def _slice(self, tp_rank: int, key: str, dim: int, lo: int, hi: int, name: str,
               rows: Optional[tuple] = None) -> torch.Tensor:
        """``[lo, hi)`` along ``dim`` of the stored tensor ``key`` of TP rank ``tp_rank``; ``rows``: ``(EP rank
        of the file or None, first, end)``, only those rows of dim 0 (read alone)."""
        f, fname = self._file(tp_rank, name, None if rows is None else rows[0])
        try:
            sl = f.get_slice(key)
            if rows is not None:
                if dim == 0:
                    raise ValueError("an expert parameter is split over TP along dim 0, which holds the experts")
                return sl[rows[1]:rows[2]].narrow(dim, lo, hi - lo)
            idx = tuple(slice(None) for _ in range(dim)) + (slice(lo, hi),)
            return sl[idx]
        except Exception as exc:  # noqa: BLE001
            raise UserError(f"checkpoint file {os.path.join(self.iter_dir, fname)!r} has no "
                            f"readable tensor {key!r} ({exc}); it is damaged or from another model.") from None

    def _whole(self, tp_rank: int, key: str, name: str, rows: Optional[tuple] = None) -> torch.Tensor:
        f, fname = self._file(tp_rank, name, None if rows is None else rows[0])
        try:
            return f.get_tensor(key) if rows is None else f.get_slice(key)[rows[1]:rows[2]]
        except Exception as exc:  # noqa: BLE001
            raise UserError(f"checkpoint file {os.path.join(self.iter_dir, fname)!r} has no "
                            f"readable tensor {key!r} ({exc}); it is damaged or from another model.") from None

    def _blocks(self, name: str) -> list[tuple[Optional[int], int, int]]:
        """:func:`expert_blocks` of this checkpoint (the files' experts)."""
        return expert_blocks(self.meta, name)

    def tensor(self, key: str, name: str, target: dict) -> torch.Tensor:
        """The shard ``target`` describes of stored tensor ``key`` of parameter ``name``: for a routed-expert
        parameter its experts (:func:`expert_span`) from the files holding them, each part re-sliced over TP."""
        span = expert_span(target)
        if span is None:
            return self._tensor(key, name, target, None)
        parts = []
        for ep_rank, a, b in self._blocks(name):
            lo, hi = max(a, span[0]), min(b, span[1])
            if lo < hi:
                local = [hi - lo] + list(target["local"][1:])
                parts.append(self._tensor(key, name, dict(target, local=local), (ep_rank, lo - a, hi - a)))
        if sum(p.shape[0] for p in parts) != span[1] - span[0]:
            raise UserError(f"checkpoint {self.iter_dir!r} holds {sum(p.shape[0] for p in parts)} of the experts "
                            f"{span[0]}..{span[1] - 1} of {name!r}; it is damaged or from another model.")
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _tensor(self, key: str, name: str, target: dict, rows: Optional[tuple]) -> torch.Tensor:
        """:meth:`tensor` of one block of rows (``rows``: ``(EP rank of the file, first, end)``; ``None``: all)."""
        src = self.meta.params[name]
        if not src["sharded"]:
            t = self._whole(0, key, name, rows)
            if list(t.shape) != list(target["local"]):
                raise UserError(f"checkpoint tensor {key!r} has shape {tuple(t.shape)}, expected "
                                f"{tuple(target['local'])}.")
            return t
        dim, full = int(src["dim"]), int(src["full_size"])
        if not target["sharded"] or target["dim"] != dim or target["full_size"] != full:
            raise UserError(f"parameter {name!r} is split along dim {dim} (size {full}) in the checkpoint but "
                            f"the model splits it differently; the checkpoint is from another model.")
        out = None
        start = starts(target)[int(target["tp_rank"])]
        stop = start + target["local"][dim]
        for s, (a, size) in enumerate(zip(starts(src), src["sizes"])):
            b = a + size
            lo, hi = max(start, a), min(stop, b, full)
            if lo < hi:
                piece = self._slice(s, key, dim, lo - a, hi - a, name, rows)
                if out is None:
                    out = piece.new_zeros(target["local"])
                out.narrow(dim, lo - start, hi - lo).copy_(piece)
        if out is None:  # a shard made only of padding (cannot happen with real splits, but be exact)
            out = torch.zeros(target["local"])
        return out


def targets_for(layout: Mapping[str, ShardSpec], tp_rank: int, ep_rank: int = 0, ep_size: int = 1) -> dict[str, dict]:
    """:func:`partition_info` records tagged with ``tp_rank`` (what :meth:`ShardReader.tensor` wants); a routed-expert
    parameter's also with ``ep_rank`` and ``ep_size``, its ``local`` shape this EP rank's ``E / ep_size`` experts."""
    out = {}
    for n, r in partition_info(layout, tp_rank).items():
        out[n] = dict(r, tp_rank=tp_rank)
        if r.get("experts") and ep_size > 1:
            out[n].update(ep_rank=ep_rank, ep_size=ep_size, local=[r["local"][0] // ep_size] + r["local"][1:])
    return out


def check_same_params(meta, targets: dict[str, dict], where: str) -> None:
    """The checkpoint (its :class:`~.manifest.Manifest` or dict) holds exactly the model's parameters with the
    same full shapes."""
    params = Manifest.of(meta).params
    have, want = set(params), set(targets)
    if have != want:
        missing, extra = sorted(want - have), sorted(have - want)
        raise UserError(f"checkpoint {where!r} does not match the model: missing parameters {missing[:4]}"
                        f"{'...' if len(missing) > 4 else ''}, unexpected {extra[:4]}"
                        f"{'...' if len(extra) > 4 else ''}. It was saved from a different architecture.")
    for n in sorted(want):
        if list(params[n]["shape"]) != list(targets[n]["shape"]):
            raise UserError(f"checkpoint {where!r}: parameter {n!r} has full shape "
                            f"{tuple(params[n]['shape'])} but the model's is {tuple(targets[n]['shape'])}; "
                            f"it was saved from a different architecture.")


def names_for_rank(records: dict[str, dict], tp_rank: int) -> list[str]:
    """Parameters TP rank ``tp_rank`` stores: its split ones, and the replicated ones on rank 0."""
    return [n for n, r in records.items() if r["sharded"] or tp_rank == 0]


def full_targets(meta) -> dict[str, dict]:
    """Targets that make :meth:`ShardReader.tensor` return every parameter's full, unpadded tensor (``meta``:
    the checkpoint's :class:`~.manifest.Manifest` or dict)."""
    out = {}
    for name, rec in Manifest.of(meta).params.items():
        if rec["sharded"]:
            out[name] = dict(rec, sizes=[rec["full_size"]], offsets=[0], local=list(rec["shape"]), tp_rank=0)
        else:
            out[name] = dict(rec, local=list(rec["shape"]), tp_rank=0)
    return out


def slice_full(full: torch.Tensor, target: dict) -> torch.Tensor:
    """The shard ``target`` describes of a full (unpadded) tensor, zero-padded past the real size."""
    if not target["sharded"]:
        return full
    dim = target["dim"]
    start = starts(target)[target["tp_rank"]]
    out = full.new_zeros(target["local"])
    hi = min(start + target["local"][dim], full.shape[dim])
    if hi > start:
        out.narrow(dim, 0, hi - start).copy_(full.narrow(dim, start, hi - start))
    return out


class OptimReader(ShardReader):
    """Reads optimizer states (``exp_avg``, ``exp_avg_sq``, ``master``) for any target layout.

    Format 2 stores, per (TP, DP) rank, flat pieces ``[lo, lo + length)`` of each flattened
    TP shard (the manifest's ``optim_files`` lists them); format 1 stored each TP shard whole. For a
    target piece of a TP shard laid out as stored (same TP size, or a replicated parameter),
    :meth:`piece` reads only the overlapping stored pieces (lazy slices). After a change of
    TP size it assembles the source TP shards it overlaps (one parameter's shard at a time)
    and re-slices them as :class:`ShardReader` does for weights.
    """

    def __init__(self, iter_dir: str, meta):
        super().__init__(iter_dir, meta, None)
        self.index: dict[tuple[int, str], list[tuple[str, int, int]]] = {}
        self.kinds = {"exp_avg", "exp_avg_sq"}
        optim_files = self.meta.optim_files
        if optim_files:
            kinds = [set(f.kinds) for f in optim_files.values()]
            self.kinds = set.intersection(*kinds) if kinds else self.kinds
            for fname, f in optim_files.items():
                for name, (lo, length) in f.pieces.items():
                    self.index.setdefault((int(f.tp_rank), name), []).append((fname, int(lo), int(length)))
        else:  # format 1: whole TP shards in optim_tpXX.safetensors
            for name, rec in self.meta.params.items():
                ranks = range(self.src_tp) if rec["sharded"] else [0]
                for r in ranks:
                    self.index[(r, name)] = [(f"optim_tp{r:02d}.safetensors", 0, -1)]
        self._files: dict[str, object] = {}

    @property
    def has_master(self) -> bool:
        return "master" in self.kinds

    def _open_name(self, fname: str):
        if fname not in self._files:
            path = os.path.join(self.iter_dir, fname)
            try:
                self._files[fname] = SafetensorsReader(path)
            except Exception as exc:  # noqa: BLE001
                raise UserError(f"checkpoint file {path!r} cannot be read ({exc}); it is damaged or truncated. "
                                f"Nothing was loaded." + earlier_iterations(self.iter_dir)) from None
        return self._files[fname]

    def _src_numel(self, tp_rank: int, name: str) -> int:
        rec = self.meta.params[name]
        shape = list(rec["shape"])
        if rec["sharded"]:
            shape[rec["dim"]] = rec["sizes"][tp_rank]
        n = 1
        for d in shape:
            n *= d
        return n

    def _flat(self, tp_rank: int, name: str, kind: str, lo: int, hi: int) -> torch.Tensor:
        """Elements ``[lo, hi)`` of the flattened stored TP shard ``tp_rank`` of ``name``."""
        out = torch.empty(hi - lo, dtype=torch.float32)
        covered = 0
        for fname, plo, plen in self.index.get((tp_rank, name), []):
            f = self._open_name(fname)
            key = f"{name}.{kind}"
            try:
                if plen < 0:  # format 1: the whole shard, shaped
                    t = f.get_tensor(key).reshape(-1)
                    plen = t.numel()
                    piece = lambda a, b, t=t: t[a:b]  # noqa: E731
                else:
                    sl = f.get_slice(key)
                    piece = lambda a, b, sl=sl: sl[a:b]  # noqa: E731
                a, b = max(lo, plo), min(hi, plo + plen)
                if a < b:
                    out[a - lo:b - lo].copy_(piece(a - plo, b - plo))
                    covered += b - a
            except UserError:
                raise
            except Exception as exc:  # noqa: BLE001
                raise UserError(f"checkpoint file {os.path.join(self.iter_dir, fname)!r} has no readable tensor "
                                f"{key!r} ({exc}); it is damaged or from another model.") from None
        if covered != hi - lo:
            raise UserError(f"checkpoint {self.iter_dir!r} holds {covered} of the {hi - lo} optimizer-state "
                            f"elements [{lo}, {hi}) of {name!r} (TP rank {tp_rank}): a file is missing from its "
                            f"manifest, or the checkpoint is from another model.")
        return out

    # ShardReader's hooks, for re-slicing whole source shards after a TP change
    def _blocks(self, name: str) -> list[tuple[Optional[int], int, int]]:
        """One block: the pieces of every EP rank are stored in the coordinates of all the experts."""
        rec = self.meta.params[name]
        return [(None, 0, int(rec["shape"][0]) if rec.get("shape") else 1)]

    def _whole(self, tp_rank: int, key: str, name: str, rows: Optional[tuple] = None) -> torch.Tensor:
        kind = key.rsplit(".", 1)[1]
        rec = self.meta.params[name]
        shape = list(rec["shape"])
        if rec["sharded"]:
            shape[rec["dim"]] = rec["sizes"][tp_rank]
        if rows is None:
            return self._flat(tp_rank, name, kind, 0, self._src_numel(tp_rank, name)).view(shape)
        inner = math.prod(shape[1:])  # (dim 0 outermost: rows a..b are one flat range)
        return self._flat(tp_rank, name, kind, rows[1] * inner, rows[2] * inner).view([rows[2] - rows[1]] + shape[1:])

    def _slice(self, tp_rank: int, key: str, dim: int, lo: int, hi: int, name: str,
               rows: Optional[tuple] = None) -> torch.Tensor:
        return self._whole(tp_rank, key, name, rows).narrow(dim, lo, hi - lo)

    def piece(self, name: str, kind: str, target: dict, lo: int, length: int) -> torch.Tensor:
        """Elements ``[lo, lo + length)`` of the flattened target TP shard of ``name``'s ``kind`` (for a routed-expert
        parameter, of this EP rank's experts: stored at :func:`flat_offset`)."""
        src = self.meta.params[name]
        same = not src["sharded"] or (list(src["sizes"]) == list(target.get("sizes", [])) and
                                     src["dim"] == target["dim"] and starts(src) == starts(target))
        if same:
            at = flat_offset(target) + lo
            return self._flat(int(target["tp_rank"]) if src["sharded"] else 0, name, kind, at, at + length)
        return self.tensor(f"{name}.{kind}", name, target).reshape(-1)[lo:lo + length].clone()
