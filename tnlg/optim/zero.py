"""ZeRO stage 0 and 1 over the data-parallel group, on flat buffers (Rajbhandari et al., SC20).

:class:`FlatZero` composes the layers of the engine, as Megatron-core's
``param_and_grad_buffer`` + ``distrib_optimizer`` do:

* :mod:`tnlg.optim.layout` — the shape-only flat layout: the trainable parameters of this
  rank's TP shard, in *backward order* (the reverse of registration, roughly the order
  autograd produces gradients), packed into one flat buffer cut into buckets of whole
  parameters, each padded to a multiple of ``dp`` so that DP rank ``r`` owns exactly
  elements ``[r * n / dp, (r + 1) * n / dp)`` of every bucket ``n``;
* here: the flat *parameter* buffer (every parameter becomes a view into it) and the
  owned slice's fp32 Adam moments (+ fp32 master for 16-bit parameters);
* :mod:`tnlg.optim.grad_buffer` — the flat gradient buffer and its bucket hooks;
* :mod:`tnlg.optim.bucket_comm` — the bucket collectives (reduce-scatter / all-reduce of
  gradients, all-gather of parameters);
* :mod:`tnlg.optim.sharded_adamw` — torch's AdamW (its functional form) on views of the owned runs;
* :mod:`tnlg.optim.sharded_backend` — the step (norm, clipping) and the by-parameter
  state exchange shared with FSDP.

Why our own ZeRO-1 and not ``torch.distributed.optim.ZeroRedundancyOptimizer``: ownership
here cuts through parameters, so every rank owns the same number of elements
(``sum_b ceil(n_b / dp)``), unlike a partition of whole tensors, where the GPT embedding
(about 31% of gpt2-small) alone overloads one rank at dp >= 4; and the gradient reduction
is a per-bucket reduce-scatter overlapped with backward, which that optimizer (it starts
after a DDP all-reduce) does not do. :func:`plan_flat_layout` computes the partition from
sizes alone (the memory planner uses it on meta shapes).

Communication (DP group only; the model's TP collectives use the TP group)
-------------------------------------------------------------------------
* forward: none;
* backward, accumulation micro steps: none; gradients accumulate in place;
* backward, last micro step: per bucket, as soon as its gradients are complete, the
  bucket is divided by ``dp`` and an asynchronous collective launched (stage 0:
  all-reduce; stage 1: reduce-scatter into the owned slice), overlapping the rest of
  backward;
* step: waits for those collectives; gradient norm (2 + 1 fp64 scalars); AdamW on the
  owned slice only; stage 1 then all-gathers every bucket's parameter slices (in place).
  Stage 1 moves reduce-scatter + all-gather = the 2 units of an all-reduce, as ZeRO's
  analysis says. On gloo the reduce-scatter runs as ``dp`` reduces and the all-gather as
  ``dp`` broadcasts (see :mod:`tnlg.optim.bucket_comm`).

Memory per rank with ``Psi`` parameters in the TP shard: fp32 parameters,
stage 0 ``4 Psi`` params + ``4 Psi`` grads + ``8 Psi`` Adam states, stage 1 the
same but Adam states ``8 Psi / dp``. ZeRO's mixed precision (``param_dtype``
bf16/fp16): 16-bit parameter and gradient buffers (``2 Psi + 2 Psi``) and an
fp32 master of the owned slice next to its Adam moments (``12 Psi / dp`` at
stage 1, ``12 Psi`` at stage 0); ``grad_dtype=float32`` keeps an fp32
gradient buffer (``4 Psi``) that autograd's 16-bit ``.grad`` is added into by
the post-accumulate hook (Megatron's ``main_grad``). The parameters are
materialised straight into the flat buffer (from ``init_fn`` for a meta-device
model), one at a time: setup never holds a second copy of the model.

Weight decay applies to parameters with ``ndim >= 2`` (all matrices, including the word
and position embeddings, as Megatron); biases and LayerNorm parameters get none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
import torch.nn as nn

from ..errors import UserError
from ..parallel.sharding import is_tp_sharded, uncounted_elements
from ..parallel.state import ParallelState
from .bucket_comm import BucketComm
from .grad_buffer import GradBuffer
from .layout import MiB, Bucket, FlatLayout, Segment, partition_report, plan_flat_layout
from .sharded_adamw import Run, ShardedAdamW
from .sharded_backend import ShardedBackend

__all__ = ["Bucket", "Segment", "FlatLayout", "plan_flat_layout", "partition_report", "FlatZero",
           "default_decay", "MiB"]


def default_decay(name: str, param: torch.Tensor) -> bool:
    """Weight decay on matrices only (``ndim >= 2``, embeddings included), never on a bias (Megatron's rule:
    SwiGLU's paired bias ``[2, ffn]`` and grouped-query attention's ``[G, 2, d]`` are biases too)."""
    return param.dim() >= 2 and not name.endswith(".bias")


def _norm_segments(segments: Sequence[Segment], skip: Sequence[int]) -> list[tuple[int, int, int, bool]]:
    """``(param, flat_lo, length, counted)`` pieces of ``segments``, each split where its parameter's
    first ``skip[param]`` elements (rows of a shared key/value group that a lower TP rank counts) end."""
    out = []
    for s in segments:
        cut = min(max(skip[s.param] - s.param_lo, 0), s.length)
        if cut:
            out.append((s.param, s.flat_lo, cut, False))
        if cut < s.length:
            out.append((s.param, s.flat_lo + cut, s.length - cut, True))
    return out


def _norm_runs(segments: Sequence[Segment], kinds: Sequence, skip: Sequence[int], base: int) -> list[tuple]:
    """:func:`_runs` of the gradient norm: a parameter's skipped elements count as nothing (``None``)."""
    runs: list[list] = []
    for param, flat_lo, length, counted in _norm_segments(segments, skip):
        lo, hi, f = flat_lo - base, flat_lo - base + length, kinds[param] if counted else None
        if runs and runs[-1][2] == f and runs[-1][1] == lo:
            runs[-1][1] = hi
        else:
            runs.append([lo, hi, f])
    return [tuple(r) for r in runs]


