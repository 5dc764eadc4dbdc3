#!/usr/bin/env python
"""Pipeline bubble and activation memory per stage, measured, against the planner (``tnlg.plan.pipeline``).

tnlg's pipeline (:class:`tnlg.model.stage.StageModel` under :class:`tnlg.parallel.pipeline_schedule.
Pipeline`, i.e. torch's ``Schedule1F1B`` / ``ScheduleInterleaved1F1B``) runs a GPT whose step is
compute-bound on a CPU (16 layers, hidden 256, 8 heads, seq 256, vocab 128: the embedding and LM head
are cheap, every stage costs the same) on gloo processes with one thread each, at every layout of
``--layouts`` (PP 4 with 1F1B, PP 4 interleaved with 2 chunks of 1 layer per rank, PP 2 x TP 2, PP 2
on 2 processes) and ``m`` = 4, 8, 16 micro batches per step.

**Bubble.** Every forward and backward of a chunk (torch's ``PipelineStage.forward_one_chunk`` and
``backward_one_chunk``) is timed on each rank, by the wall clock and by the thread's CPU time. Two
measurements of the idle fraction of a step, averaged over the pipeline ranks:

* ``wall``: ``1 - busy / step`` with the wall-clock busy time of a rank and the step's wall time
  (the slowest rank's). Only meaningful when each rank has a core of its own;
* ``replay``: the ranks' operations in the order each one ran them, each lasting its measured CPU
  time, replayed with the pipeline's dependencies (a chunk's forward of micro batch ``j`` after the
  previous chunk's, its backward after the next chunk's) as if every rank had its own core; the
  bubble is ``1 - busy / makespan`` of that replay. CPU time does not grow when processes share a
  core, so this is the bubble a machine with a core per rank would see (point-to-point time left
  out: a few hundred microseconds per send here, against tens of milliseconds of compute per op).

Both are compared with ``(P - 1) / (v m + P - 1)`` (:func:`tnlg.plan.pipeline.bubble_fraction`).

**Memory.** One more step per layout at ``m = 8`` runs under :class:`tnlg.plan.measure.AllocationTracker`
(every tensor the step creates, until freed; parameter gradients and torch's receive buffers exist
from the warm-up steps, so what is counted is activations and temporaries): its peak per pipeline
rank against the planner's activations in flight for that rank (``pipeline_plan(...)["stages"][i]
["activations"]``, fp32, the fused attention kernel the CPU runs without dropout). The receive buffers
are measured separately (the bytes of the buffers torch's stages hold) against the planner's.

    python scripts/bench_pipeline.py                   # all layouts, a few minutes on 2 cores
    python scripts/bench_pipeline.py --layouts pp4 --micro-batches 4,8
"""

from __future__ import annotations

import argparse
import os
import time

import _bench
import torch
import torch.distributed as dist

from tnlg.config import GPTConfig
from tnlg.errors import UserError
from tnlg.model.stage import StageModel
from tnlg.parallel.pipeline import chunk_layers
from tnlg.parallel.state import init_parallel
from tnlg.plan.measure import AllocationTracker
from tnlg.plan.pipeline import bubble_fraction, pipeline_plan
from tnlg.runtime.spawn import run_distributed

# name -> (processes, PP, TP, schedule, chunks per rank)
LAYOUTS = {"pp4": (4, 4, 1, "1f1b", 1), "pp4-interleaved": (4, 4, 1, "interleaved", 2),
           "pp2xtp2": (4, 2, 2, "1f1b", 1), "pp2": (2, 2, 1, "1f1b", 1)}
MiB = 2 ** 20


