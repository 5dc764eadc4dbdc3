"""Simulate one rank's training step at full size on fake tensors: memory, traffic, FLOPs, time.

:func:`simulate` runs tnlg's own code for rank 0 of a ``TP x DP`` layout, in this process,
under ``FakeTensorMode`` (tensors with shapes and dtypes but no memory, nothing computed)
and a *fake* process group (``torch.testing._internal.distributed.fake_pg``: every
collective returns at once), watched by :class:`tnlg.plan.tracker.StepTracker`:

1. ``setup``: the GPT built on the meta device and materialised into the engine
   (:func:`tnlg.optim.build_engine`, as ``tnlg pretrain`` does: ZeRO stage, 16-bit
   parameters, fp32 gradients if asked);
2. ``forward`` and ``backward`` of the micro batches, under autocast
   (:func:`tnlg.training.step.forward_loss`, ``engine.backward``); with gradient
   accumulation, one accumulation micro step (no communication) is simulated and counted
   ``k - 1`` times, then the last one (bucketed reduction launched during backward);
3. ``grad sync`` (waiting for the reductions), ``norm`` (:mod:`tnlg.optim.clip`) and
   ``optimizer`` (AdamW on the owned slice, the parameter all-gather), the pieces of
   :meth:`tnlg.optim.sharded_backend.ShardedBackend.step` called one after another;
4. ``save``: a checkpoint of the iteration, :func:`tnlg.checkpoint.saving.save` itself, into a
   temporary folder removed after (:func:`_save_on_fake_tensors`): its small files (manifest,
   RNG states, the safetensors headers) are written, the tensor data is not: each tensor's
   host copy (what the GPU sends over PCIe, one tensor at a time) is counted instead. The
   phase reports the device memory the save needs beyond the model states (nothing but what
   the save path allocates), the bytes copied to the host and the largest host copy; its time
   is the host copies at the GPU's PCIe bandwidth (the file system's time is not predicted),
   and it is not part of the step time.

Context parallelism (``cp > 1``): rank 0 is CP rank 0 of a ``TP x CP x DP`` world; its micro batches are its
two chunks of each sequence (``s / C`` positions, global positions from the model), the ring attention's
sends and receives go to the fake group (each hop counted under ``cp``; a hop's time is its send at NVLink's
bandwidth when TP x CP fits in a node), and the engine reduces over DP x CP (``ps.for_gradients()``).

A mixture of experts (``config.num_experts``; ``ep`` expert-parallel ranks carved from DP x CP): routing is data
dependent (which expert gets how many tokens is in the router's values, which fake tensors do not have), so the
simulation routes evenly (:func:`even_routing`): the router runs as written (logits, top-k, its losses), and the
assignment of the tokens to experts is :func:`tnlg.model.moe.even_routing_map`'s, every expert ``T k / E`` of the
``T k`` routed copies, the assumption of the planner's MoE terms (:mod:`tnlg.plan.experts`). The dispatch and
combine all-to-alls run on the fake group (counted under ``ep``), the engine keeps one flat backend per gradient
kind (the experts' over ``edp``); the checkpoint save is not simulated with EP > 1 (tnlg does not save EP > 1
checkpoints yet).

The model runs on the CPU code path (this torch need not have CUDA), with two exceptions
that matter for memory (:func:`_gpu_kernels`): ``F.scaled_dot_product_attention`` on 16-bit
inputs without a mask runs as CUDA's flash attention kernel does (its fake implementation:
output and fp32 log-sum-exp kept for backward, dropout included, scores recomputed in
backward), which is what SDPA picks on an A100/H100/H200 for these shapes, where the CPU
would run its math kernel with fp32 scores when attention dropout is on; and dropout runs
as CUDA's fused kernel (1-byte masks). Elsewhere (LayerNorm, cross-entropy) the CPU's kernels
stand in for the GPU's; the optimizer's operators are the same on both (torch's fused AdamW for
fp32, one ``tnlg::adamw_16bit_`` per owned run for 16-bit parameters, one fused kernel on CUDA).

Time (:func:`predict_time`): per operator ``max(FLOPs / (peak x matmul efficiency),
bytes / (bandwidth x memory efficiency), kernel floor)``, summed; collectives at the link
bandwidth of their group (ring: ``2 (n-1)/n`` of the payload for an all-reduce,
``(n-1)/n`` for reduce-scatter and all-gather; TP inside a node over NVLink, DP across
nodes when TP x DP exceeds a node), without overlap. MFU = model FLOPs (Narayanan et al.
eq. 3, :mod:`tnlg.plan.flops`) / (step time x peak).
"""

