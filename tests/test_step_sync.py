"""One host synchronisation per training iteration, and a NaN loss makes no update.

``train_step`` reads the iteration's loss together with the gradient norm (one device -> host
read, where there were two); a non-finite loss then stops the run without touching the
parameters, the Adam step count or the loss scaler.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

from tnlg.config import GPTConfig
from tnlg.model import GPT
from tnlg.optim import DynamicLossScaler, build_engine
from tnlg.parallel.loss import LossTerms
from tnlg.parallel.state import ParallelState
from tnlg.training.step import TrainingDiverged, train_step

# calls that read a device tensor on the host (a synchronisation on a GPU); the CPU-only target-id
# check reads host memory through int(), which is no device synchronisation and is not counted
DEVICE_READS = {"item", "tolist", "cpu", "numpy", "__float__", "__bool__"}


class _Reads(torch.overrides.TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in DEVICE_READS:
            self.calls.append(func.__name__)
        return func(*args, **(kwargs or {}))


def _batches(cfg, n):
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        t = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length), generator=g)
        out.append(dict(tokens=t, labels=t))
    return out


def test_one_host_read_per_iteration():
    ps = ParallelState.single()
    cfg = GPTConfig(num_layers=1, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=96)
    engine = build_engine(GPT(cfg, ps, device="meta"), ps, 1, grad_accum_steps=2)
    train_step(engine.model, engine, _batches(cfg, 2), 1e-3, autocast=None, ps=ps, iteration=1)  # warm-up
    with _Reads() as reads:
        loss, info = train_step(engine.model, engine, _batches(cfg, 2), 1e-3, autocast=None, ps=ps, iteration=2)
    assert reads.calls == ["tolist"], reads.calls
    assert math.isfinite(loss) and math.isfinite(info["grad_norm"]) and "loss" not in info


class _NaNLoss(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(4, 4))

    def forward(self, batch):  # the training step's protocol: a Batch in, its LossTerms out
        return LossTerms((self.w.sum() * float("nan")).float(), torch.tensor(1.0))


def test_nan_loss_stops_without_an_update():
    ps = ParallelState.single()
    scaler = DynamicLossScaler()
    engine = build_engine(_NaNLoss(), ps, 1, param_dtype=torch.bfloat16, loss_scaler=scaler)
    before, scale = engine.model.w.detach().clone(), scaler.scale
    with pytest.raises(TrainingDiverged, match="the training loss is nan at iteration 7"):
        zeros = torch.zeros(1, 2, dtype=torch.long)
        train_step(engine.model, engine, [dict(tokens=zeros, labels=zeros)], 1e-3,
                   autocast=None, ps=ps, iteration=7)
    assert torch.equal(engine.model.w.detach(), before)
    assert engine.num_steps == 0 and scaler.scale == scale
