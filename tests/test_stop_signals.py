"""A stop signal that reaches one rank only, in the training loop itself (2 gloo processes).

A real SIGINT, raised in rank 1 alone, while it starts up or trains: both ranks agree on where to stop
(one MAX all-reduce per iteration), save that iteration together when there is one, and report the same.
"""

from __future__ import annotations

import os
import signal

from tests.tiny import tiny_options
from tnlg import checkpoint as ck
from tnlg.runtime.spawn import run_distributed


def _options(save, **over):
    return tiny_options(2, **{**dict(train_iters=50, log_interval=100, save=str(save)), **over})


def _signalled_body(ps, o, when):
    """Train with SIGINT raised in rank 1 only: during start-up (``when`` 0) or after iteration ``when``."""
    import tnlg.training.loop as loop
    build_datasets, train_step = loop.build_datasets, loop.train_step

    def signal_at_start(*args, **kwargs):
        if ps.rank == 1 and when == 0:
            signal.raise_signal(signal.SIGINT)
        return build_datasets(*args, **kwargs)

    def signal_after(*args, iteration, **kwargs):
        out = train_step(*args, iteration=iteration, **kwargs)
        if ps.rank == 1 and iteration == when:
            signal.raise_signal(signal.SIGINT)
        return out

    loop.build_datasets, loop.train_step = signal_at_start, signal_after
    summary = loop.train(o)
    return dict(interrupted=summary.get("interrupted"), iterations=len(summary["losses"]))


def test_a_ctrl_c_on_one_rank_during_training_saves_that_iteration_on_all(tmp_path):
    results = run_distributed(_signalled_body, 2, 1, _options(tmp_path / "ckpt"), 3, timeout_s=180)
    for r in results:
        assert r == dict(interrupted=dict(signal="SIGINT", iteration=3, saved=True, forced=False), iterations=3)
    assert ck.list_iterations(str(tmp_path / "ckpt")) == [3]


def test_a_ctrl_c_during_start_up_stops_before_the_first_iteration_without_a_save(tmp_path):
    results = run_distributed(_signalled_body, 2, 1, _options(tmp_path / "ckpt"), 0, timeout_s=180)
    for r in results:
        assert r == dict(interrupted=dict(signal="SIGINT", iteration=0, saved=False, forced=False), iterations=0)
    assert not os.path.exists(tmp_path / "ckpt") or ck.list_iterations(str(tmp_path / "ckpt")) == []
