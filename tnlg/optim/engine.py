"""The data-parallel engine the training loop uses: ZeRO 0-3 composed with tensor parallelism.

One iteration with ``grad_accum_steps = k``::

    engine.zero_grad()
    for micro_batch in micro_batches:            # k of them
        loss = engine.model(tokens, labels=labels)  # mean loss of this micro batch
        engine.backward(loss)                     # the engine divides by k (and loss-scales)
    info = engine.step(lr)                        # {"grad_norm": ..., "skipped": ..., ...}

* ``backward`` counts micro steps: only the k-th communicates (bucketed,
  asynchronous reduction overlapped with backward); the first k-1 only
  accumulate. It scales the loss by ``loss_scale / k`` itself, so the caller
  passes the plain mean loss of the micro batch and global batch =
  micro batch x DP x k gives the same gradient as one big batch.
* ``backward_all(run)`` replaces the ``k`` ``backward`` calls when a pipeline schedule runs
  every micro batch's backward itself (``run(factor)``): nothing is communicated while it
  runs, and the whole gradient is reduced over DP at ``step``.
* ``step`` waits for the gradient reduction, unscales, computes the global
  gradient norm (:mod:`tnlg.optim.clip`), skips the update when the norm is
  inf/NaN (and lowers the loss scale if one is used), else clips by
  ``min(1, clip_grad / (norm + 1e-6))``, runs AdamW and brings the parameters
  up to date (stage 1: all-gather). The next ``backward`` requires ``zero_grad()``.

The engine owns the iteration's call protocol and the hyper-parameters a checkpoint
records (step count, stage, AdamW's settings, loss scaler); a *backend*
(:class:`tnlg.optim.backend.DataParallelBackend`) owns the parameters, gradients and
optimizer states and their DP communication. Stages 0 and 1 are
:class:`tnlg.optim.zero.FlatZero` (our flat buffers); 2 and 3 are
:class:`tnlg.optim.fsdp.FSDPZero` (FSDP2); ``--zero-impl deepspeed`` is
:class:`tnlg.optim.deepspeed_engine.DeepSpeedBackend`. With one DP rank there
is nothing to shard: every stage then runs the flat stage-0 path (same
numbers, no communication). Precision: ``param_dtype`` bf16/fp16 is ZeRO's
mixed precision (16-bit parameters and gradients, fp32 master weights and Adam
moments of the owned slice; see :func:`build_engine`); without it parameters
keep the dtype they are built with.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch
import torch.nn as nn

from ..errors import UserError
from ..parallel.state import ParallelState
from .backend import DataParallelBackend, PipelineBackend
from .fsdp import FSDPZero
from .kinds import KindsBackend, needs_kinds
from .scaler import DynamicLossScaler
from .zero import FlatZero, default_decay

__all__ = ["Engine", "build_engine", "check_optimizer_args", "check_states", "common_step", "STATE_FORMAT"]

STATE_FORMAT = "tnlg.optim/1"


class Engine:
    """Drives a :class:`~tnlg.optim.backend.DataParallelBackend`; see the module docstring for the protocol.

    ``betas``, ``eps`` and ``weight_decay`` are AdamW's settings the backend was built with;
    the engine keeps them for :meth:`hyperparameters` (what a checkpoint records).
    """

    def __init__(self, backend: DataParallelBackend, ps: ParallelState, zero_stage: int, lr: float,
                 clip_grad: float, grad_accum_steps: int, loss_scaler: Optional[DynamicLossScaler], *,
                 betas=(0.9, 0.95), eps: float = 1e-8, weight_decay: float = 0.0):
        self.backend = backend
        self.ps = ps
        self.zero_stage = zero_stage
        self.lr = lr
        self.clip_grad = clip_grad
        self.grad_accum_steps = grad_accum_steps
        self.loss_scaler = loss_scaler
        self.betas = (float(betas[0]), float(betas[1]))
        self.eps, self.weight_decay = float(eps), float(weight_decay)
        self._num_steps = 0         # successful optimizer steps (Adam's step count)
        self._micro = 0
        self._needs_zero = False

    # ----------------------------------------------------------------- properties
    @property
    def num_steps(self) -> int:
        """Successful optimizer steps: Adam's step count and the LR schedule's position."""
        return self._num_steps

    @num_steps.setter
    def num_steps(self, step: int) -> None:
        self._num_steps = int(step)
        self.backend.set_step(self._num_steps)

    @property
    def model(self) -> nn.Module:
        """The module to call (FSDP-sharded in place for stages 2/3, wrapped for DeepSpeed; same names)."""
        return self.backend.model

    @property
    def impl(self) -> str:
        return self.backend.impl

    @property
    def param_names(self) -> list[str]:
        return list(self.backend.names)

    @property
    def param_dtype(self) -> torch.dtype:
        """The parameters' dtype (what the checkpoint's weight files hold)."""
        return self.backend.dtype

    @property
    def is_last_micro_step(self) -> bool:
        """True when the next ``backward`` is the one that communicates."""
        return self._micro == self.grad_accum_steps - 1

    # ----------------------------------------------------------------- training
    def backward(self, loss: torch.Tensor) -> None:
        """Backward of one micro batch's mean loss, divided by ``grad_accum_steps`` and loss-scaled here.

        The ``grad_accum_steps``-th call since ``zero_grad`` reduces gradients over
        DP, overlapped with backward; earlier calls do no communication.
        """
        if self._needs_zero:
            raise RuntimeError("engine.backward() after engine.step() without engine.zero_grad(): the "
                               "previous step's gradients would be added to this one's.")
        if self._micro >= self.grad_accum_steps:
            raise RuntimeError(f"engine.backward() called {self._micro + 1} times before step(), but "
                               f"grad_accum_steps={self.grad_accum_steps}.")
        factor = 1.0 / self.grad_accum_steps
        if self.loss_scaler is not None:
            factor *= self.loss_scaler.scale
        self.backend.backward(loss, factor, self.is_last_micro_step)
        self._micro += 1

    def backward_all(self, run: Callable[[float], None]) -> None:
        """Every micro batch's backward at once, by ``run(factor)`` (a pipeline schedule, which multiplies
        each micro batch's mean loss by ``factor`` = loss scale / ``grad_accum_steps`` before backward).

        No DP communication while it runs (gradients accumulate in place); the whole gradient is
        reduced over DP once, after the last micro batch's backward on this stage: at :meth:`step` by the
        flat stages 0/1; at stages 2/3 by torch's schedule itself, which reduce-scatters FSDP2's
        accumulated gradients after its last backward (:class:`tnlg.optim.fsdp.ChunkModules`)."""
        if self._needs_zero or self._micro:
            raise RuntimeError("engine.backward_all() needs engine.zero_grad() first.")
        factor = 1.0 / self.grad_accum_steps
        if self.loss_scaler is not None:
            factor *= self.loss_scaler.scale
        backend = self._pipeline_backend()
        backend.set_sync(False)
        run(factor)
        backend.set_sync(True)  # step's finish_grad_sync launches every bucket's reduction
        self._micro = self.grad_accum_steps

    def grad_view(self, name: str) -> torch.Tensor:
        """The gradient of parameter ``name`` the optimizer steps, as a view: into the flat buffer (stages 0/1),
        or this rank's FSDP shard of it after the reduce-scatter (stages 2/3)."""
        return self._pipeline_backend().grad_view(name)

    def _pipeline_backend(self) -> PipelineBackend:
        """The backend as a pipeline drives it; a clear error for one that cannot (DeepSpeed's)."""
        if not isinstance(self.backend, PipelineBackend):
            raise UserError(f"a pipeline schedule runs with tnlg's ZeRO (--zero-impl tnlg), not with the "
                            f"{self.backend.impl} backend.")
        return self.backend

    def step(self, lr: Optional[float] = None, loss: Optional[torch.Tensor] = None) -> dict:
        """Finish the gradient reduction, clip, update; returns ``grad_norm`` (before clipping, unscaled),
        ``skipped`` (inf/NaN gradients: no update), ``clip_coeff``, ``loss_scale`` and ``lr``.

        ``loss`` (a device scalar, the iteration's loss) is read in the same host synchronisation as
        the norm and returned as ``info["loss"]``: the iteration's one device -> host read. If it is
        inf/NaN no update is made, the loss scaler is left alone and the step is not counted (the
        caller stops: :class:`tnlg.training.step.TrainingDiverged`).

        Collectives: waits for the bucket reductions; 2 tiny all-reduces (norm);
        stage 1 all-gathers the parameters.
        """
        if self._micro != self.grad_accum_steps:
            raise RuntimeError(f"engine.step() after {self._micro} backward call(s); expected "
                               f"grad_accum_steps={self.grad_accum_steps}.")
        lr = self.lr if lr is None else float(lr)
        scale = 1.0 if self.loss_scaler is None else self.loss_scaler.scale
        res = self.backend.step(lr, self.clip_grad, scale) if loss is None else \
            self.backend.step(lr, self.clip_grad, scale, loss)
        diverged = res.loss is not None and not math.isfinite(res.loss)
        if self.loss_scaler is not None and not diverged:
            self.loss_scaler.update(res.skipped)
        if not res.skipped:
            self._num_steps += 1
        self._micro = 0
        self._needs_zero = True
        info = dict(grad_norm=res.grad_norm, skipped=res.skipped, clip_coeff=res.clip_coeff, lr=lr,
                    loss_scale=None if self.loss_scaler is None else scale)
        if loss is not None:
            info["loss"] = res.loss
        return info

    def zero_grad(self) -> None:
        """Zero the gradients (flat buffers are zeroed in place; FSDP grads set to None)."""
        self.backend.zero_grad()
        self._micro = 0
        self._needs_zero = False

    def close(self) -> None:
        """Release what the backend holds beyond the object's life (DeepSpeed's hooks); unusable afterwards."""
        self.backend.close()

    # ----------------------------------------------------------------- state
    # Checkpoints stream from and into what each rank owns (``owned_pieces``); the by-parameter
    # dicts below are a convenience for tests and small models (they hold every state at once).
    @property
    def pieces_sharded_over_dp(self) -> bool:
        return self.backend.pieces_sharded_over_dp

    @property
    def has_master(self) -> bool:
        """True when parameters are 16-bit and the optimizer steps an fp32 master."""
        return self.backend.dtype != torch.float32

    def owned_pieces(self) -> Optional[list[dict]]:
        """This rank's part of every parameter's states, as views (see ``FlatZero.owned_pieces``);
        ``None`` for a backend without views (DeepSpeed: use :meth:`optimizer_state_by_param`)."""
        return self.backend.owned_pieces()

    def param_shapes(self) -> dict[str, tuple]:
        """``{name: shape}`` of this TP shard's parameters (full over DP); no communication."""
        return self.backend.param_shapes()

    def param_tensors(self, names):
        """``(name, tensor)`` of this TP shard, full over DP, one at a time (stage 3: collective)."""
        return self.backend.param_tensors(names)

    def load_param(self, name: str, value: torch.Tensor) -> None:
        """Copy a full (over DP) value of this TP shard of ``name`` into the model; no communication."""
        self.backend.load_param(name, value)

    def gather_params(self) -> None:
        """Bring every rank's parameters up to date from the owned slices (stage 1: all-gather)."""
        self.backend.gather_params()

    def refresh_master(self) -> None:
        """fp32 master of the owned slices <- the (16-bit) parameters."""
        self.backend.refresh_master()

    @torch.no_grad()
    def optimizer_state_by_param(self) -> dict[str, dict]:
        """``{name: {"exp_avg", "exp_avg_sq" (fp32, shaped like this rank's TP shard), "step"}}``.

        Independent of DP size and ZeRO stage. Collective over DP when states are partitioned
        (one all-reduce per parameter of the zero-filled full tensor); every DP rank gets the
        result. Holds every state at once: for tests and small models; checkpoints stream.
        """
        out = self.backend.optimizer_state_by_param()
        for st in out.values():
            st["step"] = self.num_steps
        return out

    @torch.no_grad()
    def load_optimizer_state_by_param(self, states: dict) -> None:
        """Inverse of :meth:`optimizer_state_by_param` at any DP size / stage: keeps this rank's part.

        No communication. Load the model's parameters first (the fp32 master, if any, is
        refreshed from them). All parameters must carry the same ``step``.
        """
        step = common_step(states)
        check_states(states, self.param_shapes())
        self.backend.load_optimizer_state_by_param(states)
        self.refresh_master()
        self.num_steps = step

    def state_dict(self) -> dict:
        """Layout-independent optimizer state (collective over DP): per-parameter states, step count,
        loss-scaler state and the hyper-parameters, for ``torch.save``."""
        return dict(format=STATE_FORMAT, params=self.optimizer_state_by_param(), **self.hyperparameters())

    def hyperparameters(self) -> dict:
        """What a checkpoint records next to the states: step count, stage, Adam's settings, loss scaler."""
        return dict(num_steps=int(self.num_steps), zero_stage=int(self.zero_stage), betas=list(self.betas),
                    eps=self.eps, weight_decay=self.weight_decay,
                    loss_scaler=None if self.loss_scaler is None else self.loss_scaler.state_dict())

    def load_state_dict(self, sd: dict) -> None:
        """Load a :meth:`state_dict` saved at any DP size and ZeRO stage (same TP shard shapes)."""
        if sd.get("format") != STATE_FORMAT:
            raise UserError(f"optimizer state has format {sd.get('format')!r}, expected {STATE_FORMAT!r}.")
        self.load_optimizer_state_by_param(sd["params"])
        self.num_steps = int(sd["num_steps"])
        if self.loss_scaler is not None and sd.get("loss_scaler"):
            self.loss_scaler.load_state_dict(sd["loss_scaler"])

    @torch.no_grad()
    def model_state_by_param(self) -> dict[str, torch.Tensor]:
        """This TP rank's parameters, full over DP (stage 3 all-gathers: collective over DP)."""
        return {n: t.clone() for n, t in self.param_tensors(self.param_names)}

    @torch.no_grad()
    def load_model_state_by_param(self, tensors: dict) -> None:
        """Copy parameters (this TP shard's shapes) into the model, whatever the stage; no communication."""
        for n in self.param_names:
            if n not in tensors:
                raise UserError(f"parameter {n!r}: no tensor given; expected one for every parameter.")
            self.load_param(n, tensors[n])
        self.refresh_master()

    def memory_report(self) -> dict:
        """Per-rank bytes: ``param_bytes``, ``grad_bytes``, ``optim_bytes`` (+ element counts)."""
        return self.backend.memory_report()


