"""The optional DeepSpeed engine (``--zero-impl deepspeed``): DeepSpeed's ZeRO 1-3 over our DP group.

:class:`DeepSpeedBackend` implements :class:`tnlg.optim.backend.DataParallelBackend`, and
:func:`build_deepspeed_engine` returns our :class:`tnlg.optim.engine.Engine` driving it, so
everything downstream (logging, checkpoints, resharding) is unchanged. DeepSpeed is told
about our layout the way Megatron-DeepSpeed did:

* an ``mpu`` object (:class:`TnlgMPU`) hands it our tensor-parallel group as
  the "model parallel" group and our data-parallel group as the DP group, so
  ZeRO partitions only over DP (each TP rank's shard is partitioned over the
  DP replicas of that shard) and broadcasts/averages only there;
* every parameter gets ``model_parallel = tensor_model_parallel = tp_sharded``,
  the attributes DeepSpeed's gradient norm reads: TP-split gradients are
  summed over the TP group, replicated ones (LayerNorm, position embedding,
  row-parallel biases) are counted on TP rank 0 only, i.e. once, as
  :mod:`tnlg.optim.clip` does;
* groups of one rank are real process groups (DeepSpeed would treat ``None``
  as the world group and count a norm ``world`` times).

Optimizer: ``torch.optim.AdamW`` (single-tensor path: the arithmetic of our own
engine) on DeepSpeed's flat fp32 partitions, two parameter groups (weight decay
on matrices only). Clipping: DeepSpeed's, ``min(1, clip / (norm + 1e-6))``, the
same rule as ours. Gradient accumulation: DeepSpeed divides each micro loss by
``grad_accum_steps``; we mark the accumulation boundary before every backward
(``set_gradient_accumulation_boundary``) and call DeepSpeed's ``step`` once per
iteration. Stage 1 communicates only at the boundary; DeepSpeed's stage 2 and 3
reduce-scatter gradients on every micro step (its design, not ours).

Collectives (DeepSpeed's, all over the DP group except the norm): stage 1:
gradient reduction at the boundary backward, all-gather of the updated
parameters in ``step``; stage 2: reduce-scatter of gradient buckets during
every backward, all-gather in ``step``; stage 3: parameter all-gathers around
every module's forward and backward plus gradient reduce-scatters; the norm:
an all-reduce over DP and one over TP.

Differences from our engine, stated rather than hidden: DeepSpeed keeps an fp32
master copy of the owned partition even for fp32 parameters (Adam states
``12 Psi / dp`` bytes instead of ``8 Psi / dp``); in fp32 it does not check
gradients for inf/NaN (the step is applied; the loop stops on a NaN loss before
that); ``--fp16`` (our autocast + dynamic loss scaler) is not supported with it.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import math
import os
import warnings
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from ..errors import UserError
from ..parallel.sharding import is_tp_sharded
from ..parallel.state import ParallelState
from .backend import StepResult
from .clip import clip_coefficient
from .deepspeed_adapters import DeepSpeedModel, TnlgMPU, real_groups
from .engine import Engine, check_optimizer_args
from .sharded_backend import check_shape
from .zero import MiB, default_decay

__all__ = ["build_deepspeed_engine", "DeepSpeedBackend", "DeepSpeedModel", "TnlgMPU",
           "check_deepspeed_options", "deepspeed_available", "INSTALL_HINT"]

INSTALL_HINT = 'pip install --no-build-isolation "deepspeed>=0.14"'  # builds against the torch installed


def deepspeed_available() -> bool:
    """True when the ``deepspeed`` package can be imported (without importing it)."""
    return importlib.util.find_spec("deepspeed") is not None


def check_deepspeed_options(zero_stage: int, fp16: bool = False) -> None:
    """Raise :class:`UserError` unless DeepSpeed is installed and can run this (stage 1-3, no ``--fp16``)."""
    if not deepspeed_available():
        raise UserError(f"--zero-impl deepspeed needs the DeepSpeed package, which is not installed. Install "
                        f"the optional extra with `{INSTALL_HINT}` (or `pip install deepspeed`), or use "
                        f"--zero-impl tnlg (the default).")
    if zero_stage not in (1, 2, 3):
        raise UserError(f"--zero-impl deepspeed runs ZeRO stages 1, 2 and 3, got --zero-stage "
                        f"{zero_stage!r}; for stage 0 use --zero-impl tnlg.")
    if fp16:
        raise UserError("--fp16 (autocast with our dynamic loss scaler) is not supported with --zero-impl "
                        "deepspeed; use --bf16 or fp32, or --zero-impl tnlg.")


def _import_deepspeed(ps: ParallelState):
    """Import DeepSpeed with the accelerator matching ``ps.device`` (CPU: ``DS_ACCELERATOR=cpu``)."""
    check_deepspeed_options(1)
    if ps.device.type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    # DeepSpeed asserts LOCAL_RANK is set (torchrun sets it; our test harness does not)
    os.environ.setdefault("LOCAL_RANK", str(ps.device.index or 0) if ps.device.type == "cuda"
                          else str(dist.get_rank() if dist.is_initialized() else 0))
    import deepspeed
    from deepspeed.accelerator import get_accelerator
    want = "cpu" if ps.device.type == "cpu" else "cuda"
    if get_accelerator().device_name() != want:
        raise UserError(f"DeepSpeed selected the {get_accelerator().device_name()!r} accelerator but this run "
                        f"is on {ps.device}; set DS_ACCELERATOR={want} before starting.")
    if want == "cpu":
        # The CPU backend JIT-compiles a shared-memory all-reduce (C++, ~30 s the first time on a machine)
        # that only DeepSpeed *inference* uses; training collectives go through torch.distributed (gloo).
        ds_torch_comm = importlib.import_module("deepspeed.comm.torch")  # deepspeed.comm.torch is torch itself
        if hasattr(ds_torch_comm, "build_shm_op"):
            ds_torch_comm.build_shm_op = lambda: None  # type: ignore[attr-defined]  # (hasattr above: some versions lack it)
    deepspeed.utils.logger.setLevel(logging.WARNING)  # its INFO lines would bury our log
    # DeepSpeed calls collectives torch has renamed; the warning (once per call) is not the user's to act on
    warnings.filterwarnings("ignore", category=FutureWarning, message=r"`torch\.distributed\."
                            r"(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated")
    return deepspeed


class DeepSpeedBackend:
    """DeepSpeed's ZeRO as a :class:`~tnlg.optim.backend.DataParallelBackend` (see the module docstring).

    ``model`` is a :class:`DeepSpeedModel` (call it; it behaves as our GPT),
    ``module`` our GPT itself, ``ds`` DeepSpeed's engine. DeepSpeed clips and steps
    itself, and its states are fragments of flat partitions: :meth:`owned_pieces` is
    ``None`` and states are exchanged whole, per parameter.
    """

    impl = "deepspeed"
    pieces_sharded_over_dp = False  # states are handed over assembled (collective), not as pieces

    def __init__(self, ds_engine, module: nn.Module, optimizer: torch.optim.Optimizer, ps: ParallelState,
                 zero_stage: int):
        self.ds = ds_engine
        self.module = module
        self._model = DeepSpeedModel(ds_engine)
        self.optimizer = optimizer  # the torch AdamW over DeepSpeed's flat fp32 partitions
        self.ps = ps
        self.zero_stage = zero_stage
        self.names = [n for n, p in module.named_parameters() if p.requires_grad]
        self.params = [p for n, p in module.named_parameters() if p.requires_grad]
        self._index = {n: i for i, n in enumerate(self.names)}
        self.dtype = self.params[0].dtype
        self._prime_optimizer_states()

    @property
    def model(self) -> nn.Module:
        return self._model

    # ----------------------------------------------------------------- training
    def backward(self, loss: torch.Tensor, factor: float, is_last: bool) -> None:
        """Backward of one micro batch's mean loss. DeepSpeed divides it by ``grad_accum_steps`` itself,
        which is ``factor`` (no loss scaler runs with DeepSpeed: ``--fp16`` is refused).

        Stage 1 reduces gradients over DP only when ``is_last``; stages 2/3 reduce-scatter on
        every call (DeepSpeed's design).
        """
        self.ds.set_gradient_accumulation_boundary(is_last)
        self.ds.backward(loss)

    def step(self, lr: float, clip_grad: float, loss_scale: float,
             loss: Optional[torch.Tensor] = None) -> StepResult:
        """DeepSpeed's step: gradient norm (all-reduce over DP, then TP), clipping by its own
        ``gradient_clipping`` (``clip_grad``, the same rule), AdamW on the owned partition,
        all-gather of the parameters."""
        loss_value = None if loss is None else float(loss.item())  # (DeepSpeed reads its norm itself too)
        if loss_value is not None and not math.isfinite(loss_value):
            return StepResult(float("nan"), True, 1.0, loss_value)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        skipped_before = self.ds.skipped_steps
        self.ds.step()
        skipped = self.ds.skipped_steps != skipped_before
        norm = self.ds.get_global_grad_norm()
        norm = float(norm) if norm is not None else float("nan")
        if norm < 0:  # DeepSpeed masks an inf/NaN norm as -1
            norm = float("nan")
        return StepResult(norm, skipped, clip_coefficient(norm, clip_grad), loss_value)

    def zero_grad(self) -> None:
        """DeepSpeed zeroes its gradient partitions in ``step``; this drops any ``.grad`` left on the GPT."""
        self.ds.zero_grad()

    def set_step(self, step: int) -> None:
        for st in self.optimizer.state.values():
            st["step"].fill_(float(step))

    def close(self) -> None:
        """Release DeepSpeed's hooks and buffers (``DeepSpeedEngine.destroy``); unusable afterwards."""
        self.ds.destroy()

    # ----------------------------------------------------------------- state
    def _prime_optimizer_states(self) -> None:
        """Create AdamW's states (zeros, step 0) now, as its first step would: so that states can be
        read and loaded before any step, and DeepSpeed links each parameter to its state fragment."""
        from torch.optim.optimizer import _get_scalar_dtype
        for flat in self._flat_partitions():
            st = self.optimizer.state[flat]
            if not st:
                st["step"] = torch.tensor(0.0, dtype=_get_scalar_dtype())
                st["exp_avg"] = torch.zeros_like(flat, memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(flat, memory_format=torch.preserve_format)
        link = getattr(self.ds.optimizer, "_lazy_init_hp_params_optimizer_state", None)
        if link is not None:  # stages 1/2: map every parameter onto its fragment of the flat states
            link()

    def _flat_partitions(self) -> list[torch.Tensor]:
        """DeepSpeed's fp32 master partitions owned by this rank: the tensors AdamW steps (stage 3
        attaches them to the optimizer's groups only during ``step``)."""
        zo = self.ds.optimizer
        flats = getattr(zo, "fp32_partitioned_groups_flat", None) if self.zero_stage == 3 else \
            getattr(zo, "single_partition_of_fp32_groups", None)
        if flats is None:
            raise RuntimeError(f"DeepSpeed {type(zo).__name__} does not expose its fp32 partitions where "
                               f"this engine expects them (DeepSpeed version not supported).")
        return list(flats)

    def param_shapes(self) -> dict[str, tuple]:
        """Full shapes (stage 3 keeps them in ``ds_shape``: its parameters are empty placeholders)."""
        return {n: tuple(getattr(p, "ds_shape", p.shape)) for n, p in zip(self.names, self.params)}

    def owned_pieces(self) -> None:
        """No views: DeepSpeed's states are fragments of its flat partitions (exchanged whole instead)."""
        return None

    @torch.no_grad()
    def optimizer_state_by_param(self) -> dict[str, dict]:
        """``{name: {"exp_avg", "exp_avg_sq"}}`` shaped like this rank's TP shard; collective over DP
        (DeepSpeed assembles each parameter's fragments with an all-reduce/all-gather)."""
        from deepspeed.utils import safe_get_full_optimizer_state
        shapes = self.param_shapes()
        return {n: {k: safe_get_full_optimizer_state(p, k).float().reshape(shapes[n]).clone()
                    for k in ("exp_avg", "exp_avg_sq")} for n, p in zip(self.names, self.params)}

    @torch.no_grad()
    def load_optimizer_state_by_param(self, states: dict) -> None:
        """Keep this rank's fragments of full per-parameter states (no communication)."""
        from deepspeed.utils import safe_set_full_optimizer_state
        for n, p in zip(self.names, self.params):
            for k in ("exp_avg", "exp_avg_sq"):
                safe_set_full_optimizer_state(p, states[n][k].detach().to(self.ps.device, torch.float32), k)

    @torch.no_grad()
    def param_tensors(self, names):
        """``(name, tensor)`` of this TP shard, full over DP, one at a time (stage 3: gathered from
        DeepSpeed's fp32 partitions, collective over DP)."""
        wanted, shapes = set(names), self.param_shapes()
        for n, p in zip(self.names, self.params):
            if n not in wanted:
                continue
            if self.zero_stage == 3:
                from deepspeed.utils import safe_get_full_fp32_param
                yield n, safe_get_full_fp32_param(p).to(p.dtype).reshape(shapes[n])
            else:
                yield n, p.detach()

    @torch.no_grad()
    def load_param(self, name: str, value: torch.Tensor) -> None:
        """Copy a parameter (this TP shard's shape) into the module and DeepSpeed's fp32 master
        partition; no communication."""
        from deepspeed.utils import safe_set_full_fp32_param
        p = self.params[self._index[name]]
        check_shape(name, value, self.param_shapes()[name])
        value = value.detach().to(self.ps.device, torch.float32)
        safe_set_full_fp32_param(p, value)
        if hasattr(p, "ds_tensor"):  # stage 3: this rank's partition of the working copy
            part = p.ds_tensor.data.view(-1)
            start = part.numel() * self.ps.dp_rank
            k = max(0, min(part.numel(), value.numel() - start))
            part[:k].copy_(value.reshape(-1)[start:start + k])
        else:
            p.data.copy_(value.to(p.dtype))

    def gather_params(self) -> None:
        """Nothing: DeepSpeed's step all-gathers the parameters itself."""

    def refresh_master(self) -> None:
        """Nothing: :meth:`load_param` sets DeepSpeed's fp32 master with the parameter."""

    def memory_report(self) -> dict:
        """Per-rank bytes. ``optim_bytes``: AdamW's states plus DeepSpeed's fp32 master partition (measured);
        ``param_bytes``: the module's parameters (stage 3: the local partitions); ``grad_bytes``: full
        gradients for stage 1, the fp32-sized partition for stages 2/3 (DeepSpeed's buffers)."""
        flats = self._flat_partitions()
        master = sum(f.numel() * f.element_size() for f in flats)
        states = sum(t.numel() * t.element_size() for st in self.optimizer.state.values()
                     for t in st.values() if torch.is_tensor(t) and t.dim() > 0)
        if self.zero_stage == 3:
            param_bytes = sum(p.ds_tensor.numel() * p.ds_tensor.element_size()  # type: ignore[attr-defined]
                              for p in self.params)  # (DeepSpeed's ZeRO-3 partition, set on each parameter)
        else:
            param_bytes = sum(p.numel() * p.element_size() for p in self.params)
        numel = sum(math.prod(s) for s in self.param_shapes().values())
        elem = self.params[0].element_size()
        grad_bytes = numel * elem if self.zero_stage == 1 else sum(f.numel() for f in flats) * elem
        return dict(param_bytes=param_bytes, grad_bytes=grad_bytes, optim_bytes=states + master,
                    adam_state_bytes=states, master_bytes=master, numel=numel,
                    owned_numel=sum(f.numel() for f in flats))


def build_deepspeed_engine(model: nn.Module, ps: ParallelState, zero_stage: int = 1, lr: float = 1e-4,
                           weight_decay: float = 0.0, betas=(0.9, 0.95), eps: float = 1e-8,
                           clip_grad: float = 1.0,
                           grad_accum_steps: int = 1, bucket_size_mb: float = 25.0, loss_scaler=None,
                           decay_fn: Callable[[str, torch.Tensor], bool] = default_decay,
                           micro_batch_size: int = 1, ds_config: Optional[dict] = None) -> Engine:
    """Wrap ``model`` (this rank's TP shard, on ``ps.device``) in DeepSpeed's ZeRO ``zero_stage`` (1-3).

    Same arguments as :func:`tnlg.optim.engine.build_engine` (``bucket_size_mb``
    sizes DeepSpeed's reduce and all-gather buckets); ``micro_batch_size`` only
    feeds DeepSpeed's batch bookkeeping; ``ds_config`` entries override the
    generated DeepSpeed config. Every rank of the world must call this (process
    groups are created, parameters broadcast over DP).
    """
    check_deepspeed_options(zero_stage, fp16=loss_scaler is not None)
    check_optimizer_args(lr, weight_decay, betas, eps, clip_grad, grad_accum_steps, bucket_size_mb)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not named:
        raise UserError("the model has no trainable parameters: nothing to optimise.")

    deepspeed = _import_deepspeed(ps)
    tp_group, dp_group = real_groups(ps)
    for n, p in named:
        flag = is_tp_sharded(n, p, ps)
        # what DeepSpeed's norm reads (is_model_parallel_parameter); attributes torch's stubs do not know
        p.model_parallel = flag  # type: ignore[attr-defined]
        p.tensor_model_parallel = flag  # type: ignore[attr-defined]
    decay = [p for n, p in named if decay_fn(n, p)]
    no_decay = [p for n, p in named if not decay_fn(n, p)]
    groups = [dict(params=g, weight_decay=wd) for g, wd in ((decay, float(weight_decay)), (no_decay, 0.0)) if g]
    optimizer = torch.optim.AdamW(groups, lr=float(lr), betas=(float(betas[0]), float(betas[1])), eps=float(eps),
                                  foreach=False)
    bucket = max(1, int(bucket_size_mb * MiB) // next(iter(named))[1].element_size())
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": int(micro_batch_size),
        "gradient_accumulation_steps": int(grad_accum_steps),
        "gradient_clipping": float(clip_grad) if clip_grad > 0 else 0.0,
        "zero_optimization": {"stage": int(zero_stage), "reduce_bucket_size": bucket,
                              "allgather_bucket_size": bucket},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2 ** 62,
        "wall_clock_breakdown": False,
    }
    for k, v in (ds_config or {}).items():
        if isinstance(v, dict) and isinstance(config.get(k), dict):
            config[k] = {**config[k], **v}
        else:
            config[k] = v
    ds_engine, ds_optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config,
                                                         mpu=TnlgMPU(ps, tp_group, dp_group),
                                                         dist_init_required=False)
    backend = DeepSpeedBackend(ds_engine, model, optimizer, ps, zero_stage)
    return Engine(backend, ps, zero_stage, float(lr), float(clip_grad), grad_accum_steps, None,
                  betas=betas, eps=eps, weight_decay=weight_decay)
