"""`tnlg pretrain` used as a user would, from Python and from the shell: the arguments the workers get,
runs without validation, defaults that belong to the built-in job, and runs that save nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tnlg.cli import build_parser, main
from tnlg.errors import UserError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--micro-batch-size", "2", "--global-batch-size", "4", "--log-interval", "1", "--no-plot",
        "--peak-tflops", "1", "--sample-prompt", "", "--lr-warmup-iters", "1",
        "--tensor-model-parallel-size", "1"]


@pytest.fixture(scope="module")
def corpus():
    from tnlg.data.corpus import default_dataset
    return default_dataset()


def _resolved(argv, world):
    from tnlg.commands.pretrain_args import resolve
    return resolve(build_parser(only="pretrain").parse_args(["pretrain", *argv]), world_size=world)


def _pretrain(argv, cwd, timeout=300):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "tnlg", "pretrain", *argv], cwd=str(cwd), env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


# --------------------------------------------------------------------------- issue 12 item 6

def test_main_from_python_passes_its_own_list_to_the_workers(monkeypatch, tmp_path, corpus):
    """issue 12 item 6: ``main([...])`` with ``--nproc-per-node 2`` built the workers' arguments from
    ``sys.argv`` (here pytest's), not from the list it was given and validated."""
    import torch.distributed.launcher.api as launcher_api

    launched = []

    class FakeLaunch:
        def __init__(self, config, entrypoint):
            self.nproc = config.nproc_per_node

        def __call__(self, *args):
            launched.append(list(args))
            return {}

    monkeypatch.setattr(launcher_api, "elastic_launch", FakeLaunch)
    for var in ("OMP_NUM_THREADS", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"):  # the launcher sets them
        monkeypatch.setenv(var, os.environ.get(var, "1"))
    monkeypatch.setattr(sys, "argv", ["tnlg", "pretrain", "--train-iters", "99", "--lr", "0.5"])
    given = ["--nproc-per-node", "2", *TINY, "--train-iters", "3", "--tensor-model-parallel-size", "1",
             "--data-path", corpus[0], "--tokenizer-model", corpus[1], "--save", str(tmp_path / "s"),
             "--sample-prompt", "-x y"]  # a value that starts with '-' and holds a space
    assert main(["pretrain", *given]) == 0
    assert len(launched) == 1
    child = launched[0]
    assert child[:3] == ["-m", "tnlg", "pretrain"]
    assert "99" not in child and "0.5" not in child
    ns = build_parser(only="pretrain").parse_args(child[2:])
    want = build_parser(only="pretrain").parse_args(["pretrain", *given])
    assert vars(ns) == vars(want)  # the very options that were validated, nothing more or less


def test_pretrain_reads_no_sys_argv():
    """issue 12 item 6: only the console entry (``tnlg.cli``) reads ``sys.argv``."""
    import ast
    import pathlib
    package = pathlib.Path(ROOT) / "tnlg"
    for path in sorted(package.rglob("*.py")):
        if path.name == "cli.py" and path.parent == package:
            continue
        tree = ast.parse(path.read_text())
        reads = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr == "argv"
                 and isinstance(n.value, ast.Name) and n.value.id == "sys"]
        assert not reads, f"{path.relative_to(ROOT)} reads sys.argv at line(s) {reads}"


# --------------------------------------------------------------------------- issue 12 item 7

def _train_body(ps, o):
    from tnlg.training import train
    s = train(o)
    return s["first_valid_loss"], s["last_valid_loss"], len(s["losses"])


def test_eval_iters_zero_runs_without_validation(capfd, tmp_path, corpus):
    """issue 12 item 7: ``--eval-iters 0`` was accepted, then crashed with a TypeError formatting the
    missing validation loss. It runs without validation and says so once."""
    from tnlg.runtime.spawn import run_distributed
    o = _resolved([*TINY, "--train-iters", "3", "--eval-interval", "2", "--eval-iters", "0",
                   "--data-path", corpus[0], "--tokenizer-model", corpus[1],
                   "--metrics-file", str(tmp_path / "m.jsonl")], world=1)
    assert run_distributed(_train_body, 1, 1, o, timeout_s=120)[0] == (None, None, 3)
    out = capfd.readouterr().out
    assert out.count("--eval-iters 0: this run does no validation") == 1, out
    assert "validation" not in out.replace("--eval-iters 0: this run does no validation", ""), out
    recs = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in recs] == [1, 2, 3] and all("split" not in r for r in recs)


