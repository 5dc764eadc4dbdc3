"""``load`` (resume training at any layout) and ``inference_plan`` / ``read_weights`` (a model's weights at this TP).

``load`` validates everything before it changes anything: the pointer, the
manifest (every file present at its recorded size), the architecture and the
data/tokenizer flags (:mod:`tnlg.checkpoint.compat`), the parameter names and
shapes, the SHA-256 of every file this rank reads; then it reads this rank's tensors
(re-sliced for this TP size; at PP > 1 those of its pipeline stage, found by name in whichever
stage's files hold them) and only then copies them into the model and optimizer.
Rank 0 alone chooses the iteration and every rank checks it sees the same manifest
(``inference_plan`` too).
A failure on any rank is gathered to all ranks (one ``all_gather_object`` of the
messages), so every rank raises the same clear error, naming the failing ranks and
their files, instead of some waiting for the others.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Mapping, Optional

import torch

from ..config import GPTConfig
from ..data.tokenizer import load_tokenizer
from ..errors import UserError, agreed
from ..parallel.sharding import ShardSpec
from ..parallel.state import ParallelState, agree_on_failure, from_rank0
from . import files as F
from .compat import check_compatible
from .manifest import Layout, Manifest, need
from .pieces import OptimPiece
from .buffers import buffer_files, load_buffers
from .reshard import (OptimReader, ShardReader, check_same_params, flat_offset, source_files, source_tp_ranks,
                      targets_for)
from .rng import restore
from .stages import chunk_layers_of, saved_stage

__all__ = ["load", "inference_plan", "read_weights", "load_weights_into", "read_states", "InferencePlan"]

LayoutOf = Callable[[GPTConfig], Mapping[str, ShardSpec]]  # a model configuration -> its parameters' TP layout


def _log(ps: ParallelState, msg: str) -> None:
    if ps.rank == 0:
        print(msg, flush=True)


def read_states(iter_dir: str, meta, layout: Mapping[str, ShardSpec], tp_rank: int,
                names=None, optimizer: bool = True) -> tuple[dict, Optional[dict]]:
    """This TP rank's parameters (and optimizer states, if stored and wanted: ``exp_avg``,
    ``exp_avg_sq``, ``master`` when stored, ``step``), whole TP shards re-sliced from the stored
    ones (``meta``: the checkpoint's :class:`~.manifest.Manifest` or dict). No communication. Holds every
    tensor at once: for offline tools (``tnlg convert``); training loads stream (:func:`load`). ``layout``: how
    the model splits over the TP size read for (:meth:`tnlg.model.GPT.describe`)."""
    manifest = Manifest.of(meta)
    targets = targets_for(layout, tp_rank)
    names = list(targets) if names is None else list(names)
    model = ShardReader(iter_dir, manifest, F.model_file)
    params = {n: model.tensor(n, n, targets[n]) for n in names}
    states = None
    if optimizer and manifest.has_optimizer:
        opt = OptimReader(iter_dir, manifest)
        step = int(need(manifest.optimizer.num_steps, "optimizer.num_steps"))
        kinds = ("exp_avg", "exp_avg_sq") + (("master",) if opt.has_master else ())
        states = {n: dict({k: opt.tensor(f"{n}.{k}", n, targets[n]) for k in kinds}, step=step) for n in names}
    return params, states


def _files_to_read(manifest: Manifest, targets: dict, pieces: Optional[list[OptimPiece]], optimizer: bool) -> set:
    """The checkpoint files this rank reads for the parameters of ``targets`` (their checksums are verified
    before loading): per parameter, the files of the stored TP shards its new shard overlaps, in the
    pipeline stage that stored it; of the optimizer files (format 2) those holding a piece that overlaps one
    of ``pieces`` (``None``: another TP size, where whole source shards are assembled)."""
    ranks = {name: source_tp_ranks(manifest.params[name], t) for name, t in targets.items()}
    out = {f for name, t in targets.items() for f in source_files(manifest, name, t, F.model_file)}
    if not (optimizer and manifest.has_optimizer):
        return out
    if not manifest.optim_files:  # format 1 (PP 1 only)
        return out | {F.optim_file(r) for rs in ranks.values() for r in rs}
    # (pieces in the stored coordinates: a routed expert's shifted to its EP rank's experts, reshard.flat_offset)
    wanted = None if pieces is None else {(pc.name, pc.lo + flat_offset(targets[pc.name]),
                                           pc.hi + flat_offset(targets[pc.name])) for pc in pieces
                                          if pc.name in targets}
    for fname, f in manifest.optim_files.items():
        for name, (lo, length) in f.pieces.items():
            if name not in ranks or int(f.tp_rank) not in ranks[name]:
                continue
            if wanted is None or any(n == name and lo < hi and a < lo + length for n, a, hi in wanted):
                out.add(fname)
                break
    return out


@dataclass
class _RngPlan:
    """The RNG files a load restores (:func:`_rng_plan`): ``shared`` for the shared streams (``None``: the
    checkpoint holds none), ``tp`` for this TP rank's dropout stream (``None``: reseeded, ``why``)."""
    shared: Optional[str] = None
    tp: Optional[str] = None
    why: str = ""

    @property
    def files(self) -> set:
        return {self.shared, self.tp} - {None}


def _rng_plan(manifest: Manifest, ps: ParallelState, chunks: list) -> _RngPlan:
    """The RNG files this rank restores. ``chunks``: the layers of this rank's model chunks.

    The shared streams (Python, NumPy, torch's default generator, which hidden dropout draws from) are
    drawn alike by the ranks of one pipeline stage, not by different stages: at the same layout each
    rank takes its own file; else rank (dp 0, tp 0) of the saved stage of this pipeline rank when that
    stage held the same layers (always at PP 1), else of the first stage."""
    rng = manifest.rng
    if not rng:
        return _RngPlan()
    saved_pp, saved_chunks = saved_stage(manifest, ps.pp_rank)
    same_stage = (saved_pp, saved_chunks) == (ps.pp_size, chunks)
    stage = F.stage_tag(ps.pp_rank if same_stage else 0, saved_pp)
    if same_stage and (rng.tp, rng.dp) == (ps.tp_size, ps.dp_size):
        own = F.rng_file(ps.dp_rank, ps.tp_rank, stage)
        return _RngPlan(own, own)
    if same_stage and rng.tp == ps.tp_size:
        return _RngPlan(F.rng_file(0, 0, stage), F.rng_file(0, ps.tp_rank, stage))
    why = (f"the TP size changed ({rng.tp} -> {ps.tp_size})" if same_stage else
           f"this rank's pipeline stage holds other layers than the saved stage did (PP {saved_pp} -> {ps.pp_size})")
    return _RngPlan(F.rng_file(0, 0, stage), None, why)


def _agreed_iteration(load_dir: str, origin: str, ps: ParallelState,
                      missing_ok: bool) -> tuple[Optional[str], list]:
    """The iteration directory every rank loads (``None``: none, start from scratch) and rank 0's notes.

    Rank 0 alone resolves ``load_dir`` (its ``latest`` pointer, or the newest complete iteration) and
    broadcasts the directory with the SHA-256 of its ``meta.json``; every rank then checks that it
    sees that directory with the same manifest (a stale cache of a shared filesystem shows another
    one), so no two ranks ever load different iterations, and none skips the collectives of a load.
    Collective: one broadcast, one all_gather_object (the check's outcome)."""
    error: Optional[BaseException] = None
    choice: Optional[tuple[str, str]] = None
    notes: list[str] = []
    if ps.rank == 0:
        try:
            if not (missing_ok and not os.path.isdir(load_dir)):
                found = F.resolve(load_dir, origin, notes)
                choice = None if found is None else (found, F.meta_digest(found))
        except UserError as exc:
            error = exc
        except OSError as exc:
            error = UserError(f"{origin} {load_dir!r} cannot be read: {exc}")
    error_text, choice, notes = from_rank0((None if error is None else str(error), choice, notes))
    if error_text is not None:
        raise agreed(UserError(error_text))
    if choice is None:
        return None, notes
    iter_dir, digest = choice
    mine = None
    if ps.rank != 0:
        try:
            seen = F.meta_digest(iter_dir)
        except (UserError, OSError):
            seen = None
        if seen != digest:
            mine = UserError(
                f"rank {ps.rank} {'does not see' if seen is None else 'sees a different'} {F.META} in {iter_dir!r}, "
                f"the checkpoint rank 0 chose to load; the ranks do not see the same files (a shared filesystem "
                f"with stale caches, or node-local folders that differ). Nothing was loaded. Make the folder "
                f"identical on every node, or give one iter_* directory every node sees.")
    agree_on_failure(mine, "finding the checkpoint")
    return iter_dir, notes


def _agreed_plan(plan: Callable[[], object], iter_dir: str):
    """``plan()`` (the checks and reads of this rank, no communication) on every rank; a failure on any
    rank is raised on every rank alike, naming the failing ranks and their files (rank 0 prints it).
    Collective: one all_gather_object of the outcomes."""
    error, out = None, None
    try:
        out = plan()
    except UserError as exc:
        error = exc
    except Exception as exc:  # noqa: BLE001 - a damaged file must not leave other ranks waiting
        error = UserError(f"checkpoint {iter_dir!r} cannot be read: {type(exc).__name__}: {exc}")
    agree_on_failure(error, f"loading checkpoint {iter_dir!r}")
    return out


@dataclass
class _LoadPlan:
    """What :func:`load` checked and read before it changes anything (:func:`_plan`)."""
    iter_dir: str
    manifest: Manifest
    layout: Mapping[str, ShardSpec]      # the whole model's parameters at this TP size (the model's description)
    targets: dict                        # this rank's parameters: their shards at this layout (targets_for)
    pieces: Optional[list[OptimPiece]]   # what this rank owns of the optimizer state (None: no views)
    rng: _RngPlan
    rng_states: dict                     # RNG file name -> its states, read


def _plan(iter_dir: str, engine, ps: ParallelState, config: GPTConfig, layout: Mapping[str, ShardSpec], options,
          tokenizer, origin: str, must_match: tuple[str, ...], weights_only: bool = False) -> _LoadPlan:
    """Everything checked before anything is changed: the manifest, every file at its size and checksum
    (each rank the files it reads), the architecture and flags, the parameters (the whole model's; this
    rank reads its pipeline stage's); the RNG states read. No communication."""
    manifest = Manifest.read(iter_dir)
    if weights_only:
        manifest.check_holds_weights(f"{origin} {iter_dir!r}")
    rng = _RngPlan() if weights_only else _rng_plan(manifest, ps, chunk_layers_of(engine.model, config.num_layers))
    F.check_files(iter_dir, manifest, ("model",) + (("optim",) if manifest.has_optimizer else ()))
    for name in rng.files:
        if name not in manifest.files:
            raise UserError(f"checkpoint {iter_dir!r} has no RNG file {name!r} in its manifest.")
    F.check_files(iter_dir, Manifest(files={k: v for k, v in manifest.files.items() if k in rng.files}), ("rng",))
    check_compatible(manifest, iter_dir, config, None if weights_only else options, tokenizer, origin,
                     () if weights_only else must_match, weights_only=weights_only)
    targets = targets_for(layout, ps.tp_rank, ps.rank_in("ep"), ps.size("ep"))
    check_same_params(manifest, targets, iter_dir)
    mine = set(engine.param_names)  # the model's, or this pipeline stage's
    targets = {n: t for n, t in targets.items() if n in mine}
    owned = engine.owned_pieces()
    pieces = None if owned is None else [OptimPiece.of(pc) for pc in owned]
    same_tp = int(need(manifest.layout.tp, "layout.tp")) == ps.tp_size
    needed = _files_to_read(manifest, targets, pieces if same_tp else None, True) | buffer_files(manifest, engine.model)
    F.verify_checksums(iter_dir, manifest, needed | rng.files)  # every file this rank reads
    rng_states = {name: torch.load(os.path.join(iter_dir, name), weights_only=True, map_location="cpu")
                  for name in rng.files}
    return _LoadPlan(iter_dir, manifest, layout, targets, pieces, rng, rng_states)


def load(load_dir: str, *, model, engine, ps: ParallelState, config: GPTConfig, options=None, tokenizer=None,
         origin: str = "--load", missing_ok: bool = False, must_match: tuple[str, ...] = (),
         weights_only: bool = False) -> Optional[dict]:
    """Resume from ``load_dir`` (a checkpoint root, following ``latest``, or an ``iter_*`` directory).

    Returns ``dict(iteration, consumed_samples, path, schedule_steps)`` (the LR schedule's position:
    :attr:`.Manifest.schedule_steps`), or ``None`` when the root holds no checkpoint yet. Loads the weights
    re-sliced for this TP size, the optimizer state re-partitioned for this DP size and ZeRO stage, the step
    count and loss scaler, and the RNG states (see :mod:`tnlg.checkpoint.rng`).
    ``missing_ok``: a ``load_dir`` that does not exist is no checkpoint (``--save`` of a new run).
    ``options`` and ``must_match``: the run's options and the names of those that must be the checkpoint's
    (:func:`tnlg.checkpoint.compat.check_compatible`). ``weights_only`` (fine-tuning, ``--finetune``): the
    weights alone (a 16-bit run's exact fp32 master where the checkpoint stores one), checked against the
    architecture and tokenizer only; no Adam moments, step count, loss scaler or RNG state; the returned
    position is iteration 0 with nothing consumed; a ``load_dir`` holding no checkpoint is then an error, not a
    start from scratch.

    Collective: rank 0 chooses the iteration and every rank checks it sees the same manifest
    (:func:`_agreed_iteration`); one all_gather_object of each rank's outcome (any rank's error is
    raised on every rank, naming the rank and the file); ZeRO-3 loading scatters nothing (each rank
    keeps its part of the full tensors it read).
    """
    iter_dir, notes = _agreed_iteration(load_dir, origin, ps, missing_ok)
    if iter_dir is None and weights_only:  # (rank 0's finding, the same on every rank)
        raise agreed(F.no_weights(load_dir, origin))
    if iter_dir is None:
        if os.path.isdir(load_dir):
            _log(ps, f"note: {origin} {load_dir!r} holds no checkpoint yet; starting from scratch.")
        return None
    layout = model.layout()  # the model hands its parameters' TP layout to the checkpoint
    plan = _agreed_plan(lambda: _plan(iter_dir, engine, ps, config, layout, options, tokenizer, origin, must_match,
                                      weights_only), iter_dir)
    for note in notes:
        _log(ps, note)
    _load_tensors(engine, plan, ps, weights_only)
    for note in load_buffers(plan.iter_dir, plan.manifest, model):
        _log(ps, note)
    if weights_only:
        _note_resharding(plan.manifest.layout, ps)
        return dict(iteration=0, consumed_samples=0, path=iter_dir, schedule_steps=0)
    _load_optimizer_counters(engine, plan, ps)
    _note_resharding(plan.manifest.layout, ps)
    _restore_rng(model, ps, config, plan)
    manifest = plan.manifest
    return dict(iteration=int(manifest.iteration), consumed_samples=int(manifest.consumed_samples), path=iter_dir,
                schedule_steps=manifest.schedule_steps)


def _load_tensors(engine, plan: _LoadPlan, ps: ParallelState, weights_only: bool = False) -> None:
    """The weights and optimizer states into the engine: streamed into its buffers (:func:`_stream_into`), or
    for an engine without the piece API (DeepSpeed) as whole per-parameter states. ``weights_only``: the
    weights (from the fp32 master where stored), no moments."""
    if plan.pieces is not None:
        _stream_into(engine, plan, weights_only)
        return
    params, states = read_states(plan.iter_dir, plan.manifest, plan.layout, ps.tp_rank, engine.param_names)
    if states is not None and all("master" in st for st in states.values()):
        params = {n: states[n]["master"] for n in params}  # a 16-bit run's exact fp32 weights
    engine.load_model_state_by_param(params)
    if states is not None and not weights_only:
        engine.load_optimizer_state_by_param(states)


def _load_optimizer_counters(engine, plan: _LoadPlan, ps: ParallelState) -> None:
    """Adam's step count and the fp16 loss scaler's state; a note when the checkpoint has no optimizer state."""
    opt = plan.manifest.optimizer
    if not opt.present:
        _log(ps, f"note: {plan.iter_dir!r} holds no optimizer state (a converted model); the optimizer starts "
                 f"fresh.")
        return
    engine.num_steps = int(need(opt.num_steps, "optimizer.num_steps"))
    if engine.loss_scaler is not None and opt.loss_scaler:
        engine.loss_scaler.load_state_dict(opt.loss_scaler)


def _note_resharding(saved: Layout, ps: ParallelState) -> None:
    """Rank 0 says so when the checkpoint was saved at another layout."""
    pp, ep = saved.pp_size, saved.ep_size
    if (pp, saved.tp, saved.dp, ep) == (ps.pp_size, ps.tp_size, ps.dp_size, ps.size("ep")):
        return

    def name(p, t, d, e):
        return ((f"PP={p} x " if max(pp, ps.pp_size) > 1 else "") + f"TP={t} x DP={d}"
                + (f" (EP={e})" if max(ep, ps.size("ep")) > 1 else ""))
    _log(ps, f"note: resharded from {name(pp, saved.tp, saved.dp, ep)} to "
             f"{name(ps.pp_size, ps.tp_size, ps.dp_size, ps.size('ep'))}.")


def _restore_rng(model, ps: ParallelState, config: GPTConfig, plan: _LoadPlan) -> None:
    """Set this rank's generators from the files :func:`_rng_plan` chose (reseeding the dropout stream, with a
    note saying why, where it is not restored)."""
    rng = plan.rng
    if rng.shared is None:
        _log(ps, "note: the checkpoint holds no RNG states; the seeded ones are kept.")
        return
    restore(plan.rng_states[rng.shared])
    restored_tp = rng.tp is not None and restore(plan.rng_states[rng.tp], model.tp_random, shared=False)
    if not restored_tp:
        model.tp_random.seed(config.seed + int(need(plan.manifest.iteration, "iteration")), ps.tp_rank)
        _log(ps, f"note: the per-TP-rank dropout RNG was reseeded from (seed + iteration, tp rank) because "
                 f"{rng.why or 'the saved one is from another device type'}; dropout masks after the resume "
                 f"differ from an uninterrupted run at the old layout.")


@torch.no_grad()
def _stream_into(engine, plan: _LoadPlan, weights_only: bool = False) -> None:
    """Load weights one parameter at a time and optimizer states one owned piece at a time, straight
    into the engine's buffers: no more than one parameter's TP shard of extra memory.

    Master weights: from the checkpoint's fp32 master where it has one (16-bit runs), else from
    its weights (fp32 runs: exact); a 16-bit model's owned slices are then set from the master,
    and an fp32 model's from the stored master (then all-gathered: stage 1)."""
    reader = ShardReader(plan.iter_dir, plan.manifest, F.model_file)
    opt = OptimReader(plan.iter_dir, plan.manifest) if plan.manifest.has_optimizer else None
    stored_master = opt is not None and opt.has_master
    pieces = plan.pieces or []  # (called with the engine's pieces: _load_tensors)
    by_name: dict[str, list[OptimPiece]] = {}
    for pc in pieces:
        by_name.setdefault(pc.name, []).append(pc)
    for name in engine.param_names:
        value = reader.tensor(name, name, plan.targets[name])
        engine.load_param(name, value)
        if not stored_master:
            flat = value.reshape(-1)
            for pc in by_name.get(name, []):
                if pc.master is not None:
                    pc.master.copy_(flat[pc.lo:pc.hi])
        del value
    if opt is None:
        return
    for pc in pieces:
        if pc.length > 0:
            _load_piece(opt, pc, plan.targets[pc.name], stored_master, moments=not weights_only)
    if stored_master and not engine.has_master:
        engine.gather_params()  # fp32 parameters took the exact stored master on their owned slices


def _load_piece(opt: OptimReader, pc: OptimPiece, target: dict, stored_master: bool, moments: bool = True) -> None:
    """One owned piece's moments (unless ``moments`` is false) and, where the checkpoint stores it, its fp32
    master (into the master and the parameter)."""
    for k in ("exp_avg", "exp_avg_sq") if moments else ():
        pc.state(k).copy_(opt.piece(pc.name, k, target, pc.lo, pc.length))
    if stored_master:
        m = opt.piece(pc.name, "master", target, pc.lo, pc.length)
        if pc.master is not None:
            pc.master.copy_(m)
        if pc.param is not None:  # (an engine's piece always views its parameter)
            pc.param.copy_(m)


@dataclass
class InferencePlan:
    """What :func:`inference_plan` checked before a model is built: the iteration read, its manifest, the model
    configuration, this rank's targets and the tokenizer."""
    iter_dir: str
    manifest: Manifest
    config: GPTConfig
    targets: dict
    tokenizer: object  # or None


def _inference_plan(iter_dir: str, ps: ParallelState, layout_of: LayoutOf, tokenizer_override) -> InferencePlan:
    """Everything checked: the manifest, the files at their sizes, the TP size, the parameters, the SHA-256 of
    the files this rank reads, the tokenizer. No communication."""
    manifest = Manifest.read(iter_dir)
    manifest.check_holds_weights(f"checkpoint {iter_dir!r}")
    F.check_files(iter_dir, manifest, ("model",))
    cfg = GPTConfig.from_dict(need(manifest.config, "config"))
    try:
        cfg.check_tensor_parallel(ps.tp_size)
    except ValueError as exc:
        raise UserError(f"checkpoint {iter_dir!r} cannot run at this tensor-parallel size: {exc}") from None
    targets = targets_for(layout_of(cfg), ps.tp_rank)
    check_same_params(manifest, targets, iter_dir)
    F.verify_checksums(iter_dir, manifest, _files_to_read(manifest, targets, None, False) | buffer_files(manifest))
    if tokenizer_override is not None:
        tokenizer = load_tokenizer(tokenizer_override)
    elif manifest.tokenizer:
        try:
            tokenizer = load_tokenizer(manifest.tokenizer)
        except UserError as exc:
            raise UserError(f"the tokenizer recorded in checkpoint {iter_dir!r} cannot be loaded: {exc} Pass the "
                            f"tokenizer explicitly (--tokenizer-model).") from None
    else:
        tokenizer = None
    return InferencePlan(iter_dir, manifest, cfg, targets, tokenizer)


def inference_plan(path: str, ps: ParallelState, layout_of: LayoutOf, tokenizer_override=None) -> InferencePlan:
    """The checked plan of reading checkpoint ``path``'s weights at this TP size (``tnlg.generation.loading.
    load_for_inference`` builds the model from it). ``layout_of(config)``: how the model of the checkpoint's
    configuration splits over ``ps.tp_size`` (:meth:`tnlg.model.GPT.describe`). ``path`` is a checkpoint root (its
    ``latest`` iteration, else the newest complete one) or an ``iter_*`` directory; the tokenizer is
    ``tokenizer_override`` (a path or tokenizer) if given, else the one recorded in the checkpoint (its files must
    be unchanged), else ``None``.

    Collective, as :func:`load`: rank 0 chooses the iteration and every rank checks it sees the same manifest
    (one broadcast, one all_gather_object); every rank verifies the files it reads, and a failure on any rank is
    raised on every rank (one all_gather_object)."""
    iter_dir, notes = _agreed_iteration(path, "checkpoint", ps, missing_ok=False)
    if iter_dir is None:
        raise agreed(UserError(f"checkpoint {path!r} holds no checkpoint (no {F.LATEST} and no iter_* directory)."))
    plan = _agreed_plan(lambda: _inference_plan(iter_dir, ps, layout_of, tokenizer_override), iter_dir)
    for note in notes:
        _log(ps, note)
    return plan


def read_weights(plan: InferencePlan, model) -> None:
    """The weights :func:`inference_plan` planned, read into ``model`` one parameter at a time (by name)."""
    reader = ShardReader(plan.iter_dir, plan.manifest, F.model_file)
    with torch.no_grad():  # one parameter at a time
        for name, p in model.named_parameters():
            p.copy_(reader.tensor(name, name, plan.targets[name]).to(p.dtype))
    load_buffers(plan.iter_dir, plan.manifest, model)  # (a router's expert bias: its routing)


def load_weights_into(path: str, model, ps: ParallelState) -> str:
    """The weights of checkpoint ``path`` (a root or an ``iter_*`` directory) read into ``model`` (built at this TP
    size with the checkpoint's parameters: a frozen base under adapters, say), one parameter at a time, checked
    and agreed on as :func:`inference_plan`; returns the iteration directory read. Collective."""
    plan = inference_plan(path, ps, lambda cfg: model.layout())
    read_weights(plan, model)
    return plan.iter_dir
