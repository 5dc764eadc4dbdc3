"""Faults injected into one rank of a real launcher run (``tnlg pretrain --nproc-per-node 2``: TP 1 x DP 2,
gloo), each ending the whole job promptly with one message that names the failing rank.

The faults come from outside the library: ``tests/fault_injection/sitecustomize.py`` is imported by every
process the test starts (a user error on one rank only, a full disk while one rank writes, a stale view of
the save root on rank 1, a SIGKILL of rank 1 mid-save, a NaN in rank 1's weights), or the files are
damaged on disk (a bit flip in DP rank 1's optimizer shard), or a real 4 MiB tmpfs fills up (as root).

For each: what the user sees, the exit status, the time to exit with the process-group timeout at
10 minutes (under 60 s), that nothing outside the save root was written (the working directory and
the temporary folder stay empty) and that the previous checkpoint still loads and resumes exactly:
the resumed losses equal those of an uninterrupted run of the same options.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time

import pytest

from tnlg import checkpoint as ck
from .tmpfs import mount_tmpfs, unmount

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INJECT = os.path.join(ROOT, "tests", "fault_injection")
PG_TIMEOUT_MIN = 10
EXIT_WITHIN_S = 60


def _argv(save, iters=4, **extra):
    from tnlg.data.corpus import default_dataset
    prefix, tok = default_dataset()
    argv = ["--nproc-per-node", "2", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", str(iters),
            "--lr", "3e-3", "--min-lr", "3e-4", "--lr-warmup-iters", "2", "--lr-decay-iters", "4",
            "--data-path", prefix, "--tokenizer-model", tok, "--eval-interval", "0", "--log-interval", "1",
            "--no-plot", "--sample-prompt", "", "--peak-tflops", "1", "--save", str(save), "--save-interval", "2",
            "--distributed-timeout-minutes", str(PG_TIMEOUT_MIN)]
    for k, v in extra.items():
        argv += [f"--{k.replace('_', '-')}", str(v)]
    return argv


def _run(tmp_path, argv, **fault):
    """``tnlg pretrain argv`` with the fault variables set; ``(exit status, output, seconds)``. It runs in an
    empty working directory with its own temporary folder, both checked to stay empty."""
    cwd, tmp = tmp_path / "cwd", tmp_path / "tmp"
    cwd.mkdir(exist_ok=True)
    tmp.mkdir(exist_ok=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([INJECT, ROOT, os.environ.get("PYTHONPATH", "")]),
               TMPDIR=str(tmp), **{k: str(v) for k, v in fault.items()})
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "tnlg", "pretrain", *argv], cwd=str(cwd), env=env,
                          capture_output=True, text=True, timeout=300)
    took = time.monotonic() - t0
    # (torch itself makes an empty torchinductor_<user> cache folder when torch._dynamo is imported)
    left = [n for n in os.listdir(tmp) if not n.startswith("torchinductor_")]
    assert os.listdir(cwd) == [] and left == [], f"files written outside the save root: {left}"
    return proc.returncode, proc.stdout + proc.stderr, took


def _losses(root):
    out = {}
    with open(os.path.join(root, "metrics.jsonl")) as f:
        for line in f:
            r = json.loads(line)
            if r.get("split") != "valid":
                out[r["iteration"]] = r["loss"]
    return [out[i] for i in sorted(out)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted run of 4 iterations (checkpoints at 2 and 4): its losses, its root (``full``: the
    starting point of the stale-view tests, which need a latest checkpoint after 2) and a root holding
    only its checkpoint of iteration 2 (``start``: the starting point every other fault test copies)."""
    tmp = tmp_path_factory.mktemp("reference")
    full = tmp / "full"
    status, log, _ = _run(tmp, _argv(full))
    assert status == 0, log[-3000:]
    start = tmp / "start"
    start.mkdir()
    shutil.copytree(full / "iter_0000002", start / "iter_0000002")
    (start / ck.LATEST).write_text("2\n")
    with open(full / "metrics.jsonl") as f, open(start / "metrics.jsonl", "w") as g:
        g.writelines(line for line in f if json.loads(line)["iteration"] <= 2)
    return dict(losses=_losses(full), start=start, full=full)


