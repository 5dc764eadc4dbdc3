#!/usr/bin/env python
"""Measured peak activation memory per rank vs the planner's formula (Korthikanti et al. 2022).

For every TP size, with and without sequence parallelism and for each recomputation
granularity (none, selective, full), one training step (forward with the loss, backward)
of a GPT whose activations dominate its memory runs under
:class:`tnlg.plan.measure.AllocationTracker`, which counts the bytes of every tensor created
during the step until it is freed (parameter gradients are allocated before, so only
activations, recomputation and temporaries are counted). Reported per row, for the
largest TP rank (rank 0: the most heads and sequence positions):

* ``peak``: the peak of those bytes during the step;
* ``after fwd``: the bytes alive when the forward returns (what is kept for backward);
* ``planner``: :func:`tnlg.plan.memory.activation_bytes` ``total`` (kept + one layer's
  recomputation working set + embedding, final LayerNorm and fp32 logits);
* ``peak / planner``: the issue's check is that this stays within 15%.

Each shape runs twice: with dropout 0 (``F.scaled_dot_product_attention`` then runs its fused
flash kernel on CPU, as it does on GPUs: planner ``attention="fused"``) and with dropout 0.1 (on
CPU it then runs the math kernel, which keeps the ``a s^2`` softmax, mask and dropout output
that the paper's ``5 a s / h`` counts: planner ``attention="math"``). PyTorch's CPU dropout keeps
its masks in the activation dtype (4 bytes in fp32) where the formula, as CUDA's fused dropout,
counts one byte per element (two in its fp32 accounting), and its math attention keeps a scaled
copy of Q: the dropout rows therefore measure above the formula on CPUs.

``--fake-pg`` runs each TP size in one process as rank 0 of a fake process group (collectives
move nothing; shapes, allocations and the largest rank's memory are those of a real run), which
is how one GPU measures TP > 1 (``--device cuda``, also reporting ``torch.cuda.max_memory_allocated``).

    python scripts/bench_activation_memory.py                   # TP 1, 2 and 4 on CPU, about a minute
    python scripts/bench_activation_memory.py --device cuda     # one GPU, fake process groups
"""

from __future__ import annotations

import argparse

import _bench
import torch

from tnlg.config import GPTConfig
from tnlg.errors import UserError
from tnlg.model import GPT
from tnlg.plan.measure import tracked_step
from tnlg.plan.memory import activation_bytes
from tnlg.runtime.spawn import run_distributed

GRANULARITIES = (None, "selective", "full")
MiB = 2 ** 20


def make_config(a: dict, sp: bool, granularity, dropout: float) -> GPTConfig:
    return GPTConfig(num_layers=a["layers"], hidden_size=a["hidden"], num_attention_heads=a["heads"],
                     seq_length=a["seq"], vocab_size=a["vocab"], hidden_dropout=dropout,
                     attention_dropout=dropout, sequence_parallel=sp, recompute_granularity=granularity,
                     seed=a["seed"])


def measure(ps, a: dict) -> list[dict]:
    """Every (SP, granularity) row at this TP size, on this rank."""
    rows = []
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[a["dtype"]]
    dev = ps.device
    cuda = dev.type == "cuda"
    gen = torch.Generator().manual_seed(a["seed"])
    tokens = torch.randint(0, a["vocab"], (a["batch"], a["seq"]), generator=gen).to(dev)
    for dropout, sp, g in ((d, sp, g) for d in a["dropouts"]
                           for sp in ((False, True) if ps.tp_size > 1 else (False,)) for g in GRANULARITIES):
        cfg = make_config(a, sp, g, dropout)
        model = GPT(cfg, ps).to(dtype).train()
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        allocator_peak = None
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            model(tokens, labels=tokens).backward()  # warm-up: lazy initialisations are not activations
            if cuda:  # the allocator's own peak, in a step of its own (the tracker is slow)
                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                model(tokens, labels=tokens).backward()
                torch.cuda.synchronize()
                allocator_peak = torch.cuda.max_memory_allocated() - base
            tracker = tracked_step(model, tokens, tokens)
        # what SDPA runs: fused kernels on GPUs; on CPUs the math kernel when there is attention dropout
        kernel = "math" if dropout > 0 and not cuda else "fused"
        pred = activation_bytes(cfg, ps.tp_size, a["batch"], g, "fp32" if dtype == torch.float32 else "bf16",
                                sequence_parallel=sp, attention=kernel)
        rows.append(dict(tp=ps.tp_size, tp_rank=ps.tp_rank, dropout=dropout, attention=kernel,
                         sequence_parallel=sp, granularity=g or "none",
                         peak=tracker.peak, after_forward=tracker.marks["after_forward"], planner=pred["total"],
                         allocator_peak=allocator_peak,
                         planner_kept=pred["layers"] + pred["outside"], planner_detail=pred))
        del model
    return rows


