"""Ctrl-C and SIGTERM on a real `tnlg pretrain` (issue 15 item 3), then the resume the message prints.

Each run is a `python -m tnlg pretrain` subprocess in its own session, signalled as a terminal or a
scheduler does (the whole process group), once a checkpoint exists. Required: no traceback anywhere, one
message from rank 0 naming the iteration, the last checkpoint and the command that resumes; that command
works, and afterwards metrics.jsonl holds each iteration once, in order.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time

import pytest

from tnlg import checkpoint as ck

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--micro-batch-size", "2", "--global-batch-size", "8", "--log-interval", "1", "--eval-interval", "10",
        "--eval-iters", "2", "--peak-tflops", "1", "--sample-prompt", ""]
ITERS = 60


def _env():
    return dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))


def _interrupted_run(argv, cwd, sig, ready):
    """Start ``tnlg pretrain argv``; when ``ready()`` holds and 3 iterations are logged, send ``sig`` to
    its process group (what Ctrl-C in a terminal or a scheduler's SIGTERM does). Returns (rc, output)."""
    proc = subprocess.Popen([sys.executable, "-m", "tnlg", "pretrain", *argv], cwd=str(cwd), env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    deadline = time.time() + 240
    try:
        while time.time() < deadline and proc.poll() is None:
            if ready() and sum(line.startswith("iter ") for line in list(lines)) >= 3:
                break
            time.sleep(0.02)
        assert proc.poll() is None, "".join(lines)[-3000:]  # it must still be training
        sent = time.time()
        os.killpg(proc.pid, sig)
        rc = proc.wait(timeout=60)
        took = time.time() - sent
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    reader.join(timeout=10)
    out = "".join(lines)
    assert took < 30, f"took {took:.0f} s to stop"
    return rc, out


def _message(out, sig):
    assert "Traceback" not in out and "KeyboardInterrupt" not in out and "SignalException" not in out, out[-4000:]
    found = [line for line in out.splitlines() if f"interrupted ({sig.name})" in line]
    assert len(found) == 1, out[-4000:]  # one message, from rank 0 only
    m = re.search(r"interrupted \(\w+\) at iteration (\d+) of \d+; the last checkpoint is iteration (\d+) in "
                  r"(\S+?)( \(saved now\))?\. Resume with: (.+)$", found[0])
    assert m, found[0]
    return int(m.group(1)), int(m.group(2)), m.group(3), bool(m.group(4)), m.group(5)


def _resume(command, cwd):
    argv = shlex.split(command)
    assert argv[:2] == ["tnlg", "pretrain"], command
    proc = subprocess.run([sys.executable, "-m", "tnlg", *argv[1:]], cwd=str(cwd), env=_env(),
                          capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "Traceback" not in out, out[-4000:]
    return out


def _check_metrics(path):
    records = [json.loads(line) for line in open(path)]
    train = [r["iteration"] for r in records if r.get("split") != "valid"]
    valid = [r["iteration"] for r in records if r.get("split") == "valid"]
    assert train == list(range(1, ITERS + 1)), train  # each iteration once, in order
    assert valid == sorted(set(valid)) and valid[0] == 0 and valid[-1] == ITERS, valid


def test_ctrl_c_on_the_builtin_job_then_resume_with_the_printed_command(tmp_path):
    """issue 15 item 3: Ctrl-C (SIGINT to the process group) on the built-in job under the launcher:
    no tracebacks, one message, and its command resumes the job's own folder; metrics stay unique."""
    def ready():
        return any(ck.read_latest(d) for d in glob.glob(str(tmp_path / "runs" / "*")))

    rc, out = _interrupted_run(["--nproc-per-node", "2", "--train-iters", str(ITERS), "--save-interval", "2",
                                *TINY], tmp_path, signal.SIGINT, ready)
    assert rc == 128 + signal.SIGINT, out[-3000:]
    n, m, folder, saved, command = _message(out, signal.SIGINT)
    assert folder.startswith("runs/pretrain-") and m <= n < ITERS and saved == (m == n)  # every 2nd is saved
    assert ck.read_latest(str(tmp_path / folder)) == m
    assert f"--save {folder}" in command and "--nproc-per-node 2" in command

    out = _resume(command, tmp_path)
    assert f"at iteration {m} (" in out, out[-3000:]
    if n > m:
        assert f"past iteration {m}" in out  # the interrupted run's last records were dropped
    _check_metrics(tmp_path / folder / "metrics.jsonl")
    assert (tmp_path / folder / "metrics_loss.png").exists()


def test_sigterm_saves_reports_and_resumes(tmp_path):
    """issue 15 item 3: SIGTERM to the process group (a scheduler's preemption) of a run on one's own data:
    a checkpoint of the last iteration, the same single message, then an exact continuation."""
    from tnlg.data.corpus import default_dataset
    prefix, tok = default_dataset()
    save = tmp_path / "ckpt"
    rc, out = _interrupted_run(["--nproc-per-node", "2", "--tensor-model-parallel-size", "2", "--train-iters",
                                str(ITERS), "--save-interval", "2", "--data-path", prefix, "--tokenizer-model", tok,
                                "--save", str(save), "--no-plot", *TINY], tmp_path, signal.SIGTERM,
                               lambda: ck.read_latest(str(save)) is not None)
    assert rc == 128 + signal.SIGTERM, out[-3000:]
    n, m, folder, saved, command = _message(out, signal.SIGTERM)
    assert saved and n == m == ck.read_latest(str(save)) and folder == str(save)
    _resume(command, tmp_path)
    _check_metrics(save / "metrics.jsonl")


def test_ctrl_c_on_one_process_without_save(tmp_path):
    """issue 15 item 3 with issue 15 item 1: one process (no launcher), no --save: the message says that
    nothing was saved, and the exit status is a signalled command's."""
    from tnlg.data.corpus import default_dataset
    prefix, tok = default_dataset()
    metrics = tmp_path / "m.jsonl"
    rc, out = _interrupted_run(["--nproc-per-node", "1", "--tensor-model-parallel-size", "1", "--train-iters",
                                "100000", "--data-path", prefix, "--tokenizer-model", tok, "--metrics-file",
                                str(metrics), "--no-plot", *TINY], tmp_path, signal.SIGINT, metrics.exists)
    assert rc == 128 + signal.SIGINT, out[-3000:]
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out[-3000:]
    assert re.search(r"interrupted \(SIGINT\) at iteration \d+ of 100000\. This run saved nothing \(no --save\)",
                     out), out[-3000:]
