"""The engine's bytes at T-NLG scale equal the planner's (meta device, fake process group).

The engine (our flat ZeRO 0/1 buffers, FSDP2 for 2/3) is built for ``tnlg-17b`` on the meta
device in a process whose default group is torch's fake backend with the real world size, so
every group, shard and buffer has its true size and nothing is allocated. Its
``memory_report()`` (read off the buffers it allocated) must equal ``tnlg plan``'s model
states within 0.5%, per category. Each layout runs in a subprocess (the fake default group
must not leak into other tests).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tnlg.config import GPTConfig
from tnlg.plan.planner import Hardware, Layout, Model, plan_layout

CASES = [  # (tp, dp, zero, precision, grads_fp32)
    (4, 64, 1, "fp16", False),   # T-NLG's own recipe
    (8, 32, 1, "bf16", False),
    (16, 16, 0, "fp16", False),
    (4, 64, 2, "bf16", False),
    (4, 64, 3, "bf16", False),
    (4, 64, 1, "bf16", True),    # --accumulate-allreduce-grads-in-fp32
    (4, 64, 1, "fp32", False),
]

_SCRIPT = r"""
import dataclasses, json, sys
import torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from tnlg.config import GPTConfig
from tnlg.model import GPT
from tnlg.optim import build_engine
from tnlg.parallel.state import init_parallel
tp, dp, zero, precision, grads_fp32 = json.loads(sys.argv[1])
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=tp * dp)
ps = dataclasses.replace(init_parallel(tp), device=torch.device("meta"))
dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": None}[precision]
model = GPT(GPTConfig.preset("tnlg-17b"), ps, device="meta")
engine = build_engine(model, ps, zero, param_dtype=dtype, accumulate_grads_in_fp32=grads_fp32)
rep = engine.memory_report()
assert all(p.device.type == "meta" for p in engine.model.parameters())
print(json.dumps({k: rep[k] for k in ("param_bytes", "grad_bytes", "optim_bytes")}))
"""


def _engine_bytes(case) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", _SCRIPT, json.dumps(case)], capture_output=True, text=True,
                         timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", CASES, ids=[f"tp{c[0]}-dp{c[1]}-zero{c[2]}-{c[3]}{'-fp32grads' if c[4] else ''}"
                                             for c in CASES])
def test_engine_bytes_equal_planner_at_tnlg_17b(case):
    tp, dp, zero, precision, grads_fp32 = case
    got = _engine_bytes(case)
    plan = plan_layout(Model("tnlg-17b", GPTConfig.preset("tnlg-17b")),
                       Layout(tp=tp, dp=dp, zero_stage=zero, precision=precision, grads_fp32=grads_fp32),
                       Hardware())["memory"]
    for ours, theirs in (("param_bytes", "params"), ("grad_bytes", "grads"), ("optim_bytes", "optimizer")):
        assert got[ours] == pytest.approx(plan[theirs], rel=0.005), \
            f"{ours}: engine {got[ours] / 1e9:.3f} GB vs planner {plan[theirs] / 1e9:.3f} GB"
    total = sum(got.values())
    assert total == pytest.approx(plan["model_states"], rel=0.005)