def _fake_measure(tp: int, a: dict, device: str) -> list[dict]:
    """``measure`` as rank 0 of a fake TP group of ``tp`` in this process (collectives are no-ops)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from tnlg.parallel.state import ParallelState
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=tp)
    try:
        return measure(ParallelState(tp_rank=0, tp_size=tp, tp_group=dist.group.WORLD,
                                     device=torch.device(device)), a)
    finally:
        dist.destroy_process_group()


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", default="1,2,4", help="comma list of TP sizes (one process per rank)")
    _bench.add_shape_arguments(p, layers=8, hidden=256, heads=8, seq=256)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--vocab", type=int, default=128)
    p.add_argument("--dropouts", default="0,0.1", help="comma list of dropout probabilities (hidden and "
                   "attention)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cuda: one GPU, every TP size through a fake process group (implies --fake-pg)")
    p.add_argument("--fake-pg", action="store_true", help="one process per TP size, as rank 0 of a fake "
                   "process group (no communication), instead of TP gloo processes")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32",
                   help="bf16: bf16 parameters under bf16 autocast, as --bf16 training")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--json-out", default="runs/bench_activation_memory.json")
    args = p.parse_args(argv)
    try:
        args.tp = [int(t) for t in args.tp.split(",") if t]
        args.dropouts = [float(d) for d in args.dropouts.split(",") if d]
    except ValueError:
        raise UserError(f"--tp and --dropouts must be comma lists of numbers, got {args.tp!r}, "
                        f"{args.dropouts!r}.") from None
    if not args.dropouts or not all(0 <= d < 1 for d in args.dropouts):
        raise UserError(f"--dropouts must be probabilities in [0, 1), got {args.dropouts}.")
    for name in ("layers", "hidden", "heads", "seq", "batch", "vocab"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name} must be a positive integer, got {getattr(args, name)}.")
    if not args.tp or min(args.tp) < 1:
        raise UserError(f"--tp needs positive TP sizes, got {args.tp}.")
    return args


def format_table(report: dict) -> str:
    d = report["dims"]
    lines = [f"activation memory per rank (largest rank), {d['layers']} layers, hidden {d['hidden']}, "
             f"{d['heads']} heads, seq {d['seq']}, batch {d['batch']}, vocab {d['vocab']}, "
             f"{d['dtype']}; torch {report['torch']}; {report['gpu'] or 'CPU'}"
             f"{'; TP > 1 as rank 0 of a fake process group' if report['fake_pg'] else ''}",
             "| dropout (attention kernel) | TP | SP | recompute | peak MiB | after fwd MiB | planner MiB "
             "| peak / planner | SP saves (measured) | SP saves (planner) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    base = {(r["dropout"], r["tp"], r["granularity"]): r for r in report["rows"] if not r["sequence_parallel"]}
    for r in report["rows"]:
        save = save_p = "-"
        if r["sequence_parallel"]:
            off = base[(r["dropout"], r["tp"], r["granularity"])]
            save, save_p = f"{1 - r['peak'] / off['peak']:.0%}", f"{1 - r['planner'] / off['planner']:.0%}"
        alloc = "" if r.get("allocator_peak") is None else f" (allocator {r['allocator_peak'] / MiB:.1f})"
        lines.append(f"| {r['dropout']:g} ({r['attention']}) | {r['tp']} | {'on' if r['sequence_parallel'] else 'off'} "
                     f"| {r['granularity']} | {r['peak'] / MiB:.1f}{alloc} | {r['after_forward'] / MiB:.1f} | "
                     f"{r['planner'] / MiB:.1f} | {r['peak'] / r['planner']:.3f} | {save} | {save_p} |")
    for d in report["dims"]["dropouts"]:
        worst = max(abs(r["peak"] / r["planner"] - 1) for r in report["rows"] if r["dropout"] == d)
        lines.append(f"dropout {d:g}: largest deviation of the peak from the planner {worst:.1%} (target <= 15%)")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    a = {k: getattr(args, k) for k in ("layers", "hidden", "heads", "seq", "batch", "vocab", "dropouts",
                                       "dtype", "seed")}
    for tp in args.tp:
        try:
            make_config(a, True, None, 0.0).check_tensor_parallel(tp)
        except ValueError as exc:
            raise UserError(str(exc)) from None
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: no CUDA GPU is visible to this process.")
    rows = []
    from tnlg.parallel.state import ParallelState
    for tp in args.tp:
        if tp == 1:
            rows += measure(ParallelState.single(args.device), a)
        elif args.fake_pg or args.device == "cuda":
            rows += _fake_measure(tp, a, args.device)
        else:
            rows += [r for r in run_distributed(measure, tp, tp, a, timeout_s=600)[0]]
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else None
    report = dict(_bench.machine_info(device=args.device, gpu=gpu),
                  fake_pg=bool(args.fake_pg or args.device == "cuda"), dims=a, rows=rows,
                  formula="tnlg.plan.memory.activation_bytes (Korthikanti et al. 2022)")
    print(format_table(report))
    _bench.write_json(args.json_out, report)
    return 0


if __name__ == "__main__":
    _bench.run(main)
