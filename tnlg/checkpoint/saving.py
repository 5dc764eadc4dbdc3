"""``save``: every rank writes its part into ``iter_N.tmp``; rank 0 commits it by renaming.

Order of events (a crash at any point leaves the previous checkpoint intact and
``latest`` pointing at it):

1. collectives to get the states: ``engine.model_state_by_param()`` (ZeRO-3:
   all-gather over DP) and ``engine.optimizer_state_by_param()`` (ZeRO >= 1:
   all-gather over DP); rank 0 removes stale ``*.tmp`` directories and creates
   ``iter_N.tmp``; barrier;
2. the ranks of DP rank 0 write their TP shard of weights and Adam moments;
   every rank writes its RNG states; ``all_gather_object`` of the file sizes;
3. rank 0 writes ``meta.json`` (the manifest), renames ``iter_N.tmp`` to
   ``iter_N`` (an existing complete ``iter_N`` is kept: saving an iteration twice
   is harmless), then replaces ``latest_checkpointed_iteration.txt`` atomically
   and prunes to ``--keep-last``; barrier.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Optional

import torch
import torch.distributed as dist

from ..config import GPTConfig
from ..parallel.state import ParallelState
from . import files as F
from .compat import data_record, options_record
from .reshard import names_for_rank, param_records, write_shard_file
from .rng import capture

__all__ = ["save", "write_checkpoint", "commit", "KILL_DURING_SAVE_ENV"]

# Test-only fault injection: "ITERATION" or "ITERATION:RANK" makes that rank SIGKILL itself after
# writing its files of that iteration, before the directory is committed (default rank: the last).
KILL_DURING_SAVE_ENV = "TNLG_TEST_KILL_DURING_SAVE"


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _barrier() -> None:
    if _distributed():
        dist.barrier()


def _maybe_kill(iteration: int, rank: int, world: int) -> None:
    spec = os.environ.get(KILL_DURING_SAVE_ENV)
    if not spec:
        return
    it, _, who = spec.partition(":")
    if int(it) == iteration and rank == (int(who) if who else world - 1):
        os.kill(os.getpid(), signal.SIGKILL)


def _tmp_name(iteration: int) -> str:
    return F.iter_dir_name(iteration) + ".tmp"


def save(save_dir: str, *, iteration: int, consumed_samples: int, model, engine, ps: ParallelState,
         config: GPTConfig, options=None, tokenizer=None, keep_last: Optional[int] = None) -> str:
    """Write a checkpoint of iteration ``iteration`` under ``save_dir``; returns its directory.

    Collective over all ranks (see the module docstring for the collectives and
    the commit protocol). ``keep_last`` keeps only the newest K iterations.
    """
    params = engine.model_state_by_param()
    states = engine.optimizer_state_by_param()
    optimizer = dict(present=True, num_steps=int(engine.num_steps), zero_stage=int(engine.zero_stage),
                     loss_scaler=None if engine.loss_scaler is None else engine.loss_scaler.state_dict(),
                     betas=[float(engine.backend.beta1), float(engine.backend.beta2)],
                     eps=float(engine.backend.eps), weight_decay=float(engine.backend.weight_decay))
    return write_checkpoint(save_dir, iteration=iteration, consumed_samples=consumed_samples, params=params,
                            states=states, optimizer=optimizer, tp_random=model.tp_random, ps=ps, config=config,
                            options=options, tokenizer=tokenizer, keep_last=keep_last)


def write_checkpoint(save_dir: str, *, iteration: int, consumed_samples: int, params: dict,
                     states: Optional[dict], optimizer: Optional[dict], tp_random, ps: ParallelState,
                     config: GPTConfig, options=None, tokenizer=None, keep_last: Optional[int] = None,
                     rng: bool = True, tokenizer_spec: Optional[dict] = None) -> str:
    """The writing half of :func:`save`, from tensors this rank already holds (its TP shard, full
    over DP). ``states=None`` writes no optimizer state (a converted model). Collective."""
    root = os.path.abspath(save_dir)
    final = os.path.join(root, F.iter_dir_name(iteration))
    tmp = os.path.join(root, _tmp_name(iteration))
    records = param_records(config, ps.tp_size)
    if set(params) != set(records):
        raise RuntimeError(f"engine parameters {sorted(set(params) ^ set(records))[:4]} do not match the model's "
                           f"partition records; cannot save.")
    if ps.rank == 0:
        os.makedirs(root, exist_ok=True)
        for name in os.listdir(root):  # leftovers of a save that crashed
            if name.startswith("iter_") and ".tmp" in name:
                F.remove_tree(os.path.join(root, name))
        os.makedirs(tmp)
    _barrier()

    written: dict[str, int] = {}
    tag = dict(format=F.FORMAT, iteration=iteration, tp_rank=ps.tp_rank, tp_size=ps.tp_size)
    if ps.dp_rank == 0:
        names = names_for_rank(records, ps.tp_rank)
        written[F.model_file(ps.tp_rank)] = write_shard_file(
            os.path.join(tmp, F.model_file(ps.tp_rank)), {n: params[n] for n in names}, tag)
        if states is not None:
            flat = {}
            for n in names:
                flat[f"{n}.exp_avg"] = states[n]["exp_avg"]
                flat[f"{n}.exp_avg_sq"] = states[n]["exp_avg_sq"]
            written[F.optim_file(ps.tp_rank)] = write_shard_file(os.path.join(tmp, F.optim_file(ps.tp_rank)),
                                                                 flat, tag)
    if rng:
        path = os.path.join(tmp, F.rng_file(ps.dp_rank, ps.tp_rank))
        with open(path + ".part", "wb") as f:
            torch.save(capture(tp_random), f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(path + ".part", path)
        written[F.rng_file(ps.dp_rank, ps.tp_rank)] = os.path.getsize(path)
    _maybe_kill(iteration, ps.rank, ps.world_size)

    if _distributed():
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, written)
    else:
        gathered = [written]
    if ps.rank == 0:
        manifest = {k: v for d in gathered for k, v in d.items()}
        tok = tokenizer_spec if tokenizer_spec is not None else (tokenizer.describe() if tokenizer else None)
        meta = dict(format=F.FORMAT, iteration=int(iteration), consumed_samples=int(consumed_samples),
                    config=config.to_dict(), options=options_record(options), data=data_record(options),
                    tokenizer=tok,
                    layout=dict(tp=ps.tp_size, dp=ps.dp_size, world=ps.world_size,
                                param_dtype=str(next(iter(params.values())).dtype).replace("torch.", "")),
                    params=records, files=manifest,
                    optimizer=optimizer if states is not None else dict(present=False),
                    rng=dict(tp=ps.tp_size, dp=ps.dp_size) if rng else None,
                    schedule=_schedule(options, optimizer),
                    created=time.strftime("%Y-%m-%dT%H:%M:%S%z"), torch=torch.__version__)
        commit(root, tmp, final, iteration, meta, keep_last)
    _barrier()
    return final


def commit(root: str, tmp: str, final: str, iteration: int, meta: dict, keep_last: Optional[int]) -> None:
    """Rank 0's part: manifest, rename, ``latest``, pruning (see the module docstring)."""
    import json
    F.atomic_write_text(os.path.join(tmp, F.META), json.dumps(meta, indent=1))
    F.fsync_dir(tmp)
    if os.path.isfile(os.path.join(final, F.META)):
        F.remove_tree(tmp)  # this iteration is already saved (interval and end of run coincide)
    else:
        if os.path.exists(final):  # an incomplete directory of that name (not written by tnlg)
            F.remove_tree(final)
        os.rename(tmp, final)
        F.fsync_dir(root)
    F.write_latest(root, iteration)
    if keep_last:
        for it in F.list_iterations(root)[:-keep_last]:
            if it != iteration:
                F.remove_tree(os.path.join(root, F.iter_dir_name(it)))


def _schedule(options, optimizer: Optional[dict]) -> Optional[dict]:
    if options is None or optimizer is None or not hasattr(options, "lr"):
        return None
    return dict(num_steps=optimizer.get("num_steps"), max_lr=options.lr, min_lr=options.min_lr,
                warmup_iters=options.lr_warmup_iters,
                decay_iters=options.lr_decay_iters or options.train_iters, decay_style=options.lr_decay_style)
