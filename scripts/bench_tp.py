#!/usr/bin/env python
"""Benchmark forward+backward of a GPT block stack: tnlg TP=1 / TP=2 vs `transformers` GPT-2 vs DTensor TP.

Four implementations of the same blocks (same weights, same input, blocks only:
no embedding, no LM head), each timed in fp32 and under bf16 autocast:

* ``tnlg-tp1``  tnlg blocks at TP=1, one process with ``--threads`` (2) intra-op threads;
* ``tnlg-tp2``  tnlg blocks at TP=2, two gloo processes with 1 thread each;
* ``tnlg-tp2-sp`` the same with sequence parallelism (each rank feeds and gets its half of the
  sequence; docs/sequence_parallel.md);
* ``hf-gpt2``   ``transformers`` ``GPT2Block`` (SDPA attention), one process, ``--threads``;
* ``hf-llama``  (``--arch llama``: rope, RMSNorm, SwiGLU, ``--groups`` KV groups, no biases, in place of
  GPT-2's blocks) ``transformers`` ``LlamaForCausalLM``'s decoder layers (SDPA), one process, ``--threads``;
* ``dtensor-tp2`` a plain-torch block stack (fused QKV laid out per head) split with
  ``torch.distributed.tensor.parallel.parallelize_module`` (Colwise/RowwiseParallel), 2 x 1 thread.

Reports ms/iter (median over ``--rounds`` x ``--iters`` steps after ``--warmup``),
tokens/s, achieved FLOP/s and MFU. FLOPs per iteration (matmuls of the blocks, attention scores and
A.V included, causal mask not discounted, forward + backward = 3 x forward):
``3 * l * (2 B s (4 h^2 + 2 h f) + 4 B s^2 h)``, which with ``f = 4h`` is
Narayanan et al. 2021 (eq. 3)'s ``72 B s l h^2 (1 + s/(6h))`` without the vocabulary term
(docs/formulas.md).
MFU divides by a dense matmul peak measured in the same run, at the same dtype
and thread count (``--peak-n`` square matmul, median), right before each row's
steps in every round: one process with ``--threads`` threads for the
single-process rows, two concurrently running 1-thread processes for the TP=2
rows. ``CPU ms/iter`` is the CPU time of our processes per step (both ranks for
TP=2): unlike wall time it barely moves when other processes load the machine.

All implementations live in one pair of gloo processes
(``tnlg.runtime.spawn.run_distributed(fn, 2, 2, ..., threads=1)``): the single-process
rows run on rank 0 with ``--threads`` threads while rank 1 blocks in a barrier,
and the rounds interleave the implementations, so load from other processes on
a shared machine hits all rows alike. The ``other load`` column is the share of
the machine's CPU time that other processes used while a row's steps ran.

    python scripts/bench_tp.py                    # about 2 minutes on 2 idle cores
    python scripts/bench_tp.py --wait-idle 900    # on a shared machine: wait for a quiet moment first
    python scripts/bench_tp.py --layers 1 --hidden 128 --heads 4 --seq 64 --rounds 1   # smoke test, seconds
    python scripts/bench_tp.py --arch llama       # the Llama shape: the same dims, tnlg vs LlamaForCausalLM
    python scripts/bench_tp.py --arch llama --profile 12   # per-operator self CPU time of one step instead

``--profile N`` times nothing: in one process with ``--threads`` threads it runs ``--warmup`` steps of each
single-process row (tnlg TP 1 and the transformers blocks), then one step of each under ``torch.profiler``,
per dtype, and prints each row's N operators with the most self CPU time (the per-operator split moves
less with other processes' load than the wall time of the step).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import os
import statistics
import time

import _bench
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from tnlg.config import GPTConfig
from tnlg.errors import UserError
from tnlg.model import GPT
from tnlg.parallel.state import ParallelState
from tnlg.runtime.spawn import run_distributed

IMPLS = ("tnlg-tp1", "tnlg-tp2", "tnlg-tp2-sp", "hf-gpt2", "dtensor-tp2", "hf-llama")
ARCH_IMPLS = {"gpt2": ("tnlg-tp1", "tnlg-tp2", "tnlg-tp2-sp", "hf-gpt2", "dtensor-tp2"),
              "llama": ("tnlg-tp1", "tnlg-tp2", "tnlg-tp2-sp", "hf-llama")}
DTYPES = ("fp32", "bf16")
CHECK_TOKENS = 8  # output / input-grad rows compared across implementations (fp32 only)


# ---------------------------------------------------------------------------- model pieces
def make_config(a) -> GPTConfig:
    """Blocks only: the vocabulary is tiny because the embedding is never applied. ``--arch llama``:
    rope, RMSNorm, SwiGLU (Megatron's default ffn ``int(8h/3/64)*64``), ``--groups`` KV groups, no biases,
    untied (the same dims otherwise)."""
    llama = dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True, group_query_attention=True,
                 num_query_groups=a["groups"], add_bias_linear=False, untie_embeddings_and_output_weights=True)
    return GPTConfig(num_layers=a["layers"], hidden_size=a["hidden"], num_attention_heads=a["heads"],
                     seq_length=a["seq"], vocab_size=128, hidden_dropout=0.0, attention_dropout=0.0,
                     seed=a["seed"], **(llama if a["arch"] == "llama" else {}))


def flops_per_iter(a) -> float:
    """Forward+backward matmul FLOPs of the block stack (see the module docstring; Llama: queries and
    output ``2 h^2``, keys and values ``2 h G d``, SwiGLU's three ``h f`` matrices)."""
    b, s, h, l = a["batch"], a["seq"], a["hidden"], a["layers"]
    if a["arch"] == "llama":
        cfg = make_config(a)
        weights = 2 * h * h + 2 * h * cfg.kv_groups * cfg.head_dim + 3 * h * cfg.ffn_hidden_size
    else:
        weights = 4 * h * h + 2 * h * (4 * h)
    return 3.0 * l * (2 * b * s * weights + 4 * b * s * s * h)


def make_input(a):
    gen = torch.Generator().manual_seed(a["seed"] + 1)
    x = torch.randn(a["batch"], a["seq"], a["hidden"], generator=gen)
    gy = torch.randn(a["batch"], a["seq"], a["hidden"], generator=gen)
    return x, gy


def full_weights(cfg: GPTConfig) -> dict:
    """The TP=1 (full) tnlg state dict; every implementation starts from these weights."""
    return GPT(cfg, ParallelState.single()).state_dict()


class FP32LayerNorm(nn.LayerNorm):
    """LayerNorm in fp32 also under autocast (as tnlg's)."""

    def forward(self, x):
        with torch.autocast(device_type=x.device.type, enabled=False):
            return F.layer_norm(x.float(), self.normalized_shape, self.weight, self.bias, self.eps)


class PlainAttention(nn.Module):
    """Causal self-attention; fused QKV rows laid out per head ``[head][q, k, v][hd]``, so a
    contiguous row split (ColwiseParallel) gives whole heads. The local head count is inferred."""

    def __init__(self, h: int, heads: int):
        super().__init__()
        self.head_dim = h // heads
        self.c_attn = nn.Linear(h, 3 * h)
        self.c_proj = nn.Linear(h, h)

    def forward(self, x):
        b, s, _ = x.shape
        qkv = self.c_attn(x).view(b, s, -1, 3, self.head_dim)
        q, k, v = (t.transpose(1, 2) for t in qkv.unbind(dim=3))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(b, s, -1))


class PlainMLP(nn.Module):
    def __init__(self, h: int, f: int):
        super().__init__()
        self.c_fc = nn.Linear(h, f)
        self.c_proj = nn.Linear(f, h)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class PlainBlock(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = FP32LayerNorm(cfg.hidden_size, eps=cfg.layernorm_epsilon)
        self.attn = PlainAttention(cfg.hidden_size, cfg.num_attention_heads)
        self.ln_2 = FP32LayerNorm(cfg.hidden_size, eps=cfg.layernorm_epsilon)
        self.mlp = PlainMLP(cfg.hidden_size, cfg.ffn_hidden_size)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


def plain_stack(cfg: GPTConfig, full: dict) -> nn.Sequential:
    stack = nn.Sequential(*[PlainBlock(cfg) for _ in range(cfg.num_layers)])
    prefix = "transformer.h."
    stack.load_state_dict({k[len(prefix):]: v for k, v in full.items() if k.startswith(prefix)})
    return stack


def hf_stack(cfg: GPTConfig, full: dict) -> nn.ModuleList:
    import transformers
    from transformers import GPT2LMHeadModel

    from tnlg.interop.hf import hf_config_from, tnlg_to_hf_state_dict
    transformers.logging.set_verbosity_error()  # (the unused tiny vocabulary has no bos/eos id 50256)
    hf_cfg = hf_config_from(cfg)
    hf_cfg._attn_implementation = "sdpa"
    model = GPT2LMHeadModel(hf_cfg)
    missing, unexpected = model.load_state_dict(tnlg_to_hf_state_dict(full, cfg), strict=False)
    missing = [m for m in missing if not m.endswith((".attn.bias", ".attn.masked_bias"))]
    if missing or unexpected:
        raise RuntimeError(f"HF weight mismatch: missing {missing}, unexpected {unexpected}")
    return model.transformer.h


def hf_llama_stack(cfg: GPTConfig, full: dict, x: torch.Tensor) -> tuple[nn.ModuleList, dict]:
    """transformers' ``LlamaForCausalLM`` layers (SDPA attention: ``enable_gqa`` without a mask) with
    tnlg's weights, and the keyword arguments its model gives every layer: the rotary ``position_embeddings``
    of ``model.rotary_emb`` (as ``LlamaModel.forward`` computes them, from the fp32 hidden states)."""
    import transformers

    from tnlg.interop.hf_llama import llama_config_from, tnlg_to_llama
    transformers.logging.set_verbosity_error()
    hf_cfg = llama_config_from(cfg, "llama")
    hf_cfg._attn_implementation = "sdpa"
    model = transformers.LlamaForCausalLM(hf_cfg)
    missing, unexpected = model.load_state_dict(tnlg_to_llama(full, cfg), strict=False)
    if missing or unexpected:
        raise RuntimeError(f"HF weight mismatch: missing {missing}, unexpected {unexpected}")
    positions = torch.arange(x.shape[1]).unsqueeze(0)
    with torch.no_grad():
        pe = model.model.rotary_emb(x.detach(), positions)
    return model.model.layers, dict(position_embeddings=pe)


# ---------------------------------------------------------------------------- timing
def matmul_times(dtype: torch.dtype, n: int, reps: int, sync=None) -> list[float]:
    """Seconds of ``reps`` ``n x n`` matmuls at ``dtype`` with the current thread count (after one warm-up)."""
    a = torch.randn(n, n).to(dtype)
    b = torch.randn(n, n).to(dtype)
    a @ b
    times = []
    for _ in range(reps):
        if sync:
            sync()
        t0 = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t0)
    return times


class Runner:
    """One implementation's block stack and its forward+backward step on the shared input."""

    def __init__(self, stack: nn.Module, x: torch.Tensor, gy: torch.Tensor, block_kwargs=None):
        self.stack, self.x, self.gy = stack, x, gy
        self.params = list(stack.parameters())
        self.kw = block_kwargs or {}  # what every block is called with besides its input (rope's angles)

    def step(self, dtype_name: str) -> torch.Tensor:
        self.x.grad = None
        for p in self.params:
            p.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype_name == "bf16"):
            y = self.x
            for block in self.stack:
                y = block(y, **self.kw)
        y.backward(self.gy.to(y.dtype))
        return y

    @staticmethod
    def first_tokens(t: torch.Tensor) -> torch.Tensor:
        """The first sample's first ``CHECK_TOKENS`` rows of a batch-first ``[b, s, h]`` tensor."""
        return t[0, :CHECK_TOKENS]

    def warmup(self, dtype_name: str, steps: int):
        """Warm-up steps; returns the first step's outputs and input gradients of the first tokens."""
        y = self.step(dtype_name)
        check = (self.first_tokens(y).detach().float().clone(), self.first_tokens(self.x.grad).clone())
        for _ in range(steps - 1):
            self.step(dtype_name)
        return check

    def times(self, dtype_name: str, iters: int, sync=None) -> list[tuple[float, float]]:
        """Per step: wall seconds and this process's CPU seconds (all its threads)."""
        out = []
        for _ in range(iters):
            if sync:
                sync()
            t0, c0 = time.perf_counter(), time.process_time()
            self.step(dtype_name)
            out.append((time.perf_counter() - t0, time.process_time() - c0))
        return out


