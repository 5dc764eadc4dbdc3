"""ZeRO stages 2 and 3 through PyTorch FSDP2 (``fully_shard``) on the data-parallel group.

FSDP only sees a 1-D :class:`~torch.distributed.device_mesh.DeviceMesh` built
from ``ps.dp_group`` (``DeviceMesh.from_group``), so it shards this rank's TP
shard of every parameter over the DP peers (same TP rank, identical shapes),
along dim 0 (``Shard(0)``; uneven sizes allowed). The model's own TP
collectives keep using the TP groups; during forward/backward FSDP hands the
layers plain (unsharded, TP-local) tensors, so tensor parallelism composes
unchanged.

Sharding units: every module that is an element of an ``nn.ModuleList`` (the
transformer blocks of GPT), then the root (embeddings, final LayerNorm, LM head).
A pipeline rank's ``StageModel`` has one root per model chunk (:class:`ChunkModules`:
the chunk's blocks as units, its embeddings / final LayerNorm / LM head in the root),
the modules the pipeline's stages run; torch's schedule then turns gradient reduction
off for every micro batch and reduce-scatters once after the last backward (stage 3
all-gathers a block's parameters again for each micro batch's backward).

Collectives (DP group) per training step:

* stage 2 (``reshard_after_forward=False``): per unit, one all-gather of its
  parameters in forward (kept until the unit's backward) and one
  reduce-scatter of its gradients (averaged over DP) in backward, overlapped
  by FSDP's prefetching. Gradients persist only as shards (``Psi / dp``).
* stage 3 (``reshard_after_forward=True``): as stage 2 but parameters are
  freed after each unit's forward and all-gathered again in backward
  (3 units of traffic instead of 2).
* gradient accumulation: ``set_requires_gradient_sync(False)`` on all but the
  last micro step, so no reduce-scatter runs then (unsharded gradients
  accumulate locally meanwhile).
* ``step()``: gradient norm (local squared sums of the gradient shards,
  all-reduced over DP, sharded ones also over TP), then AdamW on the local
  shards; no parameter communication (the next forward all-gathers).

The ``tp_sharded`` (and ``partition_*``) attributes of the original
parameters are copied onto FSDP's sharded parameters, which FSDP creates anew.

Expert parallelism (a mixture of experts at EP > 1): each routed-experts module (the parameters of gradient kind
``"expert"``, :class:`tnlg.model.moe.GroupedExperts`) is its own FSDP unit over a second mesh, the
expert-data-parallel group (the ranks holding the same experts, ``ps.group("edp")``; torchtitan shards its
experts so), sharded before the block around it: its gradients are reduce-scattered (averaged) over expert-DP
and its parameters all-gathered over it, the dense ones over DP x CP as before. The gradient norm adds the
experts' sum of squares all-reduced over expert-DP, TP and EP to the dense one's. An expert-DP group of one
rank (EP = DP x CP) has nothing to shard: refused by name (ZeRO 1 is the same there).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
import torch.nn as nn

from ..errors import UserError
from ..config import stage_parts
from ..parallel.sharding import copy_tp_attributes, counted_rows, is_tp_sharded
from ..parallel.state import ParallelState
from .sharded_adamw import Run, ShardedAdamW
from .sharded_backend import ShardedBackend
from .zero import default_decay

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

__all__ = ["FSDPZero", "fsdp_units"]


def _dt(t: Optional[torch.Tensor]) -> "DTensor":
    """``t``, a parameter ``fully_shard`` made a DTensor, or its gradient (torch's stubs keep both typed as
    plain tensors); a ``TypeError`` for anything else (a bug, not input)."""
    from torch.distributed.tensor import DTensor
    if not isinstance(t, DTensor):
        raise TypeError(f"expected a DTensor (a parameter FSDP2 shards, or its gradient), got {type(t).__name__}.")
    return t


def fsdp_units(model: nn.Module) -> list[nn.Module]:
    """Modules wrapped as their own FSDP unit: the elements of every ``nn.ModuleList``."""
    units: list[nn.Module] = []
    for m in model.modules():
        if isinstance(m, nn.ModuleList):
            units.extend(m)
    return units


class ChunkModules(nn.Module):
    """One pipeline chunk (:class:`tnlg.model.stage.PipelineChunk`) as FSDP2 needs it: a module that
    registers every module the chunk runs (its blocks, in an ``nn.ModuleList``: one FSDP unit each; the
    embeddings on the first stage, the final LayerNorm and the LM head on the last), so that
    ``fully_shard`` on it gathers their parameters around the chunk's forward; its forward is the chunk's.
    The schedule's stage runs this module, so torch's pipelining sees an FSDP module: it turns gradient
    reduction off for every micro batch's backward and reduce-scatters the accumulated gradients once,
    after the last (``PipelineStage.perform_reduce_grad``)."""

    def __init__(self, chunk: Any):  # a PipelineChunk (its stage, layers, first/last and forward are read)
        super().__init__()
        t = chunk.stage.transformer
        self.chunk: Any = chunk  # registers no parameters itself
        self.blocks = nn.ModuleList(t.h[str(i)] for i in chunk.layers)
        stage = chunk.stage
        ends = [stage.lm_head if n == "lm_head" else t[n]
                for n in stage_parts(stage.config, chunk.first, chunk.last) if n != "drop"]
        for i, m in enumerate(ends):
            self.add_module(f"end{i}", m)

    @property
    def stage(self) -> Any:
        """The chunk's :class:`~tnlg.model.stage.StageModel` (what a pipeline stage's record names)."""
        return self.chunk.stage

    @property
    def layers(self) -> range:
        return self.chunk.layers

    def forward(self, x: torch.Tensor, **documents) -> torch.Tensor:
        """The chunk's forward (``documents``: the per-document ``position_ids``/``attention_mask``)."""
        return self.chunk(x, **documents)


