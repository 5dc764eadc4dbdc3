"""tnlg.io: the one atomic write, file lock and checksum every writer uses."""

import hashlib
import multiprocessing as mp
import os
import time

import pytest

from tnlg.io import atomic_output, atomic_write, file_lock, file_sha256, temporary_name


@pytest.mark.parametrize("durable", [True, False])
def test_atomic_write_replaces_whole_file_and_leaves_no_temporary(tmp_path, durable):
    path = tmp_path / "a.json"
    atomic_write(path, "old", durable=durable)
    atomic_write(path, b"new bytes", durable=durable)
    assert path.read_bytes() == b"new bytes" and os.listdir(tmp_path) == ["a.json"]


def test_failure_inside_the_block_keeps_the_old_file(tmp_path):
    path = tmp_path / "m.json"
    path.write_text("old")
    with pytest.raises(RuntimeError, match="boom"):
        with atomic_output(path) as f:
            f.write("half of the new")
            assert os.path.exists(temporary_name(path)) and path.read_text() == "old"
            raise RuntimeError("boom")
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["m.json"]


def test_bad_mode_and_checksum(tmp_path):
    with pytest.raises(ValueError, match="mode"):
        with atomic_output(tmp_path / "x", "a"):
            pass
    data = os.urandom(3 * 1024 + 7)
    (tmp_path / "d").write_bytes(data)
    assert file_sha256(tmp_path / "d", chunk=1000) == hashlib.sha256(data).hexdigest()


def _hold(lock_path, flag_path, seconds):
    with file_lock(lock_path):
        open(flag_path, "w").close()
        time.sleep(seconds)


def test_file_lock_excludes_another_process(tmp_path):
    lock, flag = tmp_path / "sub" / "x.lock", tmp_path / "held"
    p = mp.get_context("spawn").Process(target=_hold, args=(str(lock), str(flag), 1.0))
    p.start()
    try:
        deadline = time.time() + 60
        while not flag.exists():
            assert time.time() < deadline and p.is_alive(), "the other process never took the lock"
            time.sleep(0.01)
        t = time.perf_counter()
        with file_lock(lock):  # waits until the other process lets go
            waited = time.perf_counter() - t
    finally:
        p.join(60)
    assert p.exitcode == 0 and waited > 0.3


@pytest.fixture(params=[0o022, 0o027])
def umask(request):
    before = os.umask(request.param)
    yield request.param
    os.umask(before)


def test_written_files_get_the_umask_mode(tmp_path, umask):
    """Atomic writes and the Hugging Face export give files the mode of any new file (0666 less the
    umask): save_pretrained alone leaves model.safetensors at 0600, unreadable to the group."""
    from tnlg.io import umask_file_mode
    want = 0o666 & ~umask
    assert umask_file_mode() == want
    (tmp_path / "plain").write_text("x")  # what open() gives, the reference
    assert os.stat(tmp_path / "plain").st_mode & 0o777 == want
    stale = tmp_path / "a.bin"
    with open(temporary_name(stale), "wb"):
        pass
    os.chmod(temporary_name(stale), 0o600)  # a leftover temporary file of the same name
    atomic_write(stale, b"data")
    assert os.stat(stale).st_mode & 0o777 == want
    transformers = pytest.importorskip("transformers")
    from tnlg.interop.hf import write_hf_folder
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2, n_positions=8,
                                                              vocab_size=4096))
    out = write_hf_folder(hf, str(tmp_path / "hf"), "builtin")
    modes = {f: os.stat(os.path.join(out, f)).st_mode & 0o777 for f in os.listdir(out)}
    assert "model.safetensors" in modes and set(modes.values()) == {want}, modes
