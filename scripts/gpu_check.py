"""One prepared GPU check (issues 11 and 15): run once on a lent GPU, prints a table and writes JSON.

(a) a bf16 training step of a GPT-2-XL-shaped model (1.5B) at TP 1 through the ZeRO engine
    (16-bit parameters and gradients, fp32 master and Adam): tokens/s, MFU against a matmul
    measured in the same run and against the dense bf16 peak of an H100/H200-class GPU
    (989 TFLOP/s), peak memory against the planner's prediction;
(b) the extra peak memory and the time of a checkpoint save and of a load of that model;
(c) fp16 with dynamic loss scaling for 20 steps (a smaller model): loss and loss scale;
(d) a tnlg-17b slice: as many of its 78 layers as the planner says fit on this GPU at TP 1
    builds (on meta, materialised into the engine's buffers), steps and saves;
(a, c, d) each record the bytes allocated when they start (``baseline_bytes``) and report their peak
    above it (``peak_memory_bytes``), and close their engine at the end (``left_after_close_bytes``:
    what stayed allocated; 0 when engines are freed);
(e) the MFU denominator (the training log's measured matmul peak) in bf16 and fp32, five times
    each: its spread; and ``tnlg.runtime.hardware.check_bf16("cuda")`` accepting a GPU with bf16 tensor cores;
(f) the NCCL flight recorder switched on by ``tnlg.runtime.hang.enable_flight_recorder`` records collectives
    (a one-rank NCCL group; the trace is read back with torch's dump function), and the peak measured
    under a process group (the barrier path) on NCCL;
(g) ``tnlg pretrain`` on the GPU, bf16 with recomputation, as a subprocess: its start line, the
    flight-recorder note and the log line's model TFLOP/s, MFU and HFU (its output is printed).
(h) the one-pass 16-bit AdamW (``tnlg::adamw_16bit_``; compiled on CUDA) on one run of 2^26
    elements: its result against the eager composite (the same arithmetic), and its time and
    bandwidth (28 bytes per element) against torch's fused AdamW with the upcast before and the
    copy-back after (what the step did before).
(i) side by side with megatron-core: its ``GPTModel`` (local layer spec; Transformer Engine's where
    ``transformer_engine`` imports) at the GPT-2-XL shape beside tnlg's, bf16 (each one's 16-bit path:
    tnlg's 16-bit engine buffers; megatron-core's ``Float16Module`` with its bf16 optimizer), the same micro
    batch and tokens, forward + loss + backward + Adam step; each step timed with CUDA events (on the CPU:
    the wall clock) and both MFUs against the same FLOPs (Narayanan et al. eq. 3 without recomputation)
    and the 989 TFLOP/s peak. Without megatron-core the section says so (``skipped_i``). The megatron-core
    wheel is pure Python: ``pip download --no-deps megatron-core==0.16.1`` travels with the tree.

``--sections`` picks sections (default all: ``abcdefghi``; ``a`` and ``b`` run together). ``--tiny``
runs them end to end on the CPU with small shapes (tests use it); (f) and (g) need CUDA and are
recorded as skipped without it.
Usage::

    python scripts/gpu_check.py --out gpu_check.json            # on a GPU, about 6 minutes
    python scripts/gpu_check.py --sections efg --out gpu_check.json
    python scripts/gpu_check.py --tiny --out /tmp/gpu_check.json

Seen on one H200 (torch 2.11, 2026-11-30) for (e)-(g): peak bf16 751, 693, 691, 688, 685 TFLOP/s
(1.10x spread, the first the highest), fp32 51.2-51.3 (1.001x); the flight recorder held 14
entries; the pretrain log line read "0.504 model TFLOP/s/rank | MFU 0.1% HFU 0.1% of 750.170"
(the built-in 1.3M-parameter model is far too small for a GPU).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib.util
import os
import pickle
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import _bench
import torch

from tnlg import checkpoint as ck
from tnlg.config import GPTConfig
from tnlg.runtime.hardware import check_bf16
from tnlg.model import GPT
from tnlg.optim import DynamicLossScaler, build_engine
from tnlg.parallel.state import ParallelState, pick_device
from tnlg.plan.flops import flops_per_iteration
from tnlg.plan.planner import Hardware, Layout, Model, plan_layout
from tnlg.training.throughput import measure_peak_tflops

H100_BF16_DENSE_TFLOPS = 989.0


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _mem(device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    import resource
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def _reset_peak(device):
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _current(device) -> int:
    return int(torch.cuda.memory_allocated(device)) if device.type == "cuda" else 0


class Section:
    """One section's memory: the bytes allocated when it starts (``baseline``: what earlier sections left),
    the peak above that (``peak()``: ``max_memory_allocated`` is reset to what is allocated, so the absolute
    peak would count the baseline too), and the engines it built, closed at the end (``close()``) so that
    the next section starts from what this one found."""

    def __init__(self, device):
        self.device, self.engines = device, []
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        _reset_peak(device)
        self.baseline = _current(device)

    def engine(self, engine):
        self.engines.append(engine)
        return engine

    def peak(self) -> int:
        return _mem(self.device) - self.baseline

    def close(self) -> dict:
        for e in self.engines:
            e.close()
        self.engines.clear()
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return dict(baseline_bytes=self.baseline, left_after_close_bytes=_current(self.device) - self.baseline)


def measured_matmul_tflops(device, dtype, n: int, reps: int) -> float:
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    best = float("inf")
    for _ in range(3):
        for _ in range(2):
            a @ b
        _sync(device)
        t = time.perf_counter()
        for _ in range(reps):
            a @ b
        _sync(device)
        best = min(best, (time.perf_counter() - t) / reps)
    return 2 * n ** 3 / best / 1e12


def build(cfg, ps, dtype, zero_stage=0, scaler=None):
    model = GPT(cfg, ps, device="meta")
    return build_engine(model, ps, zero_stage, lr=1e-4, weight_decay=0.01, param_dtype=dtype, loss_scaler=scaler)


def train_steps(engine, cfg, ps, micro, steps, dtype):
    gen = torch.Generator().manual_seed(0)
    losses, times = [], []
    for _ in range(steps):
        tokens = torch.randint(0, cfg.vocab_size, (micro, cfg.seq_length + 1), generator=gen).to(ps.device)
        _sync(ps.device)
        t = time.perf_counter()
        engine.zero_grad()
        with torch.autocast(device_type=ps.device.type, dtype=dtype):
            loss = engine.model(tokens[:, :-1], labels=tokens[:, 1:])
        engine.backward(loss)
        info = engine.step()
        _sync(ps.device)
        times.append(time.perf_counter() - t)
        losses.append(loss.item())
        info["loss"] = losses[-1]
    return losses, times, info


def planned_bytes(cfg, micro, precision, recompute=False, use_meta=True) -> int:
    plan = plan_layout(Model("check", cfg), Layout(tp=1, dp=1, zero_stage=0, micro_batch=micro,
                                                   recompute=recompute, precision=precision), Hardware(),
                       use_meta=use_meta)
    return int(plan["memory"]["total"])


def section_a_b(args, ps, out, workdir):
    cfg = (GPTConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=512)
           if args.tiny else GPTConfig.preset("gpt2-xl"))
    micro = 2 if args.tiny else args.micro_batch
    sec = Section(ps.device)
    engine = sec.engine(build(cfg, ps, torch.bfloat16))
    states = _current(ps.device) - sec.baseline
    losses, times, _ = train_steps(engine, cfg, ps, micro, args.steps, torch.bfloat16)
    step_s = sorted(times[1:] or times)[len(times[1:] or times) // 2]
    flops = flops_per_iteration(cfg, micro, False, cfg.padded_vocab_size(1))
    peak_mm = measured_matmul_tflops(ps.device, torch.bfloat16, 256 if args.tiny else 8192, 3 if args.tiny else 20)
    achieved = flops / step_s / 1e12
    peak_mem = sec.peak()
    planned = planned_bytes(cfg, micro, "bf16")
    out["a_bf16_step"] = dict(
        model=dict(layers=cfg.num_layers, hidden=cfg.hidden_size, heads=cfg.num_attention_heads,
                   seq=cfg.seq_length, params=cfg.num_parameters_formula()),
        micro_batch=micro, step_s=step_s, tokens_per_s=micro * cfg.seq_length / step_s,
        model_tflops=achieved, matmul_tflops_measured=peak_mm, mfu_vs_measured=achieved / peak_mm,
        mfu_vs_989=achieved / H100_BF16_DENSE_TFLOPS, peak_memory_bytes=peak_mem, model_state_bytes=states,
        planned_bytes=planned, peak_over_planned=peak_mem / planned, losses=losses)
    # (b) save and load: extra peak memory and time
    path = os.path.join(workdir, "ckpt_a")
    _reset_peak(ps.device)
    before = _current(ps.device)
    t = time.perf_counter()
    ck.save(path, iteration=1, consumed_samples=micro, model=engine.model, engine=engine, ps=ps, config=cfg)
    save_s = time.perf_counter() - t
    save_extra = _mem(ps.device) - before
    _reset_peak(ps.device)
    t = time.perf_counter()
    ck.load(path, model=engine.model, engine=engine, ps=ps, config=cfg)
    load_s = time.perf_counter() - t
    load_extra = _mem(ps.device) - before
    size = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)
    out["b_checkpoint"] = dict(save_s=save_s, load_s=load_s, save_extra_peak_bytes=save_extra,
                               load_extra_peak_bytes=load_extra, bytes_on_disk=size,
                               extra_over_states=max(save_extra, load_extra) / max(states, 1))
    shutil.rmtree(path, ignore_errors=True)
    del engine
    out["a_bf16_step"].update(sec.close())


def section_c(args, ps, out):
    cfg = (GPTConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=512)
           if args.tiny else GPTConfig.preset("gpt2-medium"))
    sec = Section(ps.device)
    engine = sec.engine(build(cfg, ps, torch.float16, scaler=DynamicLossScaler()))
    scales = []
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(20):
        tokens = torch.randint(0, cfg.vocab_size, (2 if args.tiny else 8, cfg.seq_length + 1), generator=gen)
        tokens = tokens.to(ps.device)
        engine.zero_grad()
        with torch.autocast(device_type=ps.device.type, dtype=torch.float16):
            loss = engine.model(tokens[:, :-1], labels=tokens[:, 1:])
        engine.backward(loss)
        info = engine.step()
        losses.append(loss.item())
        scales.append(info["loss_scale"])
    out["c_fp16_loss_scaling"] = dict(steps=20, first_loss=losses[0], last_loss=losses[-1],
                                      all_finite=all(map(lambda x: x == x and abs(x) != float("inf"), losses)),
                                      loss_scales=scales, skipped=sum(1 for a, b in zip(scales, scales[1:]) if b < a),
                                      peak_memory_bytes=sec.peak())
    del engine
    out["c_fp16_loss_scaling"].update(sec.close())


def section_d(args, ps, out, workdir):
    full = GPTConfig.preset("tnlg-17b")
    if args.tiny:
        full = dataclasses.replace(full, num_layers=78, hidden_size=56, num_attention_heads=28, seq_length=16,
                                   vocab_size=512)
    budget = (torch.cuda.get_device_properties(ps.device).total_memory * 0.85 if ps.device.type == "cuda"
              else 2**28)
    layers = 1
    for n in range(1, min(full.num_layers, args.d_max_layers or full.num_layers) + 1):
        if planned_bytes(dataclasses.replace(full, num_layers=n), 1, "bf16", recompute=True, use_meta=False) > budget:
            break
        layers = n
    cfg = dataclasses.replace(full, num_layers=layers, recompute_activations=True)
    sec = Section(ps.device)
    t = time.perf_counter()
    engine = sec.engine(build(cfg, ps, torch.bfloat16))
    build_s = time.perf_counter() - t
    losses, times, _ = train_steps(engine, cfg, ps, 1, 2, torch.bfloat16)
    path = os.path.join(workdir, "ckpt_d")
    t = time.perf_counter()
    ck.save(path, iteration=1, consumed_samples=1, model=engine.model, engine=engine, ps=ps, config=cfg)
    save_s = time.perf_counter() - t
    out["d_tnlg17b_slice"] = dict(layers=layers, of_layers=full.num_layers, params=cfg.num_parameters_formula(),
                                  build_s=build_s, step_s=times[-1], save_s=save_s, losses=losses,
                                  peak_memory_bytes=sec.peak(),
                                  planned_bytes=planned_bytes(cfg, 1, "bf16", recompute=True))
    shutil.rmtree(path, ignore_errors=True)
    del engine
    out["d_tnlg17b_slice"].update(sec.close())


def section_e(args, ps, out):
    # --tiny: a small matmul timed once (a CPU without bf16 kernels takes seconds per large bf16 matmul)
    kwargs = dict(n=64, trials=1, min_seconds=0.01) if args.tiny else {}
    res = {}
    for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        vals, secs = [], []
        for _ in range(2 if args.tiny else 5):
            t = time.perf_counter()
            vals.append(measure_peak_tflops(dtype, ps.device, **kwargs))
            secs.append(time.perf_counter() - t)
        res[name] = dict(tflops=vals, spread=max(vals) / min(vals), seconds=secs)
        print(f"(e) peak {name}: {[round(v, 1) for v in vals]} TFLOP/s, spread {max(vals) / min(vals):.3f}x, "
              f"{statistics.median(secs):.2f} s each", flush=True)
    if ps.device.type == "cuda":
        check_bf16("cuda")
        res["check_bf16_cuda"] = "accepted"
    out["e_peak"] = res


TRACE_ENV = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_NCCL_DUMP_ON_TIMEOUT",
             "TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")


def section_f(args, ps, out, workdir):
    import torch.distributed as dist

    from tnlg.runtime.hang import enable_flight_recorder

    prefix = enable_flight_recorder(os.path.join(workdir, "comm_trace"))
    store = dist.FileStore(os.path.join(workdir, "store"), 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=ps.device)
    try:
        x = torch.ones(1024, device=ps.device)
        for _ in range(3):
            dist.all_reduce(x)
        peak_pg = measure_peak_tflops(torch.bfloat16, ps.device)
        torch.cuda.synchronize()
        try:
            from torch._C._distributed_c10d import _dump_nccl_trace
            entries = [e.get("profiling_name") for e in pickle.loads(_dump_nccl_trace()).get("entries", [])]
        except Exception as exc:  # noqa: BLE001 - a private torch function: report what happened
            entries = f"dump failed: {exc!r}"
    finally:
        dist.destroy_process_group()
    out["f_flight_recorder"] = dict(prefix=prefix, env={k: os.environ.get(k) for k in TRACE_ENV}, entries=entries,
                                    peak_bf16_under_nccl_group=peak_pg)


def section_g(args, ps, out, workdir):
    env = dict(os.environ, TNLG_CACHE=os.path.join(workdir, "cache"), PYTHONUNBUFFERED="1")
    for k in TRACE_ENV:  # what (f) set in this process: the subprocess starts clean
        env.pop(k, None)
    cmd = [sys.executable, "-m", "tnlg", "pretrain", "--nproc-per-node", "1", "--tensor-model-parallel-size", "1",
           "--bf16", "--recompute-activations", "--train-iters", str(args.pretrain_iters), "--log-interval", "10",
           "--eval-interval", "0", "--no-plot", "--sample-tokens", "0", "--save", os.path.join(workdir, "run")]
    t = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=_bench.ROOT, timeout=400)
    out["g_pretrain"] = dict(exit=p.returncode, seconds=time.perf_counter() - t, stdout=p.stdout[-4000:],
                             stderr=p.stderr[-3000:])
    print(f"(g) tnlg pretrain on the GPU: exit {p.returncode} in {time.perf_counter() - t:.0f} s\n"
          f"{p.stdout[-2500:]}\n{p.stderr[-1500:]}", flush=True)
    if p.returncode:
        raise RuntimeError(f"tnlg pretrain exited with {p.returncode}")


def section_h(args, ps, out):
    from tnlg.optim.mixed_adamw import _eager, _scalars
    n, dev = (1 << 12) if args.tiny else (1 << 26), ps.device
    g = torch.Generator(device=dev).manual_seed(0)
    master = torch.randn(n, device=dev, generator=g)
    states = [master.bfloat16(), master, 0.1 * torch.randn(n, device=dev, generator=g),
              1e-3 * torch.rand(n, device=dev, generator=g)]
    grad = torch.randn(n, device=dev, generator=g).bfloat16()
    hyper = (1e-4, 0.1, 0.9, 0.95, 1e-8, 3, 0.5)
    fused, eager = [t.clone() for t in states], [t.clone() for t in states]
    torch.ops.tnlg.adamw_16bit_(*fused, grad, *hyper)
    _eager(*eager, grad, *_scalars(*hyper))
    diff = max(float((a.float() - b.float()).abs().max()) for a, b in zip(fused, eager))
    p16, p32 = states[0], torch.nn.Parameter(states[1])
    opt = torch.optim.AdamW([p32], lr=1e-4, weight_decay=0.1, betas=(0.9, 0.95), fused=True)
    opt.state[p32] = dict(step=torch.zeros((), device=dev), exp_avg=states[2], exp_avg_sq=states[3])

    def torch_fused():
        p32.grad = grad.float()
        opt.step()
        p16.copy_(p32.detach())

    def timed(fn, reps=3 if args.tiny else 20):
        fn()
        _sync(dev)
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        _sync(dev)
        return (time.perf_counter() - t) / reps
    one_pass = timed(lambda: torch.ops.tnlg.adamw_16bit_(*fused, grad, *hyper))
    before = timed(torch_fused)
    out["h_mixed_adamw"] = dict(numel=n, max_abs_diff_vs_eager=diff, one_pass_s=one_pass, torch_fused_s=before,
                                one_pass_gbps=28 * n / one_pass / 1e9, torch_fused_gbps=28 * n / before / 1e9)
    print(f"(h) 16-bit AdamW on {n} elements: {one_pass * 1e3:.2f} ms ({28 * n / one_pass / 1e9:.0f} GB/s of the "
          f"28-byte minimum) vs upcast + torch fused + copy-back {before * 1e3:.2f} ms; max |fused - eager| "
          f"{diff:.2e}", flush=True)


class StepTimer:
    """Seconds of each step: CUDA events on a GPU (recorded on the stream, read after a synchronize), the
    wall clock on the CPU."""

    def __init__(self, device):
        self.device, self.times = device, []

    def time(self, fn):
        if self.device.type != "cuda":
            t = time.perf_counter()
            out = fn()
            self.times.append(time.perf_counter() - t)
            return out
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = fn()
        end.record()
        end.synchronize()
        self.times.append(start.elapsed_time(end) / 1e3)
        return out


def _megatron_gpt(cfg, ps, micro):
    """megatron-core's GPTModel of ``cfg`` in its DDP with its bf16 Adam (Megatron-LM's ``--bf16``), and its
    step. On the CPU (``--tiny``) with the patches of ``tests/megatron_reference.py``."""
    sys.path.insert(0, _bench.ROOT)
    from tests import megatron_reference as mr
    if ps.device.type != "cuda":
        mr._patch_cuda_calls()
        mr._patch_optimizer_calls()
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    spec = dict(layers=cfg.num_layers, hidden=cfg.hidden_size, ffn=cfg.ffn_hidden_size, heads=cfg.num_attention_heads,
                seq=cfg.seq_length, vocab=cfg.vocab_size, divisible=128, tp=1, pp=1, untie=False, openai_gelu=True,
                bf16=True)
    layer_spec = "local"
    try:
        import transformer_engine  # noqa: F401
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
        from megatron.core.models.gpt.gpt_model import GPTModel
        torch.manual_seed(1234)
        model = GPTModel(mr._config(spec), get_gpt_layer_with_transformer_engine_spec(), vocab_size=mr.padded(spec),
                         max_sequence_length=cfg.seq_length, share_embeddings_and_output_weights=True)
        layer_spec = "transformer_engine"
    except ImportError:
        model = mr.build_model(spec)
    model = model.to(ps.device)
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(), Float16Module(model.config, model))
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-4, weight_decay=0.01, clip_grad=1.0,
                                                 bf16=True, params_dtype=torch.bfloat16), [ddp])
    gen = torch.Generator().manual_seed(0)
    s = cfg.seq_length
    positions = torch.arange(s, device=ps.device).unsqueeze(0).expand(micro, -1)
    mask = torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool, device=ps.device), 1)

    def step():
        tokens = torch.randint(0, cfg.vocab_size, (micro, s + 1), generator=gen).to(ps.device)
        ddp.zero_grad_buffer()
        opt.zero_grad()
        loss = ddp(tokens[:, :-1], positions, mask, labels=tokens[:, 1:]).float().mean()
        loss.backward()
        ddp.finish_grad_sync()
        opt.step()
        return loss
    return step, layer_spec, (model, ddp, opt)


def _one_rank_group(device, workdir) -> None:
    import torch.distributed as dist
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1,
                                init_method="file://" + os.path.join(workdir, "rdzv_i"))


def section_i(args, ps, out, workdir):
    cfg = (GPTConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=512)
           if args.tiny else GPTConfig.preset("gpt2-xl"))
    micro = 2 if args.tiny else args.micro_batch
    flops = flops_per_iteration(cfg, micro, False, cfg.padded_vocab_size(1))
    _one_rank_group(ps.device, workdir)
    rows = {}
    sec = Section(ps.device)
    engine = sec.engine(build(cfg, ps, torch.bfloat16))
    timer, gen = StepTimer(ps.device), torch.Generator().manual_seed(0)

    def tnlg_step():
        tokens = torch.randint(0, cfg.vocab_size, (micro, cfg.seq_length + 1), generator=gen).to(ps.device)
        engine.zero_grad()
        with torch.autocast(device_type=ps.device.type, dtype=torch.bfloat16):
            loss = engine.model(tokens[:, :-1], labels=tokens[:, 1:])
        engine.backward(loss)
        engine.step()
        return loss
    for _ in range(args.steps):
        timer.time(tnlg_step)
    rows["tnlg"] = timer.times
    engine = None  # tnlg_step's closure holds it too: free the model before megatron-core's run
    sec.close()
    step, layer_spec, keep = _megatron_gpt(cfg, ps, micro)
    timer = StepTimer(ps.device)
    for _ in range(args.steps):
        timer.time(step)
    rows["megatron"] = timer.times
    del keep, step
    res = dict(model=dict(layers=cfg.num_layers, hidden=cfg.hidden_size, heads=cfg.num_attention_heads,
                          seq=cfg.seq_length), micro_batch=micro, flops_per_step=flops, megatron_layer_spec=layer_spec,
               timing="CUDA events" if ps.device.type == "cuda" else "wall clock (CPU)")
    for name, times in rows.items():
        median = statistics.median(times[1:] or times)  # the first step is warm-up
        res[name] = dict(step_times_s=times, median_step_s=median, model_tflops=flops / median / 1e12,
                         mfu_vs_989=flops / median / 1e12 / H100_BF16_DENSE_TFLOPS)
    res["tnlg_over_megatron_mfu"] = res["tnlg"]["model_tflops"] / res["megatron"]["model_tflops"]
    out["i_megatron_side_by_side"] = res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="small shapes on the CPU (end-to-end smoke run)")
    p.add_argument("--sections", default="abcdefghi", help="sections to run (default abcdefghi; a and b run together)")
    p.add_argument("--pretrain-iters", type=int, default=40, help="training iterations of (g)")
    p.add_argument("--out", default="gpu_check.json", help="JSON output path")
    p.add_argument("--steps", type=int, default=4, help="training steps in (a) (the first is warm-up)")
    p.add_argument("--micro-batch", type=int, default=4, help="micro batch of (a)")
    p.add_argument("--workdir", help="where checkpoints go (default: a temporary folder)")
    p.add_argument("--d-max-layers", type=int, default=0,
                   help="cap the tnlg-17b slice of (d) at this many layers (0: as many as fit; a cap keeps its "
                        "save within the disk and the time of a short GPU lease)")
    args = p.parse_args(argv)
    device = torch.device("cpu") if args.tiny else pick_device("cuda")
    if device.type == "cuda":
        torch.cuda.set_device(0)
        device = torch.device("cuda", 0)
    ps = dataclasses.replace(ParallelState.single(), device=device)
    out = dict(date=time.strftime("%Y-%m-%d"), torch=torch.__version__, python=platform.python_version(),
               device=torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
               capability=torch.cuda.get_device_capability(device) if device.type == "cuda" else None,
               tiny=args.tiny)
    workdir = args.workdir or tempfile.mkdtemp(prefix="tnlg_gpu_check_")
    t0 = time.perf_counter()
    sections = (("a+b", "ab", lambda: section_a_b(args, ps, out, workdir)),
                ("c", "c", lambda: section_c(args, ps, out)),
                ("d", "d", lambda: section_d(args, ps, out, workdir)),
                ("e", "e", lambda: section_e(args, ps, out)),
                ("f", "f", lambda: section_f(args, ps, out, workdir)),
                ("g", "g", lambda: section_g(args, ps, out, workdir)),
                ("h", "h", lambda: section_h(args, ps, out)),
                ("i", "i", lambda: section_i(args, ps, out, workdir)))
    for name, letters, fn in sections:
        if not set(letters) & set(args.sections):
            continue
        if name == "i" and (importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None):
            out["skipped_i"] = "megatron-core is not installed (pip install --no-deps megatron-core==0.16.1)"
            continue
        if name in ("f", "g") and device.type != "cuda":
            out[f"skipped_{name}"] = "needs CUDA (NCCL, a GPU pretraining run)"
            continue
        t = time.perf_counter()
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - report and go on: one run, every section
            out[f"error_{name}"] = f"{type(exc).__name__}: {exc}"
        print(f"section {name}: {time.perf_counter() - t:.1f} s", flush=True)
        gc.collect()  # the section's engine (its parameter hooks form reference cycles) before the next one
        if device.type == "cuda":
            torch.cuda.empty_cache()
        _write(args.out, out)  # after every section: a run cut short keeps what it measured
    out["total_s"] = time.perf_counter() - t0
    if not args.workdir:
        shutil.rmtree(workdir, ignore_errors=True)
    _write(args.out, out)
    _table(out)
    return 1 if any(k.startswith("error_") for k in out) else 0


def _write(path: str, out: dict) -> None:
    _bench.write_json(path, out, indent=1, quiet=True)


def _table(out: dict) -> None:
    gb = 1e9
    print(f"\ngpu_check on {out['device']} (torch {out['torch']}, {out['date']}{', --tiny' if out['tiny'] else ''})")
    a, b = out.get("a_bf16_step"), out.get("b_checkpoint")
    if a:
        print(f"(a) bf16 step, {a['model']['params'] / 1e9:.2f}B params, micro {a['micro_batch']} x "
              f"{a['model']['seq']}: {a['tokens_per_s']:.0f} tok/s, {a['model_tflops']:.1f} model TFLOP/s, "
              f"MFU {a['mfu_vs_measured']:.1%} of the measured {a['matmul_tflops_measured']:.0f} TFLOP/s matmul, "
              f"{a['mfu_vs_989']:.1%} of 989; peak {a['peak_memory_bytes'] / gb:.2f} GB above a "
              f"{a['baseline_bytes'] / gb:.2f} GB baseline vs planned "
              f"{a['planned_bytes'] / gb:.2f} GB ({a['peak_over_planned']:.2f}x)")
    if b:
        print(f"(b) save {b['save_s']:.1f} s (+{b['save_extra_peak_bytes'] / gb:.3f} GB peak), load {b['load_s']:.1f} s "
              f"(+{b['load_extra_peak_bytes'] / gb:.3f} GB peak); {b['bytes_on_disk'] / gb:.2f} GB on disk")
    c = out.get("c_fp16_loss_scaling")
    if c:
        print(f"(c) fp16 + loss scaling, 20 steps: loss {c['first_loss']:.3f} -> {c['last_loss']:.3f}, finite "
              f"{c['all_finite']}, scale {c['loss_scales'][0]:g} -> {c['loss_scales'][-1]:g}, {c['skipped']} "
              f"scale drops")
    d = out.get("d_tnlg17b_slice")
    if d:
        print(f"(d) tnlg-17b slice: {d['layers']}/{d['of_layers']} layers ({d['params'] / 1e9:.2f}B) built in "
              f"{d['build_s']:.1f} s, step {d['step_s']:.2f} s, save {d['save_s']:.1f} s; peak "
              f"{d['peak_memory_bytes'] / gb:.1f} GB above a {d['baseline_bytes'] / gb:.2f} GB baseline vs planned "
              f"{d['planned_bytes'] / gb:.1f} GB; {d['left_after_close_bytes'] / gb:.2f} GB left after close")
    e = out.get("e_peak")
    if e:
        peaks = ", ".join(f"{k} median {statistics.median(e[k]['tflops']):.1f} TFLOP/s (spread {e[k]['spread']:.3f}x)"
                          for k in ("bf16", "fp32"))
        print(f"(e) measured peak: {peaks}; check_bf16('cuda'): {e.get('check_bf16_cuda', 'not run (CPU)')}")
    f = out.get("f_flight_recorder")
    if f:
        entries = f["entries"]
        print(f"(f) flight recorder at {f['prefix']}: "
              f"{entries if isinstance(entries, str) else f'{len(entries)} entries, first {entries[:6]}'}; "
              f"peak under a NCCL group {f['peak_bf16_under_nccl_group']:.1f} TFLOP/s")
    g = out.get("g_pretrain")
    if g:
        print(f"(g) tnlg pretrain: exit {g['exit']} in {g['seconds']:.0f} s")
    h = out.get("h_mixed_adamw")
    if h:
        print(f"(h) 16-bit AdamW: {h['one_pass_s'] * 1e3:.2f} ms vs {h['torch_fused_s'] * 1e3:.2f} ms (upcast + "
              f"torch fused + copy-back) for {h['numel']} elements; max |fused - eager| {h['max_abs_diff_vs_eager']:.2e}")
    i = out.get("i_megatron_side_by_side")
    if i:
        print(f"(i) beside megatron-core ({i['megatron_layer_spec']} spec), bf16, micro {i['micro_batch']}, "
              f"{i['timing']}: tnlg {i['tnlg']['median_step_s'] * 1e3:.1f} ms, MFU {i['tnlg']['mfu_vs_989']:.1%} of 989; "
              f"megatron-core {i['megatron']['median_step_s'] * 1e3:.1f} ms, MFU {i['megatron']['mfu_vs_989']:.1%}; "
              f"tnlg / megatron-core MFU {i['tnlg_over_megatron_mfu']:.2f}")
    for k, v in out.items():
        if k.startswith(("error_", "skipped_")):
            print(f"{k}: {v}")
    print(f"total {out['total_s']:.0f} s")


if __name__ == "__main__":
    sys.exit(main())