from __future__ import annotations

import contextlib
import math
import tempfile
import time
import warnings
from typing import Optional

import torch
import torch.distributed as dist

from ..checkpoint.stream import StreamWriter
from ..config import GPTConfig
from ..errors import UserError
from ..layout import ParallelDims
from ..plan.gpus import GPU
from ..plan.gpus import gpu as lookup_gpu
from ..plan.tracker import ALLOCATIONS, StepTracker

__all__ = ["simulate", "tracked_iteration", "predict_time", "check_layout", "even_routing"]

_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": None}
_RING = {"allreduce": lambda n: 2 * (n - 1) / n, "reducescatter": lambda n: (n - 1) / n,
         "allgather": lambda n: (n - 1) / n, "alltoall": lambda n: (n - 1) / n,
         "send": lambda n: 1.0, "recv": lambda n: 0.0}  # a hop: its send
Lora = tuple  # (rank, targets): a LoRA run's adapters, targets by PEFT's names (None: the family's default)


def check_layout(config: GPTConfig, tp: int, dp: int, zero_stage: int, precision: str, gpu_name: str,
                 micro_batch: int, accum: int, *, fsdp: bool = False, cp: int = 1) -> GPU:
    """A clear :class:`UserError` for a layout the simulation cannot run; the :class:`GPU` otherwise.
    ``fsdp``: ZeRO stages 2 and 3 (FSDP2) are simulated too (a pipeline stage's simulation runs them);
    ``cp``: context-parallel ranks (``2 cp`` must divide the sequence)."""
    if not isinstance(cp, int) or cp < 1 or config.seq_length % (2 * cp):
        raise UserError(f"--simulate: --context-parallel-size {cp!r} must be a positive integer with 2 x CP "
                        f"dividing --seq-length {config.seq_length}.")
    g = lookup_gpu(gpu_name)
    for name, v in (("--tensor-model-parallel-size", tp), ("--data-parallel-size", dp),
                    ("--micro-batch-size", micro_batch), ("gradient accumulation steps", accum)):
        if not isinstance(v, int) or v < 1:
            raise UserError(f"--simulate: {name} must be a positive integer, got {v!r}.")
    try:
        config.check_tensor_parallel(tp)
    except ValueError as err:
        raise UserError(f"--simulate: {err}") from None
    if precision not in _DTYPES:
        raise UserError(f"--simulate: --precision {precision!r} is not one of {', '.join(_DTYPES)}.")
    if fsdp and zero_stage not in (0, 1, 2, 3):
        raise UserError(f"--simulate: --zero-stage {zero_stage!r} is not a ZeRO stage; valid: 0, 1, 2, 3.")
    if not fsdp and zero_stage not in (0, 1):
        raise UserError(f"--simulate runs ZeRO stages 0 and 1 (tnlg's flat buffers); stage {zero_stage} "
                        f"(FSDP2) is not simulated yet without a pipeline (tnlg plan --pp P --simulate runs it). Plan it without --simulate, "
                        f"or simulate --zero-stage 1.")
    return g


