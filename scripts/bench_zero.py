"""Benchmark ZeRO stages 0-3 composed with TP: per-rank memory (measured vs formula) and step time.

Runs a gpt2-small-shaped GPT (hidden 768, 12 heads, vocab 50257, 12 layers by
default; the sequence is shortened so a step fits on a laptop CPU) on local
gloo processes at each (tp, dp) layout, for each ZeRO stage, and prints

* per-rank bytes of parameters, gradients and optimizer states held by the
  engine (``engine.memory_report()``: the sizes of the tensors it actually
  allocated) next to the ZeRO formulas for fp32 training with Adam
  (``Psi`` = parameters in this rank's TP shard):

  ========  ==================  ============  ============
  stage     params              grads         Adam states
  ========  ==================  ============  ============
  0         4 Psi               4 Psi         8 Psi
  1         4 Psi               4 Psi         8 Psi / dp
  2         4 Psi + 4 Psi / dp  4 Psi / dp    8 Psi / dp
  3         4 Psi / dp          4 Psi / dp    8 Psi / dp
  ========  ==================  ============  ============

  (stage 2: FSDP keeps its fp32 shard, the optimizer's "master", and the
  unsharded copy from a unit's forward to its backward; stage 3 frees the
  unsharded copy after each unit, so only one unit's is alive at a time)

  and the paper's mixed-precision totals (16 Psi, 4 Psi + 12 Psi/dp,
  2 Psi + 14 Psi/dp, 16 Psi/dp) for comparison;
* the median wall time of a full iteration (forward, backward, step) and the
  ratio to stage 0 (target: stage 1 within 3% of stage 0).

Usage::

    python scripts/bench_zero.py                      # (tp,dp) = (2,2) and (1,2), stages 0-3
    python scripts/bench_zero.py --layers 4 --steps 3 --json bench_zero.json

``scripts/bench_zero_deepspeed.py`` runs the same measurement with DeepSpeed's engines beside ours
(:func:`run_layouts` with other engine groups).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import _bench
import torch
import torch.distributed as dist

from tnlg.config import GPTConfig
from tnlg.model import GPT
from tnlg.optim import build_engine
from tnlg.runtime.spawn import run_distributed

MB = 2 ** 20


def formulas(psi: int, dp: int, stage: int) -> dict:
    """fp32 ZeRO bytes per rank (what this engine holds) and the paper's mixed-precision total
    (Rajbhandari et al. 2020; docs/formulas.md)."""
    p = {0: 4 * psi, 1: 4 * psi, 2: 4 * psi + 4 * psi / dp, 3: 4 * psi / dp}[stage]
    g = 4 * psi if stage < 2 else 4 * psi / dp
    o = 8 * psi if stage == 0 else 8 * psi / dp
    paper = {0: 16 * psi, 1: 4 * psi + 12 * psi / dp, 2: 2 * psi + 14 * psi / dp, 3: 16 * psi / dp}[stage]
    return dict(param_bytes=p, grad_bytes=g, optim_bytes=o, total=p + g + o, paper_mixed_precision_total=paper)


def _build(impl: str, stage: int, cfg, ps, bucket_mb: float):
    """Our engine (``impl="tnlg"``) or DeepSpeed's for ``stage``, on a freshly seeded model."""
    model = GPT(cfg, ps)
    if impl == "deepspeed":
        from tnlg.optim.deepspeed_engine import build_deepspeed_engine  # DeepSpeed is optional and heavy
        return build_deepspeed_engine(model, ps, stage, lr=1e-4, weight_decay=0.01, bucket_size_mb=bucket_mb)
    return build_engine(model, ps, stage, lr=1e-4, weight_decay=0.01, bucket_size_mb=bucket_mb)


def _measure(ps, cfg_dict, groups, steps, warmup, micro_batch, bucket_mb):
    """``groups``: lists of ``(impl, stage)``. The engines of one group are timed interleaved (one
    iteration each, in turn) so that load from other processes on the machine hits them equally;
    the groups run one after the other."""
    cfg = GPTConfig(**cfg_dict)
    g = torch.Generator().manual_seed(1234 + ps.dp_rank)
    out = []
    for group in groups:
        engines = {tuple(key): _build(*key, cfg, ps, bucket_mb) for key in group}
        times = {k: [] for k in engines}
        fb = {k: [] for k in engines}
        loss = {}
        for it in range(warmup + steps):
            tokens = torch.randint(0, cfg.vocab_size, (micro_batch, cfg.seq_length + 1), generator=g)
            for key, engine in engines.items():
                dist.barrier()
                t0 = time.perf_counter()
                engine.zero_grad()
                loss[key] = engine.model(tokens[:, :-1], labels=tokens[:, 1:])
                engine.backward(loss[key])
                t1 = time.perf_counter()
                engine.step()
                dist.barrier()
                t2 = time.perf_counter()
                if it >= warmup:
                    times[key].append(t2 - t0)
                    fb[key].append(t1 - t0)
        for (impl, stage), engine in engines.items():
            m = engine.memory_report()
            whole = impl == "tnlg" and stage < 2  # our stages 0 and 1 hold every parameter of the TP shard
            psi = sum(p.numel() for p in engine.model.parameters()) if whole else m["numel"]
            key = (impl, stage)
            out.append(dict(stage=stage, impl=engine.impl, psi=psi, memory=m, formula=formulas(psi, ps.dp_size, stage),
                            step_s=statistics.median(times[key]), fwd_bwd_s=statistics.median(fb[key]),
                            step_times=times[key], loss=float(loss[key].detach())))
        del engines
    return out


