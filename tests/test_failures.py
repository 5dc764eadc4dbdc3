"""The checkpoint folder's safety rules and the ranks' agreement on failures, in one process or a few
gloo processes (fast); the same faults through the real launcher are in tests/test_faults.py.

* a manifest naming a file outside its folder is refused before anything is opened;
* ``--keep-last`` and the debris cleaning touch only what tnlg wrote;
* a save whose write fails is one clear error, the save's folder removed, ``latest`` unchanged;
* one lock per save root; a second job is refused before any worker starts;
* a failure on some ranks is raised on every rank with one message naming each failing rank;
* a rank started by hand prints its own option error (no rank 0 will).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch

from tnlg import checkpoint as ck
from tnlg.checkpoint import files as F
from tnlg.config import GPTConfig
from tnlg.errors import UserError
from tnlg.runtime.spawn import run_distributed as run_fresh

from .pool import run_distributed
from .tmpfs import mount_tmpfs, unmount

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tiny():
    from tnlg.model import GPT
    from tnlg.optim import build_engine
    from tnlg.parallel.state import ParallelState
    ps = ParallelState.single()
    cfg = GPTConfig(num_layers=1, hidden_size=32, num_attention_heads=4, seq_length=8, vocab_size=64)
    model = GPT(cfg, ps)
    engine = build_engine(model, ps, 1, lr=1e-2)
    x = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    engine.zero_grad()
    engine.backward(engine.model(x, labels=x))
    engine.step()
    return dict(model=model, engine=engine, ps=ps, config=cfg)


def _save(root, it, state, **kw):
    return ck.save(str(root), iteration=it, consumed_samples=8 * it, **state, **kw)


@pytest.mark.parametrize("name", ["../../../../etc/hostname", "/etc/hostname", "sub/model_tp00.safetensors", ".."])
def test_manifest_name_outside_the_folder_is_refused(tmp_path, name):
    state = _tiny()
    d = _save(tmp_path, 1, state)
    meta_path = os.path.join(d, F.META)
    meta = json.load(open(meta_path))
    meta["files"][name] = 10
    meta["sha256"][name] = "0" * 64
    json.dump(meta, open(meta_path, "w"))
    with pytest.raises(UserError, match="plain names inside its own folder"):
        ck.load(str(tmp_path), **state)


def test_keep_last_removes_only_tnlg_iterations(tmp_path):
    state = _tiny()
    foreign = tmp_path / "iter_0000001"  # a Megatron checkpoint's folder has the same name
    (foreign / "mp_rank_00").mkdir(parents=True)
    (foreign / "mp_rank_00" / "model_optim_rng.pt").write_bytes(b"megatron")
    for it in (2, 3, 4):
        _save(tmp_path, it, state, keep_last=1)
    assert F.list_iterations(str(tmp_path)) == [1, 4]
    assert (foreign / "mp_rank_00" / "model_optim_rng.pt").read_bytes() == b"megatron"


def test_debris_of_any_crash_point_is_recognised_and_removed(tmp_path):
    state = _tiny()
    done = _save(tmp_path, 2, state)
    (tmp_path / ".tnlg-trash-0123456789ab" / "x").mkdir(parents=True)   # a crash inside a removal
    (tmp_path / ".tnlg-new-0123456789ab").mkdir()                       # a crash while creating a save folder
    F.make_save_dir(str(tmp_path / "iter_0000005.tmp"))                 # a crash mid-save
    shutil.copytree(done, tmp_path / "iter_0000001.replaced.tmp")       # an older tnlg's replaced save
    (tmp_path / "iter_0000007.replaced.tmp").mkdir()                    # not ours: no tnlg manifest
    (tmp_path / "iter_0000008.tmp").mkdir()                             # not ours: no marker
    _save(tmp_path, 3, state)
    assert sorted(os.listdir(tmp_path)) == sorted([F.LATEST, "iter_0000002", "iter_0000003",
                                                   "iter_0000007.replaced.tmp", "iter_0000008.tmp"])


def test_a_save_into_someone_elses_folder_stops_with_a_clear_error(tmp_path):
    state = _tiny()
    _save(tmp_path, 2, state)
    (tmp_path / "iter_0000004.tmp" / "notes.txt").parent.mkdir()
    (tmp_path / "iter_0000004.tmp" / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="was not written by a tnlg save"):
        _save(tmp_path, 4, state)
    assert (tmp_path / "iter_0000004.tmp" / "notes.txt").read_text() == "mine"
    assert F.read_latest(str(tmp_path)) == 2


@pytest.mark.parametrize("failing", ["model_tp00", "optim_tp00_dp000"])
def test_a_write_that_fails_is_one_error_and_leaves_the_previous_checkpoint(tmp_path, monkeypatch, failing):
    """A full disk while writing one of the files (injected here by the test, not the library)."""
    from tnlg.checkpoint import stream
    state = _tiny()
    _save(tmp_path, 2, state)
    before = {n: os.path.getmtime(tmp_path / "iter_0000002" / n) for n in os.listdir(tmp_path / "iter_0000002")}
    real = stream.StreamWriter.write

    def full(self, key, tensor):
        if failing in self.path:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self.tmp)
        return real(self, key, tensor)
    monkeypatch.setattr(stream.StreamWriter, "write", full)
    with pytest.raises(UserError) as info:
        _save(tmp_path, 4, state)
    text = str(info.value)
    assert f"could not write {str(tmp_path / 'iter_0000004.tmp' / failing)}" in text.replace("'", "")
    assert "No space left on device (errno 28)" in text and "MiB free of" in text
    assert "the latest checkpoint in" in text and "is still iteration 2" in text and info.value.agreed
    assert sorted(os.listdir(tmp_path)) == sorted([F.LATEST, "iter_0000002"])  # the save's folder removed
    assert {n: os.path.getmtime(tmp_path / "iter_0000002" / n) for n in before} == before
    monkeypatch.undo()
    assert ck.load(str(tmp_path), **state)["iteration"] == 2


def test_a_locked_save_root_refuses_a_second_job_before_any_worker_starts(tmp_path):
    save = tmp_path / "save"
    held = F.lock_root(str(save))  # the first job
    try:
        from tests.tiny import tiny_flags
        proc = subprocess.run([sys.executable, "-m", "tnlg", "pretrain", "--nproc-per-node", "2",
                               *tiny_flags(num_layers=1, train_iters=2, save=str(save))],
                              cwd=str(tmp_path), capture_output=True, text=True, timeout=120,
                              env=dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")))
    finally:
        held.close()
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"is in use by another tnlg job (pid {os.getpid()} on " in proc.stderr, proc.stderr
    assert "parameters on this rank" not in proc.stdout  # no worker started
    assert sorted(os.listdir(save)) == [F.LOCK]  # (no wall-time bound: the output says no worker started)


def test_rank_started_by_hand_prints_its_own_option_error(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "tnlg", "pretrain", "--micro-batch-size", "3",
                           "--global-batch-size", "7"], cwd=str(tmp_path), capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, RANK="1", WORLD_SIZE="2",
                                   PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")))
    assert proc.returncode == 2
    assert proc.stderr.count("tnlg pretrain: error on rank 1 of 2: --global-batch-size 7 is not divisible") == 1
    assert os.listdir(tmp_path) == []


def _agree_body(ps, messages):
    from tnlg.parallel.state import agree_on_failure
    mine = messages[ps.rank]
    try:
        agree_on_failure(None if mine is None else UserError(mine), "loading")
    except UserError as exc:
        return str(exc), exc.agreed
    return None


def test_failures_on_some_ranks_are_raised_on_every_rank_naming_each():
    out = run_distributed(_agree_body, 4, 2, [None, "bad file A", None, "bad file B"])
    assert out == [("loading failed on 2 of 4 ranks; rank 1: bad file A rank 3: bad file B", True)] * 4
    out = run_distributed(_agree_body, 2, 1, ["same on all", "same on all"])
    assert out == [("same on all", True)] * 2  # one message, as every rank said it
    assert run_distributed(_agree_body, 2, 1, [None, None]) == [None, None]


def _fails_on_rank_1_while_rank_0_waits(ps, in_collective):
    """Rank 1 raises a user error at once; rank 0 sits in a barrier, or computes for 900 s before one."""
    if ps.rank == 1:
        raise UserError("the data of rank 1 cannot be read")
    if not in_collective:
        time.sleep(900)
    torch.distributed.barrier()


def _ranks(ps):
    return ps.rank


@pytest.mark.parametrize("harness", ["fresh", "pool"])
@pytest.mark.parametrize("in_collective", [True, False])
def test_harness_stops_every_rank_as_soon_as_one_fails(in_collective, harness):
    """Neither harness (new processes per call, or the tests' worker pool) waits for the process-group
    timeout nor for a busy rank (900 s each here): the failing rank's error stops the others, and its
    traceback is what is raised. The bound is a third of the wait, so it holds on a loaded machine
    (starting two processes there takes seconds, not minutes); the pool then serves the next call."""
    from tnlg.runtime.spawn import WorkerError
    run = run_fresh if harness == "fresh" else run_distributed
    t0 = time.monotonic()
    with pytest.raises(WorkerError, match="rank 1 failed:") as info:
        run(_fails_on_rank_1_while_rank_0_waits, 2, 1, in_collective, timeout_s=900)
    assert time.monotonic() - t0 < 300
    assert "UserError: the data of rank 1 cannot be read" in str(info.value)
    assert run(_ranks, 2, 1) == [0, 1]


def test_an_rng_file_on_a_full_disk_fails_with_the_oserror_the_save_guards(tmp_path):
    """torch.save straight into a file raises a RuntimeError from its zip writer when the disk fills (no errno,
    not caught by the save's guard: a traceback on that rank); the RNG file is serialised in memory first, so
    the full disk is an OSError (ENOSPC)."""
    from tnlg.checkpoint.saving import _write_rng
    mnt = tmp_path / "tiny"
    mount_tmpfs(mnt, "64k")
    try:
        with pytest.raises(OSError) as info:
            _write_rng(str(mnt), "rng.pt", {"state": torch.zeros(100_000)})
        assert info.value.errno == errno.ENOSPC
        assert os.listdir(mnt) == []  # nothing half-written
    finally:
        unmount(mnt)
