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
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tnlg.config import GPTConfig  # noqa: E402
from tnlg.model import GPT  # noqa: E402
from tnlg.optim import build_engine  # noqa: E402
from tnlg.testing import run_distributed  # noqa: E402


def formulas(psi: int, dp: int, stage: int) -> dict:
    """fp32 ZeRO bytes per rank (what this engine holds) and the paper's mixed-precision total."""
    p = {0: 4 * psi, 1: 4 * psi, 2: 4 * psi + 4 * psi / dp, 3: 4 * psi / dp}[stage]
    g = 4 * psi if stage < 2 else 4 * psi / dp
    o = 8 * psi if stage == 0 else 8 * psi / dp
    paper = {0: 16 * psi, 1: 4 * psi + 12 * psi / dp, 2: 2 * psi + 14 * psi / dp, 3: 16 * psi / dp}[stage]
    return dict(param_bytes=p, grad_bytes=g, optim_bytes=o, total=p + g + o, paper_mixed_precision_total=paper)


def _bench(ps, cfg_dict, stages, steps, warmup, micro_batch, bucket_mb):
    """Stages 0 and 1 are timed interleaved (one iteration each, alternately) so that load from
    other processes on the machine hits both equally; stages 2 and 3 run one after the other."""
    cfg = GPTConfig(**cfg_dict)
    g = torch.Generator().manual_seed(1234 + ps.dp_rank)
    groups = [[s for s in stages if s <= 1]] + [[s] for s in stages if s >= 2]
    out = []
    for group in groups:
        if not group:
            continue
        engines = {}
        for stage in group:
            model = GPT(cfg, ps)
            engines[stage] = build_engine(model, ps, stage, lr=1e-4, weight_decay=0.01, bucket_size_mb=bucket_mb)
        times = {s: [] for s in group}
        fb = {s: [] for s in group}
        loss = None
        for it in range(warmup + steps):
            tokens = torch.randint(0, cfg.vocab_size, (micro_batch, cfg.seq_length + 1), generator=g)
            for stage, engine in engines.items():
                dist.barrier()
                t0 = time.perf_counter()
                engine.zero_grad()
                loss = engine.model(tokens[:, :-1], labels=tokens[:, 1:])
                engine.backward(loss)
                t1 = time.perf_counter()
                engine.step()
                dist.barrier()
                t2 = time.perf_counter()
                if it >= warmup:
                    times[stage].append(t2 - t0)
                    fb[stage].append(t1 - t0)
        for stage, engine in engines.items():
            psi = sum(p.numel() for p in engine.model.parameters()) if stage < 2 else engine.memory_report()["numel"]
            out.append(dict(stage=stage, impl=engine.impl, psi=psi, memory=engine.memory_report(),
                            formula=formulas(psi, ps.dp_size, stage), step_s=statistics.median(times[stage]),
                            fwd_bwd_s=statistics.median(fb[stage]), step_times=times[stage],
                            loss=float(loss.detach())))
        del engines
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layouts", default="2x2,1x2", help="comma-separated TPxDP layouts (default 2x2,1x2)")
    ap.add_argument("--stages", default="0,1,2,3")
    ap.add_argument("--layers", type=int, default=12, help="transformer layers (gpt2-small: 12)")
    ap.add_argument("--seq", type=int, default=64, help="sequence length (gpt2-small: 1024; short to fit a CPU)")
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3, help="timed iterations per stage (median reported)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--bucket-mb", type=float, default=25.0)
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    ap.add_argument("--json", default="bench_zero.json", help="where to write the results")
    args = ap.parse_args(argv)

    cfg = GPTConfig.preset("gpt2-small", num_layers=args.layers, seq_length=args.seq)
    stages = [int(s) for s in args.stages.split(",")]
    layouts = [tuple(int(x) for x in l.lower().split("x")) for l in args.layouts.split(",")]
    record = dict(torch=torch.__version__, python=platform.python_version(), cpus=os.cpu_count(),
                  threads_per_rank=args.threads, model=cfg.to_dict(), micro_batch=args.micro_batch,
                  bucket_mb=args.bucket_mb, results=[])
    print(f"gpt2-small shape: {cfg.num_layers} layers, hidden {cfg.hidden_size}, vocab {cfg.vocab_size}, "
          f"seq {cfg.seq_length}, micro batch {args.micro_batch}; torch {torch.__version__}, "
          f"{args.threads} thread(s)/rank on {os.cpu_count()} CPUs; fp32 params/grads/Adam states")
    try:
        import deepspeed  # noqa: F401
        print("DeepSpeed is installed: scripts/bench_zero_deepspeed.py prints DeepSpeed ZeRO 1-3 beside stages 0/1.")
    except ImportError:
        print("DeepSpeed not installed: no DeepSpeed ZeRO-1 comparison.")
    MB = 2 ** 20
    for tp, dp in layouts:
        t0 = time.time()
        per_rank = run_distributed(_bench, tp * dp, tp, cfg.to_dict(), stages, args.steps, args.warmup,
                                   args.micro_batch, args.bucket_mb, timeout_s=900, threads=args.threads)
        print(f"\n(tp, dp) = ({tp}, {dp})   [{time.time() - t0:.0f} s]   rank 0 shown; MiB measured / formula")
        print(f"{'stage':>5} {'impl':>5} {'Psi':>11} {'params':>15} {'grads':>15} {'Adam states':>15} "
              f"{'total':>15} {'paper(mixed)':>12} {'step s':>8} {'fwd+bwd':>8} {'vs st.0':>7}")
        base = None
        for k, r in enumerate(per_rank[0]):
            m, f = r["memory"], r["formula"]
            step = max(pr[k]["step_s"] for pr in per_rank)  # slowest rank (barriers align them)
            base = base or step
            tot = m["param_bytes"] + m["grad_bytes"] + m["optim_bytes"]
            cell = lambda a, b: f"{a / MB:7.1f}/{b / MB:7.1f}"  # noqa: E731
            print(f"{r['stage']:>5} {r['impl']:>5} {r['psi']:>11,} {cell(m['param_bytes'], f['param_bytes']):>15} "
                  f"{cell(m['grad_bytes'], f['grad_bytes']):>15} {cell(m['optim_bytes'], f['optim_bytes']):>15} "
                  f"{cell(tot, f['total']):>15} {f['paper_mixed_precision_total'] / MB:12.1f} {step:8.3f} "
                  f"{r['fwd_bwd_s']:8.3f} {step / base:7.3f}")
            optim = [pr[k]["memory"]["optim_bytes"] for pr in per_rank]
            record["results"].append(dict(tp=tp, dp=dp, stage=r["stage"], impl=r["impl"], psi=r["psi"],
                                          memory_rank0=m, formula=f, optim_bytes_per_rank=optim,
                                          step_s=step, fwd_bwd_s=r["fwd_bwd_s"], ratio_to_stage0=step / base,
                                          step_times_rank0=r["step_times"]))
    tmp = args.json + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(record, fh, indent=2)
    os.replace(tmp, args.json)
    print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