def _fresh_root(reference, tmp_path, start="start"):
    root = tmp_path / "save"
    shutil.copytree(reference[start], root)
    return root


def _still_at_2(root):
    """The previous checkpoint (iteration 2) is still the latest, and the failed save left no debris."""
    assert ck.read_latest(str(root)) == 2
    assert sorted(n for n in os.listdir(root) if n.startswith("iter_")) == ["iter_0000002"]


def _resumes_exactly(reference, tmp_path, root):
    """The previous checkpoint (iteration 2) is still the latest, loads, and the run continues exactly."""
    _still_at_2(root)
    status, log, _ = _run(tmp_path, _argv(root))
    assert status == 0, log[-3000:]
    assert "resumed from" in log and "at iteration 2" in log, log[-3000:]
    assert _losses(root) == reference["losses"], log[-3000:]


def _one_message(log, text):
    """The failure is said once, with no traceback and none of the launcher's own failure lines."""
    assert log.count(text) == 1, log[-3000:]
    assert "Traceback" not in log and "failed (exitcode" not in log and "ChildFailedError" not in log, log[-3000:]


@pytest.mark.slow
def test_user_error_on_one_rank_only_is_printed_once_and_stops_the_other(reference, tmp_path):
    """On rank 1, then on rank 0, of the same root: each run stops both ranks promptly with that rank's
    message printed once, and leaves checkpoint 2 the latest; it then resumes exactly."""
    root = _fresh_root(reference, tmp_path)
    for rank in (1, 0):
        status, log, took = _run(tmp_path, _argv(root), TNLG_TEST_USER_ERROR=rank)
        assert status == 2 and took < EXIT_WITHIN_S, (rank, status, took, log[-3000:])
        _one_message(log, f"error on rank {rank} of 2: injected: the data of rank {rank} cannot be read.")
        _still_at_2(root)
    _resumes_exactly(reference, tmp_path, root)


@pytest.mark.slow
def test_bit_flip_in_dp_rank_1_optimizer_shard_names_the_rank_and_file(reference, tmp_path):
    root = _fresh_root(reference, tmp_path)
    shard = root / "iter_0000002" / "optim_tp00_dp001.safetensors"
    good = shard.read_bytes()
    damaged = bytearray(good)
    damaged[-5] ^= 0x10  # a bit of the last tensor's data: the size stays, the SHA-256 does not
    shard.write_bytes(bytes(damaged))
    status, log, took = _run(tmp_path, _argv(root))
    assert status == 2 and took < EXIT_WITHIN_S, (status, took, log[-3000:])
    _one_message(log, "rank 1: checkpoint file")
    assert "optim_tp00_dp001.safetensors' does not match the SHA-256" in log, log[-3000:]
    shard.write_bytes(good)  # the copy restored: the same checkpoint resumes exactly
    _resumes_exactly(reference, tmp_path, root)


@pytest.mark.slow
def test_rank_that_sees_an_older_latest_loads_rank_0s_choice(reference, tmp_path):
    """Rank 1's ``latest`` reads 2 while the root holds 4: every rank loads iteration 4, which rank 0 chose."""
    root = _fresh_root(reference, tmp_path, "full")  # checkpoints 2 and 4; 4 is the latest
    status, log, took = _run(tmp_path, _argv(root, iters=6, lr_decay_iters=4), TNLG_TEST_STALE_VIEW="latest:1:2")
    assert status == 0 and took < EXIT_WITHIN_S * 2, (status, took, log[-3000:])
    assert "resumed from" in log and "at iteration 4" in log, log[-3000:]
    assert len(_losses(root)) == 6


@pytest.mark.slow
def test_rank_that_does_not_see_the_chosen_checkpoint_is_a_clear_error(reference, tmp_path):
    root = _fresh_root(reference, tmp_path, "full")  # checkpoints 2 and 4; 4 is the latest
    status, log, took = _run(tmp_path, _argv(root, iters=6), TNLG_TEST_STALE_VIEW="hidden:1:2")
    assert status == 2 and took < EXIT_WITHIN_S, (status, took, log[-3000:])
    _one_message(log, "rank 1 does not see meta.json in")
    assert "iter_0000004" in log and ck.read_latest(str(root)) == 4


