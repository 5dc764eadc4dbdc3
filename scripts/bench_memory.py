"""Peak resident memory of training per rank: fp32 vs bf16, saving and resuming runs, vs the planner.

Runs the training loop (``tnlg.training.train``, what ``tnlg pretrain`` runs in each worker) on
4 local gloo processes, TP 1 x DP 4, ZeRO-1, for a ~130M-parameter GPT on the built-in
corpus, and reads each rank's peak resident set size (``ru_maxrss``) at the end of:

* ``baseline``: a worker that only imports torch and tnlg and joins the process group;
* ``fp32`` and ``bf16`` (16-bit parameters and gradients, fp32 master and Adam of the owned
  slice): a few training iterations;
* ``fp32 + save``: the same run, saving a checkpoint at its last iteration;
* ``fp32 resume``: a run that loads that checkpoint and trains a few more iterations;
* ``engine``: the engine alone (built on meta, a few steps on random tokens, no data loader
  or loop), to separate what the engine allocates from what the rest of the process adds.

Figures are the largest rank's peak minus the baseline. The plain rows run with the workers' own heap
setting (:mod:`tnlg.parallel.heap`: freed blocks up to 1 GiB kept for the next step, as every ``tnlg``
worker does); the ``mmap`` rows rerun baseline, fp32 and bf16 with glibc's ``MALLOC_MMAP_THRESHOLD_=65536``
(allocations above 64 KiB are mapped and returned to the system when freed; a user's setting makes the
workers leave glibc alone): with freed activation and gradient buffers kept in the heap between iterations,
the peak RSS grows past what is live. Targets: bf16 <= 0.75x
fp32; saving and resuming runs <= 1.05x the plain run; memory above baseline within 10% of the
planner's model states plus activations (``tnlg plan``'s accounting for the same layout).

A second table times a save and a load of a 0.6B-parameter model (``--big-layers 19``: 1.06B,
more memory than a 24 GiB machine has for two fp32 ranks) at TP 1 x DP 2 against
``torch.save``/``torch.load`` of the same states (``--big``).

Usage::

    python scripts/bench_memory.py                 # ~5 min on 2 cores
    python scripts/bench_memory.py --big --json bench_memory.json
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import sys
import tempfile
import time

import _bench
import torch

from tnlg.runtime.spawn import run_distributed


def _rss() -> int:
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def _baseline(ps):
    import tnlg.training  # noqa: F401 - what a worker imports before training (the command itself imports no torch)
    return _rss()


def _train(ps, o):
    from tnlg.training import train
    train(o)
    return _rss()


def _engine_steps(ps, args, bf16):
    """The engine alone (no data loader, no loop): build on meta, 3 steps on random tokens."""
    from tnlg.config import GPTConfig
    from tnlg.model import GPT
    from tnlg.optim import build_engine
    cfg = GPTConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                    seq_length=args.seq, vocab_size=4096, hidden_dropout=0.0, attention_dropout=0.0)
    engine = build_engine(GPT(cfg, ps, device="meta"), ps, 1, param_dtype=torch.bfloat16 if bf16 else None)
    gen = torch.Generator().manual_seed(0)
    for _ in range(args.iters):
        t = torch.randint(0, 4096, (args.micro, args.seq + 1), generator=gen)
        engine.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = engine.model(t[:, :-1], labels=t[:, 1:])
        engine.backward(loss)
        engine.step()
    return _rss()


def _options(args, world, **over):
    from tnlg.data.corpus import default_dataset
    from tnlg.commands.pretrain_args import resolve
    prefix, tok = default_dataset()
    flags = dict(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                 seq_length=args.seq, micro_batch_size=args.micro, global_batch_size=args.micro * world,
                 train_iters=args.iters, lr=1e-4, min_lr=1e-5, lr_warmup_iters=1, log_interval=1000,
                 eval_interval=0, data_path=[prefix], tokenizer_model=tok, sample_prompt="", plot=False,
                 peak_tflops=1.0, tensor_model_parallel_size=1, zero_stage=1,
                 hidden_dropout=0.0, attention_dropout=0.0)  # as the planner's count (CPU dropout keeps float masks)
    load = over.pop("load", None)
    flags.update(over)
    o = argparse.Namespace(**flags)
    o = resolve(o, world_size=world)
    o.checkpoint.load = load
    return o


def _planned(args, precision: str, world: int) -> dict:
    from tnlg.config import GPTConfig
    from tnlg.data.corpus import default_dataset
    from tnlg.data.tokenizer import load_tokenizer
    from tnlg.plan.planner import Hardware, Layout, Model, plan_layout
    vocab = load_tokenizer(default_dataset()[1]).vocab_size
    cfg = GPTConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                    seq_length=args.seq, vocab_size=vocab)
    m = plan_layout(Model("bench", cfg), Layout(tp=1, dp=world, zero_stage=1, micro_batch=args.micro,
                                                precision=precision), Hardware())["memory"]
    return dict(params=cfg.num_parameters_formula(), model_states=m["model_states"], activations=m["activations"],
                total=m["total"])


def bench_training(args) -> dict:
    world = 4
    work = tempfile.mkdtemp(prefix="tnlg_bench_memory_")
    ckpt = os.path.join(work, "ckpt")
    mmap = {"MALLOC_MMAP_THRESHOLD_": "65536"}
    runs = [
        ("baseline", _baseline, (), {}),
        ("fp32", _train, (_options(args, world),), {}),
        ("bf16", _train, (_options(args, world, bf16=True),), {}),
        ("fp32 + save", _train, (_options(args, world, save=ckpt),), {}),
        ("fp32 resume", _train, (_options(args, world, load=ckpt, train_iters=2 * args.iters),), {}),
        ("baseline mmap", _baseline, (), mmap),
        ("fp32 mmap", _train, (_options(args, world),), mmap),
        ("bf16 mmap", _train, (_options(args, world, bf16=True),), mmap),
        ("fp32 engine mmap", _engine_steps, (args, False), mmap),
        ("bf16 engine mmap", _engine_steps, (args, True), mmap),
    ]
    if args.only:
        keep = {n.strip() for n in args.only.split(",")}
        runs = [r for r in runs if r[0] in keep or r[0].startswith("baseline")]
    out = {}
    try:
        for name, fn, fargs, env in runs:
            t = time.perf_counter()
            saved = {k: os.environ.get(k) for k in env}
            os.environ.update(env)  # read by glibc when each spawned worker starts
            try:
                peaks = run_distributed(fn, world, 1, *fargs, timeout_s=1800)
            finally:
                for k, v in saved.items():
                    if v is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = v
            out[name] = dict(peak_rss_per_rank=peaks, seconds=time.perf_counter() - t)
            print(f"  {name:18s} max rank peak {max(peaks) / 2**20:8.0f} MiB ({time.perf_counter() - t:.0f} s)",
                  flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    base = max(out["baseline"]["peak_rss_per_rank"])
    base_mmap = max(out.get("baseline mmap", out["baseline"])["peak_rss_per_rank"])
    for name in out:
        out[name]["above_baseline"] = max(out[name]["peak_rss_per_rank"]) - (base_mmap if "mmap" in name else base)
    plans = {p: _planned(args, p, world) for p in ("fp32", "bf16")}
    if args.only:  # a partial run: each measured run against the planner only
        ratios = {f"{n} / planned": (r["above_baseline"] / plans[n.split()[0]]["total"], (0.9, 1.1), "in")
                  for n, r in out.items() if not n.startswith("baseline")}
        return dict(runs=out, planned=plans, ratios={k: v[0] for k, v in ratios.items()},
                    targets={k: v[1] for k, v in ratios.items()}, baseline=base, _ratio_rows=ratios)
    fp32, bf16 = out["fp32"]["above_baseline"], out["bf16"]["above_baseline"]
    ratios = {
        "bf16 / fp32": (bf16 / fp32, 0.75, "<="),
        "fp32 + save / fp32": (out["fp32 + save"]["above_baseline"] / fp32, 1.05, "<="),
        "fp32 resume / fp32": (out["fp32 resume"]["above_baseline"] / fp32, 1.05, "<="),
        "fp32 / planned": (fp32 / plans["fp32"]["total"], (0.9, 1.1), "in"),
        "bf16 / planned": (bf16 / plans["bf16"]["total"], (0.9, 1.1), "in"),
        "fp32 mmap / planned": (out["fp32 mmap"]["above_baseline"] / plans["fp32"]["total"], (0.9, 1.1), "in"),
        "bf16 mmap / planned": (out["bf16 mmap"]["above_baseline"] / plans["bf16"]["total"], (0.9, 1.1), "in"),
        "fp32 engine mmap / planned": (out["fp32 engine mmap"]["above_baseline"] / plans["fp32"]["total"],
                                       (0.9, 1.1), "in"),
        "bf16 engine mmap / planned": (out["bf16 engine mmap"]["above_baseline"] / plans["bf16"]["total"],
                                       (0.9, 1.1), "in"),
    }
    return dict(runs=out, planned=plans, ratios={k: v[0] for k, v in ratios.items()},
                targets={k: v[1] for k, v in ratios.items()}, baseline=base, _ratio_rows=ratios)


def bench_save_load(args) -> dict:
    """Save and load time of a ~1B model at TP 1 x DP 2 vs torch.save/torch.load of the same states."""
    work = tempfile.mkdtemp(prefix="tnlg_bench_ckpt_")
    try:
        res = run_distributed(_save_load_body, 2, 1, work, args.big_layers, timeout_s=3600)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return res[0]


def _save_load_body(ps, work, layers):
    import torch.distributed as dist

    from tnlg import checkpoint as ck
    from tnlg.config import GPTConfig
    from tnlg.model import GPT
    from tnlg.optim import build_engine
    cfg = GPTConfig(num_layers=layers, hidden_size=2048, num_attention_heads=16, seq_length=128, vocab_size=50257)
    engine = build_engine(GPT(cfg, ps, device="meta"), ps, 1)
    root = os.path.join(work, "tnlg")
    dist.barrier()
    t = time.perf_counter()
    ck.save(root, iteration=1, consumed_samples=0, model=engine.model, engine=engine, ps=ps, config=cfg)
    save_s = time.perf_counter() - t
    dist.barrier()
    t = time.perf_counter()
    ck.load(root, model=engine.model, engine=engine, ps=ps, config=cfg)
    dist.barrier()
    load_s = time.perf_counter() - t
    # torch.save of the same states: each DP rank its owned moments and master (none in fp32), rank 0 the weights
    pieces = engine.owned_pieces()
    state = {"pieces": {pc["name"]: {k: pc[k] for k in ("exp_avg", "exp_avg_sq")} for pc in pieces}}
    if ps.dp_rank == 0:
        state["model"] = dict(engine.param_tensors(engine.param_names))
    path = os.path.join(work, f"torch_{ps.rank}.pt")
    dist.barrier()
    t = time.perf_counter()
    torch.save(state, path)
    with open(path, "rb+") as f:
        os.fsync(f.fileno())
    dist.barrier()
    tsave = time.perf_counter() - t
    t = time.perf_counter()
    torch.load(path, weights_only=True)
    dist.barrier()
    tload = time.perf_counter() - t
    size = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(root) for f in fs)
    return dict(params=cfg.num_parameters_formula(), checkpoint_bytes=size, save_s=save_s, load_s=load_s,
                torch_save_s=tsave, torch_load_s=tload, save_over_torch=save_s / tsave, load_over_torch=load_s / tload)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _bench.add_shape_arguments(p, layers=18, hidden=768, heads=12, seq=128)
    p.add_argument("--micro", type=int, default=2)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--big", action="store_true", help="also time save/load of a ~1B model at TP 1 x DP 2")
    p.add_argument("--big-layers", type=int, default=10,
                   help="layers of the hidden-2048 model of --big (10: 0.6B parameters, 7.3 GB per rank in fp32 "
                        "ZeRO-1 at DP 2, what a 24 GiB machine holds twice; 19: 1.06B)")
    p.add_argument("--json", default="bench_memory.json")
    p.add_argument("--only", help="comma-separated run names to measure (the baselines always run); "
                                  "ratios then cover those runs only")
    args = p.parse_args(argv)
    info = _bench.machine_info(args=vars(args))
    print(f"bench_memory: TP 1 x DP 4, ZeRO-1, {args.layers} layers x hidden {args.hidden}, seq {args.seq}, "
          f"micro {args.micro}, {args.iters} iterations; torch {torch.__version__}", flush=True)
    res = bench_training(args)
    rows = res.pop("_ratio_rows")
    print(f"\n{'run':18s} {'peak above baseline (MiB, max rank)':>38s}   planned (MiB)")
    for name, r in res["runs"].items():
        plan = res["planned"].get(name.split()[0]) if not name.startswith("baseline") else None
        print(f"{name:18s} {r['above_baseline'] / 2**20:38.0f}   "
              + (f"{plan['total'] / 2**20:.0f} (states {plan['model_states'] / 2**20:.0f} + activations "
                 f"{plan['activations'] / 2**20:.0f})" if plan else f"baseline {res['baseline'] / 2**20:.0f}"))
    print(f"\n{'ratio':28s} {'measured':>9s}  target")
    for k, (v, target, op) in rows.items():
        ok = v <= target if op == "<=" else target[0] <= v <= target[1]
        print(f"{k:28s} {v:9.3f}  {op} {target}  {'ok' if ok else 'MISSED'}")
    out = dict(info=info, training=res)
    if args.big:
        sl = bench_save_load(args)
        out["save_load"] = sl
        print(f"\nsave/load of {sl['params'] / 1e9:.2f}B params (TP 1 x DP 2, ZeRO-1, fp32; "
              f"{sl['checkpoint_bytes'] / 1e9:.2f} GB): save {sl['save_s']:.1f} s vs torch.save {sl['torch_save_s']:.1f} s "
              f"({sl['save_over_torch']:.2f}x); load {sl['load_s']:.1f} s vs torch.load {sl['torch_load_s']:.1f} s "
              f"({sl['load_over_torch']:.2f}x)")
    _bench.write_json(args.json, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
