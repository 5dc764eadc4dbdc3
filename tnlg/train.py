"""``tnlg pretrain``: the training loop (TP x DP with ZeRO), logging, evaluation, checkpoints.

Per iteration (global batch = micro batch x DP x accumulation steps):

1. ``engine.zero_grad()``; for each of the ``k`` micro batches of this rank
   (Megatron's sampler: the global sample order does not depend on DP), forward
   under autocast and ``engine.backward(loss)``; only the last micro step
   communicates gradients (bucketed, overlapped with backward).
2. The iteration's loss is averaged over micro batches and over DP (one tiny
   all-reduce); a NaN/inf loss stops the run before the optimizer step, so no
   checkpoint is ever written from the bad state.
3. ``engine.step(lr)``: global-norm clipping across TP and DP, AdamW on the
   owned ZeRO slice, parameters all-gathered.

The learning rate follows Megatron's schedule on the count of optimizer steps
taken. Rank 0 prints a line every ``--log-interval`` and writes one JSON
object per iteration (and per validation) to the metrics file.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shlex
import signal
import sys
import threading
import time
from datetime import timedelta
from types import SimpleNamespace
from typing import Optional

import torch
import torch.distributed as dist

from .errors import UserError
from .launch import argv_of, launcher_world_size, local_threads, maybe_launch, under_launcher
from .train_args import DEFAULT_NPROC, add_arguments, model_config, resolve

__all__ = ["add_arguments", "run", "train", "iteration_flops"]


class TrainingDiverged(RuntimeError):
    pass


def iteration_flops(cfg, global_batch: int, recompute: bool, padded_vocab: int) -> float:
    """FLOPs of one iteration, the planner's formula (:func:`tnlg.plan.flops.flops_per_iteration`: Narayanan
    et al. 2021 eq. 3 generalised to any ``--ffn-hidden-size``). ``recompute=False`` gives the model FLOPs
    (the MFU numerator); ``recompute=True`` adds the recomputed forward, the executed FLOPs of HFU."""
    from .plan.flops import flops_per_iteration
    return flops_per_iteration(cfg, global_batch, recompute, padded_vocab)


def measure_peak_tflops(dtype: torch.dtype, device: torch.device, n: Optional[int] = None, trials: int = 5,
                        min_seconds: float = 0.15) -> float:
    """Dense ``n x n`` matmul rate of one rank (its threads, the training dtype): the MFU denominator.

    One short matmul timed at start made MFU swing from 15% to 62% between identical runs: it caught
    the other ranks of the machine busy or idle by chance. Here, when a process group exists, every
    rank times the same number of matmuls at the same moment (a barrier before each trial), so the
    ranks share the cores as they do in training, and a trial ends when the slowest rank is done; a
    trial lasts at least ``min_seconds``, and the fastest of ``trials`` counts (the same on every rank).
    Operands come from a private generator: the global RNG streams are not touched. Collective.
    """
    n = n or (8192 if device.type == "cuda" else 1024)
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, generator=gen).to(dtype)
    b = torch.randn(n, n, device=device, generator=gen).to(dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    group = dist.is_available() and dist.is_initialized()

    def timed(reps: int) -> float:
        sync()
        t = time.perf_counter()
        for _ in range(reps):
            torch.mm(a, b)
        sync()
        return time.perf_counter() - t

    timed(1)  # warm-up (library initialisation)
    reps = torch.tensor([max(1, math.ceil(min_seconds / max(timed(1), 1e-6)))], dtype=torch.float64, device=device)
    if group:
        dist.all_reduce(reps, op=dist.ReduceOp.MAX)  # the same work on every rank
    best = math.inf
    for _ in range(trials):
        if group:
            dist.barrier()
        dt = torch.tensor([timed(int(reps.item()))], dtype=torch.float64, device=device)
        if group:  # the trial ends when the last rank is done: no rank counts the others' idle time
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        best = min(best, dt.item() / int(reps.item()))
    return 2.0 * n ** 3 / best / 1e12


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux: KiB


# --------------------------------------------------------------------------- CLI

def run(args) -> int:
    """Entry of ``tnlg pretrain``: validate everything, prepare data, launch or train here.

    The workers get exactly the options in ``args`` (rebuilt from the parsed namespace, never read
    from ``sys.argv``), plus ``--save`` when this process chose the built-in job's folder.
    """
    try:
        return _run(args)
    except KeyboardInterrupt:  # during start-up, before training installs its handlers
        if _rank0():
            print("tnlg pretrain: interrupted during start-up, before the first iteration.", file=sys.stderr)
        return 130


def _rank0() -> bool:
    return os.environ.get("RANK", "0") == "0"


def default_nproc(device: Optional[str] = None) -> int:
    """Local processes when neither a launcher nor ``--nproc-per-node`` says: one per GPU when
    training on GPUs (a machine with one GPU trains in one process, on it), else 4 CPU processes."""
    from .parallel.state import pick_device
    if pick_device(device).type == "cuda":
        return max(1, torch.cuda.device_count())
    return DEFAULT_NPROC


def _run(args) -> int:
    world = launcher_world_size()
    nproc = None
    if world is None:
        nproc = getattr(args, "nproc_per_node", None) or default_nproc(getattr(args, "device", None))
        world = nproc
    o = resolve(args, world_size=world)  # also refuses --device cuda without a GPU and --fp16 on a CPU
    note = _choose_save(o, args)  # the built-in job's folder, or the --load root; or why nothing is saved
    if o.data_path is None:  # the built-in corpus: prepared here once, found by the workers
        from .data.corpus import default_dataset
        prefix, tok = default_dataset()
        o.data_path, o.tokenizer_model = [prefix], o.tokenizer_model or tok
    if nproc is not None and nproc > 1 and not under_launcher():
        argv = argv_of(add_arguments, args)
        if not hasattr(args, "save") and o.save is not None and o.load is None:
            argv += ["--save", o.save]  # the folder chosen here: every worker, and a restarted group, uses it
            print(note, flush=True)  # the workers see a --save and say nothing of it
        if not hasattr(args, "nproc_per_node"):
            argv += ["--nproc-per-node", str(nproc)]  # so that rank 0's resume command keeps the layout
        return maybe_launch("pretrain", argv, nproc, max_restarts=o.max_restarts or 0)
    if note and _rank0():
        print(note, flush=True)
    summary = train(o)
    stopped = summary.get("interrupted")
    if _rank0():
        if stopped:
            print(_interrupted_message(stopped, o, args), file=sys.stderr, flush=True)
        elif o.save is None:
            print("tnlg pretrain: finished; no checkpoint was saved (no --save)"
                  + (f"; metrics are in {o.metrics_file}." if o.metrics_file else ", and no metrics or loss plot.")
                  + " Pass --save DIR to keep a run.", flush=True)
    # a worker that stopped as asked exits 0 (a launcher would count anything else as a failure and restart
    # the group); a lone process exits as shells expect of a signalled command
    return 128 + int(signal.Signals[stopped["signal"]]) if stopped and not under_launcher() else 0


def _checkpoint_root(path: str) -> str:
    """The root of a ``--load`` path: its parent for an ``iter_*`` directory, else the path itself."""
    from .checkpoint.files import META
    path = os.path.normpath(path)
    return os.path.dirname(path) or "." if os.path.isfile(os.path.join(path, META)) else path


def _choose_save(o: SimpleNamespace, args) -> Optional[str]:
    """Where a run without ``--save`` saves (sets ``o.save``), and the note that says so; ``None`` with
    ``--save``. Never lose work silently: the built-in job gets a fresh folder, a resumed run saves back
    into the root it loaded from, any other run saves nothing and says so now and at the end."""
    if o.save is not None:
        return None
    if o.load is not None:
        root = _checkpoint_root(o.load)
        if not os.access(root, os.W_OK):
            raise UserError(f"--load {o.load!r} without --save would save back into {root!r}, which is not "
                            f"writable. Pass --save DIR for this run's checkpoints.")
        o.save = root
        return (f"note: no --save: checkpoints, metrics.jsonl and the loss plot go back into {root}, the "
                f"checkpoint root --load reads from (--save DIR writes elsewhere).")
    if o.builtin_job:
        o.save = _builtin_folder()
        return (f"note: the built-in job saves its checkpoints, metrics.jsonl and loss plot in {o.save} "
                f"(--save DIR chooses the folder).")
    return ("note: no --save: this run writes no checkpoint"
            + ("" if o.metrics_file else ", no metrics and no loss plot")
            + "; its training is lost when it ends. Pass --save DIR to keep it.")


def _builtin_folder() -> str:
    """A new folder for the built-in job: one name for every process of the run."""
    if under_launcher():  # each process would read its own clock: use the launcher's run id
        run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
        if not run_id or run_id == "none":
            raise UserError("the built-in job under this launcher needs --save DIR: the launcher sets no run id "
                            "(TORCHELASTIC_RUN_ID), so the processes cannot agree on a new folder.")
        return os.path.join("runs", f"pretrain-{run_id}")
    return os.path.join("runs", time.strftime("pretrain-%Y%m%d-%H%M%S"))


def _last_checkpoint(save: Optional[str]) -> Optional[int]:
    """The iteration a resume from ``save`` would load (``None``: no checkpoint)."""
    from .checkpoint.files import complete_iterations, read_latest
    if not save or not os.path.isdir(save):
        return None
    try:
        latest = read_latest(save)
    except UserError:
        latest = None
    done = complete_iterations(save)
    return latest if latest in done else (done[-1] if done else None)


def resume_command(args, o: SimpleNamespace) -> str:
    """The command that continues this run: its options, with ``--save`` as chosen, and without a
    ``--load`` that would reload the old starting point once the save root holds a newer checkpoint."""
    ns = argparse.Namespace(**{k: v for k, v in vars(args).items() if k != "command"})
    if o.save is not None and o.load is None and not hasattr(args, "save"):
        ns.save = o.save  # the built-in job's folder
    if o.load is not None and _last_checkpoint(o.save) is not None:
        if hasattr(args, "save"):
            del ns.load  # resumes from --save by itself
        else:
            ns.load = o.save  # the root, not the iteration it started from
    argv = argv_of(add_arguments, ns)
    return "tnlg pretrain" + (" " + shlex.join(argv) if argv else "")


def _interrupted_message(info: dict, o: SimpleNamespace, args) -> str:
    """One paragraph: where the run stopped, the last checkpoint, and how to go on."""
    how = f"{info['signal']}, stopped at once" if info["forced"] else info["signal"]
    head = f"tnlg pretrain: interrupted ({how}) at iteration {info['iteration']} of {o.train_iters}"
    if o.save is None:
        return (f"{head}. This run saved nothing (no --save); to keep checkpoints, start it again with "
                f"--save DIR.")
    last = _last_checkpoint(o.save)
    where = (f"the last checkpoint is iteration {last} in {o.save}" + (" (saved now)" if info["saved"] else "")
             if last is not None else f"there is no checkpoint in {o.save} yet, so a resume starts over")
    torchrun = under_launcher() and not hasattr(args, "nproc_per_node")
    return (f"{head}; {where}. Resume with: {resume_command(args, o)}"
            + (" (under torchrun: the same torchrun command with these arguments)" if torchrun else ""))


# --------------------------------------------------------------------------- training

def _log(ps, *msg) -> None:
    if ps.rank == 0:
        print(*msg, flush=True)


def _batches(dataset, sampler_iter, device):
    from .data.sampler import collate
    idx = next(sampler_iter)
    batch = collate([dataset[i] for i in idx])
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def _forward(model, batch, autocast: Optional[torch.dtype], device):
    with torch.autocast(device_type=device.type, dtype=autocast or torch.float32, enabled=autocast is not None):
        return model(batch["tokens"], labels=batch["labels"], loss_mask=batch.get("loss_mask"),
                     position_ids=batch.get("position_ids"), attention_mask=batch.get("attention_mask"))


@torch.no_grad()
def evaluate(model, dataset, o, ps, autocast) -> Optional[float]:
    """Mean loss over the first ``--eval-iters`` global batches of ``dataset`` (same batches every time)."""
    from .data.sampler import MegatronPretrainingSampler
    if dataset is None or o.eval_iters == 0:
        return None
    total = min(len(dataset), o.eval_iters * o.global_batch_size)
    if total < o.micro_batch_size * ps.dp_size:
        return None
    sampler = iter(MegatronPretrainingSampler(total, 0, o.micro_batch_size, ps.dp_rank, ps.dp_size))
    was_training = model.training
    model.eval()
    losses = []
    for _ in range(total // (o.micro_batch_size * ps.dp_size)):
        losses.append(_forward(model, _batches(dataset, sampler, ps.device), autocast, ps.device).float())
    model.train(was_training)
    loss = torch.stack(losses).mean().reshape(1)
    if ps.dp_group is not None:
        dist.all_reduce(loss, group=ps.dp_group)
        loss /= ps.dp_size
    return loss.item()


def _validation_plan(valid_ds, o, ps) -> bool:
    """Whether this run validates; when it cannot, say why once (rank 0). ``--eval-interval 0`` is off
    by request, silently."""
    if not o.eval_interval:
        return False
    if o.eval_iters == 0:
        _log(ps, "note: --eval-iters 0: this run does no validation.")
        return False
    if valid_ds is None:
        _log(ps, "note: the validation split is empty; validation is skipped.")
        return False
    need = o.micro_batch_size * ps.dp_size
    if min(len(valid_ds), o.eval_iters * o.global_batch_size) < need:
        _log(ps, f"note: the validation split holds {len(valid_ds)} samples, fewer than one micro batch per "
                 f"data-parallel rank ({need}); validation is skipped.")
        return False
    return True


def _validate(model, valid_ds, o, ps, autocast, iteration: int, record) -> Optional[float]:
    """Validate, print and record one validation loss (the one place a validation loss is formatted)."""
    v = evaluate(model, valid_ds, o, ps, autocast)
    if v is None:
        return None
    when = "before training" if iteration == 0 else f"at iteration {iteration}"
    _log(ps, f"validation {when}: loss {v:.4f} | ppl {math.exp(min(20, v)):.2f}")
    record(dict(split="valid", iteration=iteration, loss=v, ppl=math.exp(min(20, v))))
    return v


def _open_metrics(path: str, resumed_at: int):
    """The metrics file, opened for appending. A run from scratch starts it afresh; a resumed run first
    drops the records past the iteration it resumed from (an interrupted run's last iterations are
    trained again), so every iteration appears once and in order. The old file is replaced atomically."""
    if resumed_at <= 0 or not os.path.exists(path):
        return open(path, "w")
    tmp = f"{path}.tmp{os.getpid()}"
    dropped = 0
    with open(path) as src, open(tmp, "w") as dst:
        for line in src:
            try:
                keep = int(json.loads(line)["iteration"]) <= resumed_at
            except (ValueError, KeyError, TypeError):  # a torn last line of a killed run
                keep = False
            if keep:
                dst.write(line if line.endswith("\n") else line + "\n")
            else:
                dropped += 1
    os.replace(tmp, path)
    if dropped:
        print(f"{path}: dropped {dropped} record(s) past iteration {resumed_at}, the iteration this run "
              f"resumes from (they are trained again).", flush=True)
    return open(path, "a")


def train(o: SimpleNamespace, return_params: bool = False) -> dict:
    """Train with options ``o`` (from :func:`tnlg.train_args.resolve`) in this process.

    Returns a summary: per-iteration ``losses`` and ``grad_norms``, the first and
    last validation loss, and with ``return_params`` the full (TP=1, unpadded)
    parameters after training (collective: gathers over DP for ZeRO-3 and over TP).

    SIGINT and SIGTERM only set a flag while it runs (main thread): at the end of the
    iteration every rank agrees to stop, after saving that iteration for SIGTERM with
    ``--save``; a second signal stops at once. Either way the summary's ``interrupted``
    says ``signal``, ``iteration`` and ``saved``.
    """
    from .checkpoint.signals import StopOnSignal
    restore = _second_sigterm_interrupts()
    stop = StopOnSignal((signal.SIGTERM, signal.SIGINT))
    try:
        return _train(o, stop, return_params)
    finally:
        stop.close()
        restore()


def _second_sigterm_interrupts():
    """While training, a SIGTERM that StopOnSignal passes on (the second one) raises KeyboardInterrupt as
    a second Ctrl-C does, so both end in the same short message. Returns the function that restores."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = signal.getsignal(signal.SIGTERM)

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)
    return lambda: signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


