"""Simulate one pipeline stage's training step at full size on fake tensors (``tnlg plan --pp P --simulate``).

:func:`simulate_stage` runs, for the first rank of pipeline stage ``i`` of a ``PP x TP x DP`` layout, in
this process, under ``FakeTensorMode`` and torch's fake process group (as
:mod:`tnlg.training.simulate` does for a layout without a pipeline), tnlg's own code of that stage:

1. ``setup``: the :class:`~tnlg.model.stage.StageModel` of the stage built on the meta device and
   materialised into the engine (:func:`tnlg.optim.build_engine`);
2. ``forward (1F1B)`` and ``backward (1F1B)``: the ``m`` micro batches in Megatron's 1F1B order for this stage (``min(P - i - 1, m)``
   warm-up forwards, then one forward and one backward at a time, then the cool-down backwards), so that
   ``min(P - i, m)`` micro batches' activations are held at once, as on the real stage. Each forward is the
   stage's chunk under autocast; as in torch's ``PipelineStage``, a stage after the first reads its input
   from one of ``m`` receive buffers of the boundary's shape, a stage before the last its output's gradient
   from one of ``m`` gradient buffers (both kept for the whole step), and a micro batch's output is kept
   until its backward; on the last stage the loss is the vocab-parallel cross-entropy;
3. ``grad sync``, ``norm`` and ``optimizer``, as without a pipeline, plus the tied embedding's gradient
   all-reduce over the first and last stage.

ZeRO 2 and 3 (FSDP2): the stage runs the engine's FSDP2 module of its chunk (as torch's ``PipelineStage``
does); before each micro batch's backward the flags torch's stage sets (no gradient reduce-scatter, no
reshard after backward), and after the last backward torch's own ``perform_reduce_grad`` (phase ``grad
sync``: the accumulated gradients reduce-scattered over DP, the parameters resharded). The model is built
on the meta device outside the fake mode (FSDP2 shards real meta parameters, then materialises its shards
as fake tensors) and FSDP2's DP mesh is built outside it too (:func:`_fsdp_mesh_on_real_ranks`).

What is not run: torch's schedule itself (``torch.distributed.pipelining``): its point-to-point warm-up
and metadata exchange read data that a fake process group does not move, so the order of its 1F1B
schedule is reproduced here instead, and its send/recv traffic between stages is not counted (the CP ring's,
with ``cp > 1``, is). Nor is the checkpoint save:
its check that every parameter of the model is held by some stage gathers every stage's records, which
a fake process group does not exchange. Interleaved schedules are not simulated.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from typing import Optional

import torch
import torch.distributed as dist

from ..config import GPTConfig
from ..errors import UserError
from ..layout import ParallelDims
from ..plan.tracker import StepTracker
from .simulate import _DTYPES, _gpu_kernels, _register_engine, _sync_norm_and_step, check_layout, predict_time

__all__ = ["simulate_stage", "one_f_one_b"]


def one_f_one_b(stages: int, stage: int, micro_batches: int) -> list[tuple[str, int]]:
    """Megatron's non-interleaved 1F1B order on ``stage``: ``("F", k)`` / ``("B", k)`` for micro batch ``k``."""
    warmup = min(stages - stage - 1, micro_batches)
    order = [("F", k) for k in range(warmup)]
    for k in range(warmup, micro_batches):
        order += [("F", k), ("B", k - warmup)]
    return order + [("B", k) for k in range(micro_batches - warmup, micro_batches)]