@contextlib.contextmanager
def _fake_world(tp: int, dp: int, cp: int = 1, ep: int = 1):
    """Rank 0 of a ``tp x cp x dp`` world whose collectives (and point-to-point sends, the ring's) do nothing:
    its :class:`ParallelState` (with ``ep`` expert-parallel ranks)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from ..parallel.state import init_expert_parallel, init_parallel
    if dist.is_initialized():
        raise UserError("--simulate runs in a process without a process group (it creates a fake one); "
                        "this process already has one.")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=ParallelDims(tp=tp, cp=cp, dp=dp).world)
    try:
        yield init_expert_parallel(init_parallel(tensor_parallel_size=tp, context_parallel_size=cp), ep)
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def even_routing(real_tensors: bool = False):
    """For the duration, a mixture of experts routes evenly on fake tensors (module docstring). The layer reads
    the routing's values in two places, which are replaced: its assignment of the routed copies to experts
    (:meth:`tnlg.model.moe.MoELayer.assignment`, the ``nonzero`` of the routing map, whose size is data) is that
    of :func:`tnlg.model.moe.even_routing_map` (the same ``T``, ``k``, ``E`` and capacity), computed on real
    tensors (the indices, as a GPU holds them: the tracker counts them); and the counts the EP ranks exchange
    (:func:`tnlg.parallel.experts.exchange_counts`, which a fake process group would not deliver) are what even
    routing sends this rank: every rank routes alike, so each sends this rank's experts the counts this rank
    has for them. The counts (``E`` integers) are fake tensors that hold their values (``FakeTensorMode``'s
    constants, allowed up to ``E`` elements for the duration), so the split sizes and the regrouping by local
    expert that the layer computes from them run as written. ``real_tensors``: real tensors route evenly too (a
    real run to check the simulation against); else they route as the router says."""
    from torch._subclasses import fake_tensor
    from torch._subclasses.fake_tensor import maybe_get_fake_mode, unset_fake_temporarily

    from ..model import moe
    from ..parallel import experts

    declared = moe.MoELayer.__dict__["assignment"]  # (a staticmethod: restored as declared)
    real_assignment, real_exchange = moe.MoELayer.assignment, experts.exchange_counts
    real_limit = fake_tensor.CONSTANT_NUMEL_LIMIT

    def assignment(self, routing_map):
        mode = maybe_get_fake_mode(routing_map)
        if mode is None and not real_tensors:  # (real tensors: the layer's own routing)
            return real_assignment(routing_map)
        cfg = self.cfg
        fake_tensor.CONSTANT_NUMEL_LIMIT = max(real_limit, cfg.num_experts)
        with unset_fake_temporarily():
            even = moe.even_routing_map(routing_map.shape[0], cfg.moe_router_topk, cfg.num_experts,
                                        cfg.moe_expert_capacity_factor, cfg.moe_pad_expert_input_to_capacity,
                                        device=routing_map.device)
            expert_idx, token_idx, counts = real_assignment(even)
        if mode is None:
            return expert_idx, token_idx, counts
        return expert_idx, token_idx, mode.fake_tensor_converter.from_real_tensor(mode, counts, make_constant=True)

    def exchange_counts(counts, ep, group):
        if maybe_get_fake_mode(counts) is None:
            return real_exchange(counts, ep, group)
        return counts.view(ep, -1)[dist.get_rank(group)].repeat(ep, 1)

    moe.MoELayer.assignment = assignment  # type: ignore[method-assign,assignment]
    experts.exchange_counts = exchange_counts
    try:
        yield
    finally:
        moe.MoELayer.assignment = declared  # type: ignore[method-assign]
        experts.exchange_counts = real_exchange
        fake_tensor.CONSTANT_NUMEL_LIMIT = real_limit


class _FlashAttention(torch.autograd.Function):
    """SDPA as CUDA's flash attention kernel runs it (forward and backward operators)."""

    @staticmethod
    def forward(ctx, q, k, v, dropout_p: float, is_causal: bool, scale):
        out, lse, cq, ck, mq, mk, seed, offset, _ = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, dropout_p, is_causal, False, scale=scale)
        ctx.save_for_backward(q, k, v, out, lse, seed, offset)
        ctx.args = (cq, ck, mq, mk, dropout_p, is_causal, scale)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, seed, offset = ctx.saved_tensors
        cq, ck, mq, mk, dropout_p, is_causal, scale = ctx.args
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            grad_out, q, k, v, out, lse, cq, ck, mq, mk, dropout_p, is_causal, seed, offset, scale=scale)
        return dq, dk, dv, None, None, None


@contextlib.contextmanager
def _gpu_kernels():
    """For the simulation's duration, two functions run the kernels a GPU runs (module docstring):
    ``F.scaled_dot_product_attention`` as :class:`_FlashAttention` (16-bit, no mask, head dim <= 256)
    and ``F.dropout`` as ``native_dropout`` (CUDA's fused dropout: a 1-byte mask; the CPU keeps a mask
    in the input's dtype). Substitutions of the functions (not a ``TorchFunctionMode``), so that
    recomputation in backward sees them too."""
    import torch.nn.functional as F
    sdpa, dropout = F.scaled_dot_product_attention, F.dropout

    def flash_where_a_gpu_would(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kw):
        if attn_mask is None and not kw and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256:
            return _FlashAttention.apply(q, k, v, dropout_p, is_causal, scale)
        return sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, **kw)

    def fused_dropout(x, p=0.5, training=True, inplace=False):
        if training and 0.0 < p < 1.0 and not inplace:
            return torch.native_dropout(x, p, True)[0]
        return dropout(x, p, training, inplace)

    F.scaled_dot_product_attention, F.dropout = flash_where_a_gpu_would, fused_dropout  # type: ignore[assignment]
    try:
        yield
    finally:
        F.scaled_dot_product_attention, F.dropout = sdpa, dropout