@pytest.mark.slow
def test_disk_full_on_one_rank_mid_save_keeps_the_previous_checkpoint(reference, tmp_path):
    """On rank 1 (its optimizer shard), then on rank 0 (the weights) of the same root: each failed save
    leaves checkpoint 2 the latest, with no debris; it then resumes exactly."""
    root = _fresh_root(reference, tmp_path)
    for rank in (1, 0):
        status, log, took = _run(tmp_path, _argv(root), TNLG_TEST_ENOSPC_AT=f"4:{rank}")
        assert status == 2 and took < EXIT_WITHIN_S, (rank, status, took, log[-3000:])
        _one_message(log, f"failed on 1 of 2 ranks; rank {rank}: could not write")
        # the failing rank's first file (DP rank 0 writes the weights, DP rank 1 only its optimizer shard)
        assert f"iter_0000004.tmp/{'model_tp00' if rank == 0 else 'optim_tp00_dp001'}.safetensors'" in log, \
            log[-3000:]
        assert "No space left on device" in log and "MiB free of" in log, log[-3000:]
        assert "the latest checkpoint in" in log and "is still iteration 2" in log, log[-3000:]
        _still_at_2(root)
    _resumes_exactly(reference, tmp_path, root)


@pytest.mark.slow
def test_real_disk_full_on_a_small_tmpfs(reference, tmp_path):
    mnt = tmp_path / "small"
    mount_tmpfs(mnt, "3m")
    try:
        root = mnt / "save"
        shutil.copytree(reference["start"], root)  # ~1.8 MiB: a second checkpoint does not fit
        status, log, took = _run(tmp_path, _argv(root))
        assert status == 2 and took < EXIT_WITHIN_S, (status, took, log[-3000:])
        # one message, printed once; it names each rank whose write hit the full disk (one or both,
        # depending on which rank's write came first)
        failed = re.search(r"failed on (\d) of 2 ranks", log)
        assert failed and log.count("tnlg pretrain: error:") == 1, log[-3000:]
        assert log.count("No space left on device") == int(failed.group(1)), log[-3000:]
        assert "MiB free of 3.0 MiB" in log, log[-3000:]
        assert "Traceback" not in log and "failed (exitcode" not in log, log[-3000:]
        assert ck.read_latest(str(root)) == 2
        moved = tmp_path / "moved"
        shutil.copytree(root, moved)  # the previous checkpoint, where there is room, resumes exactly
    finally:
        unmount(mnt)
    _resumes_exactly(reference, tmp_path, moved)


@pytest.mark.slow
def test_rank_killed_mid_save_stops_the_job_promptly(reference, tmp_path):
    root = _fresh_root(reference, tmp_path)
    status, log, took = _run(tmp_path, _argv(root), TNLG_TEST_KILL_DURING_SAVE="4:1")
    assert status != 0 and took < EXIT_WITHIN_S, (status, took, log[-3000:])
    assert "Traceback" not in log, log[-3000:]
    assert "worker rank 1 was killed by SIGKILL (exit code -9)" in log or "did not report within 5 s: 1" in log, \
        log[-3000:]
    # the killed save's folder is debris the next save removes; iteration 2 is still the latest
    shutil.rmtree(root / "iter_0000004.tmp", ignore_errors=True)
    _resumes_exactly(reference, tmp_path, root)


@pytest.mark.slow
def test_nan_on_one_rank_stops_every_rank_once_and_is_not_restarted(reference, tmp_path):
    root = _fresh_root(reference, tmp_path)
    status, log, took = _run(tmp_path, _argv(root, max_restarts=2), TNLG_TEST_NAN_AT="3:1")
    assert status == 1 and took < EXIT_WITHIN_S, (status, took, log[-3000:])
    _one_message(log, "the training loss is nan at iteration 3")
    assert "The last checkpoint is iteration 2" in log
    assert log.count("resumed from") == 1, log[-3000:]  # not restarted into the same divergence
    _resumes_exactly(reference, tmp_path, root)