def test_validation_set_smaller_than_a_micro_batch_is_skipped_with_a_note(capsys):
    """issue 12 item 7, the same defect's neighbour: a validation split too small for one micro batch per
    rank made ``evaluate`` return None, which the log line then formatted. Decided once, said once."""
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


# --------------------------------------------------------------------------- issue 12 item 8

def test_user_run_gets_megatron_defaults_not_the_builtin_jobs(corpus):
    """issue 12 item 8: ``--data-path D --tokenizer-model M --train-iters 2`` stopped on
    "--lr-warmup-iters (30) must be smaller than --lr-decay-iters (2)", a flag the user never set."""
    o = _resolved(["--data-path", corpus[0], "--tokenizer-model", corpus[1], "--train-iters", "2"], world=4)
    assert (o.schedule.lr_warmup_iters, o.schedule.lr_decay_iters, o.schedule.min_lr,
            o.schedule.lr_decay_style) == (0, None, 0.0, "linear")
    assert (o.model.hidden_dropout, o.model.attention_dropout, o.schedule.adam_beta2) == (0.1, 0.1, 0.999)
    assert (o.parallel.tensor_model_parallel_size, o.schedule.micro_batch_size,
            o.schedule.global_batch_size) == (1, 8, 32)  # micro x DP
    assert (o.logging.sample_prompt, o.logging.eval_interval, o.logging.eval_iters,
            o.logging.log_interval) == ("", 1000, 100, 100)
    assert o.builtin_job is False
    # a user's --lr below the built-in job's --min-lr, a global batch without a micro batch: both fine
    o = _resolved(["--data-path", corpus[0], "--tokenizer-model", corpus[1], "--train-iters", "2",
                   "--lr", "1e-4", "--global-batch-size", "4"], world=4)
    assert (o.schedule.min_lr, o.schedule.micro_batch_size, o.schedule.global_batch_size) == (0.0, 1, 4)
    # a preset run is a user's run too
    o = _resolved(["--preset", "tiny", "--train-iters", "5"], world=2)
    assert (o.schedule.lr_warmup_iters, o.model.hidden_dropout, o.parallel.tensor_model_parallel_size) == (0, 0.1, 1)


def test_train_iters_is_required_outside_the_builtin_job(corpus):
    """issue 12 item 8: the built-in job's 300 iterations are not a default for a user's data."""
    with pytest.raises(UserError, match="--train-iters is required"):
        _resolved(["--data-path", corpus[0], "--tokenizer-model", corpus[1]], world=4)


def test_builtin_job_defaults_unchanged_and_scaled_by_the_users_flags():
    """issue 12 item 8: the built-in job keeps its tuned values; those that depend on a flag the user
    sets follow it instead of contradicting it."""
    o = _resolved([], world=4)
    assert o.builtin_job is True
    assert (o.schedule.train_iters, o.schedule.lr, o.schedule.min_lr, o.schedule.lr_warmup_iters,
            o.schedule.lr_decay_style, o.schedule.adam_beta2) == \
        (300, 2e-3, 2e-4, 30, "cosine", 0.95)
    assert (o.parallel.tensor_model_parallel_size, o.schedule.micro_batch_size,
            o.schedule.global_batch_size) == (2, 8, 16)
    assert (o.model.hidden_dropout, o.logging.eval_interval, o.logging.eval_iters,
            o.logging.sample_prompt) == (0.0, 100, 4, "ROMEO:")
    o = _resolved(["--train-iters", "2"], world=4)  # was: warmup 30 >= decay 2
    assert (o.schedule.lr_warmup_iters, o.schedule.lr_decay_iters) == (0, None)
    o = _resolved(["--lr", "1e-4"], world=4)  # was: --min-lr 2e-4 above --lr
    assert o.schedule.min_lr == pytest.approx(1e-5)
    o = _resolved(["--nproc-per-node", "1"], world=1)  # was: TP 2 does not divide 1 process
    assert (o.parallel.tensor_model_parallel_size, o.schedule.global_batch_size,
            o.schedule.micro_batch_size) == (1, 16, 8)
    o = _resolved(["--nproc-per-node", "8"], world=8)  # was: 16 not divisible by micro 8 x DP 4
    assert (o.parallel.tensor_model_parallel_size, o.schedule.global_batch_size,
            o.schedule.micro_batch_size) == (2, 16, 4)
    o = _resolved(["--train-iters", "1000", "--lr-decay-iters", "500"], world=4)
    assert o.schedule.lr_warmup_iters == 50


