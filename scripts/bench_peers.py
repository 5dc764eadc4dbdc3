#!/usr/bin/env python
"""tnlg side by side with megatron-core's ``GPTModel`` and transformers (GPT-2 or Llama): one training step each.

The same shape (default: 6 layers, hidden 512, 8 heads, seq 256, vocab 8192, micro batch 4), the same
initialisation statistics (normal, std 0.02, zero biases, unit norms; the output projections scaled by
``1/sqrt(2 l)``: megatron-core and tnlg do it, transformers' GPT-2 too, and its Llama is scaled so after
its init), the same tokens and AdamW (lr 1e-4, betas 0.9/0.95, eps 1e-8, weight decay 0.1, no clipping).

``--arch llama`` (default ``gpt2``) trains the Llama shape instead: the same dims with rope (base 10000,
every dimension rotated), RMSNorm (eps 1e-5), SwiGLU (Megatron's default ffn ``int(8h/3/64)*64``: 1344 at
hidden 512), grouped-query attention with ``--groups`` KV groups (default 2), no linear biases and an
untied output layer: tnlg's ``GPTConfig`` with Megatron's flags, megatron-core's ``GPTModel`` with the
``TransformerConfig`` Megatron-LM makes of them (``normalization="RMSNorm"``, ``gated_linear_unit``, silu,
``num_query_groups``, ``add_bias_linear=False``, ``position_embedding_type="rope"``; local spec) and
transformers' ``LlamaForCausalLM`` (SDPA attention). One step = forward + mean cross-entropy + backward +
optimizer step, each framework through its own training path:

* ``tnlg``: ``GPT`` in its data-parallel engine (``build_engine``, ZeRO 0 at DP 1); ``16-bit`` is
  tnlg's ``--bf16``: bf16 parameters and gradients in its flat buffers, an fp32 master, autocast;
* ``megatron``: megatron-core's ``GPTModel`` (local layer spec: attention as ``baddbmm`` + softmax,
  no fused kernel) in its ``DistributedDataParallel`` with ``get_megatron_optimizer``; ``16-bit`` is
  Megatron's ``--bf16``: bf16 parameters in ``Float16Module``, an fp32 master in its optimizer. It runs
  on the CPU with gloo after the patches of ``tests/megatron_reference.py``; under
  ``torch.autocast("cpu")`` its linear layers' ``custom_fwd/custom_bwd`` are re-wrapped for ``"cpu"``;
* ``hf``: ``transformers.GPT2LMHeadModel`` (``--arch llama``: ``LlamaForCausalLM``; SDPA attention) with
  ``torch.optim.AdamW``, TP 1 only and no 16-bit path of its own (``n/a``).

Configurations: ``fp32``, ``bf16`` (fp32 parameters, ``torch.autocast("cpu", bfloat16)``) and
``16-bit`` (each framework's own), at TP 1 (one process, 2 threads) and TP 2 (2 gloo ranks, 1 thread
each). Every measurement is a fresh set of processes (``run_distributed``: spawned interpreters), and
the rounds interleave the frameworks so that load from other processes falls on all alike. Per
configuration the table shows the median and the fastest step of each framework over all rounds and
the ratios tnlg / megatron-core and tnlg / transformers; the JSON keeps every step's seconds.

``--competing-load N`` runs N extra processes for the whole benchmark, each multiplying two fp32
``512 x 512`` matrices on one thread in a loop: the oversubscribed machine a shared workstation or CI
runner is. It is the check that tnlg's step does not collapse under load (libgomp's spin-waiting threads
did that: ``tnlg/runtime/threads.py``). Each framework runs as it ships: tnlg's workers with the OpenMP
wait setting the ``tnlg`` command sets (``GOMP_SPINCOUNT=1000`` unless the user set one), megatron-core's
and transformers' with the user's environment; ``--omp-default`` runs tnlg without it too (the collapse,
for comparison). The JSON records each measurement's setting.

    python scripts/bench_peers.py                         # about 5 minutes on 2 idle cores
    python scripts/bench_peers.py --competing-load 2      # both cores kept busy by others
    python scripts/bench_peers.py --tiny                  # seconds: a smoke test
    python scripts/bench_peers.py --arch llama            # the Llama shape (8 heads, 2 KV groups)
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import statistics
import subprocess
import sys
import time
import warnings
from unittest import mock

import _bench
import torch
import torch.distributed as dist

from tnlg.errors import UserError
from tnlg.runtime.threads import WAIT_VARIABLES, set_wait_policy

FRAMEWORKS = ("tnlg", "megatron", "hf")
ARCHS = ("gpt2", "llama")
PRECISIONS = ("fp32", "bf16", "16-bit")
ADAMW = dict(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
LOAD_SIZE = 512  # the competing processes' square fp32 matmul
LOAD_CODE = ("import torch; torch.set_num_threads(1); a = torch.randn({n}, {n}); b = torch.randn({n}, {n})\n"
             "while True: a @ b")


def megatron_available() -> bool:
    return importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core") is not None


# ---------------------------------------------------------------------------- the three steps
def _tokens(spec: dict) -> torch.Tensor:
    g = torch.Generator().manual_seed(spec["seed"])
    return torch.randint(0, spec["vocab"], (spec["batch"], spec["seq"] + 1), generator=g)


def _autocast(spec: dict):
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=spec["precision"] != "fp32")


def tnlg_config(spec: dict):
    """tnlg's ``GPTConfig`` of the spec: GPT-2's decoder, or with ``arch == "llama"`` Megatron's Llama flags
    (rope, RMSNorm, SwiGLU, ``groups`` KV groups, no biases, untied); dropout 0."""
    from tnlg.config import GPTConfig
    llama = dict(position_embedding_type="rope", rotary_base=10000.0, normalization="RMSNorm", layernorm_epsilon=1e-5,
                 swiglu=True, group_query_attention=True, num_query_groups=spec["groups"], add_bias_linear=False,
                 untie_embeddings_and_output_weights=True)
    return GPTConfig(num_layers=spec["layers"], hidden_size=spec["hidden"], num_attention_heads=spec["heads"],
                     seq_length=spec["seq"], vocab_size=spec["vocab"], hidden_dropout=0.0, attention_dropout=0.0,
                     seed=spec["seed"], **(llama if spec["arch"] == "llama" else {}))


def tnlg_step(ps, spec: dict):
    from tnlg.model import GPT
    from tnlg.optim import build_engine
    model = GPT(tnlg_config(spec), ps, device="meta")  # materialised by the engine, as tnlg pretrain does
    engine = build_engine(model, ps, 0, clip_grad=0.0, lr=ADAMW["lr"], betas=ADAMW["betas"], eps=ADAMW["eps"],
                          weight_decay=ADAMW["weight_decay"],
                          param_dtype=torch.bfloat16 if spec["precision"] == "16-bit" else None)
    model, tok = engine.model, _tokens(spec)

    def step():
        engine.zero_grad()
        with _autocast(spec):
            loss = model(tok[:, :-1], labels=tok[:, 1:])
        engine.backward(loss)
        engine.step()
        return loss
    return step


def hf_model(spec: dict):
    """transformers' ``GPT2LMHeadModel``, or ``LlamaForCausalLM`` of tnlg's Llama config (its output and down
    projections scaled by ``1/sqrt(2 l)`` after transformers' init, as GPT-2's, megatron-core's and tnlg's
    are), SDPA attention, train mode."""
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel
    transformers.logging.set_verbosity_error()
    torch.manual_seed(spec["seed"])
    if spec["arch"] == "llama":
        from tnlg.interop.hf_llama import llama_config_from
        cfg = llama_config_from(tnlg_config(spec), "llama")
        cfg._attn_implementation = "sdpa"
        model = transformers.LlamaForCausalLM(cfg)
        with torch.no_grad():
            for layer in model.model.layers:
                for w in (layer.self_attn.o_proj.weight, layer.mlp.down_proj.weight):
                    w.mul_(1.0 / (2.0 * spec["layers"]) ** 0.5)
        return model.train()
    cfg = GPT2Config(vocab_size=spec["vocab"], n_positions=spec["seq"], n_embd=spec["hidden"],
                     n_layer=spec["layers"], n_head=spec["heads"], resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                     bos_token_id=None, eos_token_id=None)
    cfg._attn_implementation = "sdpa"
    return GPT2LMHeadModel(cfg).train()


def hf_step(ps, spec: dict):
    model = hf_model(spec)
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    tok = _tokens(spec)

    def step():
        opt.zero_grad(set_to_none=True)
        with _autocast(spec):  # (transformers shifts the labels itself: s - 1 predicted positions)
            loss = model(input_ids=tok[:, :-1], labels=tok[:, :-1]).loss
        loss.backward()
        opt.step()
        return loss
    return step


def _megatron_parts(spec: dict):
    sys.path.insert(0, _bench.ROOT)
    from tests import megatron_reference as mr
    mr._patch_cuda_calls()
    mr._patch_optimizer_calls()
    mr.patch_cpu_autocast()
    from megatron.core import parallel_state
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=spec["tp"], pipeline_model_parallel_size=1)
    sixteen = spec["precision"] == "16-bit"
    llama = spec["arch"] == "llama"
    mspec = dict(layers=spec["layers"], hidden=spec["hidden"], ffn=tnlg_config(spec).ffn_hidden_size,
                 heads=spec["heads"], seq=spec["seq"], vocab=spec["vocab"], divisible=128, tp=spec["tp"], pp=1,
                 untie=llama, openai_gelu=not llama, bf16=sixteen)
    if llama:  # Megatron-LM's --position-embedding-type rope --normalization RMSNorm --swiglu --group-query-attention
        mspec["llama"] = dict(groups=spec["groups"], rotary_base=10000.0, rotary_percent=1.0, eps=1e-5, qkv_bias=False)
    return mr.build_model(mspec), sixteen


def megatron_step(ps, spec: dict):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module
    model, sixteen = _megatron_parts(spec)
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(),
                                  Float16Module(model.config, model) if sixteen else model)
    opt = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=ADAMW["lr"], weight_decay=ADAMW["weight_decay"], adam_beta1=ADAMW["betas"][0],
        adam_beta2=ADAMW["betas"][1], adam_eps=ADAMW["eps"], clip_grad=0.0, bf16=sixteen,
        params_dtype=torch.bfloat16 if sixteen else torch.float32), [ddp])
    tok = _tokens(spec)
    b, s = spec["batch"], spec["seq"]
    positions = torch.arange(s).unsqueeze(0).expand(b, -1)
    mask = torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool), 1)  # True = masked
    ddp.train()

    def step():
        ddp.zero_grad_buffer()
        opt.zero_grad()
        with _autocast(spec):
            loss = ddp(tok[:, :-1], positions, mask, labels=tok[:, 1:]).float().mean()
        loss.backward()
        ddp.finish_grad_sync()
        opt.step()
        return loss
    return step


STEPS = dict(tnlg=tnlg_step, megatron=megatron_step, hf=hf_step)


def measure(ps, spec: dict) -> dict:
    """Worker: build the framework's step, ``warmup`` untimed steps, then ``steps`` timed ones (a barrier
    before each at TP 2, so every rank starts together). Returns the seconds and the first loss."""
    warnings.filterwarnings("ignore")  # megatron-core's import-time notes (no Apex, no Transformer Engine)
    step = STEPS[spec["framework"]](ps, spec)
    first = float(step().detach())
    for _ in range(spec["warmup"] - 1):
        step()
    times = []
    for _ in range(spec["steps"]):
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return dict(times=times, first_loss=first)


# ---------------------------------------------------------------------------- the driver
def configurations(a) -> list[tuple[str, int]]:
    return [(p, tp) for tp in a.tp for p in a.precisions]


def runs_of(precision: str, tp: int, frameworks) -> list[str]:
    """The frameworks that have this configuration (transformers: TP 1, no 16-bit path)."""
    return [f for f in frameworks if f != "hf" or (tp == 1 and precision != "16-bit")]


def start_load(n: int) -> list[subprocess.Popen]:
    code = LOAD_CODE.format(n=LOAD_SIZE)
    return [subprocess.Popen([sys.executable, "-c", code]) for _ in range(n)]


@contextlib.contextmanager
def omp_environment(framework: str, omp_default: bool):
    """The spawned workers' OpenMP wait settings: tnlg's as ``tnlg`` sets them
    (:func:`tnlg.runtime.threads.set_wait_policy`, unless ``--omp-default``), the others' as the user's."""
    with mock.patch.dict(os.environ):  # the environment as it was, afterwards
        _bench.user_wait_environment()  # (importing tnlg set GOMP_SPINCOUNT in this process)
        if framework == "tnlg" and not omp_default:
            set_wait_policy()
        yield


def run_rounds(a, frameworks) -> dict:
    from tnlg.runtime.spawn import run_distributed
    raw: dict = {}
    for r in range(a.rounds):
        for precision, tp in configurations(a):
            for fw in runs_of(precision, tp, frameworks):
                spec = dict(framework=fw, precision=precision, tp=tp, layers=a.layers, hidden=a.hidden,
                            heads=a.heads, seq=a.seq, vocab=a.vocab, batch=a.micro_batch, seed=1234,
                            warmup=a.warmup, steps=a.steps, arch=a.arch, groups=a.groups)
                with omp_environment(fw, a.omp_default):
                    out = run_distributed(measure, tp, tp, spec, timeout_s=a.timeout, threads=2 if tp == 1 else 1)[0]
                    out["env"] = {k: os.environ.get(k) for k in WAIT_VARIABLES}  # what the workers had
                raw.setdefault(f"{precision} TP {tp}", {}).setdefault(fw, []).append(out)
                print(f"round {r + 1}: {precision} TP {tp} {fw}: "
                      + " ".join(f"{t * 1e3:.0f}" for t in out["times"]) + " ms", flush=True)
                _bench.write_json(a.json, {"partial": True, "raw": raw}, quiet=True)  # a run cut short keeps these
    return raw


def summarise(raw: dict) -> dict:
    rows = {}
    for key, by_fw in raw.items():
        row = {}
        for fw, outs in by_fw.items():
            times = [t for o in outs for t in o["times"]]
            row[fw] = dict(median_ms=statistics.median(times) * 1e3, fastest_ms=min(times) * 1e3,
                           first_loss=outs[0]["first_loss"])
        for peer in ("megatron", "hf"):
            if "tnlg" in row and peer in row:
                row[f"tnlg/{peer}"] = {k: row["tnlg"][k] / row[peer][k] for k in ("median_ms", "fastest_ms")}
        rows[key] = row
    return rows


def print_table(rows: dict, a) -> None:
    def cell(row, fw):
        return (f"{row[fw]['median_ms']:8.0f} {row[fw]['fastest_ms']:8.0f}" if fw in row
                else f"{'n/a':>8} {'n/a':>8}")

    def ratio(row, k):
        return (f"{row[k]['median_ms']:5.2f} {row[k]['fastest_ms']:5.2f}" if k in row
                else f"{'n/a':>5} {'n/a':>5}")
    shape = (f"{a.arch}: {a.layers} layers, hidden {a.hidden}, {a.heads} heads"
             + (f" ({a.groups} KV groups)" if a.arch == "llama" else "") + f", seq {a.seq}, vocab {a.vocab}, "
             f"micro batch {a.micro_batch}")
    print(f"\n{shape}\n{'config':<14} {'tnlg med / fastest':>17} | {'megatron-core':>17} | {'transformers':>17} | "
          f"{'tnlg/mcore':>11} | {'tnlg/hf':>11}   (ms per step; ratios median, fastest)")
    for key, row in rows.items():
        print(f"{key:<14} {cell(row, 'tnlg')} | {cell(row, 'megatron')} | {cell(row, 'hf')} | "
              f"{ratio(row, 'tnlg/megatron')} | {ratio(row, 'tnlg/hf')}")


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    _bench.add_shape_arguments(p, layers=6, hidden=512, heads=8, seq=256)
    p.add_argument("--arch", choices=ARCHS, default="gpt2",
                   help="gpt2 (default) or llama: rope, RMSNorm, SwiGLU, --groups KV groups, no biases, untied")
    p.add_argument("--groups", type=int, default=None,
                   help="--arch llama: key/value groups (default 2; megatron-core at TP 2 needs them even)")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds, a fresh process each (default 3)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=4, help="timed steps per process (default 4)")
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2], choices=[1, 2])
    p.add_argument("--precisions", nargs="+", default=list(PRECISIONS), choices=PRECISIONS)
    p.add_argument("--frameworks", nargs="+", default=list(FRAMEWORKS), choices=FRAMEWORKS)
    p.add_argument("--competing-load", type=int, default=0, metavar="N",
                   help=f"N processes each multiplying {LOAD_SIZE} x {LOAD_SIZE} fp32 matrices on one thread")
    p.add_argument("--omp-default", action="store_true",
                   help="run tnlg with libgomp's default spin-wait too (without tnlg's GOMP_SPINCOUNT): the collapse "
                        "under --competing-load that the setting fixes")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a measurement may take")
    p.add_argument("--tiny", action="store_true", help="a smoke test: 1 layer, hidden 64, seq 32, vocab 256, 1 round")
    p.add_argument("--json", default="bench_peers.json")
    a = p.parse_args(argv)
    if a.tiny:
        a.layers, a.hidden, a.heads, a.seq, a.vocab, a.micro_batch = 1, 64, 4, 32, 256, 2
        a.rounds, a.warmup, a.steps = 1, 1, 2
    for name in ("rounds", "warmup", "steps", "layers", "hidden", "heads", "seq", "vocab", "micro_batch"):
        if getattr(a, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(a, name)}.")
    if a.competing_load < 0:
        raise UserError(f"--competing-load must be 0 or more processes, got {a.competing_load}.")
    if a.hidden % a.heads or a.heads % 2:
        raise UserError(f"--hidden ({a.hidden}) must divide by --heads ({a.heads}), and the heads by TP 2.")
    check_groups(a)
    return a


def check_groups(a) -> None:
    """``--groups`` (:func:`_bench.check_groups`, default 2), and even where megatron-core runs at TP 2
    (it needs ``num_query_groups % tp == 0``)."""
    _bench.check_groups(a, default=2)
    if a.arch != "llama":
        return
    if "megatron" in a.frameworks and 2 in a.tp and a.groups % 2:
        raise UserError(f"--groups {a.groups} is odd: megatron-core splits the KV groups over TP 2 only when "
                        f"they divide by 2; pass an even --groups, --tp 1, or --frameworks without megatron.")


def main() -> int:
    a = parse()
    frameworks = list(a.frameworks)
    if "megatron" in frameworks and not megatron_available():
        print("note: megatron-core is not installed (pip install --no-deps megatron-core==0.16.1); "
              "comparing tnlg with transformers only", flush=True)
        frameworks.remove("megatron")
    load = start_load(a.competing_load)
    try:
        raw = run_rounds(a, frameworks)
    finally:
        for proc in load:
            proc.terminate()
            proc.wait()
    rows = summarise(raw)
    print_table(rows, a)
    info = _bench.machine_info(args=vars(a), megatron_core=_bench.package_version("megatron-core"),
                               transformers=_bench.package_version("transformers"),
                               load_average=open("/proc/loadavg").read().split()[:3],
                               competing_load=dict(processes=a.competing_load, matmul=LOAD_SIZE, threads=1))
    _bench.write_json(a.json, dict(machine=info, frameworks=frameworks, summary=rows, raw=raw))
    return 0


if __name__ == "__main__":
    _bench.run(main)
