"""Setup holds no transient copy of the model. Building the engine from a meta-device GPT
materialises each parameter straight into the flat buffers, so the process's peak resident memory
during setup is the final model states plus about one parameter's initial value (measured in a
fresh process whose glibc returns large freed blocks at once, so the peak is what was live)."""

import json
import os
import subprocess
import sys

import pytest

_SCRIPT = r"""
import contextlib, json, sys
import torch
from tnlg.config import GPTConfig
from tnlg.model import GPT
from tnlg.optim import build_engine
from tnlg.parallel.state import ParallelState
from tnlg.plan.tracker import StepTracker

def hwm():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmHWM"))

precision, stage, tracked = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "tracked"
cfg = GPTConfig(num_layers=8, hidden_size=512, num_attention_heads=8, seq_length=64, vocab_size=8192)
ps = ParallelState.single()
# warm up (kernels, the RNG, the allocator, the modules the tracker imports on first use) with a tiny engine
# before the baseline
with StepTracker() if tracked else contextlib.nullcontext():
    build_engine(GPT(GPTConfig(num_layers=1, hidden_size=16, num_attention_heads=2, seq_length=8, vocab_size=64),
                     ps, device="meta"), ps, stage, param_dtype=torch.bfloat16 if precision == "bf16" else None)
tracker = StepTracker() if tracked else None
before = hwm()
with tracker if tracked else contextlib.nullcontext(), tracker.phase("setup") if tracked else contextlib.nullcontext():
    model = GPT(cfg, ps, device="meta")
    engine = build_engine(model, ps, stage, param_dtype=torch.bfloat16 if precision == "bf16" else None)
peak = hwm() - before
rep = engine.memory_report()
largest = max(p.numel() for p in engine.model.parameters()) * 4  # its fp32 initial value
print(json.dumps(dict(peak=peak, states=rep["param_bytes"] + rep["grad_bytes"] + rep["optim_bytes"],
                      largest=largest, tracked=tracker.phases[0].peak if tracked else None)))
"""


def _setup(precision: str, stage: int, tracked: bool = False) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="65536")
    out = subprocess.run([sys.executable, "-c", _SCRIPT, precision, str(stage), "tracked" if tracked else "-"],
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


SLACK = 16 * 2**20  # interpreter and allocator noise (measured: under 2 MiB)


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads VmHWM from /proc (Linux)")
@pytest.mark.parametrize("precision,stage", [("fp32", 0), ("bf16", 0)])
def test_setup_peak_is_states_plus_one_parameter(precision, stage):
    r = _setup(precision, stage)
    slack = SLACK
    # a transient copy of the model (the real model, then the buffers) adds 4 bytes per parameter: measured
    # 562 MiB against 449 MiB of states here, where the meta build peaks at 450
    assert r["peak"] <= r["states"] + 2 * r["largest"] + slack, r


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads VmHWM from /proc (Linux)")
def test_tracked_setup_peak_is_what_the_process_allocated():
    """The simulation's setup phase is the memory a real setup takes: on real tensors (bf16, ZeRO-1) the
    tracker's setup peak is the process's resident peak, to the allocator's noise. It used to count the
    meta-device model's shapes too (4 bytes per parameter that no process holds)."""
    r = _setup("bf16", 1, tracked=True)
    assert abs(r["tracked"] - r["peak"]) <= SLACK, r
    assert r["states"] <= r["tracked"] <= r["states"] + r["largest"], r
