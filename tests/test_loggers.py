"""TensorBoard and Weights & Biases behind Megatron's flags, read back with their own readers.

A real `tnlg pretrain` on 2 gloo processes writes an event file and an offline W&B run; TensorBoard's
EventAccumulator and W&B's own transaction-log reader (`wandb leet inspect --json`) must give the
scalars of metrics.jsonl at the same iterations, across a resume. Bad input (a missing package, a
--tensorboard-dir that is a file) is one paragraph before anything starts or is written.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys

import pytest

from tests.tiny import tiny_flags
from tnlg.cli import main
from tnlg.runtime.spawn import checkout_env, run_tnlg

TRAIN_KEYS = ("loss", "lr", "grad_norm", "ms_per_iter", "tokens_per_s", "tflops", "mfu", "hfu",
              "peak_memory_bytes")


# W&B's command next to this Python (a venv's bin/ need not be on PATH), else the one on PATH
_WANDB_CLI = next((c for c in (os.path.join(os.path.dirname(sys.executable), "wandb"),) if os.path.exists(c)),
                  shutil.which("wandb") or "wandb")


def _wandb_env(tmp_path):
    """W&B offline, with every folder it would write under ``tmp_path`` (nothing in the home folder)."""
    return dict(WANDB_MODE="offline", WANDB_SILENT="true", WANDB_DIR=str(tmp_path / "wandb_dir"),
                WANDB_CACHE_DIR=str(tmp_path / "wandb_cache"), WANDB_CONFIG_DIR=str(tmp_path / "wandb_config"),
                WANDB_DATA_DIR=str(tmp_path / "wandb_data"))


def _pretrain(argv, tmp_path):
    return run_tnlg(["pretrain", *argv], tmp_path, env=checkout_env(**_wandb_env(tmp_path)))


def _jsonl_series(path):
    """``{tag: [(iteration, value)]}`` of a metrics file, in the backends' names."""
    series: dict = {}
    for r in map(json.loads, open(path)):
        split, keys = ("valid", ("loss", "ppl")) if r.get("split") == "valid" else ("train", TRAIN_KEYS)
        for k in keys:
            series.setdefault(f"{split}/{k}", []).append((r["iteration"], r[k]))
    return series