def _instrument(events: list) -> None:
    """Time every chunk forward and backward of torch's pipeline stages in this process (the bench's own
    processes only): appends ``(kind, chunk, micro batch, wall start, wall end, CPU seconds)``."""
    from torch.distributed.pipelining.stage import _PipelineStageBase

    def timed(kind, method):
        def run(self, mb, *args, **kwargs):
            w0, c0 = time.perf_counter(), time.thread_time()
            out = method(self, mb, *args, **kwargs)
            events.append((kind, self.stage_index, mb, w0, time.perf_counter(), time.thread_time() - c0))
            return out
        return run
    _PipelineStageBase.forward_one_chunk = timed("F", _PipelineStageBase.forward_one_chunk)
    _PipelineStageBase.backward_one_chunk = timed("B", _PipelineStageBase.backward_one_chunk)


def _measure(_ps, cfg_dict: dict, layout: tuple, micro_batches: list, steps: int, memory_m: int) -> dict:
    from tnlg.parallel.pipeline_schedule import Pipeline
    _, pp, tp, schedule, virtual = layout
    ps = init_parallel(tp, pipeline_parallel_size=pp)
    cfg = GPTConfig(**cfg_dict)
    chunks = chunk_layers(cfg.num_layers, pp, virtual)[ps.pp_rank::pp]
    model = StageModel(cfg, ps, chunks)
    events: list = []
    _instrument(events)
    gen = torch.Generator().manual_seed(1234)
    out = dict(pp_rank=ps.pp_rank, tp_rank=ps.tp_rank, timing={})
    for m in micro_batches:
        pipe, batches = Pipeline(model, m, schedule), _batches(cfg, m, gen)
        runs = []
        for step in range(steps + 1):  # the first step is the warm-up (torch sets up its buffers)
            start, end = _step(model, pipe, batches, m, events)
            if step:
                runs.append(dict(start=start, end=end, events=list(events)))
        out["timing"][m] = runs
    pipe, batches = Pipeline(model, memory_m, schedule), _batches(cfg, memory_m, gen)
    _step(model, pipe, batches, memory_m, events)  # warm-up: gradients and receive buffers exist after it
    tracker = AllocationTracker()
    _step(model, pipe, batches, memory_m, events, tracker)
    out["memory"] = dict(m=memory_m, peak=tracker.peak, buffers=_receive_buffer_bytes(pipe))
    return out


def _batches(cfg: GPTConfig, m: int, gen: torch.Generator) -> list[dict]:
    tokens = torch.randint(0, cfg.vocab_size, (m, 1, cfg.seq_length + 1), generator=gen)
    return [dict(tokens=t[:, :-1], labels=t[:, 1:]) for t in tokens]


def _step(model, pipe, batches: list, m: int, events: list, tracker=None) -> tuple[float, float]:
    """One step of every rank from a common start (a barrier); its wall start and end on this rank."""
    for p in model.parameters():
        if p.grad is not None:
            p.grad.zero_()  # in place: the gradients stay allocated, as an engine's buffers
    del events[:]
    dist.barrier()
    start = time.perf_counter()
    if tracker is None:
        pipe.run(batches, 1.0 / m)
    else:
        with tracker:
            pipe.run(batches, 1.0 / m)
    return start, time.perf_counter()


def _receive_buffer_bytes(pipe) -> int:
    """Bytes of the receive buffers torch's stages of this rank hold (activations and their gradients)."""
    stages = getattr(pipe.schedule, "_stages", None) or [pipe.schedule._stage]
    total = 0
    for stage in stages:
        for infos in list(stage.args_recv_info.values()) + list(stage.grad_recv_info.values()):
            total += sum(i.buffer.numel() * i.buffer.element_size() for i in infos
                         if getattr(i, "buffer", None) is not None)
    return total


