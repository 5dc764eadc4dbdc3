"""``tnlg pretrain --context-parallel-size``: the tiny run's losses equal CP 1's (also at CP 2 x PP 2), its checkpoints do not
depend on CP (a CP 2 run and a CP 2 x PP 2 run resumed at CP 1 and at TP 1 x CP 4 continue CP 1's trajectory), validation
gives CP 1's loss, and the layouts CP cannot run are one paragraph before any process starts."""

from __future__ import annotations

import pytest
import torch

from tests.tiny import tiny_options
from tnlg.errors import UserError
from .pool import run_distributed

RUN = dict(train_iters=6, lr=3e-3, min_lr=3e-4, lr_warmup_iters=2, hidden_dropout=0.0, attention_dropout=0.0, eval_interval=3,
           eval_iters=1, split="80,20,0", reset_position_ids=True, reset_attention_mask=True)


def _runs_body(ps, runs):
    """Each ``(options, load)`` of ``runs`` in turn (``load`` set after resolve: an earlier run writes it):
    ``(losses, last validation loss)``; ``("eval", checkpoint)``: :func:`_eval_body`'s losses."""
    from tnlg.training import train
    out = []
    for o, load in runs:
        if isinstance(o, str):
            out.append(_eval_body(ps, load))
            continue
        o.checkpoint.load = load
        s = train(o)
        out.append((s["losses"], s["last_valid_loss"]))
    return out


def _options(world, save=None, **extra):
    o = tiny_options(world, **dict(RUN, **extra))
    o.checkpoint.save = save
    return o


@pytest.mark.slow
def test_cp_runs_and_resumes_on_cp_1s_trajectory(tmp_path):
    """Dropout 0 (its streams differ per CP layout), documents inside samples (reset positions and masks).
    Three spawns: CP 2 (6 steps, and 3 steps saved); CP 2 x PP 2 (6 steps, iteration 3 saved), both
    checkpoints resumed at CP 4, and `tnlg eval` of the CP 2 one at four layouts; CP 1 (the reference),
    both checkpoints resumed at CP 1 (the CP x PP one: at PP 1 too)."""
    save, piped_save = str(tmp_path / "cp2"), str(tmp_path / "cp2_pp2")
    piped_iter3 = str(tmp_path / "cp2_pp2" / "iter_0000003")
    (cp2, cp2_valid), (first, _) = run_distributed(_runs_body, 2, 1, [
        (_options(2, context_parallel_size=2), None),
        (_options(2, save, context_parallel_size=2, train_iters=3, save_interval=3), None)], timeout_s=240)[0]
    four = [(_options(4, piped_save, context_parallel_size=2, pipeline_model_parallel_size=2, save_interval=3), None)]
    four += [(_options(4, context_parallel_size=4), load) for load in (save, piped_iter3)] + [("eval", save)]
    (piped, piped_valid), *at_cp4, by_cp = run_distributed(_runs_body, 4, 1, four, timeout_s=300)[0]
    one = [(_options(1), None)] + [(_options(1), load) for load in (save, piped_iter3)]
    (ref, ref_valid), *at_cp1 = run_distributed(_runs_body, 1, 1, one, timeout_s=240)[0]
    assert ref_valid is not None
    for what, (losses, valid) in (("CP 2", (cp2, cp2_valid)), ("CP 2 x PP 2", (piped, piped_valid))):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref), rtol=1e-5, atol=1e-5,
                                   msg=lambda m, w=what: f"{w}: {m}")
        assert valid == pytest.approx(ref_valid, rel=1e-5), what
    assert first == pytest.approx(ref[:3], rel=1e-5)
    for cp, resumed in ((1, at_cp1), (4, at_cp4)):
        for source, (rest, valid) in zip(("CP 2", "CP 2 x PP 2"), resumed):
            torch.testing.assert_close(torch.tensor(rest), torch.tensor(ref[3:]), rtol=1e-5, atol=1e-5,
                                       msg=lambda m, c=cp, s=source: f"{s} resumed at CP {c}: {m}")
            assert valid == pytest.approx(ref_valid, rel=1e-5), (source, cp)
    assert by_cp[2] == pytest.approx(by_cp[1], rel=1e-6) and by_cp[4] == pytest.approx(by_cp[1], rel=1e-6)
    assert by_cp[(2, 2)] == pytest.approx(by_cp[1], rel=1e-6)  # CP 2 x PP 2


def _eval_body(_ps, ckpt):
    """``tnlg eval --task loss`` of the checkpoint at CP 1 (DP 4), CP 2 (x DP 2), CP 4 and CP 2 x PP 2, with documents."""
    import argparse

    from tests.tiny import tiny_settings
    from tnlg.commands.eval import _precheck, add_arguments, evaluate
    from tnlg.parallel.state import init_parallel
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    out = {}
    for cp, pp in ((1, 1), (2, 1), (4, 1), (2, 2)):
        ps = init_parallel(1, context_parallel_size=cp, pipeline_parallel_size=pp)
        args = parser.parse_args(["--task", "loss", "--checkpoint", ckpt, "--input", tiny_settings()["data_path"][0],
                                  "--cp", str(cp), "--pp", str(pp), "--eval-samples", "8", "--micro-batch-size", "2",
                                  "--reset-position-ids", "--reset-attention-mask"])
        _precheck(args)
        out[cp if pp == 1 else (cp, pp)] = evaluate(args, ps)["loss"]
    return out


@pytest.mark.parametrize("extra,match", [
    (dict(context_parallel_size=3), r"2 x CP must divide --seq-length 16"),
    (dict(context_parallel_size=2, attention_dropout=0.1), r"does not run with --attention-dropout 0.1"),
], ids=["length", "attention-dropout"])
def test_what_cp_cannot_run_is_one_paragraph(extra, match):
    with pytest.raises(UserError, match=match):
        tiny_options(4, **dict(RUN, **extra)).check(4)


def test_a_cp_that_does_not_divide_the_world_is_refused():
    with pytest.raises(UserError, match=r"--context-parallel-size 4 does not divide the 6 processes: .* Valid "
                                        r"context-parallel sizes .*: \[1, 2\]"):
        tiny_options(6, **dict(RUN, context_parallel_size=4, tensor_model_parallel_size=1)).check(6)
