"""``save``: every rank streams its part into ``iter_N.tmp``; rank 0 commits it by renaming.

What each rank writes (nothing is gathered; extra memory is one tensor's host copy):

* the ranks of DP rank 0 write their TP shard of the weights (``model_tpXX``), one
  parameter at a time; with ZeRO-3 every DP rank takes part in each parameter's
  all-gather (FSDP's ``full_tensor``), one parameter at a time;
* every rank that owns optimizer state writes exactly what it owns
  (``optim_tpXX_dpYYY``): the Adam moments and, for 16-bit training, the fp32 master
  weights, as flat pieces of its TP shards (ZeRO-1: its slice of every bucket; FSDP: its
  shards; stage 0: DP rank 0 writes everything). Replicated parameters come from TP rank 0;
* every rank writes its RNG states.

At PP > 1 each pipeline stage writes its own parameters in files named with the stage
(``model_ppYY_tpXX``, ``optim_ppYY_tpXX_dpZZZ``, ``rng_ppYY_dpZZZ_tpXX``), the last stage's tied
copy of the word embedding not at all; rank 0 records each parameter's stage and the stages'
layers in ``meta.json`` (:mod:`.stages`). At PP 1 the files and the manifest are what they were
before pipelines existed.

Order of events (a crash at any point leaves the previous checkpoint intact and
``latest`` pointing at it):

1. rank 0 removes the debris of earlier crashed saves (only tnlg's own, see
   :func:`tnlg.checkpoint.files.remove_debris`) and creates ``iter_N.tmp`` with the marker;
   every rank learns whether that worked;
2. every rank streams its files and computes their SHA-256; an I/O error (disk full, EIO,
   permissions) is kept, not raised, and the rank keeps joining the collectives of the
   writes (ZeRO-3's all-gathers); the ranks then agree: any rank's error is raised on every
   rank, naming the rank, the file and the free space, after rank 0 removed ``iter_N.tmp``.
   A parameter that is not finite (NaN or inf: training diverged) is such an error of the rank
   that writes it, found as the weights stream (one parameter's flags at a time, no collective of
   its own: the same agreement carries it), raised as :class:`NonFiniteParameters`: a checkpoint
   whose parameters are not finite is never written, nor named the latest;
3. ``all_gather_object`` of (size, checksum, pieces) per file and of each rank's stage; rank 0 writes ``meta.json``
   (the manifest), renames ``iter_N.tmp`` to ``iter_N`` (an existing ``iter_N``, from a run
   that was rolled back, is swapped out atomically and removed, and the log says so),
   replaces ``latest_checkpointed_iteration.txt`` atomically and prunes to ``--keep-last``
   (only iterations with a tnlg manifest); every rank learns whether that worked.

Each "every rank learns" is one small ``all_gather_object`` of the ranks' error messages
(:func:`tnlg.parallel.state.agree_on_failure`), where a barrier stood before: a rank that
failed never leaves the others waiting for the process-group timeout.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import time
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from ..config import GPTConfig
from ..errors import UserError, agreed
from ..io import atomic_output, atomic_write, file_sha256, fsync_dir, write_failure
from ..parallel.sharding import ShardSpec
from ..parallel.state import ParallelState, agree_on_failure, is_distributed
from . import files as F
from . import torch_file
from .compat import data_record, options_record
from .manifest import Layout, Manifest, OptimFile, OptimizerState, RngLayout, Schedule
from .pieces import OptimPiece
from . import buffers as B
from .reshard import flat_offset, names_for_rank, param_records, partition_info, targets_for
from .rng import capture
from .stages import assign_stages, chunk_layers_of, stage_record, stored_names
from .stream import StreamWriter

__all__ = ["save", "write_offline", "commit", "NonFiniteParameters", "all_finite"]

_NOT_FINITE = "holds NaN or infinite values"  # in the message of a rank whose parameter is not finite


class NonFiniteParameters(UserError):
    """A save refused on every rank alike: a parameter holds NaN or inf (training has diverged), so the
    checkpoint was not written and the previous one stays the latest."""


def _tmp_name(iteration: int) -> str:
    return F.iter_dir_name(iteration) + ".tmp"


def _write_states(tmp: str, engine, model, names: set, ps: ParallelState, tag: dict, targets, pp,
                  failure: "_SaveFailure") -> dict:
    """This rank's optimizer shard and RNG states, each under ``failure``'s guard (none once a write failed)."""
    written: dict = {}
    if failure.ok:
        with failure.guard(os.path.join(tmp, F.optim_file(ps.tp_rank, ps.dp_rank, pp))):
            written.update(_write_optimizer(tmp, engine, names, ps, tag, targets))
    rng_name = F.rng_file(ps.dp_rank, ps.tp_rank, pp)
    if failure.ok:
        with failure.guard(os.path.join(tmp, rng_name)):
            written.update(_write_rng(tmp, rng_name, capture(model.tp_random)))
    return written


def save(save_dir: str, *, iteration: int, consumed_samples: int, model, engine, ps: ParallelState,
         config: GPTConfig, options=None, tokenizer=None, keep_last: Optional[int] = None,
         schedule_steps: Optional[int] = None, adapters: Optional[dict] = None) -> str:
    """Write a checkpoint of iteration ``iteration`` under ``save_dir``; returns its directory.

    Collective over all ranks (see the module docstring for what each rank writes and the
    commit protocol). ``keep_last`` keeps only the newest K iterations. ``schedule_steps``: the LR
    schedule's position (the manifest's ``schedule.num_steps``; default the optimizer's step count).
    ``adapters``: a LoRA run's record (the manifest's ``adapters``: its settings and frozen base), whose
    ``model.layout()`` then names the adapters alone (:mod:`tnlg.training.adapter_checkpoint`).
    """
    root = os.path.abspath(save_dir)
    final = os.path.join(root, F.iter_dir_name(iteration))
    tmp = os.path.join(root, _tmp_name(iteration))
    layout = model.layout()  # the whole GPT's parameters at this TP size, from the model
    records = param_records(layout)
    ep, ep_rank = ps.size("ep"), ps.rank_in("ep")
    targets = targets_for(layout, ps.tp_rank, ep_rank, ep)
    if ps.pp_size == 1 and set(engine.param_names) != set(records):
        raise RuntimeError(f"engine parameters {sorted(set(engine.param_names) ^ set(records))[:4]} do not match "
                           f"the model's partition records; cannot save.")
    stored = stored_names(model, engine.param_names, records)  # a pipeline stage's, once each
    _prepare(root, tmp, ps, iteration)
    pp = F.stage_tag(ps.pp_rank, ps.pp_size)  # None at PP 1: the file names and tags of before
    names = [n for n in names_for_rank(records, ps.tp_rank) if n in set(stored)]
    tag = dict(format=F.FORMAT, iteration=iteration, tp_rank=ps.tp_rank, tp_size=ps.tp_size,
               **({} if pp is None else dict(pp_rank=ps.pp_rank, pp_size=ps.pp_size)))
    written: dict[str, _Written] = {}
    failure = _SaveFailure(root, iteration, ps)
    # at EP > 1 each EP rank's routed experts go to its own file (reshard's module docstring), the rest as before
    experts = {n for n in names if records[n].get("experts")} if ep > 1 else set()
    bufs = B.persistent_buffers(model) if ps.tp_rank == 0 and ps.dp_rank == 0 else []
    written.update(_write_model(tmp, engine, [n for n in names if n not in experts], ps, tag, failure,
                                F.model_file(ps.tp_rank, pp), ps.dp_rank == 0, bufs))  # collective with ZeRO-3
    if experts:
        written.update(_write_model(tmp, engine, [n for n in names if n in experts], ps,
                                    dict(tag, ep_rank=ep_rank, ep_size=ep), failure,
                                    F.model_file(ps.tp_rank, pp, ep_rank), ps.rank_in("edp") == 0))
    written.update(_write_states(tmp, engine, model, set(names), ps, tag, targets, pp, failure))
    failure.agree(tmp)  # every rank raises the same error when any rank's write failed; tmp removed
    optimizer = OptimizerState.from_dict(dict(present=True, **engine.hyperparameters()))
    pp_size = None if pp is None else ps.pp_size  # recorded at PP > 1 only
    stage = stage_record(ps.pp_rank, ps.pp_size, chunk_layers_of(model, config.num_layers), stored)
    manifest = Manifest(
        format=F.FORMAT, iteration=int(iteration), consumed_samples=int(consumed_samples), config=config.to_dict(),
        options=options_record(options), data=data_record(options),
        tokenizer=tokenizer.describe() if tokenizer else None,
        layout=Layout(tp=ps.tp_size, dp=ps.dp_size, world=ps.world_size,
                      param_dtype=str(engine.param_dtype).replace("torch.", ""), pp=pp_size,
                      ep=ep if ep > 1 else None),
        params=records, optimizer=optimizer, rng=RngLayout(tp=ps.tp_size, dp=ps.dp_size, pp=pp_size),
        schedule=_schedule(options, optimizer, schedule_steps), adapters=adapters)
    _finish(root, tmp, final, iteration, (written, stage, B.records(model, pp) if bufs else {}), ps, manifest,
            keep_last, failure)
    return final


@dataclass
class _Written:
    """What a rank tells rank 0 of a file it wrote: its size, its SHA-256 and, for an optimizer file, its
    ``optim_files`` entry."""
    size: int
    sha256: str
    optim: Optional[OptimFile] = None


class _SaveFailure:
    """The first I/O error of this rank's part of a save (disk full, EIO, permissions), as a message naming
    the rank, the file and the free space; :meth:`agree` raises it on every rank (rank 0 prints it)."""

    def __init__(self, root: str, iteration: int, ps: ParallelState):
        self.root, self.iteration, self.ps = root, iteration, ps
        self.error: Optional[UserError] = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @contextlib.contextmanager
    def guard(self, path: str):
        """Turn an ``OSError`` of the body (writing ``path``) into the message (the first one is kept).
        Callers skip their writes once one failed (:attr:`ok`)."""
        try:
            yield
        except OSError as exc:
            if self.error is None:
                self.error = UserError(_io_message(exc, path, self.ps))
        except UserError as exc:  # a folder in the way that is not ours
            if self.error is None:
                self.error = exc

    def agree(self, tmp: Optional[str] = None) -> None:
        """Collective: when any rank failed, every rank raises one error naming each failing rank; rank 0
        first removes ``tmp`` (the save's own folder), so the previous checkpoint stays the latest."""
        try:
            agree_on_failure(self.error, f"saving the checkpoint of iteration {self.iteration}")
        except UserError as exc:
            if self.ps.rank == 0 and tmp is not None:
                F.remove_tree(tmp)
            latest = _quiet_latest(self.root)
            if _NOT_FINITE in str(exc):
                raise agreed(NonFiniteParameters(
                    f"{exc}; the checkpoint of iteration {self.iteration} was not written (a run continued from it "
                    "would compute nothing but NaN)")) from None
            raise agreed(UserError(
                f"{exc} The checkpoint of iteration {self.iteration} was not written; "
                + (f"the latest checkpoint in {self.root} is still iteration {latest}." if latest is not None
                   else f"{self.root} holds no earlier checkpoint.")
                + " Free space or fix the folder's permissions, then resume.")) from None


def _io_message(exc: OSError, path: str, ps: ParallelState) -> str:
    """``could not write FILE: <error> (errno E) (N MiB free of M MiB on that filesystem)``."""
    return write_failure(exc, path)


def _quiet_latest(root: str) -> Optional[int]:
    try:
        return F.read_latest(root)
    except (UserError, OSError):
        return None


def _prepare(root: str, tmp: str, ps: ParallelState, iteration: int) -> None:
    """Rank 0: remove only our own debris, create ``tmp`` with the marker; every rank learns whether it
    worked."""
    failure = _SaveFailure(root, iteration, ps)
    if ps.rank == 0:
        with failure.guard(tmp):
            os.makedirs(root, exist_ok=True)
            F.remove_debris(root)
            F.make_save_dir(tmp)
    failure.agree(tmp if failure.error is None else None)


def all_finite(t: torch.Tensor) -> bool:
    """Whether every value of ``t`` is finite, read from its minimum and maximum (NaN and inf reach them): one
    ``aminmax`` pass and two host reads, not a flag per element. ``plan --simulate`` saves on fake tensors,
    which have no value to read: they count as finite (the host reads of a real run only, as the
    vocabulary check's)."""
    from torch._subclasses.fake_tensor import is_fake
    if is_fake(t) or t.numel() == 0:
        return True
    lo, hi = torch.aminmax(t.detach())
    return math.isfinite(lo.item()) and math.isfinite(hi.item())


def _write_model(tmp: str, engine, names: list[str], ps: ParallelState, tag: dict, failure: _SaveFailure,
                 fname: str, writes: bool, buffers=()) -> dict:
    """The rank that ``writes`` (DP rank 0 of each TP rank; for an EP rank's experts, its expert-DP rank 0) streams
    its TP shard of the weights ``names`` into ``fname``, then ``buffers`` (``(name, tensor)``, the model's saved
    buffers: :mod:`.buffers`) (stage 3: every DP rank joins each parameter's all-gather, also after a write
    failed). Returns ``{file: record}`` for the files this rank wrote."""
    path = os.path.join(tmp, fname)
    stream = None
    out = {}
    specs = _param_specs(engine, names) + [(n, tuple(b.shape), b.dtype) for n, b in buffers]
    for name, tensor in engine.param_tensors(names):
        if writes and failure.ok and not all_finite(tensor):  # one parameter at a time: its min and max
            stage = "" if tag.get("pp_rank") is None else f", pipeline stage {tag['pp_rank']}"
            failure.error = UserError(f"parameter {name} (TP rank {ps.tp_rank}{stage}) {_NOT_FINITE}")
        if writes and failure.ok:
            with failure.guard(path):
                if stream is None:
                    stream = StreamWriter(path, specs, tag)
                stream.write(name, tensor)
    if writes and failure.ok:
        with failure.guard(path):
            if stream is None:
                stream = StreamWriter(path, specs, tag)
            for name, b in buffers:
                stream.write(name, b)
            size, sha = stream.close()
            out[fname] = _Written(size, sha)
    if writes and not failure.ok and stream is not None:
        with contextlib.suppress(OSError):
            stream.abort()
    return out


def _write_optimizer(tmp: str, engine, names: set, ps: ParallelState, tag: dict, targets: dict) -> dict:
    """Every rank owning optimizer state streams exactly what it owns, as flat pieces: where a kind's pieces are
    not partitioned (ZeRO 0), only the rank 0 of its gradient group writes them (DP rank 0; for the routed
    experts, each EP rank's expert-DP rank 0, its pieces shifted to its experts: :func:`.reshard.flat_offset`)."""
    pieces, sharded = _owned_pieces(engine)
    mine = []
    for pc in pieces:
        kind_sharded = sharded if pc.sharded is None else pc.sharded
        first = ps.rank_in("edp") == 0 if pc.kind == "expert" else ps.dp_rank == 0
        if pc.name in names and pc.length > 0 and (kind_sharded or first):
            mine.append(dataclasses.replace(pc, lo=pc.lo + flat_offset(targets[pc.name])))
    if not mine and not sharded and ps.dp_rank != 0:
        return {}
    return _write_pieces(tmp, mine, ps.tp_rank, ps.dp_rank, tag)


def _write_pieces(tmp: str, pieces: Sequence[OptimPiece], tp_rank: int, dp_rank: int, tag: dict,
                  kinds=None) -> dict[str, _Written]:
    """One ``optim_[ppYY_]tpXX_dpZZZ`` file of flat pieces (``exp_avg``/``exp_avg_sq``/optional ``master``
    of each), streamed; returns ``{file: record}`` (the stage in ``tag["pp_rank"]`` at PP > 1). ``kinds``:
    the states written (default: the moments, and ``master`` where the pieces have one)."""
    if kinds is None:
        kinds = ("exp_avg", "exp_avg_sq") + (("master",) if pieces and pieces[0].master is not None else ())
    specs = [(f"{pc.name}.{k}", (pc.length,), torch.float32) for pc in pieces for k in kinds]
    pp = tag.get("pp_rank")
    fname = F.optim_file(tp_rank, dp_rank, pp)
    stream = StreamWriter(os.path.join(tmp, fname), specs, tag)
    for pc in pieces:
        for k in kinds:
            stream.write(f"{pc.name}.{k}", pc.state(k).float())
    size, sha = stream.close()
    return {fname: _Written(size, sha, OptimFile(tp_rank=tp_rank, dp_rank=dp_rank, kinds=list(kinds), pp_rank=pp,
                                                 pieces={pc.name: [int(pc.lo), int(pc.length)] for pc in pieces}))}


def _write_rng(tmp: str, name: str, state) -> dict[str, _Written]:
    """One RNG file, written atomically and durably; returns ``{file: record}``."""
    path = os.path.join(tmp, name)
    with atomic_output(path, "wb") as f:  # a full disk: the OSError (ENOSPC) the save's guard turns into one message
        torch_file.write(state, f, path)
    return {name: _Written(os.path.getsize(path), file_sha256(path))}


def _file_sections(files: dict[str, _Written]) -> dict:
    """The manifest's sections describing what was written: sizes, checksums, optimizer pieces."""
    return dict(files={k: v.size for k, v in files.items()}, sha256={k: v.sha256 for k, v in files.items()},
                optim_files={k: v.optim for k, v in files.items() if v.optim is not None})


def _finish(root: str, tmp: str, final: str, iteration: int, written: tuple, ps: ParallelState,
            manifest: Manifest, keep_last: Optional[int], failure: _SaveFailure) -> None:
    """Share what every rank wrote (``written``: its files, its :func:`.stages.stage_record` and the manifest
    records of the buffers it wrote); rank 0
    completes the manifest (each parameter's stage, the files) and commits; every rank learns whether the
    commit worked."""
    if is_distributed():
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, written)
    else:
        gathered = [written]
    if ps.rank == 0:
        files = {k: v for d, _, _ in gathered for k, v in d.items()}
        buffers = {k: v for _, _, b in gathered for k, v in b.items()}
        with failure.guard(os.path.join(tmp, F.META)):
            params, pipeline = assign_stages(manifest.params, [stage for _, stage, _ in gathered])
            manifest = manifest.replace(params=params, pipeline=pipeline, buffers=buffers or None,
                                        **_file_sections(files),
                                        created=time.strftime("%Y-%m-%dT%H:%M:%S%z"), torch=torch.__version__)
            commit(root, tmp, final, iteration, manifest, keep_last)
    failure.agree(tmp if failure.error is not None and os.path.isdir(tmp) else None)


