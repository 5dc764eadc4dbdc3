"""Ctrl-C and SIGTERM on a real `tnlg pretrain`, then the resume the message prints.

Each run is a `python -m tnlg pretrain` subprocess (the launcher and 2 gloo workers) in its own session,
signalled as a terminal or a scheduler does (the whole process group). Required: no traceback anywhere,
one message from rank 0 naming the iteration, the checkpoint saved of it and the command that resumes;
that command works and continues exactly, and afterwards metrics.jsonl holds each iteration once, in
order. A second Ctrl-C stops at once, without a save.
"""

from __future__ import annotations

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

from tests.tiny import tiny_flags
from tnlg import checkpoint as ck
from tnlg.runtime.spawn import checkout_env, run_tnlg

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ITERS = 60
BUILTIN_JOB = dict(data_path=None, tokenizer_model=None)  # no --data-path: the built-in job on its own corpus


def _flags(**over):
    """The tiny run of ITERS iterations with validation every 10, then ``over``."""
    return tiny_flags(**{**dict(global_batch_size=8, eval_interval=10, eval_iters=2, train_iters=ITERS), **over})


def _interrupted_run(argv, cwd, sig, ready, env=None, second=None, launcher=()):
    """Start ``tnlg pretrain argv`` (under ``launcher``, e.g. torchrun's arguments); when ``ready()`` holds and
    3 iterations are logged, send ``sig`` to its process group (what Ctrl-C in a terminal or a scheduler's
    SIGTERM does); with ``second``, send ``sig`` once more as soon as ``second()`` holds. Returns (rc, output)."""
    proc = subprocess.Popen([sys.executable, *launcher, "-m", "tnlg", "pretrain", *argv], cwd=str(cwd),
                            env=env or checkout_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        _wait_for(lambda: ready() and sum(line.startswith("iter ") for line in list(lines)) >= 3, proc, lines)
        sent = time.time()
        os.killpg(proc.pid, sig)
        if second is not None:
            _wait_for(second, proc, lines)
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


def _wait_for(condition, proc, lines, timeout=240):
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None and not condition():
        time.sleep(0.02)
    assert proc.poll() is None and condition(), "".join(lines)[-3000:]  # it must still be running


def _message(out, sig, launcher_traceback=False):
    """The one message rank 0 printed; no traceback anywhere (with ``launcher_traceback``: but torchrun's
    own, which ends its process on a signal with the SignalException torch raises in it). Its command: the
    short one (``--save DIR --use-checkpoint-args``) it leads with, the full one in the parentheses after."""
    if launcher_traceback:
        assert out.count("Traceback") == 1 and out.rstrip().endswith(f"got signal: {int(sig)}"), out[-4000:]
        out = out[:out.index("Traceback")]
    assert "Traceback" not in out and "KeyboardInterrupt" not in out and "SignalException" not in out, out[-4000:]
    found = [line for line in out.splitlines() if f"interrupted ({sig.name})" in line]
    assert len(found) == 1, out[-4000:]  # one message, from rank 0 only
    m = re.search(r"interrupted \(\w+\) at iteration (\d+) of \d+; the last checkpoint is iteration (\d+) in "
                  r"(\S+?)( \(saved now\))?\. Resume with: (tnlg pretrain --save \S+ --use-checkpoint-args"
                  r"(?: --nproc-per-node \d+)?) \(every flag spelled out: (tnlg pretrain .+?)\)"
                  r"( \(under torchrun: the same torchrun command with these arguments\))?$", found[0])
    assert m, found[0]
    assert m.group(5).split()[3] == m.group(3), found[0]  # the folder it saved in
    return int(m.group(1)), int(m.group(2)), m.group(3), bool(m.group(4)), m.group(5), m.group(6), m.group(7)


def _resume(command, cwd):
    argv = shlex.split(command)
    assert argv[:2] == ["tnlg", "pretrain"], command
    return run_tnlg(argv[1:], cwd)


def _train_losses(path):
    return [r["loss"] for r in map(json.loads, open(path)) if r.get("split") != "valid"]


def _check_metrics(path):
    records = [json.loads(line) for line in open(path)]
    train = [r["iteration"] for r in records if r.get("split") != "valid"]
    valid = [r["iteration"] for r in records if r.get("split") == "valid"]
    assert train == list(range(1, ITERS + 1)), train  # each iteration once, in order
    assert valid == sorted(set(valid)) and valid[0] == 0 and valid[-1] == ITERS, valid


def test_ctrl_c_saves_the_current_iteration_and_the_resume_continues_exactly(tmp_path):
    """Ctrl-C (SIGINT to the process group) on the built-in job under the launcher, which saves nothing
    on its own before iteration 100: the workers finish the iteration, save it, and rank 0 prints one
    message; its command resumes the job's own folder, and the losses of the interrupted and resumed
    run are those of a run that was never interrupted, bit for bit."""
    rc, out = _interrupted_run(["--nproc-per-node", "2", *_flags(**BUILTIN_JOB, plot=None)], tmp_path,
                               signal.SIGINT, lambda: True)
    assert rc == 128 + signal.SIGINT, out[-3000:]
    n, m, folder, saved, command, full, _ = _message(out, signal.SIGINT)
    assert folder.startswith("runs/pretrain-") and saved and m == n < ITERS, out[-3000:]
    assert ck.list_iterations(str(tmp_path / folder)) == [n]  # the one checkpoint: Ctrl-C's
    assert command == f"tnlg pretrain --save {folder} --use-checkpoint-args --nproc-per-node 2", command
    assert f"--save {folder}" in full and "--nproc-per-node 2" in full

    out = _resume(command, tmp_path)
    assert f"at iteration {m} (" in out, out[-3000:]
    _check_metrics(tmp_path / folder / "metrics.jsonl")
    assert (tmp_path / folder / "metrics_loss.png").exists()
    run_tnlg(["pretrain", "--nproc-per-node", "2", *_flags(**BUILTIN_JOB, save="reference")], tmp_path)
    assert _train_losses(tmp_path / folder / "metrics.jsonl") == _train_losses(tmp_path / "reference" /
                                                                               "metrics.jsonl")


def test_a_second_ctrl_c_stops_at_once_without_a_save(tmp_path):
    """The first Ctrl-C finds the workers training; the second one reaches them inside the save that the
    first asked for (made slow by tests/fault_injection: 60 s): the run stops within seconds, rank 0 says
    it stopped at once, and no checkpoint is written."""
    save, marker = tmp_path / "ckpt", tmp_path / "saving"
    env = checkout_env(TNLG_TEST_SLOW_SAVE=str(marker))
    env["PYTHONPATH"] = os.path.join(ROOT, "tests", "fault_injection") + os.pathsep + env["PYTHONPATH"]
    rc, out = _interrupted_run(["--nproc-per-node", "2", *_flags(tensor_model_parallel_size=1, save=str(save))],
                               tmp_path, signal.SIGINT, lambda: True, env=env,
                               second=lambda: all(os.path.exists(f"{marker}.{r}") for r in (0, 1)))
    assert rc == 128 + signal.SIGINT, out[-3000:]
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out[-4000:]
    found = [line for line in out.splitlines() if "interrupted (SIGINT, stopped at once) at iteration" in line]
    assert len(found) == 1, out[-4000:]
    assert f"there is no checkpoint in {save} yet" in found[0], found[0]
    assert ck.list_iterations(str(save)) == [] and ck.read_latest(str(save)) is None


def test_ctrl_c_under_torchrun_saves_and_names_the_torchrun_command(tmp_path):
    """torchrun (not our launcher) forwards the Ctrl-C to its 2 workers: they save the iteration, and rank 0
    says to resume with the same torchrun command (torchrun itself then ends with its own traceback)."""
    save = tmp_path / "ckpt"
    torchrun = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    rc, out = _interrupted_run(_flags(tensor_model_parallel_size=1, save=str(save)), tmp_path, signal.SIGINT,
                               lambda: True, launcher=torchrun)
    n, m, folder, saved, command, _, torchrun_note = _message(out, signal.SIGINT, launcher_traceback=True)
    assert saved and n == m and ck.list_iterations(str(save)) == [n] and folder == str(save)
    assert torchrun_note and "--nproc-per-node" not in command, command  # torchrun's own says how many
    assert rc != 0  # torchrun's own exit status for a signal


def test_sigterm_saves_reports_and_resumes(tmp_path):
    """SIGTERM to the process group (a scheduler's preemption) of a TP 2 run on one's own data that also
    saves every 2nd iteration: a checkpoint of the last iteration, the same single message, then the
    continuation."""
    save = tmp_path / "ckpt"
    rc, out = _interrupted_run(["--nproc-per-node", "2", *_flags(tensor_model_parallel_size=2, save_interval=2,
                                                                 save=str(save))], tmp_path, signal.SIGTERM,
                               lambda: ck.read_latest(str(save)) is not None)
    assert rc == 128 + signal.SIGTERM, out[-3000:]
    n, m, folder, saved, _, command, _ = _message(out, signal.SIGTERM)  # the full command resumes too
    assert saved and n == m == ck.read_latest(str(save)) and folder == str(save)
    _resume(command, tmp_path)
    _check_metrics(save / "metrics.jsonl")


def test_ctrl_c_on_one_process_without_save(tmp_path):
    """One process (no launcher), no --save: the message says that nothing was saved and how to get a save
    next time, and the exit status is a signalled command's."""
    metrics = tmp_path / "m.jsonl"
    rc, out = _interrupted_run(["--nproc-per-node", "1", *_flags(tensor_model_parallel_size=1, train_iters=100000,
                                                                 metrics_file=str(metrics))],
                               tmp_path, signal.SIGINT, metrics.exists)
    assert rc == 128 + signal.SIGINT, out[-3000:]
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out[-3000:]
    m = re.search(r"interrupted \(SIGINT\) at iteration (\d+) of 100000\. This run saved nothing: it has no "
                  r"save root \(no --save.*iteration (\d+) was not written\. Start it again with --save DIR", out)
    assert m and m.group(1) == m.group(2), out[-3000:]


def test_sighup_to_one_process_saves_like_ctrl_c(tmp_path):
    """SIGHUP (a closed terminal; torchrun forwards it too) to one process with --save: that iteration is
    saved, the message says so, and the exit status is a SIGHUP-ed command's."""
    save = tmp_path / "ckpt"
    rc, out = _interrupted_run(["--nproc-per-node", "1", *_flags(tensor_model_parallel_size=1, train_iters=100000,
                                                                 save=str(save))],
                               tmp_path, signal.SIGHUP, lambda: True)
    assert rc == 128 + signal.SIGHUP, out[-3000:]
    n, m, folder, saved, *_ = _message(out, signal.SIGHUP)
    assert saved and n == m and ck.list_iterations(str(save)) == [n] and folder == str(save)


def test_ctrl_c_on_a_two_process_eval_exits_130_with_one_line(tmp_path):
    """Ctrl-C (SIGINT to the process group) on `tnlg eval --nproc-per-node 2` while both ranks evaluate: exit
    status 130 and one line from rank 0, no traceback on any rank (each rank used to print its
    KeyboardInterrupt traceback). stderr is a terminal here, so the ranks say when they evaluate."""
    import pty

    from tests.hf_reference import random_gpt2
    from tnlg.cli import main
    from tnlg.data.corpus import corpus_documents
    random_gpt2(4096, 16).save_pretrained(tmp_path / "hf")
    assert main(["convert", "--from", "hf", str(tmp_path / "hf"), "--to", str(tmp_path / "ckpt"),
                 "--tokenizer-model", "builtin"]) == 0
    text = tmp_path / "long.txt"
    text.write_text("".join(t for _, t in corpus_documents())[:400000])
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "tnlg", "eval", "--task", "text", "--checkpoint",
                             str(tmp_path / "ckpt"), "--nproc-per-node", "2", "--micro-batch-size", "1",
                             "--overlapping-eval", "8", str(text)], cwd=str(tmp_path), env=checkout_env(),
                            stdout=subprocess.PIPE, stderr=slave, text=True, start_new_session=True)
    os.close(slave)
    chunks: list[bytes] = []

    def read():
        while True:
            try:
                data = os.read(master, 4096)
            except OSError:  # the terminal closed: every process that held it has ended
                return
            if not data:
                return
            chunks.append(data)
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        _wait_for(lambda: b"evaluating --task text" in b"".join(chunks), proc, [])
        time.sleep(1)
        os.killpg(proc.pid, signal.SIGINT)
        rc = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    reader.join(timeout=10)
    os.close(master)
    err = b"".join(chunks).decode(errors="replace").replace("\r\n", "\n")
    assert rc == 128 + signal.SIGINT, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    after = err.split("evaluating --task text", 1)[1].strip().splitlines()
    assert after == ["tnlg eval: interrupted (Ctrl-C); nothing was written."], err[-3000:]
    assert proc.stdout.read() == ""