@contextlib.contextmanager
def _save_on_fake_tensors(host_copies: list):
    """For the duration, :func:`tnlg.checkpoint.saving.save` runs on fake tensors (module docstring):
    its safetensors writer checks each tensor against the header as written, then appends the bytes
    of the tensor's host copy to ``host_copies`` instead of writing them (real tensors are written as
    ever); the RNG states (small host tensors) are captured outside the fake mode; and the save's
    exchanges of Python objects (its agreement on failures, the manifest's file records) hand every
    rank this rank's object, as the fake process group moves no data (a few hundred bytes, not counted)."""
    from torch._subclasses.fake_tensor import is_fake, unset_fake_temporarily

    from ..checkpoint import saving

    class CountedWriter(StreamWriter):
        def write(self, key: str, tensor: torch.Tensor) -> None:
            if not is_fake(tensor):
                return super().write(key, tensor)
            want_key, shape, dtype = self.specs[self.next]
            if key != want_key or tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
                raise ValueError(f"stream write {self.next}: got {key!r} {tuple(tensor.shape)} {tensor.dtype}, "
                                 f"expected {want_key!r} {tuple(shape)} {dtype}.")
            host_copies.append(tensor.numel() * tensor.element_size())
            self.next += 1

    def capture(*args):
        with unset_fake_temporarily():
            return real_capture(*args)

    def all_gather_object(object_list: list, obj, group=None) -> None:
        object_list[:] = [obj] * len(object_list)

    real_writer, real_capture, real_gather = saving.StreamWriter, saving.capture, dist.all_gather_object
    # patched for the simulation only, restored below (mypy refuses assigning to a class name)
    saving.StreamWriter, saving.capture, dist.all_gather_object = CountedWriter, capture, all_gather_object  # type: ignore[misc]
    try:
        yield
    finally:
        saving.StreamWriter, saving.capture, dist.all_gather_object = real_writer, real_capture, real_gather  # type: ignore[misc]


def _register_engine(tracker: StepTracker, engine) -> None:
    for b in getattr(engine.backend, "parts", (engine.backend,)):  # (expert parallelism: a backend per kind)
        _register_backend(tracker, b)


def _register_backend(tracker: StepTracker, b) -> None:
    if not hasattr(b, "param_buffer"):  # FSDP2 (ZeRO 2/3): the local shards; gradients appear in backward
        tracker.register([p.to_local() for p in b.params], "parameters")
        tracker.register([m for m in b.master if m is not None], "master")
        tracker.register(b.exp_avg + b.exp_avg_sq, "adam")
        return
    tracker.register(b.param_buffer, "parameters")
    tracker.register(b.grad_buffer, "gradients")
    tracker.register(b.master, "master")
    tracker.register([b.exp_avg, b.exp_avg_sq], "adam")


def _sync_norm_and_step(tracker, engine, ps, clip_grad: float) -> None:
    """The step's phases after the last backward, as the trainer runs them: grad sync, norm, optimizer."""
    from torch._subclasses.fake_tensor import is_fake

    from ..optim.clip import SIMULATED_NORM, clip_coefficient, global_norm, global_sum_of_squares, squared_sums
    b = engine.backend
    parts = getattr(b, "parts", (b,))  # (expert parallelism: the dense and the experts' backends, one norm)
    with tracker.phase("grad sync"):
        for part in parts:
            part.finish_grad_sync()
    with tracker.phase("norm"):
        if len(parts) > 1:  # (the dense and the experts' sums of squares, added as KindsBackend.step adds them)
            dense_sq = global_sum_of_squares(*squared_sums(b.dense.grad_pieces()), b.dense.ps,
                                             b.dense.grads_sharded_over_dp)
            total = dense_sq + b._expert_sq().to(dense_sq)
            norm = SIMULATED_NORM if is_fake(total) else math.sqrt(max(total.item(), 0.0))
        else:
            sh, rep = squared_sums(b.grad_pieces())
            norm = global_norm(sh, rep, ps, over_dp=b.grads_sharded_over_dp)
    with tracker.phase("optimizer"):
        for part in parts:
            part.adam_step(1e-4, clip_coefficient(norm, clip_grad))