def write_offline(root: str, meta, tp_size: int, shard_of_rank, rng_of_rank=None, *,
                  layout: Mapping[str, ShardSpec]) -> str:
    """Write a checkpoint for ``tp_size`` virtual TP ranks (DP 1) from ``shard_of_rank(r, names) ->
    (params, states or None)``, ``states[name]`` holding full TP-shard ``exp_avg``/``exp_avg_sq``
    (and optionally ``master``), and commit it like :func:`save` (``tnlg convert``). ``meta``: the
    :class:`~.manifest.Manifest` (or its dict) to complete with the parameters and files. ``params`` is
    any mapping whose values have the manifest's ``layout.param_dtype``; each is looked up once, when
    written, so a mapping that computes its values holds one tensor at a time (so are the states:
    ``states[name]`` may be such a mapping too). ``layout``: how the model of ``meta``'s configuration splits
    over ``tp_size`` ranks (:meth:`tnlg.model.GPT.describe`)."""
    root = os.path.abspath(root)
    # one stage: a pipeline checkpoint's stages are not kept; nor its buffers (a router's expert bias: not carried by
    # a conversion yet, and a load of the result says so)
    manifest = Manifest.of(meta).without("pipeline", "buffers")
    iteration = int(manifest.iteration)
    final = os.path.join(root, F.iter_dir_name(iteration))
    tmp = os.path.join(root, _tmp_name(iteration))
    new_root = not os.path.isdir(root)
    os.makedirs(root, exist_ok=True)
    F.make_save_dir(tmp)
    records = param_records(layout)
    dtype = getattr(torch, manifest.layout.param_dtype)
    files: dict[str, _Written] = {}
    try:
        for r in range(tp_size):
            files.update(_write_offline_rank(tmp, layout, tp_size, r, iteration, dtype, shard_of_rank, rng_of_rank))
        manifest = manifest.extended(  # (the keys it has keep their places: the files of before)
            format=F.FORMAT, params=records, **_file_sections(files),
            layout=manifest.layout.without("pp", "ep").extended(tp=tp_size, dp=1, world=tp_size),
            rng=RngLayout(tp=tp_size, dp=1) if rng_of_rank is not None else None)
        commit(root, tmp, final, iteration, manifest, None)
    except BaseException:  # a source that fails while it is read (a damaged file): no debris, a rerun works
        F.remove_tree(tmp)
        if new_root and not os.listdir(root):
            os.rmdir(root)
        raise
    return final


