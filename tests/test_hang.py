"""A hung collective ends in one message naming it, not a traceback per rank (issue 15 item 10)."""

from __future__ import annotations

import contextlib
import io
import os
import re
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch

from tnlg.hang import FR_DIR_ENV, Hang, describe, enable_flight_recorder, is_collective_timeout, make_dump_dir, message
from tnlg.testing import run_distributed

TIMEOUT_S = 3.0


def _grad_sync(ps, t):
    import torch.distributed as dist
    dist.all_reduce(t, group=ps.dp_group)  # rank 1 never comes


def _hang_body(ps):
    from tnlg.hang import report
    if ps.rank == 1:  # the hung rank: it never enters the collective (and never says it is alive)
        time.sleep(TIMEOUT_S + 4)
        return None
    try:
        _grad_sync(ps, torch.ones(1))
    except RuntimeError as exc:
        assert is_collective_timeout(exc)
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            status = report(exc, "pretrain", wait_s=1.5)
        return status, err.getvalue()
    raise AssertionError("the all_reduce with a missing rank returned")


def test_timeout_names_the_collective_group_caller_and_missing_rank():
    """issue 15 item 10: a hang ended in rank 0's raw `RuntimeError: ... pair closure` traceback."""
    (status, text), _ = run_distributed(_hang_body, 2, 1, timeout_s=TIMEOUT_S)
    assert status == 1 and text.count("\n") == 1 and "Traceback" not in text, text
    assert "all_reduce over the data-parallel group (ranks 0, 1)" in text
    assert "Ranks that did not report within 1.5 s: 1 " in text
    assert "(The error was: " in text and ".cc:" not in text


def test_message_has_iteration_checkpoint_and_resume(tmp_path):
    hang = Hang(error="Timed out waiting 60000ms for recv operation to complete", collective="all_reduce",
                group="the tensor-parallel group (ranks 2, 3)", caller="tnlg/parallel/mappings.py:70 (all_reduce)",
                iteration=37, options=SimpleNamespace(save=str(tmp_path)), missing=[3])
    text = message(hang, "pretrain", "tnlg pretrain --save x", 1.0)
    assert ("tnlg pretrain: a collective timed out after 1 min: all_reduce over the tensor-parallel group "
            "(ranks 2, 3), called from tnlg/parallel/mappings.py:70 (all_reduce), after iteration 37") in text
    assert f"There is no checkpoint in {tmp_path} yet." in text and "Resume with: tnlg pretrain --save x" in text
    hang.options, hang.missing = SimpleNamespace(save=None), None
    text = message(hang, "pretrain", None, 0.25)
    assert "after 15 s" in text and "saved no checkpoint (no --save)" in text and "is unknown" in text


def test_not_a_timeout_is_left_alone():
    from tnlg.hang import report
    assert report(RuntimeError("CUDA out of memory"), "pretrain") is None
    assert report(ValueError("timed out"), "pretrain") is None
    assert describe(RuntimeError("x")).collective is None


def test_flight_recorder_env(tmp_path, monkeypatch):
    """On NCCL a timeout may abort the process before Python sees it: torch's flight recorder dumps instead."""
    names = ("TORCH_FR_BUFFER_SIZE", "TORCH_FR_DUMP_TEMP_FILE") if torch.__version__ >= "2.7" else \
        ("TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")  # torch 2.7 renamed them
    for k in (*names, "TORCH_NCCL_DUMP_ON_TIMEOUT", FR_DIR_ENV):
        monkeypatch.delenv(k, raising=False)
    prefix = enable_flight_recorder(str(tmp_path / "comm_trace"))
    assert prefix == str(tmp_path / "comm_trace" / "rank_")
    assert not (tmp_path / "comm_trace").exists()  # nothing on disk before the options are validated
    make_dump_dir()  # (what a worker does once it joined its group)
    assert (tmp_path / "comm_trace").is_dir()
    assert int(os.environ[names[0]]) > 0 and os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert os.environ[names[1]] == prefix
    monkeypatch.setenv(names[1], "/elsewhere/rank_")  # the user's own setting wins
    assert enable_flight_recorder(str(tmp_path / "x")) == "/elsewhere/rank_"


def _workers(save: str) -> dict[int, int]:
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read()
            env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        except OSError:
            continue
        rank = [e[5:] for e in env if e.startswith(b"RANK=")]
        if save.encode() in cmd and rank and any(e.startswith(b"TORCHELASTIC_RUN_ID=") for e in env):
            found[int(rank[0])] = int(pid)
    return found


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc to find the worker processes")
def test_sigstopped_worker_ends_the_job_with_one_message(tmp_path):
    """issue 15 item 10, as the user saw it: SIGSTOP one worker of the built-in job mid-run."""
    save = str(tmp_path / "run")
    proc = subprocess.Popen([sys.executable, "-m", "tnlg", "pretrain", "--train-iters", "200", "--save", save,
                             "--distributed-timeout-minutes", "0.1", "--eval-interval", "0", "--log-interval", "2",
                             "--save-interval", "2", "--no-plot", "--sample-tokens", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines, stopped = [], None
    try:
        for line in proc.stdout:
            lines.append(line)
            if stopped is None and re.match(r"iter\s+4/", line):
                stopped = _workers(save)[3]
                os.kill(stopped, signal.SIGSTOP)
        proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in _workers(save).values():
            os.kill(pid, signal.SIGKILL)
    out = "".join(lines)
    assert stopped is not None and proc.returncode != 0
    assert "Traceback" not in out and "pair closure" not in out, out
    # rank 0 either times out itself or sees a peer that timed out first close its connection
    msgs = [ln for ln in lines if "tnlg pretrain: a collective " in ln]
    assert len(msgs) == 1, out
    assert "Ranks that did not report within 5 s: 3 " in msgs[0] and "The last checkpoint is iteration" in msgs[0]
    assert f"--save {save}" in msgs[0] and "after iteration" in msgs[0]
