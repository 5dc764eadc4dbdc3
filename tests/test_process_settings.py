"""A user's process that calls ``tnlg.init_parallel`` runs with the settings a ``tnlg`` command's worker runs with.

The command's workers join through :func:`tnlg.runtime.launch.join` (what ``tnlg pretrain`` / ``finetune`` call
in each process, and ``eval`` / ``generate`` / ``serve`` on several); a user's script of the README's shape
imports tnlg first and calls ``tnlg.init_parallel``. Each runs here in fresh processes, alone and under
``torchrun --nproc-per-node 2``, and reports what the process sees: torch's intra-op and interop threads, the
OpenMP and allocator variables of its environment, and whether a freed 64 MiB block stays in its heap (glibc's
default hands it back at once). Both ways must see the same, and the threads are the cores shared among the
local processes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tnlg.runtime.spawn import checkout_env

_PROBE = """
import json, os, sys
if sys.argv[1] == "command":
    import tnlg.cli  # (what `python -m tnlg` imports first)
    from tnlg.runtime.launch import join
    ps = join(1)
else:
    import tnlg, torch  # the README's script
    ps = tnlg.init_parallel()
import torch

def resident():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

block = bytearray(64 << 20)  # every page touched
before = resident()
del block
names = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY", "OMP_NUM_THREADS", "KMP_BLOCKTIME", "KMP_AFFINITY", "MALLOC_ARENA_MAX",
         "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")
print(json.dumps(dict(rank=int(os.environ.get("RANK", "0")), threads=torch.get_num_threads(),
                      interop=torch.get_num_interop_threads(), env={n: os.environ.get(n) for n in names},
                      freed_block_kept=before - resident() < (32 << 20))), flush=True)
"""

_USER_SETTINGS = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY", "OMP_NUM_THREADS", "MALLOC_MMAP_THRESHOLD_",
                  "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "GLIBC_TUNABLES")


def _seen(way: str, probe, launcher: list) -> dict:
    """What each rank of ``way`` (``command``, ``api``) reports, by rank."""
    env = {k: v for k, v in checkout_env().items() if k not in _USER_SETTINGS and not k.startswith("KMP_")}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID", "TNLG_STORE"):
        env.pop(name, None)
    done = subprocess.run([sys.executable, *launcher, str(probe), way], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    reports = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return {r.pop("rank"): r for r in reports}


@pytest.mark.skipif(not sys.platform.startswith("linux") or os.confstr("CS_GNU_LIBC_VERSION") is None,
                    reason="glibc's malloc (Linux) only")
@pytest.mark.parametrize("launcher,local", [([], 1),
                                            (["-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                                              "2"], 2)], ids=["alone", "torchrun-2"])
def test_a_users_process_sees_the_settings_a_command_worker_sees(tmp_path, launcher, local):
    probe = tmp_path / "probe.py"
    probe.write_text(_PROBE)
    command, api = _seen("command", probe, launcher), _seen("api", probe, launcher)
    assert sorted(command) == sorted(api) == list(range(local)), (command, api)
    assert api == command
    for seen in command.values():
        assert seen["threads"] == max(1, (os.cpu_count() or 1) // local), seen
        assert seen["freed_block_kept"] and seen["env"]["GOMP_SPINCOUNT"] == "1000", seen