@pytest.mark.slow
def test_parameters_that_are_not_finite_are_never_saved(reference, tmp_path):
    """An update that leaves a parameter NaN at iteration 4 (its loss was finite): the save of iteration 4
    is refused on every rank alike, the run stops with exit status 1 naming the last (finite)
    checkpoint, iteration 2, which stays the latest and resumes exactly; not restarted."""
    root = _fresh_root(reference, tmp_path)
    status, log, took = _run(tmp_path, _argv(root, max_restarts=2), TNLG_TEST_NAN_PARAM_AFTER="4:0")
    assert status == 1 and took < EXIT_WITHIN_S, (status, took, log[-3000:])
    _one_message(log, "the model's parameters are not finite after iteration 4")
    assert "holds NaN or infinite values" in log and "The last checkpoint is iteration 2" in log, log[-3000:]
    assert log.count("resumed from") == 1, log[-3000:]
    _resumes_exactly(reference, tmp_path, root)


def _nearly_full_tmpfs(mnt, free_kib: int) -> None:
    """Mount a 256 KiB tmpfs on ``mnt`` and fill it but ``free_kib`` KiB (skip where that is not allowed)."""
    mount_tmpfs(mnt, "256k")
    (mnt / "spare").write_bytes(b"\0" * 1024 * free_kib)
    with open(mnt / "filler", "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError:
            pass
    (mnt / "spare").unlink()


# what each run points at the nearly full filesystem, how much room it leaves there, and what the message names
_REPORTS = {"metrics": (lambda m: ["--metrics-file", str(m / "metrics.jsonl")], 4, "the metrics file", "metrics.jsonl"),
            "tensorboard": (lambda m: ["--tensorboard-dir", str(m / "tb")], 4, "TensorBoard's event file", "tb"),
            "plot": (lambda m: ["--metrics-file", str(m / "m.jsonl")], 12, "the loss curve", "m_loss.png"),
            "log": (lambda m: [], 4, "the log (standard output)", "out.log")}


@pytest.mark.slow
@pytest.mark.parametrize("output", [pytest.param(o, marks=pytest.mark.needs_package("tensorboard")) if o == "tensorboard"
                                    else o for o in _REPORTS])
def test_a_full_disk_under_the_runs_reports_ends_in_one_message(tmp_path, output):
    """rank 0's metrics file, TensorBoard's events, the loss plot and the log lines (standard output
    redirected to a file) on a real, nearly full tmpfs, the checkpoints elsewhere: the run ends in one
    paragraph naming that file and the full disk (no traceback, no "worker rank 0 failed"), exit status 2,
    and the checkpoints saved before are intact: the run resumes from the latest."""
    flags, free_kib, what, name = _REPORTS[output]
    mnt, save = tmp_path / "small", tmp_path / "save"
    _nearly_full_tmpfs(mnt, free_kib)
    try:
        argv = [a for a in _argv(save, iters=12 if output == "plot" else 40, save_interval=4)
                if not (output == "plot" and a == "--no-plot")] + flags(mnt)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
        with open(mnt / "out.log" if output == "log" else tmp_path / "out.log", "w") as out:
            proc = subprocess.run([sys.executable, "-m", "tnlg", "pretrain", *argv], cwd=str(tmp_path), env=env,
                                  stdout=out, stderr=subprocess.PIPE, text=True, timeout=300)
    finally:
        unmount(mnt)
    log = proc.stderr
    assert proc.returncode == 2, log[-3000:]
    assert log.count("tnlg pretrain: error") == 1 and f"{what}: could not write" in log, log[-3000:]
    assert f"{name}': No space left on device (errno 28)" in log, log[-3000:]
    assert "Traceback" not in log and "failed (exitcode" not in log and "worker rank" not in log, log[-3000:]
    latest = ck.read_latest(str(save))
    assert latest is not None and latest % 4 == 0, log[-3000:]
    if output == "metrics":  # the latest checkpoint loads and the run goes on from it
        (tmp_path / "again").mkdir()
        status, out, _ = _run(tmp_path / "again", _argv(save, iters=latest + 1, save_interval=4))
        assert status == 0 and f"at iteration {latest}" in out, out[-3000:]
