"""A stop signal that reaches one rank only, in the training loop itself (2 gloo processes).

A real SIGINT, raised in rank 1 alone, while it starts up or trains: both ranks agree on where to stop
(one MAX all-reduce per iteration), save that iteration together when there is one, and report the same.
"""

from __future__ import annotations

import argparse
import os
import signal

from tnlg import checkpoint as ck
from tnlg.runtime.spawn import run_distributed
from tnlg.commands.pretrain_args import resolve


def _options(save, **over):
    from tnlg.data.corpus import default_dataset
    prefix, tok = default_dataset()
    flags = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, micro_batch_size=2,
                 global_batch_size=4, train_iters=50, log_interval=100, eval_interval=0, data_path=[prefix],
                 tokenizer_model=tok, sample_prompt="", plot=False, peak_tflops=1.0, save=str(save))
    flags.update(over)
    return resolve(argparse.Namespace(**flags), world_size=2)


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