def build_engine(model: nn.Module, ps: ParallelState, zero_stage: int = 1, lr: float = 1e-4,
                 weight_decay: float = 0.0, betas=(0.9, 0.95), eps: float = 1e-8, clip_grad: float = 1.0,
                 grad_accum_steps: int = 1, bucket_size_mb: float = 25.0,
                 loss_scaler: Optional[DynamicLossScaler] = None,
                 decay_fn: Callable[[str, torch.Tensor], bool] = default_decay,
                 collectives: str = "auto", param_dtype: Optional[torch.dtype] = None,
                 accumulate_grads_in_fp32: bool = False,
                 init_fn: Optional[Callable[[str, torch.Tensor], torch.Tensor]] = None) -> Engine:
    """Wrap ``model`` (this rank's TP shard, already on ``ps.device``) for data-parallel training.

    ``zero_stage`` 0: all-reduce, full AdamW everywhere; 1: optimizer states
    partitioned (flat buffers); 2: + gradients sharded; 3: + parameters sharded
    (2 and 3 via FSDP2). ``clip_grad <= 0`` disables clipping. ``bucket_size_mb``
    sizes the gradient buckets of stages 0/1. ``decay_fn(name, param)`` picks the
    parameters that get weight decay (default: ``ndim >= 2``). ``collectives``
    (stages 0/1): ``auto``, ``native`` or ``p2p``, see :mod:`tnlg.optim.zero`.

    Precision (ZeRO's mixed precision): ``param_dtype`` (bf16/fp16) makes parameters and
    gradients 16-bit (2 + 2 bytes per parameter) with an fp32 master and Adam moments for the
    owned slice (12 bytes per owned parameter); ``accumulate_grads_in_fp32`` keeps an fp32
    gradient buffer instead (2 + 4 + 12/dp at stage 1; stages 0/1 only). ``None`` keeps the
    model's dtype.

    The model may be built on the meta device: each parameter is then materialised straight into
    the engine's buffers from ``init_fn(name, param)`` (default: the model's ``initial_shard``),
    so setup holds at most the final model states plus one parameter's initial value. Every rank
    of the world must call this (collectives are set up).
    """
    if zero_stage not in (0, 1, 2, 3):
        raise UserError(f"--zero-stage must be 0, 1, 2 or 3, got {zero_stage!r}.")
    experts = needs_kinds(model, ps, zero_stage)
    check_optimizer_args(lr, weight_decay, betas, eps, clip_grad, grad_accum_steps, bucket_size_mb)
    if param_dtype not in (None, torch.float32, torch.bfloat16, torch.float16):
        raise UserError(f"param_dtype must be torch.float32, torch.bfloat16 or torch.float16, got {param_dtype!r}.")
    low_precision = param_dtype in (torch.bfloat16, torch.float16)
    if accumulate_grads_in_fp32 and not low_precision:
        raise UserError("--accumulate-allreduce-grads-in-fp32 needs --bf16 or --fp16: in fp32 training the "
                        "gradients are fp32 already.")
    fsdp = zero_stage >= 2 and ps.dp_size > 1
    if accumulate_grads_in_fp32 and fsdp:
        raise UserError(f"--accumulate-allreduce-grads-in-fp32 is implemented for ZeRO stages 0 and 1 (our flat "
                        f"buffers), not for stage {zero_stage} (FSDP2 reduces and keeps gradients in the "
                        f"parameters' 16-bit dtype). Drop the flag or use --zero-stage 1.")
    init_fn = init_fn or getattr(model, "initial_shard", None)
    meta_buffers = [n for n, b in model.named_buffers() if b.device.type == "meta"]
    kw = dict(betas=betas, eps=eps, weight_decay=weight_decay, decay_fn=decay_fn, param_dtype=param_dtype,
              init_fn=init_fn)
    backend: DataParallelBackend
    if fsdp:
        backend = FSDPZero(model, ps, zero_stage, **kw)
    else:
        stage = zero_stage if zero_stage <= 1 else 0  # one DP rank: nothing to shard
        flat = dict(bucket_size_mb=bucket_size_mb, collectives=collectives,
                    grad_dtype=torch.float32 if accumulate_grads_in_fp32 else None, **kw)
        # with expert parallelism, one flat backend per gradient kind (tnlg.optim.kinds)
        backend = KindsBackend(model, ps, stage, **flat) if experts else FlatZero(model, ps, stage, **flat)
    _materialise_buffers(backend.model, meta_buffers, ps.device)
    return Engine(backend, ps, zero_stage, float(lr), float(clip_grad), grad_accum_steps, loss_scaler,
                  betas=betas, eps=eps, weight_decay=weight_decay)