def fsdp_roots(model: nn.Module) -> list[nn.Module]:
    """The modules sharded as FSDP roots: the model, or for a pipeline rank's ``StageModel`` one
    :class:`ChunkModules` per model chunk (the stage model's own forward never runs)."""
    if not hasattr(model, "chunk_ranges"):
        return [model]
    stage: Any = model  # a StageModel: its chunks
    return [ChunkModules(stage.chunk(k)) for k in range(len(stage.chunk_ranges))]


class FSDPZero(ShardedBackend):
    """Stage 2 or 3: FSDP2 sharding of parameters/gradients over DP, AdamW on the local shards."""

    impl = "fsdp"
    grads_sharded_over_dp = True
    pieces_sharded_over_dp = True
    params: list["DTensor"]  # (fully_shard's parameters)

    def __init__(self, model: nn.Module, ps: ParallelState, stage: int, *, betas=(0.9, 0.95), eps=1e-8,
                 weight_decay: float = 0.0, decay_fn: Callable[[str, torch.Tensor], bool] = default_decay,
                 param_dtype: Optional[torch.dtype] = None,
                 init_fn: Optional[Callable[[str, torch.Tensor], torch.Tensor]] = None):
        if stage not in (2, 3):
            raise ValueError(f"FSDPZero implements ZeRO stages 2 and 3, got {stage}.")
        before = [(n, p) for n, p in model.named_parameters()]
        experts = {n for n, p in before if getattr(p, "gradient_kind", "dense") == "expert"} if ps.ep_size > 1 else set()
        if experts and ps.size("edp") < 2:
            raise UserError(f"--zero-stage {stage} with expert parallelism EP {ps.ep_size} = DP x CP: each expert is "
                            "held by one rank (an expert-data-parallel group of one), so FSDP has nothing to shard of "
                            "the experts; use --zero-stage 1 (the same memory for the experts), or an EP below DP x CP.")
        if ps.dp_size < 2 or ps.dp_group is None:
            raise ValueError("FSDP sharding needs a data-parallel group of at least 2 ranks.")
        self.ps, self.stage = ps, stage

        flags = {n: is_tp_sharded(n, p, ps) for n, p in before}
        duplicate = {n for n, p in before if getattr(p, "pipeline_duplicate", False)}
        decay = {n: bool(decay_fn(n, p)) for n, p in before}
        self.full_numel = {n: p.numel() for n, p in before}
        # a shared key/value group's rows are counted in the norm once, on the lowest TP rank holding them:
        # (rows this rank leaves out, rows of its TP slice) per parameter, read before FSDP shards dim 0
        skip = {n: (counted_rows(p, ps.tp_rank)[0] if getattr(p, "partition_offsets", ()) else 0, p.shape[0] if p.dim()
                    else 1) for n, p in before}
        if param_dtype is not None:
            model.to(param_dtype)  # 16-bit sharded parameters and gradients; fp32 master below
        self._shard(model, stage == 3, before, init_fn)
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad and p.numel() > 0]
        if not named:
            raise UserError("the model has no trainable parameters: nothing to optimise.")
        originals = dict(before)
        for n, p in model.named_parameters():  # FSDP's sharded parameters are new objects
            if n in originals:
                copy_tp_attributes(originals[n], p)
        self.names = [n for n, _ in named]
        self._index = {n: i for i, n in enumerate(self.names)}
        self.params = [_dt(p) for _, p in named]
        self.dtype = self.params[0].dtype
        self.tp_sharded = [flags[n] for n in self.names]
        # what the gradient norm counts: all but the last pipeline stage's copy of the tied embedding
        self.counted = [n not in duplicate for n in self.names]
        self.norm_skip = [skip[n] for n in self.names]
        self.decay = [decay[n] for n in self.names]
        self.expert = [n in experts for n in self.names]  # (sharded over expert-DP: module docstring)
        self._build_optimizer(betas, eps, weight_decay)

    def _shard(self, model: nn.Module, reshard: bool, before: list, init_fn) -> None:
        """``fully_shard`` the units and the roots over the DP mesh; materialise this rank's shards of a
        meta-device model from ``init_fn``, one parameter's initial value at a time."""
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard

        ps = self.ps
        mesh_device = "cpu" if ps.device.type == "meta" else ps.device.type
        assert ps.dp_group is not None  # (__init__ refuses a DP of one rank)
        self.mesh = DeviceMesh.from_group(ps.dp_group, device_type=mesh_device)
        edp = ps.group("edp") if ps.ep_size > 1 else None
        expert_mesh = None if edp is None else DeviceMesh.from_group(edp, device_type=mesh_device)
        self.roots = fsdp_roots(model)
        for root in self.roots:
            for unit in fsdp_units(root):
                for m in unit.modules() if expert_mesh is not None else ():  # the experts first, over expert-DP
                    if any(getattr(p, "gradient_kind", "dense") == "expert" for p in m.parameters(recurse=False)):
                        fully_shard(m, mesh=expert_mesh, reshard_after_forward=reshard)
                fully_shard(unit, mesh=self.mesh, reshard_after_forward=reshard)
            fully_shard(root, mesh=self.mesh, reshard_after_forward=reshard)
        if self.roots[0] is not model:
            # what the pipeline's stages run (tnlg.parallel.pipeline_schedule); a plain attribute, which
            # nn.Module's stubs type as a tensor or a module
            model.pipeline_chunks = self.roots  # type: ignore[assignment]
        self.model = model
        self.materialized = ps.device.type != "meta"
        if any(p.device.type == "meta" for _, p in before) and self.materialized:
            if init_fn is None:
                raise UserError("the model is on the meta device and no init_fn was given to materialise it.")
            for root in self.roots:
                root.to_empty(device=ps.device)
            with torch.no_grad():
                for (n, orig), (_, p) in zip(before, model.named_parameters()):
                    local = _dt(p)
                    local.to_local().copy_(self._local_of(init_fn(n, orig).to(p.dtype), local))

    def _build_optimizer(self, betas, eps: float, weight_decay: float) -> None:
        """Adam moments (and the fp32 master of 16-bit parameters) of the local shards, and
        ``torch.optim.AdamW`` on them in groups of about 2^23 elements (one group's 16-bit gradients
        are upcast at a time); gradients are attached at each step."""
        self.exp_avg = [torch.zeros_like(p.to_local(), dtype=torch.float32) for p in self.params]
        self.exp_avg_sq = [torch.zeros_like(p.to_local(), dtype=torch.float32) for p in self.params]
        self.master: list[Optional[torch.Tensor]] = [None if p.dtype == torch.float32 else
                                                     p.to_local().detach().float() for p in self.params]
        self.runs: list[Run] = []
        groups: list[list[Run]] = [[]]
        size = 0
        for p, m, v, mst, d in zip(self.params, self.exp_avg, self.exp_avg_sq, self.master, self.decay):
            local = p.to_local()
            run = Run(target=(local if mst is None else mst).view(-1), grad=None, exp_avg=m.view(-1),
                      exp_avg_sq=v.view(-1), decay=d, param=None if mst is None else local.view(-1))
            self.runs.append(run)
            if size >= 2 ** 23:
                groups.append([])
                size = 0
            groups[-1].append(run)
            size += local.numel()
        self.optimizer = ShardedAdamW(groups, betas=betas, eps=eps, weight_decay=weight_decay)

    # ----------------------------------------------------------------- gradient sync
    def set_sync(self, is_last: bool) -> None:
        """Reduce-scatter gradients only in the last micro step's backward."""
        from torch.distributed.fsdp import FSDPModule
        for root in self.roots:
            assert isinstance(root, FSDPModule)  # (fully_shard made it one)
            root.set_requires_gradient_sync(is_last)

    def finish_grad_sync(self) -> None:
        """Nothing to wait for: FSDP's post-backward callback finishes the reduce-scatters."""

    def _local_grads(self):
        for p in self.params:
            yield None if p.grad is None else _dt(p.grad).to_local()

    def grad_pieces(self, expert: bool = False):
        """``(gradient shard, tp_sharded)`` the norm counts, of the dense parameters (``expert``: of the experts)."""
        dp, rank = self.ps.dp_size, self.ps.dp_rank
        for g, f, counted, (skip, rows), kind in zip(self._local_grads(), self.tp_sharded, self.counted,
                                                      self.norm_skip, self.expert):
            if g is not None and counted and kind == expert:
                if skip:  # FSDP2 holds rows [rank * ceil(rows / dp), ...) of the TP slice
                    start = rank * -(-rows // dp)
                    g = g[min(max(skip - start, 0), g.shape[0]):]
                yield g, f

    def step(self, lr: float, clip_grad: float, loss_scale: float, loss: Optional[torch.Tensor] = None):
        """:meth:`ShardedBackend.step`; with experts sharded over expert-DP (module docstring) the norm is the dense
        parameters' plus the experts' (summed over expert-DP, TP and EP), as :class:`tnlg.optim.kinds.KindsBackend`
        computes it at ZeRO 1."""
        if not any(self.expert):
            return super().step(lr, clip_grad, loss_scale, loss)
        import torch.distributed as dist

        from .backend import clipped_step
        from .clip import global_sum_of_squares, norm_and, squared_sums, summed_sum_of_squares
        dense = global_sum_of_squares(*squared_sums(self.grad_pieces()), self.ps, True, over_pp=False)
        experts = summed_sum_of_squares(self.grad_pieces(expert=True), self.ps.device,
                                        (self.ps.group("edp"), self.ps.tp_group, self.ps.group("ep")))
        total = dense + experts.to(dense)
        if self.ps.pp_size > 1:  # (each stage holds different layers, experts included)
            dist.all_reduce(total, group=self.ps.pp_group)
        norm, loss_value = norm_and(total, loss)
        return clipped_step(norm, loss_value, loss_scale, clip_grad, lambda factor: self.adam_step(lr, factor))

    def state_group(self, name: str):
        """The expert-DP group for a routed expert's parameter (module docstring), else DP (x CP)."""
        return self.ps.group("edp") if self.expert[self._index[name]] else self.ps.dp_group

    def grad_view(self, name: str) -> torch.Tensor:
        """This rank's shard of parameter ``name``'s gradient (after the reduce-scatter), a view."""
        return _dt(self.params[self._index[name]].grad).to_local()

    @torch.no_grad()
    def adam_step(self, lr: float, grad_factor: float = 1.0) -> None:
        """AdamW on ``grad_factor`` times the local shards' gradients (unused parameters, without a
        gradient, are skipped as ``torch.optim`` skips them)."""
        for p, run in zip(self.params, self.runs):
            run.grad = None if p.grad is None else _dt(p.grad).to_local().view(-1)
        self.optimizer.step(lr, grad_factor)
        for run in self.runs:
            run.grad = None

    def set_step(self, step: int) -> None:
        self.optimizer.set_step(step)

    def gather_params(self) -> None:
        """Nothing: FSDP all-gathers parameters in the next forward."""

    @torch.no_grad()
    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def close(self) -> None:
        """Drop the gradient shards; FSDP's hooks live on the (sharded) model and go with it, the
        Adam states and master with the last reference to the backend. Unusable afterwards."""
        self.zero_grad()
        for run in self.runs:
            run.grad = None

    # ----------------------------------------------------------------- state exchange (checkpoints)
    def _local_of(self, full: torch.Tensor, p: "DTensor") -> torch.Tensor:
        """This rank's FSDP shard of a (TP-shard) tensor; local slicing, no communication."""
        from torch.distributed.tensor import distribute_tensor
        return distribute_tensor(full.to(p.to_local().device), p.device_mesh, p.placements,
                                 src_data_rank=None).to_local()

    def owned_pieces(self) -> list[dict]:
        """This rank's FSDP shards as pieces of the flattened TP shard (``Shard(0)`` of a contiguous
        tensor is one flat range): ``name``, ``lo``, ``length`` and 1-D views of ``param``,
        ``exp_avg``, ``exp_avg_sq``, ``master`` (see :meth:`tnlg.optim.zero.FlatZero.owned_pieces`)."""
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
        out = []
        for n, p, m, v, mst in zip(self.names, self.params, self.exp_avg, self.exp_avg_sq, self.master):
            local = p.to_local()
            if local.numel() == 0:
                continue
            _, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
            row = p.numel() // p.shape[0]
            out.append(dict(name=n, lo=int(offset[0]) * row, length=local.numel(), param=local.view(-1),
                            exp_avg=m.view(-1), exp_avg_sq=v.view(-1),
                            master=None if mst is None else mst.view(-1),
                            **(dict(kind="expert", sharded=True) if self.expert[self._index[n]] else {})))
        return out

    def param_tensors(self, names):
        """``(name, full tensor)`` of the named parameters, one at a time: an all-gather over DP per
        parameter (collective: every DP rank must iterate with the same names)."""
        for n, p in self._selected(names):
            yield n, p.full_tensor()

    @torch.no_grad()
    def load_param(self, name: str, value: torch.Tensor) -> None:
        """Keep this rank's shard of a full (over DP) value; no communication."""
        p = _dt(self._checked(name, value))
        p.to_local().copy_(self._local_of(value.to(p.dtype), p))

    @torch.no_grad()
    def refresh_master(self) -> None:
        for p, mst in zip(self.params, self.master):
            if mst is not None:
                mst.copy_(p.to_local())

    def memory_report(self) -> dict:
        """Bytes this rank holds across a step. Parameters: the local shards, plus (stage 2) the
        unsharded copy FSDP keeps from a unit's forward until its backward; gradients: shards;
        optimizer: Adam states of the shards (+ fp32 master for low-precision parameters)."""
        shard = sum(p.to_local().numel() * p.element_size() for p in self.params)
        full = sum(p.numel() * p.element_size() for p in self.params)
        grads = sum(p.to_local().numel() * p.element_size() for p in self.params)
        adam = sum(m.numel() * 8 for m in self.exp_avg)
        master = sum(0 if m is None else m.numel() * 4 for m in self.master)
        return dict(param_bytes=shard + (full if self.stage == 2 else 0), grad_bytes=grads,
                    optim_bytes=adam + master, adam_bytes=adam, master_bytes=master,
                    param_shard_bytes=shard, numel=sum(p.numel() for p in self.params),
                    owned_numel=sum(p.to_local().numel() for p in self.params),
                    param_dtype=str(self.dtype).replace("torch.", ""),
                    grad_dtype=str(self.dtype).replace("torch.", ""))
