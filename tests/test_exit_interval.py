"""``--exit-interval N`` (Megatron-LM's): a run stops after each iteration divisible by N, saves it, and the same
options resumed go on exactly; the last stretch ends at --train-iters as an uninterrupted run does."""

from __future__ import annotations

import pytest

from tests.tiny import tiny_options
from tnlg import checkpoint as ck
from .pool import run_distributed


def _train(ps, o):
    from tnlg.training import train
    s = train(o)
    return s["losses"], s.get("exited"), s.get("interrupted")


def test_a_run_stops_at_each_multiple_saves_and_resumes_exactly(tmp_path):
    common = dict(train_iters=5, lr=3e-3, lr_warmup_iters=1, tensor_model_parallel_size=2, hidden_dropout=0.1)
    reference = run_distributed(_train, 2, 1, tiny_options(2, **common), timeout_s=180)[0]
    o = tiny_options(2, exit_interval=2, save=str(tmp_path / "run"), **common)
    pieces = []
    for stop in (2, 4, None):
        losses, exited, interrupted = run_distributed(_train, 2, 1, o, timeout_s=180)[0]
        assert interrupted is None
        assert (exited and exited["iteration"]) == stop and (stop is None or exited["saved"]), exited
        pieces += losses
        if stop is not None:
            assert ck.list_iterations(str(tmp_path / "run"))[-1] == stop
    assert len(pieces) == 5 and pieces == reference[0]


def test_exit_interval_must_be_positive():
    from tnlg.errors import UserError
    with pytest.raises(UserError, match=r"--exit-interval must be a positive integer, got 0"):
        tiny_options(1, train_iters=2, exit_interval=0)