def _replay(ops_by_rank: dict, n_chunks: int) -> tuple[float, dict]:
    """Makespan of the ranks' ops in their executed order, each its CPU time, with the pipeline's
    dependencies; and each rank's busy seconds."""
    done, clock, idx = {}, {r: 0.0 for r in ops_by_rank}, {r: 0 for r in ops_by_rank}
    progress = True
    while progress:
        progress = False
        for r, ops in ops_by_rank.items():
            while idx[r] < len(ops):
                kind, chunk, mb, cpu = ops[idx[r]]
                dep = (("F", chunk - 1, mb) if chunk > 0 else None) if kind == "F" else \
                    (("B", chunk + 1, mb) if chunk < n_chunks - 1 else ("F", chunk, mb))
                if dep is not None and dep not in done:
                    break
                start = max(clock[r], done[dep] if dep is not None else 0.0)
                done[(kind, chunk, mb)] = clock[r] = start + cpu
                idx[r] += 1
                progress = True
    if any(idx[r] < len(ops) for r, ops in ops_by_rank.items()):
        raise RuntimeError("the replay deadlocked: the recorded order breaks the pipeline's dependencies")
    return max(clock.values()), {r: sum(o[3] for o in ops) for r, ops in ops_by_rank.items()}


def _bubbles(per_rank: list, m: int, n_chunks: int) -> dict:
    """Wall-clock and replayed bubble of every timed step at ``m`` micro batches, averaged over steps."""
    wall, replay = [], []
    for step in range(len(per_rank[0]["timing"][m])):
        runs = [r["timing"][m][step] for r in per_rank]
        span = max(x["end"] for x in runs) - min(x["start"] for x in runs)
        # a pipeline rank is its TP group: an op lasts as long as its slowest TP rank's
        ops: dict = {}
        for r, x in zip(per_rank, runs):
            ops.setdefault(r["pp_rank"], []).append(x)
        wall.append(sum(1 - sum(e[4] - e[3] for e in xs[0]["events"]) / span for xs in ops.values()) / len(ops))
        merged = {pr: [(e[0], e[1], e[2], max(x["events"][k][5] for x in xs)) for k, e in enumerate(xs[0]["events"])]
                  for pr, xs in ops.items()}
        makespan, busy = _replay(merged, n_chunks)
        replay.append(sum(1 - b / makespan for b in busy.values()) / len(busy))
    return dict(wall=sum(wall) / len(wall), replay=sum(replay) / len(replay), step_s=span)


