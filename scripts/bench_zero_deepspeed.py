"""DeepSpeed's ZeRO next to ours: the table of ``scripts/bench_zero.py`` with a DeepSpeed column.

Same gpt2-small-shaped GPT, layouts and columns as ``bench_zero.py``; per
layout it builds our stage 0, our stage 1 and DeepSpeed's ZeRO-1 (``--zero-impl
deepspeed``, our TP/DP groups handed to DeepSpeed through an ``mpu``) on the same
weights and times them *interleaved* (one iteration each, in turn), so load from
other processes hits all three alike; DeepSpeed's stages 2 and 3 (``--ds-stages``)
run one after the other. Memory is what each engine holds (``memory_report()``)
next to the fp32 formulas of ``bench_zero.py``; DeepSpeed keeps an fp32 master
copy of its partition even for fp32 parameters, so its optimizer bytes are
``12 Psi / dp`` against the formula's ``8 Psi / dp``.

Usage::

    python scripts/bench_zero_deepspeed.py                 # (tp,dp) = (2,2) and (1,2)
    python scripts/bench_zero_deepspeed.py --layers 4 --steps 3 --ds-stages 1,2,3
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
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_zero import formulas  # noqa: E402
from tnlg.config import GPTConfig  # noqa: E402
from tnlg.model import GPT  # noqa: E402
from tnlg.optim import build_engine  # noqa: E402
from tnlg.testing import run_distributed  # noqa: E402


def _build(impl: str, stage: int, cfg, ps, bucket_mb: float):
    model = GPT(cfg, ps)
    if impl == "deepspeed":
        from tnlg.optim.deepspeed_engine import build_deepspeed_engine
        return build_deepspeed_engine(model, ps, stage, lr=1e-4, weight_decay=0.01, bucket_size_mb=bucket_mb)
    return build_engine(model, ps, stage, lr=1e-4, weight_decay=0.01, bucket_size_mb=bucket_mb)


def _bench(ps, cfg_dict, ds_stages, steps, warmup, micro_batch, bucket_mb):
    cfg = GPTConfig(**cfg_dict)
    g = torch.Generator().manual_seed(1234 + ps.dp_rank)
    groups = [[("tnlg", 0), ("tnlg", 1)] + [("deepspeed", s) for s in ds_stages if s == 1]]
    groups += [[("deepspeed", s)] for s in ds_stages if s != 1]
    out = []
    for group in groups:
        engines = {key: _build(*key, cfg, ps, bucket_mb) for key in group}
        times = {k: [] for k in group}
        fb = {k: [] for k in group}
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
            out.append(dict(impl=impl, stage=stage, psi=m["numel"], memory=m,
                            formula=formulas(m["numel"], ps.dp_size, stage),
                            step_s=statistics.median(times[(impl, stage)]),
                            fwd_bwd_s=statistics.median(fb[(impl, stage)]), step_times=times[(impl, stage)],
                            loss=float(loss[(impl, stage)].detach())))
        del engines
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layouts", default="2x2,1x2", help="comma-separated TPxDP layouts (default 2x2,1x2)")
    ap.add_argument("--ds-stages", default="1", help="DeepSpeed ZeRO stages to run (1: timed with ours)")
    ap.add_argument("--layers", type=int, default=12, help="transformer layers (gpt2-small: 12)")
    ap.add_argument("--seq", type=int, default=64, help="sequence length (gpt2-small: 1024; short to fit a CPU)")
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3, help="timed iterations per engine (median reported)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--bucket-mb", type=float, default=25.0)
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    ap.add_argument("--json", default="bench_zero_deepspeed.json", help="where to write the results")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import deepspeed
    except ImportError:
        print('DeepSpeed is not installed: nothing to compare (pip install -e ".[deepspeed]").')
        return 1

    cfg = GPTConfig.preset("gpt2-small", num_layers=args.layers, seq_length=args.seq)
    ds_stages = [int(s) for s in args.ds_stages.split(",")]
    layouts = [tuple(int(x) for x in l.lower().split("x")) for l in args.layouts.split(",")]
    record = dict(torch=torch.__version__, deepspeed=deepspeed.__version__, python=platform.python_version(),
                  cpus=os.cpu_count(), threads_per_rank=args.threads, model=cfg.to_dict(),
                  micro_batch=args.micro_batch, bucket_mb=args.bucket_mb, results=[])
    print(f"gpt2-small shape: {cfg.num_layers} layers, hidden {cfg.hidden_size}, vocab {cfg.vocab_size}, "
          f"seq {cfg.seq_length}, micro batch {args.micro_batch}; torch {torch.__version__}, DeepSpeed "
          f"{deepspeed.__version__}, {args.threads} thread(s)/rank on {os.cpu_count()} CPUs; fp32")
    MB = 2 ** 20
    for tp, dp in layouts:
        t0 = time.time()
        per_rank = run_distributed(_bench, tp * dp, tp, cfg.to_dict(), ds_stages, args.steps, args.warmup,
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
                                          memory_rank0=m, formula=f, step_s=step, fwd_bwd_s=r["fwd_bwd_s"],
                                          ratio_to_stage0=step / base, step_times_rank0=r["step_times"],
                                          loss=r["loss"]))
    tmp = args.json + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(record, fh, indent=2)
    os.replace(tmp, args.json)
    print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