def _agreed_signal(stop, ps) -> int:
    """The signal that stops every rank (collective; SIGTERM wins over SIGINT: it asks for a save)."""
    n = torch.tensor([float(stop.received or 0)], device=ps.device)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(n, op=dist.ReduceOp.MAX)
    return int(n.item())


def _train(o: SimpleNamespace, stop, return_params: bool) -> dict:
    from .data.gpt_dataset import build_train_valid_test_datasets
    from .data.sampler import MegatronPretrainingSampler
    from .data.tokenizer import load_tokenizer
    from .model import GPT
    from .optim import DynamicLossScaler, LRSchedule, build_engine
    from .parallel.random import seed_everything
    from .parallel.state import init_parallel

    torch.set_num_threads(local_threads())
    ps = init_parallel(o.tensor_model_parallel_size, timeout=timedelta(minutes=o.distributed_timeout_minutes),
                       device=o.device)
    if o.global_batch_size is None:  # Megatron's default, when resolve did not know the layout
        o.global_batch_size = o.micro_batch_size * ps.dp_size
    if o.global_batch_size % (o.micro_batch_size * ps.dp_size):
        raise UserError(f"--global-batch-size {o.global_batch_size} is not divisible by --micro-batch-size "
                        f"{o.micro_batch_size} x data-parallel size {ps.dp_size}.")
    accum = o.global_batch_size // (o.micro_batch_size * ps.dp_size)
    seed_everything(o.seed)
    tokenizer = load_tokenizer(o.tokenizer_model)
    cfg = model_config(o, tokenizer.vocab_size)
    autocast = torch.bfloat16 if o.bf16 else (torch.float16 if o.fp16 else None)
    scaler = DynamicLossScaler() if o.fp16 else None
    if o.zero_impl == "deepspeed":  # optional engine: DeepSpeed's ZeRO over our TP/DP groups (fp32 params)
        from .optim.deepspeed_engine import build_deepspeed_engine as build
        model, extra = GPT(cfg, ps), dict(micro_batch_size=o.micro_batch_size)
    else:
        # built on the meta device and materialised by the engine straight into its (16-bit, for
        # --bf16/--fp16) flat buffers: no transient copy of the model at start-up
        build, model = build_engine, GPT(cfg, ps, device="meta")
        extra = dict(param_dtype=autocast, accumulate_grads_in_fp32=o.accumulate_allreduce_grads_in_fp32)
    engine = build(model, ps, o.zero_stage, lr=o.lr, weight_decay=o.weight_decay,
                   betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps, clip_grad=o.clip_grad,
                   grad_accum_steps=accum, bucket_size_mb=o.bucket_size_mb, loss_scaler=scaler, **extra)
    model = engine.model
    schedule = LRSchedule(max_lr=o.lr, min_lr=o.min_lr, warmup_iters=o.lr_warmup_iters,
                          decay_iters=o.lr_decay_iters or o.train_iters, decay_style=o.lr_decay_style)

    evals = (o.train_iters // o.eval_interval + 1) * o.eval_iters * o.global_batch_size if o.eval_interval else 0
    barrier = (lambda: dist.barrier()) if dist.is_initialized() else None
    train_ds, valid_ds, _test_ds = build_train_valid_test_datasets(
        o.data_path, o.split, cfg.seq_length, (o.train_iters * o.global_batch_size, evals,
                                               o.eval_iters * o.global_batch_size),
        o.seed, cache_dir=o.data_cache_path, eod_id=tokenizer.eod_id, eod_mask_loss=o.eod_mask_loss,
        reset_position_ids=o.reset_position_ids, reset_attention_mask=o.reset_attention_mask,
        vocab_size=tokenizer.vocab_size, barrier=barrier)
    if train_ds is None:
        raise UserError(f"--split {o.split!r} leaves no documents for training.")
    validating = _validation_plan(valid_ds, o, ps)  # says once why not

    # measured before loading: it draws random numbers, and a resumed run continues the restored RNG streams
    peak = o.peak_tflops or measure_peak_tflops(autocast or torch.float32, ps.device)
    iteration, consumed = 0, 0
    ckpt = None
    if o.save or o.load:
        from . import checkpoint as ckpt
    # --load, else resume automatically from --save when it holds a checkpoint (elastic restarts rely on it)
    load_dir, origin = (o.load, "--load") if o.load else (o.save, "--save")
    if load_dir and (o.load or ckpt.has_checkpoint(o.save)):
        state = ckpt.load(load_dir, model=model, engine=engine, ps=ps, config=cfg, options=o,
                          tokenizer=tokenizer, origin=origin)
        if state is not None:
            iteration, consumed = state["iteration"], state["consumed_samples"]
            _log(ps, f"resumed from {state['path']} at iteration {iteration} ({consumed} samples consumed)")

    metrics_path = o.metrics_file or (os.path.join(o.save, "metrics.jsonl") if o.save else None)
    metrics = None
    if ps.rank == 0 and metrics_path:
        os.makedirs(os.path.dirname(os.path.abspath(metrics_path)), exist_ok=True)
        metrics = _open_metrics(metrics_path, iteration)

    def record(d: dict) -> None:
        if metrics is not None:
            metrics.write(json.dumps(d) + "\n")
            metrics.flush()

    # model FLOPs (MFU: what the model needs) and executed FLOPs (HFU: + the recomputed forward), any ffn width
    flops = iteration_flops(cfg, o.global_batch_size, False, model_padded_vocab(engine))
    hw_flops = iteration_flops(cfg, o.global_batch_size, o.recompute_activations, model_padded_vocab(engine))
    tokens_per_iter = o.global_batch_size * cfg.seq_length
    n_params = sum(getattr(p, "ds_numel", p.numel()) for p in engine.model.parameters())  # (DeepSpeed ZeRO-3)
    _log(ps, f"tnlg pretrain: {n_params:,} parameters on this rank "
             f"(TP={ps.tp_size} x DP={ps.dp_size}, ZeRO stage {o.zero_stage}, {accum} accumulation step(s), "
             f"{'bf16' if o.bf16 else 'fp16' if o.fp16 else 'fp32'}); {o.train_iters} iterations of "
             f"{o.global_batch_size} x {cfg.seq_length} tokens; peak {peak:.3f} TFLOP/s per rank "
             f"({'--peak-tflops' if o.peak_tflops else 'measured: dense matmuls on every rank at once, best of 5'})")

    summary = dict(first_valid_loss=None, last_valid_loss=None, losses=[], grad_norms=[])
    if validating and iteration == 0:
        summary["first_valid_loss"] = _validate(model, valid_ds, o, ps, autocast, 0, record)

    sampler = iter(MegatronPretrainingSampler(len(train_ds), consumed, o.micro_batch_size, ps.dp_rank,
                                              ps.dp_size))
    model.train()
    window_t, window_loss, window_n = time.perf_counter(), 0.0, 0
    try:
        while iteration < o.train_iters:
            t0 = time.perf_counter()
            lr = schedule.lr(engine.num_steps)
            engine.zero_grad()
            micro_losses = []
            for _ in range(accum):
                loss = _forward(model, _batches(train_ds, sampler, ps.device), autocast, ps.device)
                engine.backward(loss)
                micro_losses.append(loss.detach().float())
            loss = torch.stack(micro_losses).mean().reshape(1)
            if ps.dp_group is not None:
                dist.all_reduce(loss, group=ps.dp_group)
                loss /= ps.dp_size
            loss = loss.item()
            if not math.isfinite(loss):
                raise TrainingDiverged(f"the training loss is {loss} at iteration {iteration + 1}; stopping before "
                                       f"the optimizer step (no checkpoint is written from this state). Lower --lr, "
                                       f"raise --lr-warmup-iters, or check the data.")
            info = engine.step(lr)
            iteration += 1
            consumed += o.global_batch_size
            dt = time.perf_counter() - t0
            tflops = flops / dt / ps.world_size / 1e12
            rec = dict(iteration=iteration, consumed_samples=consumed, loss=loss, lr=lr, grad_norm=info["grad_norm"],
                       skipped=info["skipped"], ms_per_iter=dt * 1e3, tokens_per_s=tokens_per_iter / dt,
                       tflops=tflops, mfu=tflops / peak, hfu=hw_flops / dt / ps.world_size / 1e12 / peak,
                       peak_tflops=peak, peak_memory_bytes=peak_memory_bytes(ps.device))
            if info.get("loss_scale") is not None:
                rec["loss_scale"] = info["loss_scale"]
            record(rec)
            summary["losses"].append(loss)
            summary["grad_norms"].append(info["grad_norm"])
            window_loss, window_n = window_loss + loss, window_n + 1
            if iteration % o.log_interval == 0 or iteration == o.train_iters:
                span = time.perf_counter() - window_t
                _log(ps, f"iter {iteration:6d}/{o.train_iters} | samples {consumed:8d} | lr {lr:.3e} | "
                         f"loss {window_loss / window_n:.4f} | grad norm {info['grad_norm']:.3f} | "
                         f"{span / window_n * 1e3:7.1f} ms/iter | {tokens_per_iter * window_n / span:8.0f} tok/s | "
                         f"{flops * window_n / span / ps.world_size / 1e12:.3f} model TFLOP/s/rank | "
                         f"MFU {flops * window_n / span / ps.world_size / 1e12 / peak:.1%}"
                         + (f" HFU {hw_flops * window_n / span / ps.world_size / 1e12 / peak:.1%}"
                            if o.recompute_activations else "")
                         + f" of {peak:.3f} | "
                         f"mem {rec['peak_memory_bytes'] / 2**20:.0f} MiB"
                         + (" | skipped (overflow)" if info["skipped"] else ""))
                window_t, window_loss, window_n = time.perf_counter(), 0.0, 0
            last = iteration == o.train_iters
            if validating and (iteration % o.eval_interval == 0 or last):
                summary["last_valid_loss"] = _validate(model, valid_ds, o, ps, autocast, iteration, record)
            # collective: every rank agrees to stop at the same iteration, and on the signal
            signum = _agreed_signal(stop, ps) if stop.requested(ps, iteration) and not last else 0
            saving = (o.save_interval and iteration % o.save_interval == 0) or last or signum == signal.SIGTERM
            if o.save and saving:
                ckpt.save(o.save, iteration=iteration, consumed_samples=consumed, model=model, engine=engine, ps=ps,
                          config=cfg, options=o, tokenizer=tokenizer, keep_last=o.keep_last)
                _log(ps, f"saved checkpoint at iteration {iteration} to {o.save}")
            if signum:
                summary["interrupted"] = dict(signal=signal.Signals(signum).name, iteration=iteration,
                                              saved=bool(o.save and saving), forced=False)
                summary["stopped_by_signal"] = True
                break
    except KeyboardInterrupt:  # a second signal (or a Ctrl-C outside the handler's reach): stop at once
        summary["interrupted"] = dict(signal=signal.Signals(stop.received or signal.SIGINT).name,
                                      iteration=iteration, saved=False, forced=True)
        summary["stopped_by_signal"] = True

    if metrics is not None:
        metrics.close()
        if o.plot:
            _plot(metrics_path)
    if not summary.get("stopped_by_signal"):
        _sample(model, tokenizer, o, ps)
    if return_params:
        summary["params"] = _full_params(engine, cfg, ps)
    return summary


def _full_params(engine, cfg, ps) -> dict:
    """Full TP=1 tensors of every parameter, whatever the ZeRO stage (collective over DP and TP)."""
    from .model import GPT
    from .parallel.state import ParallelState
    from .shards import gather_full
    with torch.device("meta"):  # the partition metadata of this rank's shard, without memory
        meta = dict(GPT(cfg, ParallelState(tp_rank=ps.tp_rank, tp_size=ps.tp_size, virtual=True)).named_parameters())
    return {n: gather_full(t.detach().cpu(), meta[n], ps) for n, t in engine.model_state_by_param().items()}


def model_padded_vocab(engine) -> int:
    return engine.model.config.padded_vocab_size(engine.ps.tp_size)


def _curves(metrics_path: str) -> tuple[list, list]:
    """``(iteration, loss)`` points of training and validation, in iteration order, one per iteration
    (a repeated iteration keeps its last record): no line of the plot runs backwards."""
    points: dict = {"train": {}, "valid": {}}
    with open(metrics_path) as f:
        for line in f:
            try:
                r = json.loads(line)
            except ValueError:  # a torn last line of a killed run
                continue
            if r.get("loss") is not None:
                points["valid" if r.get("split") == "valid" else "train"][r["iteration"]] = r["loss"]
    return sorted(points["train"].items()), sorted(points["valid"].items())


def _plot(metrics_path: str) -> None:
    """Loss curve (training and validation) next to the metrics file."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    train, valid = _curves(metrics_path)
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot(*zip(*train), label="train", lw=1)
    if valid:
        ax.plot(*zip(*valid), "o-", label="validation")
    ax.set_xlabel("iteration")
    ax.set_ylabel("loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    out = os.path.splitext(metrics_path)[0] + "_loss.png"
    tmp = out + ".tmp.png"
    fig.savefig(tmp, dpi=100, bbox_inches="tight")
    plt.close(fig)
    os.replace(tmp, out)
    print(f"loss curve: {out}", flush=True)


def _sample(model, tokenizer, o, ps) -> None:
    if not o.sample_prompt or not o.sample_tokens:
        return
    try:
        from .generate import generate
    except ImportError:
        return
    model.eval()
    text = generate(model, tokenizer, [o.sample_prompt], max_new_tokens=o.sample_tokens, greedy=False,
                    temperature=0.8, top_k=40, seed=o.seed)[0]
    _log(ps, f"sample:\n{o.sample_prompt}{text}")
