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

Pipeline stages change nothing in the tensors: a checkpoint saved at PP > 1 records, per
parameter, the stage whose files hold it (``pp_rank``, :meth:`.Manifest.stage_of`); every parameter is
stored once (the last stage's tied copy of the word embedding is not written), so a loading
rank finds each of its parameters by the GPT's name, whatever stages either side has.
"""

from __future__ import annotations

import os
from typing import Mapping

import torch

from ..errors import UserError
from ..parallel.sharding import ShardSpec
from .files import earlier_iterations
from .manifest import Manifest, need
from .stream import SafetensorsReader

__all__ = ["partition_info", "source_tp_ranks", "targets_for", "full_targets", "param_records", "names_for_rank",
           "check_same_params", "slice_full", "ShardReader", "OptimReader"]


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

    def _file(self, tp_rank: int, name: str):
        """The open file of TP rank ``tp_rank`` holding parameter ``name`` (``file_of(tp_rank, pipeline
        stage)``: the stage the manifest records for it, ``None`` at PP 1) and its name."""
        fname = self.file_of(tp_rank, self.meta.stage_of(name))
        if fname not in self._open:
            path = os.path.join(self.iter_dir, fname)
            try:
                self._open[fname] = SafetensorsReader(path)
            except Exception as exc:  # noqa: BLE001 - any parse failure means a damaged file
                raise UserError(f"checkpoint file {path!r} cannot be read ({exc}); it is damaged or "
                                f"truncated. Nothing was loaded." + earlier_iterations(self.iter_dir)) from None
        return self._open[fname], fname

    def _slice(self, tp_rank: int, key: str, dim: int, lo: int, hi: int, name: str) -> torch.Tensor:
        f, fname = self._file(tp_rank, name)
        try:
            sl = f.get_slice(key)
            idx = tuple(slice(None) for _ in range(dim)) + (slice(lo, hi),)
            return sl[idx]
        except Exception as exc:  # noqa: BLE001
            raise UserError(f"checkpoint file {os.path.join(self.iter_dir, fname)!r} has no "
                            f"readable tensor {key!r} ({exc}); it is damaged or from another model.") from None

    def _whole(self, tp_rank: int, key: str, name: str) -> torch.Tensor:
        f, fname = self._file(tp_rank, name)
        try:
            return f.get_tensor(key)
        except Exception as exc:  # noqa: BLE001
            raise UserError(f"checkpoint file {os.path.join(self.iter_dir, fname)!r} has no "
                            f"readable tensor {key!r} ({exc}); it is damaged or from another model.") from None

    def tensor(self, key: str, name: str, target: dict) -> torch.Tensor:
        src = self.meta.params[name]
        if not src["sharded"]:
            t = self._whole(0, key, name)
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
                piece = self._slice(s, key, dim, lo - a, hi - a, name)
                if out is None:
                    out = piece.new_zeros(target["local"])
                out.narrow(dim, lo - start, hi - lo).copy_(piece)
        if out is None:  # a shard made only of padding (cannot happen with real splits, but be exact)
            out = torch.zeros(target["local"])
        return out


def targets_for(layout: Mapping[str, ShardSpec], tp_rank: int) -> dict[str, dict]:
    """:func:`partition_info` records tagged with ``tp_rank`` (what :meth:`ShardReader.tensor` wants)."""
    return {n: dict(r, tp_rank=tp_rank) for n, r in partition_info(layout, tp_rank).items()}


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
    def _whole(self, tp_rank: int, key: str, name: str) -> torch.Tensor:
        kind = key.rsplit(".", 1)[1]
        rec = self.meta.params[name]
        shape = list(rec["shape"])
        if rec["sharded"]:
            shape[rec["dim"]] = rec["sizes"][tp_rank]
        return self._flat(tp_rank, name, kind, 0, self._src_numel(tp_rank, name)).view(shape)

    def _slice(self, tp_rank: int, key: str, dim: int, lo: int, hi: int, name: str) -> torch.Tensor:
        return self._whole(tp_rank, key, name).narrow(dim, lo, hi - lo)

    def piece(self, name: str, kind: str, target: dict, lo: int, length: int) -> torch.Tensor:
        """Elements ``[lo, lo + length)`` of the flattened target TP shard of ``name``'s ``kind``."""
        src = self.meta.params[name]
        same = not src["sharded"] or (list(src["sizes"]) == list(target.get("sizes", [])) and
                                     src["dim"] == target["dim"] and starts(src) == starts(target))
        if same:
            return self._flat(int(target["tp_rank"]) if src["sharded"] else 0, name, kind, lo, lo + length)
        return self.tensor(f"{name}.{kind}", name, target).reshape(-1)[lo:lo + length].clone()
