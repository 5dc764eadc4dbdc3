"""End-to-end fault tolerance through the real CLI and launchers (slow): a rank SIGKILLed mid-run under
the elastic launcher, SIGTERM -> save and exit, and a two-"node" loopback run with ``torchrun``.

Each launcher run is compared with the same options trained in-process (``run_distributed``,
one thread per rank as under the launcher), loss for loss.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from tests.tiny import resolve_flags, tiny_flags
from tnlg import checkpoint as ck
from .pool import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _argv(tmp, tp, iters, **extra):
    return tiny_flags(global_batch_size=8, train_iters=iters, lr=3e-3, min_lr=3e-4, lr_warmup_iters=2,
                      hidden_dropout=0.1, attention_dropout=0.1, tensor_model_parallel_size=tp, **extra)


def _train_body(ps, o):
    from tnlg.training import train
    return train(o)["losses"]


def _reference(argv, world):
    """The same options trained uninterrupted in-process (no checkpoints)."""
    o = resolve_flags(argv, world)
    o.checkpoint.save, o.logging.metrics_file = None, None
    return run_distributed(_train_body, world, 1, o, timeout_s=180)[0]


def _losses(metrics_file):
    """Per-iteration training loss; a re-run iteration (after a restart) keeps its last value."""
    out = {}
    with open(metrics_file) as f:
        for line in f:
            r = json.loads(line)
            if r.get("split") != "valid":
                out[r["iteration"]] = r["loss"]
    return [out[i] for i in sorted(out)]


def _env(**extra):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.update({k: str(v) for k, v in extra.items()})
    return env


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_elastic_restart_after_sigkill_resumes_exactly(tmp_path):
    save, metrics = tmp_path / "ckpt", tmp_path / "metrics.jsonl"
    argv = _argv(tmp_path, tp=1, iters=10, save=save, save_interval=4, metrics_file=metrics)
    # rank 1 SIGKILLs itself at the end of iteration 6 of the first attempt (checkpoint at 4), by
    # tests/fault_injection/sitecustomize.py.
    # TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: with torch's default shared rendezvous store, a restarted
    # group can read the dead group's gloo addresses (pytorch/pytorch#135712) and fail to connect.
    env = _env(TNLG_TEST_KILL_AT_ITERATION="6:1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1)
    env["PYTHONPATH"] = os.path.join(ROOT, "tests", "fault_injection") + os.pathsep + env["PYTHONPATH"]
    proc = subprocess.run([sys.executable, "-m", "tnlg", "pretrain", "--nproc-per-node", "2",
                           "--max-restarts", "1", *argv], env=env,
                          cwd=str(tmp_path), capture_output=True, text=True, timeout=600)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    assert "at iteration 4 (32 samples consumed)" in log, log[-4000:]  # the restart resumed from --save
    assert ck.read_latest(str(save)) == 10
    got = _losses(metrics)
    assert len(got) == 10
    assert got == _reference(argv, 2)


@pytest.mark.slow
def test_two_node_loopback_matches_single_node(tmp_path):
    save, metrics = tmp_path / "ckpt", tmp_path / "metrics.jsonl"
    argv = _argv(tmp_path, tp=2, iters=6, save=save, metrics_file=metrics)
    port = _free_port()
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node",
                               "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                               "--rdzv-id", f"tnlg-test-{port}", "-m", "tnlg", "pretrain", *argv],
                              env=_env(), cwd=str(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True)
             for _ in range(2)]
    logs = []
    for p in nodes:
        try:
            out, _ = p.communicate(timeout=600)
        except subprocess.TimeoutExpired:
            for q in nodes:
                q.kill()
            raise
        logs.append(out)
    assert all(p.returncode == 0 for p in nodes), "\n----\n".join(x[-3000:] for x in logs)
    assert ck.read_latest(str(save)) == 6
    assert ck.read_meta(ck.resolve(str(save)))["layout"] == dict(tp=2, dp=2, world=4, param_dtype="float32")
    assert _losses(metrics) == _reference(argv, 4)  # TP inside a node, DP across: same as one node


@pytest.mark.slow
def test_sigterm_saves_then_exits(tmp_path):
    """A SIGTERM to every worker of a launcher run: they agree on one iteration, save it, exit 0;
    the losses up to there are the uninterrupted run's."""
    save, metrics = tmp_path / "ckpt", tmp_path / "metrics.jsonl"
    argv = _argv(tmp_path, tp=2, iters=400, save=save, metrics_file=metrics, lr_decay_iters=400)
    proc = subprocess.Popen([sys.executable, "-m", "tnlg", "pretrain", "--nproc-per-node", "2", *argv],
                            env=_env(), cwd=str(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    reader = threading.Thread(target=lambda: setattr(proc, "log", proc.stdout.read()), daemon=True)
    reader.start()
    deadline = time.time() + 300
    while time.time() < deadline and not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        time.sleep(0.05)
    workers = _children_running_tnlg(proc.pid)
    assert workers, "no worker processes found"
    for pid in workers:  # what a scheduler does: SIGTERM to every process of the job
        os.kill(pid, signal.SIGTERM)
    assert proc.wait(timeout=300) == 0, proc.log[-3000:] if hasattr(proc, "log") else ""
    reader.join(timeout=10)
    assert "interrupted (SIGTERM) at iteration" in proc.log and "(saved now)" in proc.log, proc.log[-3000:]
    stopped = ck.read_latest(str(save))
    assert stopped is not None and 3 <= stopped < 400
    assert _losses(metrics) == _reference(_argv(tmp_path, tp=2, iters=stopped, lr_decay_iters=400), 2)


def _children_running_tnlg(root_pid):
    """PIDs of descendants of ``root_pid`` whose command line runs ``-m tnlg pretrain`` (the workers)."""
    parent = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    parent[int(d)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                pass
    out = []
    for pid in parent:
        p, seen = pid, 0
        while p in parent and p != root_pid and seen < 50:
            p, seen = parent[p], seen + 1
        if p == root_pid and pid != root_pid:
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read().split(b"\0")
            except OSError:
                continue
            if b"tnlg" in cmd and b"pretrain" in cmd:
                out.append(pid)
    return out