def simulate(config: GPTConfig, tp: int, dp: int, *, zero_stage: int = 1, precision: str = "bf16",
             micro_batch: int = 1, accum: int = 1, grads_fp32: bool = False, gpu: str = "h100",
             bucket_size_mb: float = 25.0, clip_grad: float = 1.0, gpu_kernels: bool = True, cp: int = 1,
             ep: int = 1, lora: Optional[Lora] = None) -> dict:
    """Simulate one iteration of rank 0 (see the module docstring); a dict of phases and the prediction.
    ``gpu_kernels=False`` keeps the CPU's attention and dropout kernels (to compare with a real CPU run).
    ``cp``: context-parallel ranks; rank 0 runs its two chunks of each sequence (``s / cp`` positions)
    through the ring attention, whose sends and receives go to the fake group (counted as ``cp`` traffic).
    ``ep``: expert-parallel ranks of a mixture of experts, routed evenly (:func:`even_routing`); no save at EP > 1.
    ``lora``: ``(rank, targets)``, the step of a LoRA fine-tuning run (:func:`tracked_iteration`)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    g = check_layout(config, tp, dp, zero_stage, precision, gpu, micro_batch, accum, cp=cp)
    from ..plan.experts import check_expert_layout
    check_expert_layout(config, ep, dp * cp, zero_stage)
    layout = dict(tp=tp, cp=cp, dp=dp, zero_stage=zero_stage, precision=precision, micro_batch=micro_batch, accum=accum,
                  grads_fp32=grads_fp32, bucket_size_mb=bucket_size_mb, ep=ep)
    if lora is not None:
        layout.update(lora_rank=lora[0], lora_targets=list(lora[1] or ()))
    started = time.perf_counter()
    host_copies: list[int] = []
    with _fake_world(tp, dp, cp, ep) as ps, FakeTensorMode(allow_non_fake_inputs=True), \
            _gpu_kernels() if gpu_kernels else contextlib.nullcontext(), even_routing(), \
            _save_on_fake_tensors(host_copies), tempfile.TemporaryDirectory(prefix="tnlg-simulate-") as save_dir, \
            warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
        tracker, memory = tracked_iteration(config, ps, zero_stage=zero_stage, precision=precision,
                                            micro_batch=micro_batch, accum=accum, grads_fp32=grads_fp32,
                                            bucket_size_mb=bucket_size_mb, clip_grad=clip_grad,
                                            save_dir=save_dir if ep == 1 else None, lora=lora)
    return _report(config, tracker, g, layout, memory, time.perf_counter() - started, host_copies)


def tracked_iteration(config: GPTConfig, ps, *, zero_stage: int, precision: str, micro_batch: int, accum: int,
                      grads_fp32: bool = False, bucket_size_mb: float = 25.0,
                      clip_grad: float = 1.0, save_dir: Optional[str] = None,
                      lora: Optional[Lora] = None) -> tuple[StepTracker, dict]:
    """One iteration of tnlg's code on ``ps`` under a :class:`StepTracker`, phase by phase (module
    docstring), and with ``save_dir`` a checkpoint of it saved there; real or fake tensors alike.
    Returns the tracker and the engine's memory report. With context parallelism (``ps.cp_size > 1``) the
    micro batches are this CP rank's ``s / C`` positions and the engine reduces over DP x CP
    (``ps.for_gradients()``), as ``tnlg pretrain`` builds it. ``lora``: ``(rank, targets)`` (PEFT's names;
    ``None`` targets: PEFT's default for the family): the base built as ``tnlg finetune --lora-rank`` builds it
    (:func:`tnlg.training.adapters.frozen_base`: on the device, in the 16-bit dtype; its initial weights stand for
    the checkpoint's), frozen, with rank-``rank`` adapters, the engine holding the adapters alone; the frozen
    weights are counted as ``parameters`` and in the report's ``frozen_bytes``."""
    from ..model import GPT
    from ..optim import build_engine
    from .step import forward_loss
    dtype, micro_steps = _DTYPES[precision], min(accum, 2)
    grad_ps = ps.for_gradients()
    tracker = StepTracker({ps.tp_group: "tp", grad_ps.dp_group: "dp", ps.cp_group: "cp", ps.ep_group: "ep",
                           ps.edp_group: "edp"})
    with tracker:
        with tracker.phase("setup"):
            model = GPT(config, ps, device="meta") if lora is None else _adapted(config, ps, dtype, lora)
            engine = build_engine(model, grad_ps, zero_stage, grad_accum_steps=micro_steps,
                                  param_dtype=dtype, accumulate_grads_in_fp32=grads_fp32,
                                  bucket_size_mb=bucket_size_mb, clip_grad=clip_grad)
        _register_engine(tracker, engine)
        frozen = [p for p in engine.model.parameters() if not p.requires_grad]
        tracker.register(frozen, "parameters")
        engine.zero_grad()
        for i in range(micro_steps):
            tokens = torch.randint(0, config.vocab_size, (micro_batch, config.seq_length // ps.cp_size),
                                   device=ps.device)  # (this CP rank's chunks: the model takes their positions)
            batch = dict(tokens=tokens, labels=tokens, loss_mask=torch.ones(tokens.shape, device=ps.device))
            tag = " (accumulation)" if i < micro_steps - 1 else ""
            with tracker.phase("forward" + tag):
                loss = forward_loss(engine.model, batch, dtype)
            with tracker.phase("backward" + tag):
                engine.backward(loss)
                del loss, batch, tokens
        _sync_norm_and_step(tracker, engine, grad_ps, clip_grad)
        if save_dir is not None:
            from ..checkpoint.saving import save
            with tracker.phase("save"):
                save(save_dir, iteration=1, consumed_samples=micro_batch * accum * ps.dp_size,
                     model=engine.model if lora is None else _adapter_view(engine.model, config, ps, lora),
                     engine=engine, ps=grad_ps, config=config)
        memory = engine.memory_report()
        if lora is not None:
            memory["frozen_bytes"] = sum(p.numel() * p.element_size() for p in frozen)
        del frozen
        engine.close()
    return tracker, memory


def _adapted(config: GPTConfig, ps, dtype, lora: Lora):
    """The frozen base and its adapters, as an adapter run builds them (:func:`tracked_iteration`)."""
    from ..adapters.lora import LoraSettings
    from ..interop.peft import add_lora
    from .adapters import frozen_base
    model = frozen_base(config, ps, [range(config.num_layers)], dtype)
    add_lora(model, LoraSettings(lora[0]), lora[1])
    return model


def _adapter_view(model, config: GPTConfig, ps, lora: Lora):
    """The model as an adapter run's checkpoint sees it (its adapters alone)."""
    from .adapter_checkpoint import CheckpointView, adapter_layout, targets_of
    return CheckpointView(model, adapter_layout(config, ps.tp_size, lora[0], targets_of(model)))


def _comm_time(op, group_size: int, gbps: float) -> float:
    kind = next((k for k in _RING if k in op.name.replace("_", "")), "allreduce")
    return op.comm_bytes * _RING.get(kind, _RING["allreduce"])(max(group_size, 2)) / (gbps * 1e9)


def predict_time(phases, g: GPU, tp: int, dp: int, gpus_per_node: int = 8, cp: int = 1, ep: int = 1) -> dict:
    """Seconds per phase on GPU ``g`` (module docstring): compute, memory-bound, communication. ``dp``: the
    gradient group's size (DP x CP with context parallelism); the CP ring's sends at NVLink's bandwidth when
    TP x CP fits in a node, else the network's (not overlapped with compute here); expert parallelism's
    all-to-alls (``ep``) likewise when TP x EP fits in a node, the experts' gradients over DP x CP / EP."""
    flops_s, bytes_s = g.flops_16bit * g.matmul_efficiency, g.memory_bps * g.memory_efficiency
    dp_gbps = g.nvlink_gbps if tp * dp <= gpus_per_node else g.network_gbps
    cp_gbps = g.nvlink_gbps if tp * cp <= gpus_per_node else g.network_gbps
    ep_gbps = g.nvlink_gbps if tp * ep <= gpus_per_node else g.network_gbps
    groups = {"tp": (tp, g.nvlink_gbps), "cp": (cp, cp_gbps), "ep": (ep, ep_gbps), "edp": (max(dp // ep, 1), dp_gbps)}
    out = {}
    for ph in phases:
        compute = comm = 0.0
        for op in ph.ops:
            if op.comm_bytes:
                size, gbps = groups.get(op.group, (dp, dp_gbps))
                comm += _comm_time(op, size, gbps)
            elif op.name not in ALLOCATIONS:  # an allocation launches no kernel
                compute += max(op.flops / flops_s, op.bytes / bytes_s, g.kernel_floor_s)
        out[ph.name] = dict(compute_s=compute, comm_s=comm, total_s=compute + comm)
    return out


def _save_phase(d: dict, g: GPU, host_copies: list[int]) -> None:
    """The save phase's host copies (``comm_bytes["host"]``, at the GPU's PCIe bandwidth) and the largest."""
    total = sum(host_copies)
    d["comm_bytes"]["host"] = total
    d.update(host_copy_bytes=total, largest_host_copy_bytes=max(host_copies, default=0))
    d["comm_s"] += total / (g.host_gbps * 1e9)
    d["total_s"] = d["compute_s"] + d["comm_s"]


def _report(config: GPTConfig, tracker: StepTracker, g: GPU, layout: dict, memory: dict, wall: float,
            host_copies: list[int]) -> dict:
    from ..plan.flops import flops_per_iteration
    cp = layout.get("cp", 1)
    times = predict_time(tracker.phases, g, layout["tp"], layout["dp"] * cp, cp=cp, ep=layout.get("ep", 1))
    accum = layout["accum"]
    step = sum(t["total_s"] * (accum - 1 if name.endswith("(accumulation)") else 1)
               for name, t in times.items() if name not in ("setup", "save"))
    tokens = layout["micro_batch"] * accum * config.seq_length // cp
    model_flops = flops_per_iteration(config, layout["micro_batch"] * accum, None,
                                      config.padded_vocab_size(layout["tp"])) / (layout["tp"] * cp)
    phases = []
    for ph in tracker.phases:
        d = ph.as_dict()
        d.update(times[ph.name])
        if ph.name == "save":
            _save_phase(d, g, host_copies)
        phases.append(d)
    peak = max(p["peak_bytes"] for p in phases if p["name"] != "setup")
    notes = []
    if config.num_experts is not None:
        notes.append("mixture of experts routed evenly (the assignment of tokens to experts is data; every expert "
                     "gets T k / E of the routed copies; real routing is uneven)")
        if layout.get("ep", 1) > 1:
            notes.append(f"EP {layout['ep']}: the checkpoint save is not simulated (tnlg does not save EP > 1 "
                         "checkpoints yet); the all-to-all counts' exchange is not run (even routing knows them)")
    if "lora_rank" in layout:
        notes.append("LoRA: a frozen base (its initial weights standing for the checkpoint's) and the adapters in "
                     "the engine; MFU counts full training's model FLOPs")
    # the model states as allocated: what lives when the first forward starts (a frozen base's weights included)
    first = next(p for p in phases if p["name"].startswith("forward"))
    states = sum(first["live_start"].get(k, 0) for k in ("parameters", "gradients", "master", "adam"))
    return dict(layout=layout, gpu=g.name, phases=phases, peak_bytes=peak, model_state_bytes=states,
                ops=[ph.ops for ph in tracker.phases],
                peak_phase=max((p for p in phases if p["name"] != "setup"), key=lambda p: p["peak_bytes"])["name"],
                model_states=memory, step_time_s=step, tokens_per_rank=tokens,
                model_flops_per_rank=model_flops, mfu=model_flops / (step * g.flops_16bit) if step else None,
                simulated_in_s=round(wall, 2),
                notes=["rank 0 of the layout under FakeTensorMode on the CPU code path, with CUDA's flash attention "
                       "and fused dropout; LayerNorm and cross-entropy run the CPU's operators, the optimizer the GPU's",
                       "time: per op max(FLOPs at 78% of the 16-bit spec, bytes at 85% of HBM, 4 us) + "
                       "collectives at link bandwidth, no overlap",
                       "save: a checkpoint of the iteration by tnlg's save path, tensor data copied to the host "
                       "(comm 'host', at the PCIe spec) and not written; not part of the iteration's time"] + notes)
