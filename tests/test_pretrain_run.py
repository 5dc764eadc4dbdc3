"""What a ``tnlg pretrain`` run does around training, used as a user would, from Python and from the shell:
runs without validation say so once, runs that save nothing say so at the start and the end, a resumed run
saves back where it loaded from, and its metrics hold each iteration once."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.tiny import tiny_flags, tiny_options
from tnlg.runtime.spawn import checkout_env

# the tiny run in one process, with one iteration of warmup
ONE_PROCESS = dict(lr_warmup_iters=1, tensor_model_parallel_size=1)


def _pretrain(argv, cwd, timeout=300):
    proc = subprocess.run([sys.executable, "-m", "tnlg", "pretrain", *argv], cwd=str(cwd), env=checkout_env(),
                          capture_output=True, text=True, timeout=timeout)
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _train_body(ps, o):
    from tnlg.training import train
    s = train(o)
    return s["first_valid_loss"], s["last_valid_loss"], len(s["losses"])


def test_eval_iters_zero_runs_without_validation(capfd, tmp_path):
    """``--eval-iters 0`` runs without validation and says so once (it used to be accepted, then crash with a
    TypeError formatting the missing validation loss)."""
    from .pool import run_distributed
    o = tiny_options(1, **ONE_PROCESS, train_iters=3, eval_interval=2, eval_iters=0,
                     metrics_file=str(tmp_path / "m.jsonl"))
    assert run_distributed(_train_body, 1, 1, o, timeout_s=120)[0] == (None, None, 3)
    out = capfd.readouterr().out
    assert out.count("--eval-iters 0: this run does no validation") == 1, out
    assert "validation" not in out.replace("--eval-iters 0: this run does no validation", ""), out
    recs = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in recs] == [1, 2, 3] and all("split" not in r for r in recs)


def test_validation_set_smaller_than_a_micro_batch_is_skipped_with_a_note(capsys):
    """A validation split too small for one micro batch per rank is skipped, decided once and said once (it
    made ``evaluate`` return None, which the log line then formatted)."""
    from types import SimpleNamespace

    from tnlg.training.validation import validation_plan
    o = SimpleNamespace(eval_interval=1, eval_iters=1, micro_batch_size=1, global_batch_size=4)
    ps = SimpleNamespace(dp_size=4, rank=0)

    def _validation_plan(dataset, o, ps):
        return validation_plan(dataset, o, o, ps, print)  # (logging and schedule fields in one)

    assert _validation_plan([0, 1], o, ps) is False
    assert "fewer than one micro batch per data-parallel rank (4)" in capsys.readouterr().out
    assert _validation_plan(list(range(4)), o, ps) is True
    assert _validation_plan(None, o, ps) is False and "validation split is empty" in capsys.readouterr().out
    o.eval_interval = 0
    assert _validation_plan(list(range(4)), o, ps) is False and capsys.readouterr().out == ""


def test_run_without_save_says_so_at_start_and_end(tmp_path):
    """A --data-path run without --save says when it starts and when it ends that it saves nothing (it used
    to train, then write nothing, with no word)."""
    proc = _pretrain(["--nproc-per-node", "1", *tiny_flags(**ONE_PROCESS, train_iters=2)], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if "no --save" in line)
    assert "writes no checkpoint" in lines[start] and start < next(i for i, x in enumerate(lines) if "iter " in x)
    assert "no checkpoint was saved (no --save)" in lines[-1], proc.stdout[-2000:]
    assert os.listdir(tmp_path) == []  # nothing written behind the user's back


def test_resumed_run_without_save_saves_back_into_the_load_root(tmp_path):
    """``--load DIR --train-iters N`` without --save saves back into the checkpoint root it loaded from (it
    used to train, then save nothing)."""
    root = tmp_path / "ckpt"
    one = ["--nproc-per-node", "1"]
    assert _pretrain([*one, *tiny_flags(**ONE_PROCESS, train_iters=2, save=str(root))], tmp_path).returncode == 0
    proc = _pretrain([*one, *tiny_flags(**ONE_PROCESS, train_iters=4, lr_decay_iters=4,
                                        load=str(root / "iter_0000002"))], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"go back into {root}" in proc.stdout, proc.stdout[-2000:]
    from tnlg import checkpoint as ck
    assert ck.read_latest(str(root)) == 4
    recs = [json.loads(line) for line in (root / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in recs] == [1, 2, 3, 4]


def test_resumed_metrics_hold_each_iteration_once(tmp_path, capsys):
    """A run interrupted at iteration 7 with its last checkpoint at 4 is resumed from 4; the records of 5-7
    (trained again) are dropped from its metrics, so each iteration appears once and in order."""
    from tnlg.training.metrics import loss_curves as _curves
    from tnlg.training.metrics import open_metrics as _open_metrics
    path = tmp_path / "metrics.jsonl"
    recs = [dict(split="valid", iteration=0, loss=9.0)] + [dict(iteration=i, loss=9.0 - i) for i in range(1, 8)]
    recs.insert(6, dict(split="valid", iteration=5, loss=4.5))
    path.write_text("".join(json.dumps(r) + "\n" for r in recs) + '{"iteration": 8, "lo')  # torn last line
    f = _open_metrics(str(path), 4)
    for i in range(5, 9):
        f.write((json.dumps(dict(iteration=i, loss=1.0)) + "\n").encode())  # (unbuffered bytes: one record per call)
    f.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r.get("split"), r["iteration"]) for r in lines] == \
        [("valid", 0)] + [(None, i) for i in range(1, 9)]
    assert "dropped 5 record(s) past iteration 4" in capsys.readouterr().out
    # the plot's curves are ordered by iteration even for a file written before this fix
    path.write_text("".join(json.dumps(dict(iteration=i, loss=float(i))) + "\n" for i in (1, 2, 3, 2, 3, 4)))
    train, valid = _curves(str(path))
    assert [i for i, _ in train] == [1, 2, 3, 4] and valid == []
    assert _open_metrics(str(path), 0).close() is None and path.read_text() == ""  # a fresh run starts afresh