class OtherLoad:
    """CPU seconds used by processes other than ours (``pids``) while a segment ran.

    From /proc/stat (all busy time) minus /proc/<pid>/stat (utime + stime, all threads)."""

    def __init__(self, pids):
        self.pids = pids
        self.tick = os.sysconf("SC_CLK_TCK")

    def _read(self):
        try:
            with open("/proc/stat") as f:
                fields = [int(v) for v in f.readline().split()[1:9]]
            busy = sum(fields) - fields[3] - fields[4]  # minus idle and iowait
            ours = 0
            for pid in self.pids:
                with open(f"/proc/{pid}/stat") as f:
                    stat = f.read().rsplit(")", 1)[1].split()
                ours += int(stat[11]) + int(stat[12])
            return (busy - ours) / self.tick
        except (OSError, ValueError, IndexError):
            return None

    def measure(self, fn):
        """``fn()``'s result, other processes' CPU seconds, and wall seconds."""
        o0, t0 = self._read(), time.perf_counter()
        out = fn()
        o1, wall = self._read(), time.perf_counter() - t0
        return out, (None if o0 is None or o1 is None else max(0.0, o1 - o0)), wall


# ---------------------------------------------------------------------------- implementations
class SequenceFirstRunner(Runner):
    """tnlg blocks (``tnlg-tp1``, ``tnlg-tp2``): the decoder's activations are sequence-first, so the input
    leaf and the output gradient are the shared ones transposed, ``[s, b, h]``, as the model's embedding
    gives them (the copy is made once, outside the timed steps)."""

    def __init__(self, stack: nn.Module, x: torch.Tensor, gy: torch.Tensor, block_kwargs=None):
        leaf = x.detach().transpose(0, 1).contiguous().requires_grad_(True)
        super().__init__(stack, leaf, gy.transpose(0, 1).contiguous(), block_kwargs)

    @staticmethod
    def first_tokens(t: torch.Tensor) -> torch.Tensor:
        return t[:CHECK_TOKENS, 0]