def _runs(segments: Sequence[Segment], flags: Sequence[bool], base: int) -> list[tuple[int, int, bool]]:
    """Merge adjacent segments into ``(lo, hi, flag)`` runs relative to ``base``."""
    runs: list[list] = []
    for s in segments:
        lo, hi, f = s.flat_lo - base, s.flat_lo - base + s.length, flags[s.param]
        if runs and runs[-1][2] == f and runs[-1][1] == lo:
            runs[-1][1] = hi
        else:
            runs.append([lo, hi, f])
    return [tuple(r) for r in runs]


@dataclass
class _BucketShard:
    """Views of one bucket's owned slice into every buffer."""

    bucket: Bucket
    owned_lo: int   # where this bucket's slice starts in the compact owned buffers
    param: torch.Tensor
    grad: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    master: Optional[torch.Tensor]
    decay_runs: list[tuple[int, int, bool]]
    tp_runs: list[tuple[int, int, bool]]


# --------------------------------------------------------------------------- the backend
def _trainable(model: nn.Module, ps: ParallelState, param_dtype: Optional[torch.dtype],
               select: Optional[Callable[[str, torch.Tensor], bool]] = None):
    """The trainable parameters (``select``: those it picks), the buffers' dtype and device; a clear error for
    what flat buffers cannot hold."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad and p.numel() > 0
             and (select is None or select(n, p))]
    if not named:
        raise UserError("the model has no trainable parameters: nothing to optimise.")
    dtypes = {p.dtype for _, p in named}
    devices = {p.device for _, p in named if p.device.type != "meta"}
    if (len(dtypes) > 1 and param_dtype is None) or len(devices) > 1:
        raise UserError(f"ZeRO flat buffers need every trainable parameter on one device with one dtype; "
                        f"found dtypes {sorted(map(str, dtypes))} on devices {sorted(map(str, devices))}.")
    dtype = param_dtype or dtypes.pop()
    if not dtype.is_floating_point:
        raise UserError(f"parameters must be floating point, got {dtype}.")
    return named, dtype, (ps.device if ps.virtual or not devices else devices.pop())


def _materialise(model: nn.Module, order: list, buffer: torch.Tensor, layout, init_fn) -> list:
    """Each parameter of ``order`` copied (or initialised, from the meta device) into its place in
    ``buffer``, one at a time, and installed in ``model`` as a view of it; returns the views."""
    params = []
    holders = _holders(model)
    with torch.no_grad():
        _zero_padding(buffer, layout)
        for (name, p), off in zip(order, layout.param_offsets):
            pv = buffer[off:off + p.numel()].view(p.shape)
            if p.device.type != "meta":
                pv.copy_(p)
            elif buffer.device.type != "meta":
                if init_fn is None:
                    raise UserError(f"parameter {name!r} is on the meta device and no init_fn was given "
                                    f"to materialise it; build the model on a real device or pass init_fn.")
                pv.copy_(init_fn(name, p))
            params.append(_install(holders, p, pv))
    return params


class FlatZero(ShardedBackend):
    """Stage 0 (all-reduce, full Adam) or stage 1 (reduce-scatter, partitioned Adam, all-gather).

    Built by :func:`tnlg.optim.engine.build_engine`; see the module docstring for
    layout and collectives. ``select(name, param)``: the parameters this backend holds (default: every
    trainable one; :class:`tnlg.optim.kinds.KindsBackend` builds one per gradient kind). Parameters become views of ``param_buffer``; their
    ``.grad`` are views of ``grad_buffer`` (after a stage-1 step only the owned
    slice of ``grad_buffer`` holds the averaged gradient).
    """

    impl = "flat"

    def __init__(self, model: nn.Module, ps: ParallelState, stage: int, *, betas=(0.9, 0.95), eps=1e-8,
                 weight_decay: float = 0.0, bucket_size_mb: float = 25.0,
                 decay_fn: Callable[[str, torch.Tensor], bool] = default_decay, collectives: str = "auto",
                 param_dtype: Optional[torch.dtype] = None, grad_dtype: Optional[torch.dtype] = None,
                 init_fn: Optional[Callable[[str, torch.Tensor], torch.Tensor]] = None,
                 select: Optional[Callable[[str, torch.Tensor], bool]] = None):
        if stage not in (0, 1):
            raise ValueError(f"FlatZero implements ZeRO stages 0 and 1, got {stage}.")
        named, dtype, device = _trainable(model, ps, param_dtype, select)
        grad_dtype = grad_dtype or dtype
        self.model, self.ps, self.stage = model, ps, stage
        self.dtype, self.grad_dtype, self.device = dtype, grad_dtype, device
        self.dp = ps.dp_size
        self.shards = self.dp if stage == 1 else 1
        self.rank_in_shards = ps.dp_rank if stage == 1 else 0
        self.grads_sharded_over_dp = self.pieces_sharded_over_dp = self.shards > 1
        self.comm = BucketComm(ps, self.shards, collectives)

        order = list(reversed(named))  # backward order: the last layers produce gradients first
        self.names = [n for n, _ in order]
        self._index = {n: i for i, n in enumerate(self.names)}
        self.tp_sharded = [is_tp_sharded(n, p, ps) for n, p in order]
        # what each parameter adds to the gradient norm: sharded / replicated over TP, or nothing for the
        # last pipeline stage's copy of the tied embedding (the first stage's is counted)
        self.norm_kind = [None if getattr(p, "pipeline_duplicate", False) else t
                          for (_, p), t in zip(order, self.tp_sharded)]
        # a shared key/value group's rows are counted once, on the lowest TP rank holding them
        self.norm_skip = [uncounted_elements(p, ps.tp_rank) for _, p in order]
        self.decay = [bool(decay_fn(n, p)) for n, p in order]
        elem = torch.empty((), dtype=grad_dtype).element_size()
        self.bucket_numel = max(1, int(bucket_size_mb * MiB) // elem)
        self.layout = L = plan_flat_layout([p.numel() for _, p in order], self.shards, self.bucket_numel)

        # Parameters are materialised straight into the flat buffer, one at a time (a meta-device
        # model costs nothing until here), so setup never holds more than the final model states
        # plus one parameter's initial value.
        self.param_buffer = torch.empty(L.total_numel, dtype=dtype, device=device)
        self.params = _materialise(model, order, self.param_buffer, L, init_fn)
        # gradients: a flat buffer of the same layout, and the hooks that launch each bucket's reduction
        self.grads = GradBuffer(self.params, L, grad_dtype, device, self.comm)
        self.grad_buffer = self.grads.buffer

        # Adam states (and fp32 master for low-precision params) for the owned slice only.
        self.exp_avg = torch.zeros(L.owned_numel, dtype=torch.float32, device=device)
        self.exp_avg_sq = torch.zeros(L.owned_numel, dtype=torch.float32, device=device)
        self.master = None if dtype == torch.float32 else torch.zeros(L.owned_numel, dtype=torch.float32,
                                                                      device=device)
        self.materialized = device.type != "meta"
        self.segments = L.segments(self.rank_in_shards)
        self.shards_views = self._owned_views()
        # torch's AdamW on the owned runs, one bucket at a time (the fp32 master for 16-bit params)
        self.optimizer = ShardedAdamW(
            [[Run(target=(v.param if v.master is None else v.master)[a:z], grad=v.grad[a:z],
                  exp_avg=v.exp_avg[a:z], exp_avg_sq=v.exp_avg_sq[a:z], decay=f,
                  param=None if v.master is None else v.param[a:z]) for a, z, f in v.decay_runs]
             for v in self.shards_views], betas=betas, eps=eps, weight_decay=weight_decay)
        if self.materialized:
            self.refresh_master()

    def _owned_views(self) -> list[_BucketShard]:
        """Every bucket's owned slice as views of the parameter, gradient and state buffers."""
        by_bucket: dict[int, list[Segment]] = {}
        for s in self.segments:
            by_bucket.setdefault(s.bucket, []).append(s)
        views, owned_base = [], 0
        for b in self.layout.buckets:
            lo, hi = b.shard_range(self.rank_in_shards)
            segs, o = by_bucket.get(b.index, []), slice(owned_base, owned_base + b.shard_numel)
            views.append(_BucketShard(
                bucket=b, owned_lo=owned_base, param=self.param_buffer[lo:hi], grad=self.grad_buffer[lo:hi],
                exp_avg=self.exp_avg[o], exp_avg_sq=self.exp_avg_sq[o],
                master=None if self.master is None else self.master[o],
                decay_runs=_runs(segs, self.decay, lo), tp_runs=_norm_runs(segs, self.norm_kind, self.norm_skip, lo)))
            owned_base += b.shard_numel
        return views

    @property
    def comm_counts(self) -> dict:
        """Buckets reduced during backward / at the step, and parameter buckets gathered."""
        return self.comm.counts

    @property
    def collectives(self) -> str:
        return self.comm.collectives

    # ----------------------------------------------------------------- gradient sync
    def set_sync(self, is_last: bool) -> None:
        """Called before each micro step's backward: communicate only on the last one."""
        self.grads.set_sync(is_last)

    def finish_grad_sync(self) -> None:
        """Launch buckets whose parameters got no gradient (unused), in order; wait for all."""
        self.grads.finish_grad_sync()

    # ----------------------------------------------------------------- optimizer
    def grad_pieces(self):
        """``(owned gradient run, tp_sharded)`` pairs: what this rank contributes to the norm."""
        for v in self.shards_views:
            for lo, hi, f in v.tp_runs:
                if f is not None:
                    yield v.grad[lo:hi], f

    def grad_view(self, name: str) -> torch.Tensor:
        """Parameter ``name``'s gradient as a view into the flat gradient buffer (full over DP before the
        step's reduction)."""
        return self.grads.views[self._index[name]]

    @torch.no_grad()
    def adam_step(self, lr: float, grad_factor: float = 1.0) -> None:
        """AdamW (``torch.optim.AdamW``) on ``grad_factor`` times the owned slice's gradient of every
        bucket, then (stage 1) all-gather the parameters. 16-bit parameters: the fp32 master is
        stepped, one bucket's gradient upcast at a time, and the rounded result written back."""
        self.optimizer.step(lr, grad_factor)
        self.gather_params()

    def set_step(self, step: int) -> None:
        """Adam's step count (after loading a checkpoint)."""
        self.optimizer.set_step(step)

    def gather_params(self) -> None:
        """Stage 1: all-gather every bucket's owned parameter slices (in place, async then wait)."""
        works = [w for v in self.shards_views for w in self.comm.gather(self.param_buffer, v.bucket)]
        for w in works:
            w.wait()

    def zero_grad(self) -> None:
        self.grads.zero_grad()

    def close(self) -> None:
        """Remove the gradient hooks and ``.grad`` views (the model may outlive the engine); the
        buffers are freed with the last reference to the engine. Unusable afterwards."""
        self.grads.close()

    # ----------------------------------------------------------------- state exchange (checkpoints)
    def owned_pieces(self) -> list[dict]:
        """What this rank owns, one entry per parameter piece: ``name``, ``lo``/``length`` (the range
        of the flattened TP shard), and 1-D views of the ``param``, ``exp_avg``, ``exp_avg_sq`` and
        fp32 ``master`` (``None`` for fp32 parameters). Views, not copies: a checkpoint writes
        from them and loads into them. No communication."""
        out = []
        for s in self.segments:
            o = slice(s.owned_lo, s.owned_lo + s.length)
            out.append(dict(name=self.names[s.param], lo=s.param_lo, length=s.length,
                            param=self.param_buffer[s.flat_lo:s.flat_lo + s.length],
                            exp_avg=self.exp_avg[o], exp_avg_sq=self.exp_avg_sq[o],
                            master=None if self.master is None else self.master[o]))
        return out

    def param_tensors(self, names):
        """``(name, tensor)`` for the named parameters (this TP shard, full over DP); no communication."""
        for n, p in self._selected(names):
            yield n, p.detach()

    @torch.no_grad()
    def load_param(self, name: str, value: torch.Tensor) -> None:
        """Copy a full (over DP) value of this TP shard of parameter ``name``; no communication."""
        self._checked(name, value).copy_(value)

    @torch.no_grad()
    def refresh_master(self) -> None:
        """Copy the owned parameter slices into the fp32 master."""
        for v in self.shards_views:
            if v.master is not None:  # (every view has one when the backend keeps a master)
                v.master.copy_(v.param)

    def memory_report(self) -> dict:
        """Bytes this rank holds: full parameter and gradient buffers, owned Adam states (+ fp32 master).

        Read off the allocated buffers (also on the meta device, where nothing is allocated)."""
        adam = self.exp_avg.numel() * 4 * 2
        master = 0 if self.master is None else self.master.numel() * 4
        return dict(param_bytes=self.param_buffer.numel() * self.param_buffer.element_size(),
                    grad_bytes=self.grad_buffer.numel() * self.grad_buffer.element_size(),
                    optim_bytes=adam + master, adam_bytes=adam, master_bytes=master,
                    numel=sum(p.numel() for p in self.params), owned_numel=self.layout.owned_numel,
                    buckets=len(self.layout.buckets), param_dtype=str(self.dtype).replace("torch.", ""),
                    grad_dtype=str(self.grad_dtype).replace("torch.", ""))