def add_arguments(ap: argparse.ArgumentParser, json_default: str) -> None:
    """The options both ZeRO benchmarks take."""
    ap.add_argument("--layouts", default="2x2,1x2", help="comma-separated TPxDP layouts (default 2x2,1x2)")
    ap.add_argument("--layers", type=int, default=12, help="transformer layers (gpt2-small: 12)")
    ap.add_argument("--seq", type=int, default=64, help="sequence length (gpt2-small: 1024; short to fit a CPU)")
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3, help="timed iterations per engine (median reported)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--bucket-mb", type=float, default=25.0)
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    ap.add_argument("--json", default=json_default, help="where to write the results")


def run_layouts(args, groups, record: dict, note: str = "") -> int:
    """Measure ``groups`` at every layout of ``args.layouts``; print a table per layout and write JSON."""
    cfg = GPTConfig.preset("gpt2-small", num_layers=args.layers, seq_length=args.seq)
    record.update(_bench.machine_info(threads_per_rank=args.threads, model=cfg.to_dict(),
                                      micro_batch=args.micro_batch, bucket_mb=args.bucket_mb), results=[])
    print(f"gpt2-small shape: {cfg.num_layers} layers, hidden {cfg.hidden_size}, vocab {cfg.vocab_size}, "
          f"seq {cfg.seq_length}, micro batch {args.micro_batch}; torch {torch.__version__}{note}, "
          f"{args.threads} thread(s)/rank on {os.cpu_count()} CPUs; fp32 params/grads/Adam states")
    for tp, dp in [tuple(int(x) for x in layout.lower().split("x")) for layout in args.layouts.split(",")]:
        t0 = time.time()
        per_rank = run_distributed(_measure, tp * dp, tp, cfg.to_dict(), groups, args.steps, args.warmup,
                                   args.micro_batch, args.bucket_mb, timeout_s=900, threads=args.threads)
        print(f"\n(tp, dp) = ({tp}, {dp})   [{time.time() - t0:.0f} s]   rank 0 shown; MiB measured / formula")
        print(f"{'stage':>5} {'impl':>9} {'Psi':>11} {'params':>15} {'grads':>15} {'Adam states':>15} "
              f"{'total':>15} {'paper(mixed)':>12} {'step s':>8} {'fwd+bwd':>8} {'vs st.0':>7}")
        base = None
        for k, r in enumerate(per_rank[0]):
            m, f = r["memory"], r["formula"]
            step = max(pr[k]["step_s"] for pr in per_rank)  # slowest rank (barriers align them)
            base = base or step
            tot = m["param_bytes"] + m["grad_bytes"] + m["optim_bytes"]
            cell = lambda a, b: f"{a / MB:7.1f}/{b / MB:7.1f}"  # noqa: E731
            print(f"{r['stage']:>5} {r['impl']:>9} {r['psi']:>11,} {cell(m['param_bytes'], f['param_bytes']):>15} "
                  f"{cell(m['grad_bytes'], f['grad_bytes']):>15} {cell(m['optim_bytes'], f['optim_bytes']):>15} "
                  f"{cell(tot, f['total']):>15} {f['paper_mixed_precision_total'] / MB:12.1f} {step:8.3f} "
                  f"{r['fwd_bwd_s']:8.3f} {step / base:7.3f}")
            record["results"].append(dict(tp=tp, dp=dp, stage=r["stage"], impl=r["impl"], psi=r["psi"],
                                          memory_rank0=m, formula=f,
                                          optim_bytes_per_rank=[pr[k]["memory"]["optim_bytes"] for pr in per_rank],
                                          step_s=step, fwd_bwd_s=r["fwd_bwd_s"], ratio_to_stage0=step / base,
                                          step_times_rank0=r["step_times"], loss=r["loss"]))
    print()
    _bench.write_json(args.json, record)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(ap, "bench_zero.json")
    ap.add_argument("--stages", default="0,1,2,3")
    args = ap.parse_args(argv)
    stages = [int(s) for s in args.stages.split(",")]
    # stages 0 and 1 are timed interleaved; stages 2 and 3 one after the other
    groups = [g for g in [[("tnlg", s) for s in stages if s <= 1]] + [[("tnlg", s)] for s in stages if s >= 2] if g]
    if _bench.package_version("deepspeed"):
        print("DeepSpeed is installed: scripts/bench_zero_deepspeed.py prints DeepSpeed ZeRO 1-3 beside stages 0/1.")
    else:
        print("DeepSpeed not installed: no DeepSpeed ZeRO-1 comparison.")
    return run_layouts(args, groups, {})


if __name__ == "__main__":
    sys.exit(main())
