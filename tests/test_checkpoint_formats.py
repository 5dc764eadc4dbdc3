"""Checkpoints of format 1 (tnlg 0.1: whole per-TP-rank moments, fp32 weights) still load.

``tests/fixtures/checkpoint_v1`` was written by tnlg 0.1 (commit 08415ef) after 3 ZeRO-1 steps of a
tiny GPT. It must load into today's engine at any DP size and stage, with weights, moments and the
step count equal to what its files hold (read here independently with ``safetensors``).
"""

from __future__ import annotations

import os

import pytest
import torch

from tnlg import checkpoint as ck
from tnlg.config import GPTConfig
from .pool import run_distributed

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "checkpoint_v1")


def _expected():
    from safetensors.torch import load_file
    d = os.path.join(FIXTURE, "iter_0000003")
    return load_file(os.path.join(d, "model_tp00.safetensors")), load_file(os.path.join(d, "optim_tp00.safetensors"))


def _load_body(ps, stage):
    from tnlg.model import GPT
    from tnlg.optim import build_engine
    cfg = GPTConfig.from_dict(ck.read_meta(ck.resolve(FIXTURE))["config"])
    engine = build_engine(GPT(cfg, ps, device="meta"), ps, stage)
    state = ck.load(FIXTURE, model=engine.model, engine=engine, ps=ps, config=cfg)
    params = engine.model_state_by_param()
    moments = engine.optimizer_state_by_param()
    return dict(iteration=state["iteration"], steps=engine.num_steps, params=params, moments=moments)


@pytest.mark.parametrize("world,stage", [(1, 0), (2, 1), (2, 3)])
def test_format1_checkpoint_loads(world, stage):
    assert ck.read_meta(ck.resolve(FIXTURE))["format"] == "tnlg.checkpoint/1"
    got = run_distributed(_load_body, world, 1, stage, timeout_s=120)[0]
    weights, optim = _expected()
    assert got["iteration"] == 3 and got["steps"] == 3
    for name, t in weights.items():
        assert torch.equal(got["params"][name], t), name
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(got["moments"][name][k], optim[f"{name}.{k}"]), (name, k)