def test_help_says_which_defaults_belong_to_the_builtin_job(capsys):
    """issue 12 item 8: --help documents the built-in job's own defaults."""
    with pytest.raises(SystemExit):
        main(["pretrain", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "apply to it only" in out and "Megatron-LM's defaults" in out
    assert "(default 0.0006; built-in job 0.002)" in out
    assert "(default 0; built-in job a tenth of the schedule, 30)" in out
    assert "(default none: required; built-in job 300)" in out


# --------------------------------------------------------------------------- issue 15 item 1

def test_run_without_save_says_so_at_start_and_end(tmp_path, corpus):
    """issue 15 item 1: a --data-path run without --save trained, then wrote nothing, with no word."""
    proc = _pretrain(["--nproc-per-node", "1", *TINY, "--train-iters", "2", "--eval-interval", "0",
                      "--data-path", corpus[0], "--tokenizer-model", corpus[1]], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if "no --save" in line)
    assert "writes no checkpoint" in lines[start] and start < next(i for i, x in enumerate(lines) if "iter " in x)
    assert "no checkpoint was saved (no --save)" in lines[-1], proc.stdout[-2000:]
    assert os.listdir(tmp_path) == []  # nothing written behind the user's back


def test_resumed_run_without_save_saves_back_into_the_load_root(tmp_path, corpus):
    """issue 15 item 1: ``--load DIR --train-iters N`` without --save trained, then saved nothing."""
    base = ["--nproc-per-node", "1", *TINY, "--eval-interval", "0", "--data-path", corpus[0],
            "--tokenizer-model", corpus[1]]
    root = tmp_path / "ckpt"
    assert _pretrain([*base, "--train-iters", "2", "--save", str(root)], tmp_path).returncode == 0
    proc = _pretrain([*base, "--train-iters", "4", "--lr-decay-iters", "4",
                      "--load", str(root / "iter_0000002")], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"go back into {root}" in proc.stdout, proc.stdout[-2000:]
    from tnlg import checkpoint as ck
    assert ck.read_latest(str(root)) == 4
    recs = [json.loads(line) for line in (root / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in recs] == [1, 2, 3, 4]


def test_load_root_not_writable_is_refused_before_start(tmp_path, capsys):
    """issue 15 item 1: saving back into an unwritable --load root fails before any work, not at the end."""
    if os.geteuid() == 0:
        pytest.skip("root can write anywhere")
    root = tmp_path / "ro"
    root.mkdir()
    root.chmod(0o500)
    try:
        assert main(["pretrain", "--nproc-per-node", "1", "--load", str(root)]) == 2
        assert "not writable" in capsys.readouterr().err
    finally:
        root.chmod(0o700)


# --------------------------------------------------------------------------- issue 15 item 3

def test_resumed_metrics_hold_each_iteration_once(tmp_path, capsys):
    """issue 15 item 3: a run interrupted at iteration 7 with its last checkpoint at 4 is resumed from 4;
    the records of 5-7 (trained again) are dropped, so each iteration appears once and in order."""
    from tnlg.training.metrics import loss_curves as _curves
    from tnlg.training.metrics import open_metrics as _open_metrics
    path = tmp_path / "metrics.jsonl"
    recs = [dict(split="valid", iteration=0, loss=9.0)] + [dict(iteration=i, loss=9.0 - i) for i in range(1, 8)]
    recs.insert(6, dict(split="valid", iteration=5, loss=4.5))
    path.write_text("".join(json.dumps(r) + "\n" for r in recs) + '{"iteration": 8, "lo')  # torn last line
    f = _open_metrics(str(path), 4)
    for i in range(5, 9):
        f.write(json.dumps(dict(iteration=i, loss=1.0)) + "\n")
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
