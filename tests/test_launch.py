"""tnlg's own launcher (``--nproc-per-node``) listens on loopback only: its rendezvous store is bound to
127.0.0.1 and nothing of it is reachable from another host."""

from __future__ import annotations

import os

import pytest

from tnlg import launch


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