@contextlib.contextmanager
def _fake_stage_world(tp: int, pp: int, dp: int, stage: int, cp: int = 1):
    """The first rank of pipeline stage ``stage`` of a ``tp x cp x pp x dp`` world whose collectives (and the
    ring's sends) do nothing."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from ..parallel.state import init_parallel
    if dist.is_initialized():
        raise UserError("--simulate runs in a process without a process group (it creates a fake one); "
                        "this process already has one.")
    dims = ParallelDims(tp=tp, cp=cp, dp=dp, pp=pp)
    dist.init_process_group("fake", store=FakeStore(), rank=dims.rank(pp=stage), world_size=dims.world)
    try:
        yield init_parallel(tensor_parallel_size=tp, pipeline_parallel_size=pp, context_parallel_size=cp)
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def _fsdp_mesh_on_real_ranks():
    """For the duration, ``DeviceMesh.from_group`` (FSDP2's mesh of the DP group, ZeRO 2/3) runs outside the
    fake tensor mode: it builds the mesh from a tensor of the group's ranks, which it reads back, and a fake
    tensor has no values to read."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import DeviceMesh
    real = DeviceMesh.from_group

    def from_group(*args, **kwargs):
        with unset_fake_temporarily():
            return real(*args, **kwargs)

    setattr(DeviceMesh, "from_group", staticmethod(from_group))  # noqa: B010 (a patch for the with-body)
    try:
        yield
    finally:
        setattr(DeviceMesh, "from_group", staticmethod(real))  # noqa: B010


def _micro_forward(chunk, ps, config: GPTConfig, micro_batch: int, dtype, received: Optional[torch.Tensor]):
    """One micro batch through ``chunk`` under autocast, from the tokens on the first stage, else from
    ``received`` (the receive buffer): ``(what backward starts from, the chunk's output)``."""
    from ..parallel.vocab import vocab_parallel_cross_entropy
    from .step import autocast_to
    tokens = torch.randint(0, config.vocab_size, (micro_batch, config.seq_length // ps.cp_size), device=ps.device)
    x = tokens if received is None else received.detach().requires_grad_()  # torch's stage input
    with autocast_to(dtype, ps.device):
        out = chunk(x)
        if not ps.is_last_stage:
            return out, out
        return vocab_parallel_cross_entropy(out, tokens, ps, config.vocab_size).mean(), out


def _receive_buffers(ps, config: GPTConfig, micro_batch: int, micro_batches: int, dtype) -> list:
    """torch's ``PipelineStage`` buffers: one ``[s, b, h]`` (the decoder's sequence-first activation; with
    sequence parallelism this rank's positions ``[s_r, b, h]``) per micro batch for the activation it receives
    (all stages but the first) and one for the gradient (all but the last), kept for the whole run."""
    from ..parallel.mappings import sequence_sizes
    s = config.seq_length // ps.cp_size
    if config.sequence_parallel and 1 < ps.tp_size <= s:  # (the model's sequence split, DecoderBase.sequence_split)
        s = sequence_sizes(s, ps.tp_size)[ps.tp_rank]
    shape, dt = (s, micro_batch, config.hidden_size), dtype or torch.float32
    make = [torch.empty(shape, dtype=dt, device=ps.device) for _ in range(micro_batches)]
    inputs = None if ps.is_first_stage else make
    grads = None if ps.is_last_stage else [torch.empty(shape, dtype=dt, device=ps.device)
                                            for _ in range(micro_batches)]
    return [inputs, grads]


def _run_schedule(tracker: StepTracker, engine, ps, config: GPTConfig, micro_batch: int, micro_batches: int,
                  dtype) -> None:
    """The stage's micro batches in 1F1B order (module docstring), inside ``engine.backward_all``: each forward
    a phase ``forward (1F1B)``, each backward a phase ``backward (1F1B)`` (merged by :func:`_merge`). As in
    torch's stage, a micro batch's output is kept until its backward (the last stage's logits too)."""
    from ..parallel.pipeline_schedule import tie_embedding_grads
    fsdp = getattr(engine.model, "pipeline_chunks", None)  # ZeRO 2/3: the FSDP2 module the stage runs
    chunk, held = (fsdp[0] if fsdp else engine.model.chunk(0)), {}

    def run(factor: float) -> None:
        with tracker.phase("forward (1F1B)"):
            inputs, grads = _receive_buffers(ps, config, micro_batch, micro_batches, dtype)
        for kind, k in one_f_one_b(ps.pp_size, ps.pp_rank, micro_batches):
            if kind == "F":
                with tracker.phase("forward (1F1B)"):
                    held[k] = _micro_forward(chunk, ps, config, micro_batch, dtype, inputs and inputs[k])
                continue
            with tracker.phase("backward (1F1B)"):
                if fsdp:
                    _no_sync(chunk)
                start, out = held.pop(k)
                if ps.is_last_stage:
                    (start * factor).backward()
                else:  # the gradient received from the next stage
                    start.backward(grads[k])
                del start, out
        if fsdp:
            with tracker.phase("grad sync"):
                _reduce_grad(chunk)
        with tracker.phase("backward (1F1B)"):
            tie_embedding_grads(engine.model, engine.grad_view)
    engine.backward_all(run)


def _no_sync(chunk) -> None:
    """What torch's ``PipelineStage.backward_maybe_with_nosync`` sets on an FSDP2 module before every micro
    batch's backward: no reduce-scatter, no reshard after backward (the unsharded parameters and the
    accumulated unsharded gradients stay for the rest of the step)."""
    chunk.set_is_last_backward(False)
    chunk.set_reshard_after_backward(False)
    chunk.set_requires_gradient_sync(False)


def _reduce_grad(chunk) -> None:
    """torch's ``PipelineStage.perform_reduce_grad`` (its own code, on an object holding the stage's module):
    after the last backward, FSDP2's post-backward of every parameter group, which reduce-scatters the
    accumulated gradients over DP and reshards the parameters."""
    from types import SimpleNamespace

    from torch.distributed.pipelining.stage import _PipelineStageBase
    _PipelineStageBase.perform_reduce_grad(SimpleNamespace(submod=chunk), 1)  # type: ignore[arg-type]


def _merge(phases: list[dict]) -> list[dict]:
    """Phases of one name as one, in first-seen order: the first's live bytes at the start, the highest peak
    (with its kinds), FLOPs, bytes, communication and times summed."""
    out: dict[str, dict] = {}
    for p in phases:
        m = out.get(p["name"])
        if m is None:
            out[p["name"]] = dict(p, comm_bytes=dict(p["comm_bytes"]), count=1)
            continue
        if p["peak_bytes"] > m["peak_bytes"]:
            m.update(peak_bytes=p["peak_bytes"], peak_by_kind=p["peak_by_kind"])
        for k in ("flops", "read_bytes", "written_bytes", "ops", "compute_s", "comm_s", "total_s", "count"):
            m[k] += p.get(k, 1)
        for g, n in p["comm_bytes"].items():
            m["comm_bytes"][g] = m["comm_bytes"].get(g, 0) + n
    return list(out.values())


def _tracked_stage(config: GPTConfig, ps, *, zero_stage: int, precision: str, micro_batch: int,
                   micro_batches: int, grads_fp32: bool, bucket_size_mb: float,
                   clip_grad: float) -> tuple[StepTracker, dict]:
    """The stage's iteration under a :class:`StepTracker`, phase by phase (module docstring)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    from ..optim import build_engine
    from ..model.stage import StageModel
    from ..parallel.pipeline import chunk_layers
    from ..parallel.pipeline_schedule import tie_embedding_grads  # noqa: F401  (imported here, untracked:
    # torch.distributed.pipelining creates a tensor at import, which would count as a live temporary)
    dtype = _DTYPES[precision]
    grad_ps = ps.for_gradients()  # the engine reduces over DP x CP
    tracker = StepTracker({ps.tp_group: "tp", grad_ps.dp_group: "dp", ps.pp_group: "pp", ps.cp_group: "cp"})
    with tracker:
        with tracker.phase("setup"):
            chunks = [chunk_layers(config.num_layers, ps.pp_size)[ps.pp_rank]]
            with unset_fake_temporarily():  # a meta-device build holds nothing; FSDP2 takes real meta parameters
                model = StageModel(config, ps, chunks, device="meta")
                if dtype is not None and zero_stage >= 2:
                    model.to(dtype)  # FSDPZero's own cast, here where no fake tensor takes part
            engine = build_engine(model, grad_ps, zero_stage,
                                  grad_accum_steps=micro_batches, param_dtype=dtype,
                                  accumulate_grads_in_fp32=grads_fp32, bucket_size_mb=bucket_size_mb,
                                  clip_grad=clip_grad)
        _register_engine(tracker, engine)
        engine.zero_grad()
        _run_schedule(tracker, engine, ps, config, micro_batch, micro_batches, dtype)
        _sync_norm_and_step(tracker, engine, grad_ps, clip_grad)
        memory = engine.memory_report()
        engine.close()
    return tracker, memory


def simulate_stage(config: GPTConfig, tp: int, pp: int, dp: int, stage: int, *, zero_stage: int = 1,
                   precision: str = "bf16", micro_batch: int = 1, micro_batches: int = 1, grads_fp32: bool = False,
                   gpu: str = "h100", bucket_size_mb: float = 25.0, clip_grad: float = 1.0, cp: int = 1) -> dict:
    """Simulate one iteration of pipeline stage ``stage``'s first rank (module docstring): its phases
    (live, peak by kind, time on ``gpu``), the peak outside setup and its phase, and the engine's report.
    ``cp``: context-parallel ranks; the stage runs CP rank 0's ``s / cp`` positions (the ring's sends to the
    fake group), its engine reduces over DP x CP."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    g = check_layout(config, tp, dp, zero_stage, precision, gpu, micro_batch, micro_batches, fsdp=True, cp=cp)
    if not (isinstance(pp, int) and pp > 1 and 0 <= stage < pp):
        raise UserError(f"--simulate of a pipeline stage needs --pp > 1 and a stage in 0..pp-1, got pp {pp!r}, "
                        f"stage {stage!r}.")
    started = time.perf_counter()
    with _fake_stage_world(tp, pp, dp, stage, cp) as ps, FakeTensorMode(allow_non_fake_inputs=True), _gpu_kernels(), \
            _fsdp_mesh_on_real_ranks(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
        tracker, memory = _tracked_stage(config, ps, zero_stage=zero_stage, precision=precision,
                                         micro_batch=micro_batch, micro_batches=micro_batches, grads_fp32=grads_fp32,
                                         bucket_size_mb=bucket_size_mb, clip_grad=clip_grad)
    phases = _merge([dict(ph.as_dict(), **predict_time([ph], g, tp, dp * cp, cp=cp)[ph.name])
                     for ph in tracker.phases])
    step = phases[1:]
    top = max(step, key=lambda p: p["peak_bytes"])
    return dict(stage=stage, layout=dict(tp=tp, cp=cp, pp=pp, dp=dp, zero_stage=zero_stage, precision=precision,
                                         micro_batch=micro_batch, micro_batches=micro_batches, grads_fp32=grads_fp32),
                gpu=g.name, phases=phases, peak_bytes=top["peak_bytes"], peak_phase=top["name"],
                setup_peak_bytes=phases[0]["peak_bytes"], model_states=memory,
                in_flight=min(pp - stage, micro_batches),
                simulated_in_s=round(time.perf_counter() - started, 2))