def _materialise_buffers(model: nn.Module, names: list[str], device: torch.device) -> None:
    """The buffers ``names`` of a model built on the meta device, created on ``device`` at zero (after the backend
    materialised the parameters; FSDP's ``to_empty`` leaves them uninitialised): every buffer a tnlg model has
    starts at zero (a router's expert bias and its token counts, :class:`tnlg.model.moe.Router`)."""
    if device.type == "meta":
        return
    for name in names:
        owner, _, leaf = name.rpartition(".")
        module = model.get_submodule(owner) if owner else model
        old = module._buffers[leaf]
        assert old is not None  # (named_buffers lists set buffers only)
        module._buffers[leaf] = torch.zeros(old.shape, dtype=old.dtype, device=device)


def check_optimizer_args(lr, weight_decay, betas, eps, clip_grad, grad_accum_steps, bucket_size_mb) -> None:
    """The optimizer settings every engine accepts; a clear :class:`UserError` for a bad one."""
    if not isinstance(grad_accum_steps, int) or grad_accum_steps < 1:
        raise UserError(f"gradient accumulation steps must be a positive integer, got {grad_accum_steps!r} "
                        f"(global batch / (micro batch x data-parallel size)).")
    for name, value in (("--lr", lr), ("--weight-decay", weight_decay), ("--adam-eps", eps)):
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
            raise UserError(f"{name} must be a finite number >= 0, got {value!r}.")
    if not eps > 0:
        raise UserError(f"--adam-eps must be > 0, got {eps!r}.")
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise UserError(f"Adam betas must be two numbers in [0, 1), got {betas!r}.")
    if not (isinstance(clip_grad, (int, float)) and math.isfinite(clip_grad)):
        raise UserError(f"--clip-grad must be a finite number (0 disables clipping), got {clip_grad!r}.")
    if not bucket_size_mb > 0:
        raise UserError(f"the gradient bucket size must be > 0 MiB, got {bucket_size_mb!r}.")


