"""Dynamic loss scaler: growth, backoff with hysteresis, and skipped steps on injected inf/NaN."""

import math

import pytest
import torch
import torch.nn as nn

from tnlg.errors import UserError
from tnlg.optim import DynamicLossScaler, build_engine
from tnlg.optim.scaler import found_inf_or_nan
from tnlg.parallel.state import ParallelState


def test_growth_every_interval_good_steps():
    s = DynamicLossScaler(initial_scale=2.0 ** 10, growth_interval=3, hysteresis=1)
    for _ in range(2):
        s.update(False)
    assert s.scale == 2.0 ** 10
    s.update(False)
    assert s.scale == 2.0 ** 11
    for _ in range(3):
        s.update(False)
    assert s.scale == 2.0 ** 12


def test_backoff_hysteresis_and_min_scale():
    s = DynamicLossScaler(initial_scale=8.0, min_scale=2.0, growth_interval=2, hysteresis=2)
    s.update(True)                 # first overflow: hysteresis absorbs it
    assert s.scale == 8.0
    s.update(True)                 # second: halve
    assert s.scale == 4.0
    s.update(True)                 # budget stays exhausted until growth: halve again
    assert s.scale == 2.0
    s.update(True)
    assert s.scale == 2.0          # floor
    s.update(False)
    s.update(True)                 # an overflow resets the growth counter
    s.update(False)
    assert s.scale == 2.0
    s.update(False)
    assert s.scale == 4.0          # two consecutive good steps -> growth, hysteresis refilled
    s.update(True)
    assert s.scale == 4.0


def test_state_dict_round_trip_and_errors():
    s = DynamicLossScaler(initial_scale=16.0, growth_interval=5)
    s.update(True)
    s.update(False)
    t = DynamicLossScaler()
    t.load_state_dict(s.state_dict())
    assert t.state_dict() == s.state_dict()
    for kw in (dict(initial_scale=0), dict(min_scale=-1), dict(growth_interval=0), dict(hysteresis=0),
               dict(backoff_factor=1.0), dict(growth_factor=1.0)):
        with pytest.raises(UserError):
            DynamicLossScaler(**kw)


def test_found_inf_or_nan():
    assert not found_inf_or_nan([torch.ones(3), None, torch.empty(0)])
    assert found_inf_or_nan([torch.ones(3), torch.tensor([1.0, float("inf")])])
    assert found_inf_or_nan([torch.tensor([float("nan")])])


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w = nn.Parameter(torch.randn(4, 3, generator=g))
        self.b = nn.Parameter(torch.randn(4, generator=g))

    def forward(self, x):
        return ((x @ self.w.t() + self.b) ** 2).mean()


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
@pytest.mark.parametrize("stage", [0, 1])
def test_engine_skips_step_and_backs_off_on_injected_bad_grad(bad, stage):
    ps = ParallelState.single()
    x = torch.randn(5, 3, generator=torch.Generator().manual_seed(1))
    scaler = DynamicLossScaler(initial_scale=2.0 ** 16, growth_interval=2, hysteresis=1)
    engine = build_engine(Tiny(), ps, stage, lr=1e-2, loss_scaler=scaler)
    before = {n: t.clone() for n, t in engine.model_state_by_param().items()}
    engine.backward(engine.model(x))
    engine.model.w.grad[1, 2] = bad            # injected overflow
    info = engine.step()
    assert info["skipped"] and not math.isfinite(info["grad_norm"])
    assert scaler.scale == 2.0 ** 15 and engine.num_steps == 0
    for n, t in engine.model_state_by_param().items():
        assert torch.equal(t, before[n]), n
    for _ in range(2):                         # good steps: update, then growth after 2
        engine.zero_grad()
        engine.backward(engine.model(x))
        info = engine.step()
        assert not info["skipped"]
    assert engine.num_steps == 2 and scaler.scale == 2.0 ** 16


def test_scaled_step_equals_unscaled_step():
    """Scales are powers of two: unscaling is exact, so the update is bit-identical."""
    ps = ParallelState.single()
    x = torch.randn(5, 3, generator=torch.Generator().manual_seed(1))
    results = []
    for scaler in (None, DynamicLossScaler(initial_scale=2.0 ** 20)):
        engine = build_engine(Tiny(), ps, 1, lr=1e-2, weight_decay=0.1, clip_grad=0.5, loss_scaler=scaler)
        engine.backward(engine.model(x))
        info = engine.step()
        results.append((info["grad_norm"], engine.model_state_by_param()))
    assert results[0][0] == results[1][0]
    for n, t in results[0][1].items():
        assert torch.equal(t, results[1][1][n]), n