def _memory_rows(per_rank: list, cfg: GPTConfig, layout: tuple) -> list[dict]:
    _, pp, tp, schedule, virtual = layout
    m = per_rank[0]["memory"]["m"]
    plan = pipeline_plan(cfg, tp, pp, 1, 0, "fp32", 1, m, None, schedule, virtual, attention="fused")
    rows = []
    for r in per_rank:
        if r["tp_rank"]:
            continue
        s = plan["stages"][r["pp_rank"]]
        rows.append(dict(stage=r["pp_rank"], m=m, in_flight=s["in_flight"], peak=r["memory"]["peak"],
                         planner=s["activations"], buffers=r["memory"]["buffers"], planner_buffers=s["buffers"]))
    return rows


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma list of {', '.join(LAYOUTS)}")
    _bench.add_shape_arguments(p, layers=16, hidden=256, heads=8, seq=256)
    p.add_argument("--micro-batches", default="4,8,16", help="comma list of micro batches per step")
    p.add_argument("--steps", type=int, default=2, help="timed steps per (layout, m), after one warm-up")
    p.add_argument("--memory-m", type=int, default=8, help="micro batches of the step whose memory is tracked")
    p.add_argument("--json-out", default="runs/bench_pipeline.json")
    args = p.parse_args(argv)
    args.layouts = [x for x in args.layouts.split(",") if x]
    bad = [x for x in args.layouts if x not in LAYOUTS]
    try:
        args.micro_batches = [int(x) for x in args.micro_batches.split(",") if x]
    except ValueError:
        raise UserError(f"--micro-batches must be a comma list of integers, got {args.micro_batches!r}.") from None
    if bad or not args.layouts:
        raise UserError(f"--layouts {bad or args.layouts}: valid layouts are {', '.join(LAYOUTS)}.")
    if not args.micro_batches or min(args.micro_batches + [args.memory_m]) < 4 or args.steps < 1:
        raise UserError(f"--micro-batches and --memory-m need at least 4 micro batches (the stages of PP 4), and "
                        f"--steps at least 1; got {args.micro_batches}, {args.memory_m}, {args.steps}.")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    cfg = GPTConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                    seq_length=args.seq, vocab_size=128, hidden_dropout=0.0, attention_dropout=0.0)
    for name in args.layouts:
        _, pp, tp, _, v = LAYOUTS[name]
        if cfg.num_layers % (pp * v) or cfg.num_attention_heads % tp:
            raise UserError(f"layout {name} needs --layers divisible by {pp * v} and --heads by {tp}.")
    load = os.getloadavg()[0]
    print(f"GPT {cfg.num_layers} layers, hidden {cfg.hidden_size}, {cfg.num_attention_heads} heads, seq "
          f"{cfg.seq_length}, vocab 128, micro batch 1, fp32; torch {torch.__version__}; {_bench.cpu_name()}, "
          f"{os.cpu_count()} CPUs, 1 thread per rank, load average {load:.1f} at the start")
    if os.cpu_count() < 4:
        print(f"note: the 4-process layouts put 4 ranks on {os.cpu_count()} cores: while more ranks compute than "
              f"there are cores each runs slower, so the wall-clock bubble is distorted (ranks idle in the bubble "
              f"leave their core to the others and the busy ones speed up); 'replay' rebuilds the step from each "
              f"op's CPU time, which sharing does not change")
    record = dict(_bench.machine_info(model=cfg.to_dict(), load_average_start=load), bubble=[], memory=[])
    for name in args.layouts:
        layout = LAYOUTS[name]
        procs, pp, tp, schedule, v = layout
        t0 = time.time()
        per_rank = run_distributed(_measure, procs, 1, cfg.to_dict(), layout, args.micro_batches, args.steps,
                                   args.memory_m, timeout_s=900)
        for m in args.micro_batches:
            b = _bubbles(per_rank, m, pp * v)
            record["bubble"].append(dict(layout=name, processes=procs, pp=pp, tp=tp, schedule=schedule, virtual=v,
                                         m=m, formula=bubble_fraction(pp, m, v), **b))
        record["memory"] += [dict(layout=name, **row) for row in _memory_rows(per_rank, cfg, layout)]
        print(f"  {name}: {time.time() - t0:.0f} s")
    record["load_average_end"] = os.getloadavg()[0]
    print(format_tables(record))
    _bench.write_json(args.json_out, record)
    return 0


def format_tables(record: dict) -> str:
    lines = ["", "| layout | processes | schedule | m | bubble (P-1)/(vm+P-1) | measured: replay | measured: wall | "
                 "replay - formula | step s (wall) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in record["bubble"]:
        sched = r["schedule"] + (f", v = {r['virtual']}" if r["virtual"] > 1 else "")
        lines.append(f"| PP {r['pp']} x TP {r['tp']} | {r['processes']} | {sched} | {r['m']} | {r['formula']:.3f} | "
                     f"{r['replay']:.3f} | {r['wall']:.3f} | {r['replay'] - r['formula']:+.3f} | {r['step_s']:.2f} |")
    lines += ["", "| layout | stage | in flight (planner) | peak activations MiB | planner MiB | peak / planner | "
                  "receive buffers MiB | planner MiB |", "|---|---|---|---|---|---|---|---|"]
    for r in record["memory"]:
        lines.append(f"| {r['layout']} | {r['stage']} | {r['in_flight']} | {r['peak'] / MiB:.1f} | "
                     f"{r['planner'] / MiB:.1f} | {r['peak'] / r['planner']:.3f} | {r['buffers'] / MiB:.2f} | "
                     f"{r['planner_buffers'] / MiB:.2f} |")
    worst = max((abs(r["replay"] - r["formula"]) for r in record["bubble"]), default=0)
    mem = max((abs(r["peak"] / r["planner"] - 1) for r in record["memory"]), default=0)
    lines.append(f"largest |replayed bubble - formula| {worst:.3f} (target 0.05); largest |peak / planner - 1| "
                 f"{mem:.1%} (target 15%)")
    return "\n".join(lines)


if __name__ == "__main__":
    _bench.run(main)