def tnlg_stack(cfg: GPTConfig, ps: ParallelState) -> nn.ModuleList:
    """tnlg blocks (TP-invariant init from ``cfg.seed``): per block 2 all-reduces of [s, b, h]
    in forward and 2 in backward when ``ps.tp_size > 1``."""
    return GPT(cfg, ps).train().transformer.h


def tnlg_block_kwargs(cfg: GPTConfig, seq: int) -> dict:
    """What every block takes besides its input: the forward's context, with rope's angles (the model
    computes them once per forward) or none."""
    from tnlg.model import ForwardContext
    angles = GPT(cfg, ParallelState.single(), device="meta").rotary(seq, None, device=torch.device("cpu"))
    return dict(ctx=ForwardContext(rotary=angles))


class SequenceParallelRunner(Runner):
    """tnlg blocks with sequence parallelism (``tnlg-tp2-sp``): each rank feeds its positions of the
    input, sequence-first ``[s / 2, b, h]`` as the model's embedding gives them, and gets its
    positions of the output (the checks compare rank 0's first tokens). Per block, forward: 2
    all-gathers + 2 reduce-scatters of [s, b, h]; backward: 4 all-gathers, 2 reduce-scatters and one
    small all-reduce (the gradients of the block's LayerNorm weights and biases and projection biases)."""

    def __init__(self, cfg: GPTConfig, ps: ParallelState, x: torch.Tensor, gy: torch.Tensor):
        from tnlg.parallel.mappings import sequence_sizes
        self.sp = sequence_sizes(x.shape[1], ps.tp_size)
        start = sum(self.sp[:ps.tp_rank])
        shard = x.detach()[:, start:start + self.sp[ps.tp_rank]].clone().requires_grad_(True)
        super().__init__(tnlg_stack(dataclasses.replace(cfg, sequence_parallel=True), ps), shard,
                         gy[:, start:start + self.sp[ps.tp_rank]].contiguous(), tnlg_block_kwargs(cfg, x.shape[1]))

    def step(self, dtype_name: str) -> torch.Tensor:
        self.x.grad = None
        for p in self.params:
            p.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype_name == "bf16"):
            y = self.x.transpose(0, 1).contiguous()  # (the leaf stays batch-first for the checks)
            for block in self.stack:
                y = block(y, ctx=dataclasses.replace(self.kw["ctx"], sp=self.sp))
            y = y.transpose(0, 1)
        y.backward(self.gy.to(y.dtype))
        return y


