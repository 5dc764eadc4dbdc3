"""Megatron's LR schedule: warmup, cosine / linear / constant decay, min-lr floor, errors."""

import math

import pytest

from tnlg.errors import UserError
from tnlg.optim import LRSchedule


def test_warmup_is_linear_from_init_lr_and_starts_at_zero():
    s = LRSchedule(max_lr=1e-3, min_lr=1e-5, warmup_iters=10, decay_iters=100)
    assert s.lr(0) == 0.0  # Megatron: the first update of a warmup run uses lr 0
    assert s.lr(5) == pytest.approx(5e-4)
    assert s.lr(10) == pytest.approx(1e-3)
    s2 = LRSchedule(max_lr=1e-3, warmup_iters=10, decay_iters=100, init_lr=1e-4)
    assert s2.lr(0) == pytest.approx(1e-4) and s2.lr(5) == pytest.approx(1e-4 + 0.5 * 9e-4)


@pytest.mark.parametrize("style", ["cosine", "linear"])
def test_decay_reaches_min_lr_at_decay_iters_and_stays(style):
    s = LRSchedule(max_lr=1e-3, min_lr=1e-5, warmup_iters=10, decay_iters=110, decay_style=style)
    assert s.lr(110) == pytest.approx(1e-5)
    assert s.lr(111) == 1e-5 and s.lr(10_000) == 1e-5
    mid = s.lr(60)  # halfway through decay: both styles give the mean of max and min
    assert mid == pytest.approx((1e-3 + 1e-5) / 2)
    quarter = s.lr(35)
    expected = (0.5 * (math.cos(math.pi * 0.25) + 1) if style == "cosine" else 0.75) * (1e-3 - 1e-5) + 1e-5
    assert quarter == pytest.approx(expected)
    values = [s.lr(n) for n in range(10, 112)]
    assert all(a >= b for a, b in zip(values, values[1:]))  # monotone after warmup


def test_constant_keeps_max_lr_after_warmup_even_past_decay_iters():
    s = LRSchedule(max_lr=3e-4, min_lr=1e-5, warmup_iters=4, decay_iters=10, decay_style="constant")
    assert s.lr(2) == pytest.approx(1.5e-4)
    assert s.lr(4) == s.lr(9) == s.lr(500) == 3e-4


def test_no_warmup_and_inverse_square_root():
    s = LRSchedule(max_lr=1e-3, min_lr=0.0, warmup_iters=0, decay_iters=100)
    assert s.lr(0) == 1e-3
    r = LRSchedule(max_lr=1e-3, min_lr=1e-5, warmup_iters=100, decay_iters=1000,
                   decay_style="inverse-square-root")
    assert r.lr(400) == pytest.approx(1e-3 * (100 / 400) ** 0.5)


def test_tnlg_recipe_values():
    # T-NLG: peak 1.5e-4, 3200 linear warmup steps, cosine decay over 500k steps
    s = LRSchedule(max_lr=1.5e-4, min_lr=0.0, warmup_iters=3200, decay_iters=500_000)
    assert s.lr(1600) == pytest.approx(0.75e-4)
    assert s.lr(3200 + (500_000 - 3200) // 2) == pytest.approx(0.75e-4, rel=1e-5)


@pytest.mark.parametrize("kwargs", [
    dict(max_lr=1e-3, decay_style="exponential"),
    dict(max_lr=1e-3, min_lr=2e-3),
    dict(max_lr=-1.0),
    dict(max_lr=1e-3, warmup_iters=100, decay_iters=100),
    dict(max_lr=1e-3, warmup_iters=-1),
    dict(max_lr=1e-3, decay_iters=0),
    dict(max_lr=1e-3, init_lr=2e-3),
])
def test_invalid_settings_are_user_errors(kwargs):
    with pytest.raises(UserError):
        LRSchedule(**kwargs)