# --------------------------------------------------------------------------- helpers
def _zero_padding(buffer: torch.Tensor, layout: FlatLayout) -> None:
    """Zero the padding at the end of every bucket (parameters overwrite the rest)."""
    for b in layout.buckets:
        if b.padded_numel > b.numel:
            buffer[b.start + b.numel:b.start + b.padded_numel].zero_()


def _holders(model: nn.Module) -> dict[int, list[tuple[nn.Module, str]]]:
    """Every ``(module, name)`` registering each parameter of ``model``, by the parameter's ``id`` (a tied
    weight has two); one walk of the modules for all the parameters."""
    out: dict[int, list[tuple[nn.Module, str]]] = {}
    for m in model.modules():
        for k, p in m._parameters.items():
            if p is not None:
                out.setdefault(id(p), []).append((m, k))
    return out


def _install(holders: dict[int, list[tuple[nn.Module, str]]], old: torch.Tensor, value: torch.Tensor) -> nn.Parameter:
    """Replace parameter ``old`` wherever it is registered (``holders``: :func:`_holders` of the model) by a
    parameter whose storage is ``value`` (a view of a flat buffer); the attributes tnlg sets on parameters
    (``tp_sharded``, ``partition_*``) are carried over. Works for meta-device parameters, whose ``.data``
    cannot be swapped for a real tensor."""
    new = nn.Parameter(value, requires_grad=old.requires_grad)
    for k, v in vars(old).items():
        if not k.startswith("_"):
            setattr(new, k, v)
    for m, k in holders.get(id(old), ()):
        if m._parameters[k] is old:
            m._parameters[k] = new
    return new

