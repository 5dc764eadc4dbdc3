"""``load`` (resume training at any layout) and ``load_for_inference`` (build a model at this TP).

``load`` validates everything before it changes anything: the pointer, the
manifest (every file present at its recorded size), the architecture and the
data/tokenizer flags (:mod:`tnlg.checkpoint.compat`), the parameter names and
shapes; then it reads this rank's tensors (re-sliced for this TP size) and only
then copies them into the model and optimizer. A failure on any rank is shared
with all ranks (one tiny all-reduce), so every rank raises the same clear error
instead of some waiting for the others.
"""

from __future__ import annotations

import os
from typing import Optional

import torch
import torch.distributed as dist

from ..config import GPTConfig
from ..errors import UserError
from ..parallel.state import ParallelState
from . import files as F
from .compat import check_compatible
from .reshard import ShardReader, check_same_params, targets_for
from .rng import restore

__all__ = ["load", "load_for_inference", "read_states"]


def _log(ps: ParallelState, msg: str) -> None:
    if ps.rank == 0:
        print(msg, flush=True)


def _agree(error: Optional[BaseException], ps: ParallelState) -> None:
    """Raise on every rank if any rank failed (MAX all-reduce of a flag over the world)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        flag = torch.tensor([1.0 if error is not None else 0.0], device=ps.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() and error is None:
            raise UserError("loading the checkpoint failed on another rank (its error is printed by that rank); "
                            "nothing was loaded.")
    if error is not None:
        raise error


def read_states(iter_dir: str, meta: dict, config: GPTConfig, tp_size: int, tp_rank: int,
                names=None, optimizer: bool = True) -> tuple[dict, Optional[dict]]:
    """This TP rank's parameters (and Adam moments, if stored and wanted), re-sliced from the
    stored shards. No communication."""
    targets = targets_for(config, tp_size, tp_rank)
    names = list(targets) if names is None else list(names)
    model = ShardReader(iter_dir, meta, F.model_file)
    params = {n: model.tensor(n, n, targets[n]) for n in names}
    states = None
    if optimizer and meta["optimizer"].get("present"):
        opt = ShardReader(iter_dir, meta, F.optim_file)
        step = int(meta["optimizer"]["num_steps"])
        states = {n: dict(exp_avg=opt.tensor(f"{n}.exp_avg", n, targets[n]),
                          exp_avg_sq=opt.tensor(f"{n}.exp_avg_sq", n, targets[n]), step=step) for n in names}
    return params, states


def _rng_plan(meta: dict, ps: ParallelState) -> tuple[Optional[str], Optional[str]]:
    """(file for the shared streams, file for this TP rank's dropout stream or None to reseed)."""
    rng = meta.get("rng")
    if not rng:
        return None, None
    if (rng["tp"], rng["dp"]) == (ps.tp_size, ps.dp_size):
        own = F.rng_file(ps.dp_rank, ps.tp_rank)
        return own, own
    return F.rng_file(0, 0), (F.rng_file(0, ps.tp_rank) if rng["tp"] == ps.tp_size else None)


def load(load_dir: str, *, model, engine, ps: ParallelState, config: GPTConfig, options=None, tokenizer=None,
         origin: str = "--load") -> Optional[dict]:
    """Resume from ``load_dir`` (a checkpoint root, following ``latest``, or an ``iter_*`` directory).

    Returns ``dict(iteration, consumed_samples, path)``, or ``None`` when the root
    holds no checkpoint yet. Loads the weights re-sliced for this TP size, the
    optimizer state re-partitioned for this DP size and ZeRO stage, the step count
    and loss scaler, and the RNG states (see :mod:`tnlg.checkpoint.rng`).
    Collective: one all-reduce to agree on success; ZeRO-3 loading scatters nothing
    (each rank keeps its part of the full tensors it read).
    """
    error, plan = None, None
    try:
        iter_dir = F.resolve(load_dir, origin)
        if iter_dir is None:
            _log(ps, f"note: {origin} {load_dir!r} holds no checkpoint yet; starting from scratch.")
        else:
            meta = F.read_meta(iter_dir)
            shared_rng, tp_rng = _rng_plan(meta, ps)
            kinds = ("model",) + (("optim",) if meta["optimizer"].get("present") else ())
            F.check_files(iter_dir, meta, kinds)
            for name in {shared_rng, tp_rng} - {None}:
                if name not in meta["files"]:
                    raise UserError(f"checkpoint {iter_dir!r} has no RNG file {name!r} in its manifest.")
            F.check_files(iter_dir, {"files": {k: v for k, v in meta["files"].items()
                                               if k in (shared_rng, tp_rng)}}, ("rng",))
            check_compatible(meta, iter_dir, config, options, tokenizer, origin)
            check_same_params(meta, targets_for(config, ps.tp_size, ps.tp_rank), iter_dir)
            params, states = read_states(iter_dir, meta, config, ps.tp_size, ps.tp_rank, engine.param_names)
            rng_states = {name: torch.load(os.path.join(iter_dir, name), weights_only=True, map_location="cpu")
                          for name in {shared_rng, tp_rng} - {None}}
            plan = (iter_dir, meta, params, states, rng_states, shared_rng, tp_rng)
    except UserError as exc:
        error = exc
    except Exception as exc:  # noqa: BLE001 - a damaged file must not leave other ranks waiting
        error = UserError(f"checkpoint {load_dir!r} cannot be read: {type(exc).__name__}: {exc}")
    _agree(error, ps)
    if plan is None:
        return None

    iter_dir, meta, params, states, rng_states, shared_rng, tp_rng = plan
    engine.load_model_state_by_param(params)
    if states is not None:
        engine.load_optimizer_state_by_param(states)
        if engine.loss_scaler is not None and meta["optimizer"].get("loss_scaler"):
            engine.loss_scaler.load_state_dict(meta["optimizer"]["loss_scaler"])
    else:
        _log(ps, f"note: {iter_dir!r} holds no optimizer state (a converted model); the optimizer starts fresh.")
    saved = meta["layout"]
    if (saved["tp"], saved["dp"]) != (ps.tp_size, ps.dp_size):
        _log(ps, f"note: resharded from TP={saved['tp']} x DP={saved['dp']} to TP={ps.tp_size} x DP={ps.dp_size}.")
    if shared_rng is None:
        _log(ps, "note: the checkpoint holds no RNG states; the seeded ones are kept.")
    else:
        restore(rng_states[shared_rng])
        restored_tp = tp_rng is not None and restore(rng_states[tp_rng], model.tp_random, shared=False)
        if not restored_tp:
            model.tp_random.seed(config.seed + int(meta["iteration"]), ps.tp_rank)
            _log(ps, f"note: the per-TP-rank dropout RNG was reseeded from (seed + iteration, tp rank) because "
                     f"the TP size changed ({meta['rng']['tp']} -> {ps.tp_size}); dropout masks after the resume "
                     f"differ from an uninterrupted run at the old layout.")
    return dict(iteration=int(meta["iteration"]), consumed_samples=int(meta["consumed_samples"]), path=iter_dir)


def load_for_inference(path: str, ps: Optional[ParallelState] = None, tokenizer_override=None):
    """``(model, tokenizer or None)``: a :class:`tnlg.GPT` built at this TP size (``ps``, default one
    process) with the checkpoint's weights, in eval mode.

    ``path`` is a checkpoint root (its ``latest`` iteration) or an ``iter_*``
    directory. The tokenizer is ``tokenizer_override`` (a path or tokenizer) if
    given, else the one recorded in the checkpoint (its files must be unchanged),
    else ``None``. No communication: every rank reads its own slices.
    """
    from ..data.tokenizer import load_tokenizer
    from ..model import GPT
    ps = ps or ParallelState.single()
    iter_dir = F.resolve(path, "checkpoint")
    if iter_dir is None:
        raise UserError(f"checkpoint {path!r} holds no checkpoint (no {F.LATEST} and no iter_* directory).")
    meta = F.read_meta(iter_dir)
    F.check_files(iter_dir, meta, ("model",))
    cfg = GPTConfig.from_dict(meta["config"])
    try:
        cfg.check_tensor_parallel(ps.tp_size)
    except ValueError as exc:
        raise UserError(f"checkpoint {iter_dir!r} cannot run at this tensor-parallel size: {exc}") from None
    check_same_params(meta, targets_for(cfg, ps.tp_size, ps.tp_rank), iter_dir)
    params, _ = read_states(iter_dir, meta, cfg, ps.tp_size, ps.tp_rank, optimizer=False)
    model = GPT(cfg, ps)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(params[name].to(p.dtype))
    model.eval()
    if tokenizer_override is not None:
        tokenizer = load_tokenizer(tokenizer_override)
    elif meta.get("tokenizer"):
        try:
            tokenizer = load_tokenizer(meta["tokenizer"])
        except UserError as exc:
            raise UserError(f"the tokenizer recorded in checkpoint {iter_dir!r} cannot be loaded: {exc} Pass the "
                            f"tokenizer explicitly (--tokenizer-model).") from None
    else:
        tokenizer = None
    return model, tokenizer