def _write_offline_rank(tmp: str, layout: Mapping[str, ShardSpec], tp_size: int, r: int, iteration: int, dtype: torch.dtype,
                        shard_of_rank, rng_of_rank) -> dict[str, _Written]:
    """The files of virtual TP rank ``r`` (:func:`write_offline`): its weights, its optimizer states as one
    whole-shard piece per parameter, its RNG states."""
    records = param_records(layout)
    names = names_for_rank(records, r)
    params, states = shard_of_rank(r, names)  # params may compute each tensor when it is looked up
    tag = dict(format=F.FORMAT, iteration=iteration, tp_rank=r, tp_size=tp_size)
    local = partition_info(layout, r)
    stream = StreamWriter(os.path.join(tmp, F.model_file(r)),
                          [(n, tuple(local[n]["local"]), dtype) for n in names], tag)
    for n in names:
        stream.write(n, params[n])
    size, sha = stream.close()
    files = {F.model_file(r): _Written(size, sha)}
    if states is not None:
        kinds = [k for k in ("exp_avg", "exp_avg_sq", "master") if all(k in states[n] for n in names)]
        pieces = [_WholeShardPiece(n, math.prod(local[n]["local"]), states[n]) for n in names]
        files.update(_write_pieces(tmp, pieces, r, 0, tag, tuple(kinds)))
    if rng_of_rank is not None:
        files.update(_write_rng(tmp, F.rng_file(0, r), rng_of_rank(r)))
    return files