def dtensor_stack(cfg: GPTConfig, tp_size: int) -> nn.Sequential:
    """Plain blocks split with ``parallelize_module``: Colwise c_attn / c_fc, Rowwise c_proj."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    stack = plain_stack(cfg, full_weights(cfg)).train()
    mesh = init_device_mesh("cpu", (tp_size,))
    plan = {"attn.c_attn": ColwiseParallel(), "attn.c_proj": RowwiseParallel(),
            "mlp.c_fc": ColwiseParallel(), "mlp.c_proj": RowwiseParallel()}
    for block in stack:
        parallelize_module(block, mesh, plan)
    return stack


SINGLE = ("tnlg-tp1", "hf-gpt2", "hf-llama")  # one process with --threads threads (rank 0; rank 1 waits)
_DT = {"fp32": torch.float32, "bf16": torch.bfloat16}


def bench_worker(ps: ParallelState, a: dict, impls: list, dtypes: list) -> dict:
    """Time every implementation in this pair of processes, interleaved over ``a["rounds"]``.

    Single-process rows run on rank 0 with ``a["threads"]`` threads while rank 1 blocks in a
    (non-spinning) gloo barrier; TP=2 rows run on both ranks with 1 thread each and a barrier
    before every step. Returns this rank's per-step seconds, matmul-peak samples and checks.
    """
    rank0 = ps.rank == 0
    pids = [None, None]
    dist.all_gather_object(pids, os.getpid())
    other_load = OtherLoad(pids)
    cfg = make_config(a)
    x, gy = make_input(a)
    x.requires_grad_(True)
    runners, kw = {}, tnlg_block_kwargs(cfg, a["seq"])
    for impl in impls:
        if impl == "tnlg-tp2":
            runners[impl] = SequenceFirstRunner(tnlg_stack(cfg, ps), x, gy, kw)
        elif impl == "tnlg-tp2-sp":
            runners[impl] = SequenceParallelRunner(cfg, ps, x, gy)
        elif impl == "dtensor-tp2":
            runners[impl] = Runner(dtensor_stack(cfg, ps.tp_size), x, gy)
        elif rank0 and impl == "tnlg-tp1":
            runners[impl] = SequenceFirstRunner(tnlg_stack(cfg, ParallelState.single()), x, gy, kw)
        elif rank0 and impl == "hf-gpt2":
            runners[impl] = Runner(hf_stack(cfg, full_weights(cfg)).train(), x, gy)
        elif rank0 and impl == "hf-llama":
            layers, hf_kw = hf_llama_stack(cfg, full_weights(cfg), x)
            runners[impl] = Runner(layers.train(), x, gy, hf_kw)
    times = {f"{i}/{d}": [] for i in impls for d in dtypes}
    cpu = {key: [] for key in times}
    other = {key: [0.0, 0.0] for key in times}  # other processes' CPU seconds, wall seconds
    peaks = {key: [] for key in times}  # seconds per peak matmul, taken next to each row's steps
    checks = {}

    def segment(single: bool, fn):
        """``fn()`` on rank 0 alone with --threads threads, or on both ranks with 1 thread."""
        if not single:
            torch.set_num_threads(1)
            return fn()
        dist.barrier()
        out = None
        if rank0:
            torch.set_num_threads(a["threads"])
            out = fn()
            torch.set_num_threads(1)
        dist.barrier()
        return out

    for r in range(a["rounds"]):
        for d in dtypes:
            for impl in impls:
                run, single, key = runners.get(impl), impl in SINGLE, f"{impl}/{d}"
                sync = None if single else dist.barrier
                if r == 0:
                    got = segment(single, lambda run=run, d=d: run.warmup(d, a["warmup"]))
                    if got is not None and d == "fp32":
                        checks[impl] = got

                def timed(run=run, d=d, sync=sync):  # the matmul peak right before the steps, in the same configuration
                    peak = matmul_times(_DT[d], a["peak_n"], a["peak_reps"], sync)
                    return peak, other_load.measure(lambda: run.times(d, a["iters"], sync))

                got = segment(single, timed)
                if got is not None:
                    peak, (ts, other_s, wall) = got
                    peaks[key] += peak
                    times[key] += [w for w, _ in ts]
                    cpu[key] += [c for _, c in ts]
                    if other_s is not None:
                        other[key][0] += other_s
                        other[key][1] += wall
    return dict(rank=ps.rank, times=times, cpu=cpu, peaks=peaks, checks=checks, other=other)


def merge_ranks(results: list) -> tuple[dict, dict, dict]:
    """Per-step wall seconds per row (TP=2 rows: a step ends when the slowest rank ends), per-step
    CPU seconds (TP=2 rows: both ranks), and the seconds per matmul of the peak samples (pair: 2
    matmuls, one per rank, in the slowest rank's time)."""
    r0, r1 = sorted(results, key=lambda r: r["rank"])
    times, cpu = {}, {}
    for key, ts in r0["times"].items():
        single = key.split("/")[0] in SINGLE
        times[key] = ts if single else [max(u, v) for u, v in zip(ts, r1["times"][key])]
        cpu[key] = r0["cpu"][key] if single else [u + v for u, v in zip(r0["cpu"][key], r1["cpu"][key])]
    peaks = {}
    for key, ts in r0["peaks"].items():
        single = key.split("/")[0] in SINGLE
        peaks[key] = ts if single else [max(u, v) / 2 for u, v in zip(ts, r1["peaks"][key])]
    return times, cpu, peaks


def profile_rows(a: dict, impls, dtypes, top: int) -> dict:
    """``--profile``: per dtype and single-process row, the ``top`` operators by self CPU time of one step
    (after ``a["warmup"]`` steps), ``{key: [(op, self_ms, calls), ...]}``, and each step's total self CPU ms."""
    from torch.profiler import ProfilerActivity, profile
    torch.set_num_threads(a["threads"])
    cfg = make_config(a)
    x, gy = make_input(a)
    x.requires_grad_(True)
    runners = {}
    for impl in impls:
        if impl == "tnlg-tp1":
            runners[impl] = SequenceFirstRunner(tnlg_stack(cfg, ParallelState.single()), x, gy,
                                                tnlg_block_kwargs(cfg, a["seq"]))
        elif impl == "hf-gpt2":
            runners[impl] = Runner(hf_stack(cfg, full_weights(cfg)).train(), x, gy)
        elif impl == "hf-llama":
            layers, hf_kw = hf_llama_stack(cfg, full_weights(cfg), x)
            runners[impl] = Runner(layers.train(), x, gy, hf_kw)
    out: dict = {}
    for d in dtypes:
        for run in runners.values():
            run.warmup(d, a["warmup"])
        for impl, run in runners.items():  # (one after the other, each right after the other's warm-up)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                run.step(d)
            events = prof.key_averages()
            ops = sorted(((e.key, e.self_cpu_time_total / 1e3, e.count) for e in events), key=lambda t: -t[1])
            out[f"{impl}/{d}"] = dict(total_self_ms=sum(t[1] for t in ops), top=ops[:top])
    return out


def format_profile(prof: dict, a: dict) -> str:
    lines = [f"{a['arch']} block stack, one fwd+bwd step under torch.profiler, {a['threads']} threads; "
             f"self CPU ms (calls)"]
    for key, p in prof.items():
        lines.append(f"{key}: total self CPU {p['total_self_ms']:.0f} ms")
        lines += [f"  {op:<58} {ms:8.1f} ({n})" for op, ms, n in p["top"]]
    return "\n".join(lines)


# ---------------------------------------------------------------------------- driver
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    _bench.add_shape_arguments(p, layers=2, hidden=1024, heads=16, seq=512)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--arch", choices=tuple(ARCH_IMPLS), default="gpt2",
                   help="gpt2 (default) or llama: rope, RMSNorm, SwiGLU, --groups KV groups, no biases; "
                        "the default --impls follow (llama: hf-llama, no dtensor-tp2)")
    p.add_argument("--groups", type=int, default=None,
                   help="--arch llama: key/value groups (default heads / 4)")
    p.add_argument("--threads", type=int, default=2, help="intra-op threads of the single-process rows")
    p.add_argument("--warmup", type=int, default=1, help="warm-up steps per row (first round only)")
    p.add_argument("--rounds", type=int, default=4, help="interleaved rounds over all rows")
    p.add_argument("--iters", type=int, default=2, help="timed steps per row and round")
    p.add_argument("--peak-n", type=int, default=2048, help="size of the square matmul for the peak")
    p.add_argument("--peak-reps", type=int, default=2, help="peak matmuls per row and round")
    p.add_argument("--dtypes", default="fp32,bf16", help=f"comma list of {', '.join(DTYPES)}")
    p.add_argument("--impls", default=None, help=f"comma list of {', '.join(IMPLS)} (default: the --arch's)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--json-out", default="runs/bench_tp.json")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="instead of timing: the N operators with the most self CPU time in one step of each "
                        "single-process row (torch.profiler), per dtype")
    p.add_argument("--wait-idle", type=float, default=0.0, metavar="SECONDS",
                   help="on a shared machine: first wait up to SECONDS until other processes use under 10%% "
                        "of the CPUs (over 5 s windows)")
    args = p.parse_args(argv)
    args.dtypes = [d for d in args.dtypes.split(",") if d]
    valid = ARCH_IMPLS[args.arch]
    args.impls = list(valid) if args.impls is None else [i for i in args.impls.split(",") if i]
    bad = [d for d in args.dtypes if d not in DTYPES] + [i for i in args.impls if i not in valid]
    if bad or not args.dtypes or not args.impls:
        raise UserError(f"unknown or empty --dtypes/--impls entries {bad}: valid dtypes are {', '.join(DTYPES)}, "
                        f"valid implementations for --arch {args.arch} {', '.join(valid)} (comma-separated).")
    _bench.check_groups(args, default=max(1, args.heads // 4))
    for name in ("layers", "hidden", "heads", "seq", "batch", "threads", "warmup", "rounds", "iters",
                 "peak_n", "peak_reps"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(args, name)}.")
    if args.profile < 0:
        raise UserError(f"--profile must be 0 (time the rows) or a number of operators to list, got {args.profile}.")
    if args.wait_idle < 0:
        raise UserError(f"--wait-idle must be >= 0 seconds, got {args.wait_idle}.")
    if args.hidden % args.heads or args.heads % 2:
        raise UserError(f"--hidden {args.hidden} must divide by --heads {args.heads}, and --heads by 2 (TP=2 "
                        f"with DTensor needs the same whole heads on each rank); e.g. --hidden 1024 --heads 16.")
    return args


def build_rows(a: dict, impls, dtypes, times: dict, cpu: dict, peaks: dict, checks: dict,
               other: dict) -> list[dict]:
    rows = []
    n_tok = a["batch"] * a["seq"]
    for d in dtypes:
        for impl in impls:
            ts = times[f"{impl}/{d}"]
            med = statistics.median(ts)
            peak_t = statistics.median(peaks[f"{impl}/{d}"])
            procs, threads = (1, a["threads"]) if impl in SINGLE else (2, 1)
            peak = 2.0 * a["peak_n"] ** 3 / peak_t  # pair: peak_t is already per matmul of the two
            flops = flops_per_iter(a) / med
            row = dict(impl=impl, dtype=d, procs=procs, threads_per_proc=threads, ms_per_iter=med * 1e3,
                       ms_min=min(ts) * 1e3, ms_all=[t * 1e3 for t in ts],
                       cpu_ms_per_iter=statistics.median(cpu[f"{impl}/{d}"]) * 1e3, tokens_per_s=n_tok / med,
                       flops_per_s=flops, peak_flops_per_s=peak, mfu=flops / peak)
            o_s, wall = other[f"{impl}/{d}"]
            row["other_cpu_share"] = o_s / (wall * (os.cpu_count() or 1)) if wall else None
            if d == "fp32" and impl in checks and "tnlg-tp1" in checks:
                row["max_abs_diff_vs_tp1"] = max(float((u - v).abs().max())
                                                 for u, v in zip(checks[impl], checks["tnlg-tp1"]))
            rows.append(row)
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    a = {k: getattr(args, k) for k in ("layers", "hidden", "heads", "seq", "batch", "threads", "warmup",
                                       "rounds", "iters", "peak_n", "peak_reps", "seed", "arch", "groups")}
    skipped = skip_slow_bf16(args)  # AVX2-only CPUs: bf16 rows would run for hours; name them and go on
    if not args.dtypes:
        return 0
    if args.profile:
        single = [i for i in args.impls if i in SINGLE]
        prof = profile_rows(a, single, args.dtypes, args.profile)
        print(format_profile(prof, a))
        _bench.write_json(args.json_out, dict(_bench.machine_info(
            date=_dt.datetime.now().astimezone().isoformat(timespec="seconds"), cores=os.cpu_count(),
            transformers=_bench.package_version("transformers")), arch=args.arch, threads=args.threads,
            loadavg=os.getloadavg(), profile=prof))
        return 0
    waited = 0.0
    if args.wait_idle:
        waited, share = wait_idle(args.wait_idle)
        print(f"waited {waited:.0f} s for an idle machine (busy share {share:.0%} over the last 5 s)", flush=True)
    t_start, load_before = time.time(), os.getloadavg()
    results = run_distributed(bench_worker, 2, 2, a, args.impls, args.dtypes, threads=1, timeout_s=900)
    times, cpu, peaks = merge_ranks(results)
    r0 = min(results, key=lambda r: r["rank"])
    rows = build_rows(a, args.impls, args.dtypes, times, cpu, peaks, r0["checks"], r0["other"])
    report = dict(
        _bench.machine_info(date=_dt.datetime.now().astimezone().isoformat(timespec="seconds"),
                            transformers=_bench.package_version("transformers"), cores=os.cpu_count()),
        threads_single_process=args.threads, threads_per_rank_tp2=1,
        arch=args.arch, dims=dict(layers=args.layers, hidden=args.hidden, heads=args.heads,
                                  ffn=make_config(a).ffn_hidden_size, seq=args.seq, batch=args.batch,
                                  kv_groups=make_config(a).kv_groups),
        applied="transformer blocks only (no embedding, LM head or final norm; rope's angles computed once "
                "per runner, as each model does once per forward); dropout 0; train mode; "
                "fp32 weights, bf16 rows under torch.autocast('cpu', torch.bfloat16)",
        flop_formula=("3 * l * (2*B*s*(4h^2 + 2h*f) + 4*B*s^2*h) = 72 B s l h^2 (1 + s/(6h)) for f = 4h "
                      "(Narayanan et al. 2021, eq. 3, without the vocabulary term; causal mask not discounted)"
                      if args.arch == "gpt2" else
                      "3 * l * (2*B*s*(2h^2 + 2h*G*d + 3h*f) + 4*B*s^2*h) (queries and output, G KV groups of "
                      "head dim d, SwiGLU's three matrices; causal mask not discounted)"),
        flops_per_iter=flops_per_iter(a), warmup=args.warmup, rounds=args.rounds, iters_per_round=args.iters,
        peak_matmul_flops_per_s={k: 2.0 * args.peak_n ** 3 / statistics.median(v) for k, v in peaks.items()},
        peak_matmul_n=args.peak_n,
        waited_for_idle_s=waited, loadavg_before=load_before, loadavg_after=os.getloadavg(), total_wall_s=time.time() - t_start,
        rows=rows, summary=summary(rows), skipped=skipped)
    print(format_table(report))
    _bench.write_json(args.json_out, report)
    return 0


def skip_slow_bf16(args) -> list[dict]:
    """Drop the bf16 rows where bf16 matmuls are far slower than fp32 (``tnlg.runtime.hardware``: a few-ms probe;
    ``TNLG_ALLOW_SLOW_BF16=1`` keeps them), printing which rows are skipped and why."""
    from tnlg.runtime.hardware import ALLOW_ENV, bf16_skip_reason, fast_bf16_cpu
    if "bf16" not in args.dtypes or fast_bf16_cpu() or os.environ.get(ALLOW_ENV) == "1":
        return []
    reason = bf16_skip_reason()
    rows = [f"{impl}/bf16" for impl in args.impls]
    args.dtypes = [d for d in args.dtypes if d != "bf16"]
    print(f"skipped {len(rows)} row(s): {', '.join(rows)}: {reason} (set {ALLOW_ENV}=1 to run them anyway)"
          + ("" if args.dtypes else "; nothing left to run"), flush=True)
    return [dict(row=r, reason=reason) for r in rows]


def wait_idle(max_wait: float, threshold: float = 0.10, window: float = 5.0) -> tuple[float, float]:
    """Sleep until the CPUs' busy share over ``window`` seconds is below ``threshold`` or
    ``max_wait`` has passed; returns the seconds waited and the last busy share."""
    def busy_total():
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:9]]
        return sum(v) - v[3] - v[4], sum(v)

    t0 = time.time()
    while True:
        try:
            b0, t_0 = busy_total()
            time.sleep(window)
            b1, t_1 = busy_total()
        except (OSError, ValueError):
            return time.time() - t0, float("nan")
        share = (b1 - b0) / max(1, t_1 - t_0)
        if share < threshold or time.time() - t0 >= max_wait:
            return time.time() - t0, share