def _tensorboard_series(log_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})  # 0: keep every event
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _wandb_series(run_dirs):
    """``{tag: [(step, value)]}`` of offline W&B runs, read by W&B's own reader of its transaction log."""
    series: dict = {}
    for run_dir in run_dirs:
        proc = subprocess.run([_WANDB_CLI, "leet", "inspect", "--json", str(run_dir)],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        for line in proc.stdout.splitlines():
            rec = json.loads(line)
            if rec.get("type") == "history":
                item = rec["history"]["item"]
                for tag, value in item.items():
                    if not tag.startswith("_"):
                        series.setdefault(tag, []).append((item["_step"], value))
    return series


@pytest.mark.slow
@pytest.mark.needs_package("tensorboard", "wandb")
def test_tensorboard_and_wandb_get_the_scalars_of_metrics_jsonl_across_a_resume(tmp_path):
    """Two gloo processes, 4 iterations then a resume to 8: TensorBoard and the offline W&B runs hold,
    for every scalar of metrics.jsonl, its value at every iteration (validations at 0, 3, 4, 6 and 8);
    rank 0 alone writes (one event file and one W&B run per launch); the log line shows elapsed time
    and an ETA; the metrics file marks where the second run resumed."""
    from tnlg.training.metrics import read_curves
    tiny = tiny_flags(tensor_model_parallel_size=1, log_interval=3, eval_interval=3, eval_iters=1)
    base = ["--nproc-per-node", "2", *tiny, "--save", "run", "--tensorboard-dir", "tb", "--wandb-project", "tnlg-test",
            "--wandb-exp-name", "exp", "--wandb-save-dir", "wb"]
    out = _pretrain([*base, "--train-iters", "4"], tmp_path)
    assert re.search(r"iter +3/4 .* \| elapsed \d+:\d\d:\d\d \| ETA \d+:\d\d:\d\d$", out, re.M), out[-3000:]
    # iterations 2-3: the loss a mean over them, the gradient norm iteration 3's (metrics.jsonl's)
    line = re.search(r"iter +3/4 .*\| loss \(mean of 2\) (\S+) \| grad norm \(this iter\) (\S+) \|", out)
    assert line, out[-3000:]
    out = _pretrain([*base, "--train-iters", "8"], tmp_path)
    assert "at iteration 4 (" in out, out[-3000:]

    expected = _jsonl_series(tmp_path / "run" / "metrics.jsonl")
    assert [i for i, _ in expected["train/loss"]] == list(range(1, 9))
    assert [i for i, _ in expected["valid/ppl"]] == [0, 3, 4, 6, 8]
    assert read_curves(str(tmp_path / "run" / "metrics.jsonl"))["resumed"] == [4]
    loss, norm = dict(expected["train/loss"]), dict(expected["train/grad_norm"])
    assert abs(float(line[1]) - (loss[2] + loss[3]) / 2) <= 5e-5 and abs(float(line[2]) - norm[3]) <= 5e-4, line[0]

    assert len(os.listdir(tmp_path / "tb")) == 2  # one event file per launch: rank 0 only
    board = _tensorboard_series(tmp_path / "tb")
    assert set(board) == set(expected)
    for tag, points in expected.items():  # event files hold float32
        assert [s for s, _ in board[tag]] == [i for i, _ in points], tag
        for (_, got), (_, want) in zip(board[tag], points):
            assert math.isclose(got, want, rel_tol=1e-6, abs_tol=1e-12), (tag, got, want)

    runs = sorted((tmp_path / "wb" / "wandb").glob("offline-run-*"))
    assert len(runs) == 2  # one W&B run per launch: rank 0 only
    assert _wandb_series(runs) == expected  # JSON doubles: exact


def _refused(capsys, monkeypatch, tmp_path, argv):
    """Run ``tnlg pretrain argv`` in ``tmp_path`` in this process; return its error, checking that it exits
    2 with one paragraph and writes nothing."""
    monkeypatch.chdir(tmp_path)
    before = sorted(os.listdir(tmp_path))
    assert main(["pretrain", "--nproc-per-node", "1", "--train-iters", "2", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("tnlg pretrain: error: ") and "\n" not in err and "Traceback" not in err, err
    assert sorted(os.listdir(tmp_path)) == before
    return err


@pytest.mark.needs_package("tensorboard")  # the package is checked first
def test_a_tensorboard_dir_that_is_a_file_is_refused_before_anything_starts(capsys, monkeypatch, tmp_path):
    (tmp_path / "board").write_text("not a folder")
    err = _refused(capsys, monkeypatch, tmp_path, ["--tensorboard-dir", "board"])
    assert "--tensorboard-dir 'board' is a file, not a folder" in err
    (tmp_path / "f").write_text("")
    err = _refused(capsys, monkeypatch, tmp_path, ["--tensorboard-dir", "f/events"])
    assert "--tensorboard-dir 'f/events' cannot be created" in err and "is a file" in err


@pytest.mark.parametrize("package,argv", [("wandb", ["--wandb-project", "p"]),
                                          ("tensorboard", ["--tensorboard-dir", "tb"])])
def test_a_logger_whose_package_is_missing_is_refused_before_anything_starts(capsys, monkeypatch, tmp_path,
                                                                             package, argv):
    monkeypatch.setitem(sys.modules, package, None)  # as if not installed: import fails, find_spec is None
    err = _refused(capsys, monkeypatch, tmp_path, argv)
    assert f"needs the {package} package, which is not installed: pip install {package}" in err


def test_wandb_options_without_a_project_are_refused(capsys, monkeypatch, tmp_path):
    err = _refused(capsys, monkeypatch, tmp_path, ["--wandb-exp-name", "x"])
    assert "--wandb-exp-name configures the Weights & Biases run" in err and "without --wandb-project" in err
