"""tnlg's own launcher (``--nproc-per-node``) listens on loopback only: its rendezvous store is bound to
127.0.0.1 and nothing of it is reachable from another host."""

from __future__ import annotations

import os

import pytest

from tnlg.runtime import launch


def _listening(port: int) -> set:
    """The local addresses listening on TCP ``port`` (IPv4 and IPv6), read from the kernel's tables."""
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(table):
            continue
        with open(table) as f:
            next(f)
            for line in f:
                local, state = line.split()[1], line.split()[3]
                addr, hex_port = local.split(":")
                if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                    out.add(addr)
    return out


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads Linux's socket tables")
def test_default_launch_binds_its_store_to_loopback_only(monkeypatch):
    seen = {}

    def fake_elastic_launch(config, entrypoint):
        host, port = config.rdzv_endpoint.rsplit(":", 1)
        seen.update(host=host, local_addr=config.local_addr, listening=_listening(int(port)))
        return lambda *args: None

    import torch.distributed.launcher.api as api
    monkeypatch.setattr(api, "elastic_launch", fake_elastic_launch)
    for var in ("OMP_NUM_THREADS", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"):  # set by the launcher: restored after
        monkeypatch.setenv(var, os.environ.get(var, "1"))
    for var in ("TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    assert launch.maybe_launch("eval", [], 2) == 0
    assert seen["host"] == "127.0.0.1" and seen["local_addr"] == "127.0.0.1"
    assert seen["listening"] == {"0100007F"}, seen  # 127.0.0.1 (little-endian hex); not 0.0.0.0, not ::


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_node_eval_through_rdzv_endpoint_matches_one_process(tmp_path):
    """Two launchers of ``tnlg eval --nnodes 2 --nproc-per-node 1 --rdzv-endpoint 127.0.0.1:PORT`` (two
    "nodes" on one machine) make one job of 2 ranks (DP 2), whose loss is the one-process loss."""
    import json
    import subprocess
    import sys

    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from tnlg.runtime.spawn import checkout_env, run_tnlg
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=4096, n_positions=32, n_embd=32, n_layer=2, n_head=4)).save_pretrained(
        tmp_path / "hf")
    (tmp_path / "t.txt").write_text("The king said to his army that the war was over. She came back to the city.")
    argv = ["eval", "--task", "wikitext", "--checkpoint", tmp_path / "hf", "--tokenizer-model", "builtin",
            "--input", tmp_path / "t.txt", "--overlapping-eval", "16", "--json"]
    one = json.loads(next(line for line in run_tnlg(argv, tmp_path).splitlines() if line.startswith("{")))
    nodes = argv + ["--nproc-per-node", "1", "--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{_free_port()}"]
    procs = [subprocess.Popen([sys.executable, "-m", "tnlg", *map(str, nodes)], cwd=str(tmp_path), env=checkout_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    results = [json.loads(line) for out in outs for line in out.splitlines() if line.startswith("{")]
    assert len(results) == 1, outs  # rank 0, on whichever node it is, prints the one result
    assert results[0]["data_parallel_size"] == 2
    assert abs(results[0]["val_loss"] - one["val_loss"]) <= 1e-6 * one["val_loss"], (results, one)


@pytest.mark.parametrize("extra,needle", [(["--nnodes", "2"], "go together"),
                                          (["--rdzv-endpoint", "h:1"], "go together"),
                                          (["--nnodes", "2", "--rdzv-endpoint", "node0"], "is not HOST:PORT")])
def test_nodes_and_endpoint_are_checked_before_any_process_starts(tmp_path, capsys, extra, needle):
    from tnlg.cli import main
    (tmp_path / "t.txt").write_text("some words")
    (tmp_path / "ck").mkdir()
    assert main(["eval", "--task", "wikitext", "--checkpoint", str(tmp_path / "ck"), "--tokenizer-model", "builtin",
                 "--input", str(tmp_path / "t.txt"), "--nproc-per-node", "2", *extra]) == 2
    assert needle in capsys.readouterr().err


def _gone(pid: int) -> bool:
    """Whether process ``pid`` has ended (a zombie nobody reaped counts as ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def _children(pid: int) -> list:
    """The pids whose parent is ``pid``, read from /proc."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(entry))
            except (OSError, IndexError, ValueError):
                pass
    return out


def _wait_gone(pids, seconds: float) -> list:
    import time
    deadline = time.time() + seconds
    while time.time() < deadline and not all(map(_gone, pids)):
        time.sleep(0.05)
    return [p for p in pids if not _gone(p)]


# a "launcher" that starts one worker in its own session (as torch's elastic agent does), says the worker's
# pid and how the worker watches it, then waits to be killed
_PARENT = r"""
import os, subprocess, sys
child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], start_new_session=True, stdout=subprocess.PIPE,
                         text=True, env=dict(os.environ, TNLG_LAUNCHER_PID=str(os.getpid()), TORCHELASTIC_RUN_ID="t"))
print(child.pid, child.stdout.readline().strip(), flush=True)
import time; time.sleep(300)
"""
_WORKER = r"""
import time
from tnlg.runtime.orphans import end_with_launcher
print(end_with_launcher(use_prctl={use_prctl}), flush=True)
time.sleep(300)
"""


@pytest.mark.skipif(not os.path.exists("/proc/1/stat"), reason="reads Linux's process table")
@pytest.mark.parametrize("use_prctl,how", [(True, "prctl"), (False, "watchdog")])
def test_a_worker_ends_by_itself_when_its_launcher_is_killed(use_prctl, how):
    """SIGKILL of the process that started a worker (which cannot forward it) ends the worker within
    seconds: by the kernel's parent-death signal on Linux, by the portable watchdog on the parent pid."""
    import signal
    import subprocess
    import sys

    from tnlg.runtime.spawn import checkout_env
    parent = subprocess.Popen([sys.executable, "-c", _PARENT, _WORKER.format(use_prctl=use_prctl)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=checkout_env())
    try:
        pid, said = parent.stdout.readline().split()
        worker = int(pid)
        assert said == how and not _gone(worker), said
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(timeout=10)
        assert _wait_gone([worker], 5.0) == [], "the worker outlived its launcher by 5 s"
    finally:
        parent.kill()
        if "worker" in locals() and not _gone(worker):
            os.kill(worker, signal.SIGKILL)
    err = parent.stderr.read()  # the worker's stderr is the launcher's: the message of the watchdog is there
    assert "Traceback" not in err, err
    if how == "watchdog":
        assert f"the launcher (pid {parent.pid}) is gone" in err and f"(pid {worker}) stops now" in err, err


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/1/stat"), reason="reads Linux's process table")
def test_sigkill_of_the_pretrain_launcher_ends_its_workers_and_the_job_restarts(tmp_path):
    """``kill -KILL`` of a ``tnlg pretrain --nproc-per-node 2`` launcher at TP 2 (workers in sessions of their
    own): both workers are gone within seconds, nothing saves after that, and the same job started again
    with ``--load`` is not refused by the save lock: it resumes from the last checkpoint and finishes."""
    import signal
    import subprocess
    import sys
    import time

    from tests.tiny import tiny_flags
    from tnlg import checkpoint as ck
    from tnlg.runtime.spawn import checkout_env, run_tnlg
    save = tmp_path / "ckpt"
    flags = tiny_flags(tensor_model_parallel_size=2, save=str(save), save_interval=3, log_interval=1)
    proc = subprocess.Popen([sys.executable, "-m", "tnlg", "pretrain", "--nproc-per-node", "2", *flags,
                             "--train-iters", "100000"], cwd=str(tmp_path), env=checkout_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    workers: list = []
    try:
        deadline = time.time() + 240
        while time.time() < deadline and proc.poll() is None and (ck.read_latest(str(save)) or 0) < 3:
            time.sleep(0.1)
        workers = _children(proc.pid)
        assert proc.poll() is None and len(workers) == 2, (proc.poll(), workers)
        proc.kill()  # SIGKILL to the launcher alone, as the out-of-memory killer sends it
        proc.wait(timeout=10)
        assert _wait_gone(workers, 5.0) == [], "workers outlived their launcher by 5 s"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        for pid in workers:  # (in sessions of their own: the launcher's group does not hold them)
            if not _gone(pid):
                os.kill(pid, signal.SIGKILL)
    last = ck.read_latest(str(save))
    time.sleep(1.0)
    assert ck.read_latest(str(save)) == last  # nothing saves any more
    out = run_tnlg(["pretrain", "--nproc-per-node", "2", *flags, "--load", str(save), "--train-iters", str(last + 2)],
                   tmp_path)
    assert "in use by another tnlg job" not in out
    assert ck.read_latest(str(save)) == last + 2, out[-3000:]


def _listeners() -> set:
    """Every local (address, port) in state LISTEN, from the kernel's tables of this network namespace,
    as the tables write them (little-endian hex: 127.0.0.1 is 0100007F)."""
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            next(f)
            for line in f:
                local, state = line.split()[1], line.split()[3]
                if state == "0A":
                    addr, port = local.split(":")
                    out.add((addr, int(port, 16)))
    return out


def _on_loopback(hex_addr: str) -> bool:
    """Whether a table's address is in 127.0.0.0/8 (IPv4, or IPv4-mapped IPv6) or is ::1."""
    if len(hex_addr) == 8:
        return hex_addr.endswith("7F")
    return hex_addr == "00000000000000000000000001000000" or (
        hex_addr.startswith("0000000000000000FFFF0000") and hex_addr.endswith("7F"))


# a private network namespace and mount namespace: loopback up, a veth pair whose end v0 holds 10.77.0.1, and
# the host name resolving to that address (as on a cluster node, where it resolves to the LAN address)
_NETNS = r"""
set -e
ip link set lo up
ip link add v0 type veth peer name v1
ip addr add 10.77.0.1/24 dev v0
ip link set v0 up
ip link set v1 up
printf '127.0.0.1 localhost\n10.77.0.1 %s\n' "$(hostname)" > "$HOSTS"
mount --bind "$HOSTS" /etc/hosts
exec "$@"
"""


def _in_netns(tmp_path, argv: list, timeout: float):
    """Run ``argv`` in a private network namespace (see _NETNS); skip where ``unshare`` is not permitted."""
    import shutil
    import subprocess

    from tnlg.runtime.spawn import checkout_env
    if not (shutil.which("unshare") and shutil.which("ip") and os.geteuid() == 0):
        pytest.skip("needs root, unshare and ip to make a private network namespace")
    probe = subprocess.run(["unshare", "-n", "-m", "sh", "-c", "ip link add v0 type veth peer name v1"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"no private network namespace with a veth pair here: {probe.stderr.strip()}")
    env = checkout_env(HOSTS=str(tmp_path / "hosts"))
    return subprocess.run(["unshare", "-n", "-m", "sh", "-c", _NETNS, "netns", *argv], cwd=str(tmp_path), env=env,
                          capture_output=True, text=True, timeout=timeout)


_INTERFACES = r"""
import os, socket
from tnlg.runtime.interfaces import gloo_interface
assert socket.gethostbyname(socket.gethostname()) == "10.77.0.1"  # the host name names the LAN-like address
print(gloo_interface(None), gloo_interface("10.77.0.1:29500"), gloo_interface("127.0.0.1:29500"))
os.environ["GLOO_SOCKET_IFNAME"] = "v1"
print(gloo_interface(None), gloo_interface("10.77.0.1:29500"))
"""


def test_gloo_interface_follows_the_store(tmp_path):
    """One node: loopback whatever the host name resolves to; several: the interface of the route to the
    endpoint's host; the user's own GLOO_SOCKET_IFNAME wins."""
    import sys
    proc = _in_netns(tmp_path, [sys.executable, "-c", _INTERFACES], 60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[:2] == ["lo v0 lo", "v1 v1"], proc.stdout


_JOB = r"""
import json, subprocess, sys, time
from tests.test_launch import _listeners
from tests.tiny import tiny_flags
job = subprocess.Popen([sys.executable, "-m", "tnlg", "pretrain", "--nproc-per-node", "2",
                        *tiny_flags(tensor_model_parallel_size=2, train_iters=20)],
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
seen = set()
while job.poll() is None:
    seen |= _listeners()
    time.sleep(0.05)
out = job.stdout.read()
print(json.dumps(dict(rc=job.returncode, seen=sorted(seen), out=out[-3000:])))
"""


@pytest.mark.slow
def test_a_single_node_job_listens_on_loopback_only(tmp_path):
    """A 2-process TP 2 ``tnlg pretrain`` on a host whose name resolves to a non-loopback address: no socket
    of the job (store, gloo) listens outside 127.0.0.0/8 at any moment of the run."""
    import json
    import re
    import sys
    proc = _in_netns(tmp_path, [sys.executable, "-c", _JOB], 400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    job = json.loads(proc.stdout)
    assert job["rc"] == 0 and re.search(r"iter +20/20", job["out"]), job["out"]
    seen = [tuple(x) for x in job["seen"]]
    assert len(seen) >= 2, seen  # the store, and gloo's sockets
    assert all(_on_loopback(addr) for addr, _ in seen), seen


def test_an_rdzv_endpoint_whose_host_does_not_resolve_is_one_paragraph():
    """``--rdzv-endpoint nonexistent.invalid:29555`` is refused before any launcher starts, in one paragraph
    naming the host (it used to end after a minute of retries in Python and C++ frames); a host that
    resolves passes."""
    from tnlg.errors import UserError
    from tnlg.runtime.launch import check_nodes
    with pytest.raises(UserError, match=r"the host 'nonexistent\.invalid' does not resolve.*e\.g\. node0:29500") as e:
        check_nodes(2, "nonexistent.invalid:29555")
    assert "\n" not in str(e.value)
    check_nodes(2, "127.0.0.1:29555")
    check_nodes(2, "localhost:29555")