def summary(rows) -> dict:
    """The issue's targets as throughput ratios (tokens/s of the medians)."""
    by = {(r["impl"], r["dtype"]): r["tokens_per_s"] for r in rows}
    out = {}
    for d in DTYPES:
        for name, num, den, target in (("tp2_over_tp1", "tnlg-tp2", "tnlg-tp1", 0.95),
                                       ("tp2sp_over_tp1", "tnlg-tp2-sp", "tnlg-tp1", 0.97 if d == "fp32" else 0.95),
                                       ("tp2sp_over_tp2", "tnlg-tp2-sp", "tnlg-tp2", 1.0),
                                       ("tp2_over_dtensor", "tnlg-tp2", "dtensor-tp2", 1.0),
                                       ("tp1_over_hf", "tnlg-tp1", "hf-gpt2", 1.0),
                                       ("tp1_over_hf", "tnlg-tp1", "hf-llama", 1.0)):
            if (num, d) in by and (den, d) in by:
                ratio = by[(num, d)] / by[(den, d)]
                out[f"{d}_{name}"] = dict(ratio=ratio, target=target, met=ratio >= target)
    return out


def format_table(report) -> str:
    d = report["dims"]
    lines = [f"{report.get('arch', 'gpt2')} block stack fwd+bwd: {d['layers']} layers, hidden {d['hidden']}, "
             f"{d['heads']} heads ({d.get('kv_groups', d['heads'])} KV groups), ffn {d['ffn']}, seq {d['seq']}, batch {d['batch']}; torch {report['torch']}; "
             f"{report['cores']} cores ({report['cpu']}); {report['flops_per_iter'] / 1e9:.1f} GFLOP/iter; "
             f"median of {report['rounds']} x {report['iters_per_round']} steps",
             "| impl | dtype | procs x threads | ms/iter (median) | ms/iter (min) | CPU ms/iter | tokens/s "
             "| GFLOP/s | peak GFLOP/s | MFU | max abs diff vs TP=1 | other load |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        diff = f"{r['max_abs_diff_vs_tp1']:.1e}" if "max_abs_diff_vs_tp1" in r else "-"
        other = "-" if r.get("other_cpu_share") is None else f"{100 * r['other_cpu_share']:.0f}%"
        lines.append(f"| {r['impl']} | {r['dtype']} | {r['procs']} x {r['threads_per_proc']} | "
                     f"{r['ms_per_iter']:.0f} | {r['ms_min']:.0f} | {r['cpu_ms_per_iter']:.0f} | "
                     f"{r['tokens_per_s']:.0f} | "
                     f"{r['flops_per_s'] / 1e9:.1f} | {r['peak_flops_per_s'] / 1e9:.1f} | "
                     f"{100 * r['mfu']:.1f}% | {diff} | {other} |")
    for k, v in report["summary"].items():
        lines.append(f"{k}: {v['ratio']:.3f} (target >= {v['target']}) {'met' if v['met'] else 'MISSED'}")
    if report.get("skipped"):
        lines.append(f"skipped: {', '.join(s['row'] for s in report['skipped'])} ({report['skipped'][0]['reason']})")
    lines.append(f"load average before/after: {report['loadavg_before'][0]:.2f} / "
                 f"{report['loadavg_after'][0]:.2f}; total {report['total_wall_s']:.0f} s")
    return "\n".join(lines)


if __name__ == "__main__":
    _bench.run(main)