def common_step(states: dict) -> int:
    """The one Adam step count all per-parameter states carry; a clear :class:`UserError` otherwise."""
    no_step = [n for n, d in states.items() if not isinstance(d, dict) or "step" not in d]
    if no_step:
        raise UserError(f"optimizer state of parameter {no_step[0]!r} has no 'step' count (Adam's bias "
                        f"correction needs it); pass the dict that optimizer_state_by_param() returned.")
    steps = {int(d["step"]) for d in states.values()} if states else {0}
    if len(steps) > 1:
        raise UserError(f"optimizer state has different step counts per parameter ({sorted(steps)[:4]}); "
                        f"this engine keeps one step count for all parameters.")
    return steps.pop()


def check_states(states: dict, shapes: dict) -> None:
    """Every parameter in ``shapes`` (name -> this rank's TP-shard shape) has ``exp_avg`` and
    ``exp_avg_sq`` of that shape in ``states``; a clear :class:`UserError` otherwise."""
    missing = sorted(set(shapes) - set(states))
    if missing:
        raise UserError(f"optimizer state has no entry for {len(missing)} parameter(s), e.g. {missing[:3]}; "
                        f"it was saved for a different model.")
    for name, shape in shapes.items():
        for k in ("exp_avg", "exp_avg_sq"):
            t = states[name].get(k) if isinstance(states[name], dict) else None
            if t is None or tuple(t.shape) != tuple(shape):
                raise UserError(f"optimizer state {k!r} of parameter {name!r} has shape "
                                f"{None if t is None else tuple(t.shape)}, expected {tuple(shape)} "
                                f"(this rank's tensor-parallel shard).")