class _WholeShardPiece(OptimPiece):
    """The piece ``[0, length)`` of a whole TP shard (offline writes): its states are looked up in
    ``states`` when :func:`_write_pieces` writes them, one at a time."""

    def __init__(self, name: str, length: int, states):
        super().__init__(name=name, lo=0, length=int(length))
        self.states = states

    def state(self, kind: str) -> torch.Tensor:
        return self.states[kind].reshape(-1)


def commit(root: str, tmp: str, final: str, iteration: int, manifest: Manifest, keep_last: Optional[int]) -> None:
    """Rank 0's part: manifest, rename (replacing an older save of this iteration atomically),
    ``latest``, pruning (see the module docstring)."""
    atomic_write(os.path.join(tmp, F.META), Manifest.of(manifest).to_json())
    fsync_dir(tmp)
    if os.path.exists(final):
        # An older save of this iteration: a run rolled back to an earlier checkpoint reached it
        # again. The new one replaces it: swap atomically, then remove the old (now at ``tmp``).
        if not F.exchange(tmp, final):
            old = F.trash_name(root)  # a name only tnlg gives: a crash before it is removed leaves known debris
            os.rename(final, old)  # brief window; a resume then falls back to the newest complete iteration
            os.rename(tmp, final)
            tmp = old
        fsync_dir(root)
        F.remove_tree(tmp)
        _drop_marker(final)
        print(f"note: replaced an older save of iteration {iteration} in {root} (this run reached that iteration "
              f"again, e.g. after rolling back).", flush=True)
    else:
        os.rename(tmp, final)
        fsync_dir(root)
        _drop_marker(final)
    F.write_latest(root, iteration)
    if keep_last:  # only iterations whose manifest says tnlg wrote them (a Megatron iter_* has the same name)
        for it in F.list_iterations(root)[:-keep_last]:
            path = os.path.join(root, F.iter_dir_name(it))
            if it != iteration and F.is_tnlg_iteration(path):
                F.remove_tree(path)


