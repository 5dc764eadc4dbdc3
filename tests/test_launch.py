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
