"""GPU checks of issue 15 items 5, 10 and 11 (one short run on a CUDA machine).

(a) the MFU peak (``tnlg.train.measure_peak_tflops``) in bf16 and fp32, five times each: its spread;
(b) ``tnlg.hardware.check_bf16("cuda")`` accepts a GPU with bf16 tensor cores;
(c) the NCCL flight recorder switched on by ``tnlg.hang.enable_flight_recorder`` records collectives
    (a one-rank NCCL group; the recorder's trace is read back with torch's dump function), and the
    peak measured under a process group (barrier path) on NCCL;
(d) ``tnlg pretrain`` on the GPU, bf16 with recomputation: the start line, the flight-recorder note and
    the log line's model TFLOP/s, MFU and HFU (run as a subprocess; its output is printed).

    python scripts/gpu_check_issue15.py [--out DIR]

Seen on one H200 (torch 2.11, 2026-11-30): peak bf16 751, 693, 691, 688, 685 TFLOP/s (1.10x spread,
the first the highest), fp32 51.2-51.3 (1.001x); the flight recorder held 14 entries; the
pretrain log line read "0.504 model TFLOP/s/rank | MFU 0.1% HFU 0.1% of 750.170" (the built-in
1.3M-parameter model is far too small for a GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=tempfile.mkdtemp(prefix="gpu_check_issue15_"))
    ap.add_argument("--iters", type=int, default=40)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    import torch
    from tnlg.hang import enable_flight_recorder
    from tnlg.hardware import check_bf16
    from tnlg.train import measure_peak_tflops

    res: dict = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(),
                 "capability": torch.cuda.get_device_capability()}
    dev = torch.device("cuda")
    for name, dt in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        vals, secs = [], []
        for _ in range(5):
            t = time.perf_counter()
            vals.append(measure_peak_tflops(dt, dev))
            secs.append(time.perf_counter() - t)
        res[f"a_peak_{name}"] = dict(tflops=vals, spread=max(vals) / min(vals), seconds=secs)
        print(f"(a) peak {name}: {[round(v, 1) for v in vals]} TFLOP/s, spread {max(vals) / min(vals):.3f}x, "
              f"{statistics.median(secs):.2f} s each", flush=True)
    check_bf16("cuda")
    res["b_check_bf16_cuda"] = "accepted"
    print("(b) check_bf16('cuda'): accepted", flush=True)

    prefix = enable_flight_recorder(os.path.join(args.out, "comm_trace"))
    import torch.distributed as dist
    store = dist.FileStore(os.path.join(args.out, "store"), 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=torch.device("cuda", 0))
    x = torch.ones(1024, device=dev)
    for _ in range(3):
        dist.all_reduce(x)
    peak_pg = measure_peak_tflops(torch.bfloat16, dev)
    torch.cuda.synchronize()
    entries = None
    try:
        from torch._C._distributed_c10d import _dump_nccl_trace
        trace = pickle.loads(_dump_nccl_trace())
        entries = [e.get("profiling_name") for e in trace.get("entries", [])]
    except Exception as exc:  # noqa: BLE001
        entries = f"dump failed: {exc!r}"
    dist.destroy_process_group()
    res["c_flight_recorder"] = dict(prefix=prefix, env={k: os.environ.get(k) for k in (
        "TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_NCCL_DUMP_ON_TIMEOUT",
        "TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")},
        entries=entries, peak_bf16_under_nccl_group=peak_pg)
    print(f"(c) flight recorder at {prefix}: {entries if isinstance(entries, str) else len(entries)} entries "
          f"({entries[:6] if isinstance(entries, list) else ''}); peak under a NCCL group {peak_pg:.1f} TFLOP/s",
          flush=True)

    env = dict(os.environ, TNLG_CACHE=os.path.join(args.out, "cache"), PYTHONUNBUFFERED="1")
    for k in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_NCCL_DUMP_ON_TIMEOUT",
              "TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"):
        env.pop(k, None)
    cmd = [sys.executable, "-m", "tnlg", "pretrain", "--nproc-per-node", "1", "--tensor-model-parallel-size", "1",
           "--bf16", "--recompute-activations", "--train-iters", str(args.iters), "--log-interval", "10",
           "--eval-interval", "0", "--no-plot", "--sample-tokens", "0", "--save", os.path.join(args.out, "run")]
    t = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))), timeout=400)
    res["d_pretrain"] = dict(exit=p.returncode, seconds=time.perf_counter() - t, stdout=p.stdout[-4000:],
                             stderr=p.stderr[-3000:])
    print(f"(d) tnlg pretrain on the GPU: exit {p.returncode} in {time.perf_counter() - t:.0f} s\n"
          f"{p.stdout[-2500:]}\n{p.stderr[-1500:]}", flush=True)
    with open(os.path.join(args.out, "gpu_check_issue15.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)
    return 0 if p.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