def _drop_marker(final: str) -> None:
    """A committed directory is complete: it no longer needs the in-progress marker."""
    try:
        os.remove(os.path.join(final, F.MARKER))
    except FileNotFoundError:
        pass


# --------------------------------------------------------------------------- engine adapters

def _owned_pieces(engine) -> tuple[list[OptimPiece], bool]:
    """(pieces, sharded over DP) of any engine; a backend without views (DeepSpeed) hands over
    full per-parameter states instead (its states are assembled: not streamed)."""
    pieces = engine.owned_pieces()
    if pieces is not None:
        return [OptimPiece.of(pc) for pc in pieces], engine.pieces_sharded_over_dp
    states = engine.optimizer_state_by_param()
    return [OptimPiece(name=n, lo=0, length=st["exp_avg"].numel(), exp_avg=st["exp_avg"].reshape(-1),
                       exp_avg_sq=st["exp_avg_sq"].reshape(-1)) for n, st in states.items()], False


def _param_specs(engine, names) -> list[tuple[str, tuple, torch.dtype]]:
    """Names, shapes (this TP shard, full over DP) and dtypes, in the order of ``engine.param_tensors``."""
    shapes, wanted = engine.param_shapes(), set(names)
    return [(n, shapes[n], engine.param_dtype) for n in engine.param_names if n in wanted]


def _schedule(options, optimizer: Optional[OptimizerState], schedule_steps: Optional[int] = None) -> Optional[Schedule]:
    """The manifest's ``schedule``: its position (``schedule_steps``, default Adam's step count) and the run's
    LR schedule (:meth:`tnlg.options.ScheduleOptions.lr_schedule`); ``None`` without the run's options."""
    if options is None or optimizer is None or not hasattr(options, "schedule"):
        return None
    lr = options.schedule.lr_schedule()
    return Schedule(num_steps=optimizer.num_steps if schedule_steps is None else int(schedule_steps),
                    max_lr=lr.max_lr, min_lr=lr.min_lr, warmup_iters=lr.warmup_iters, decay_iters=lr.decay_iters,
                    decay_style=lr.decay_style)
