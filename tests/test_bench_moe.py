"""scripts/bench_moe.py end to end in its smoke-test shape (``--tiny``: h 64, E 4, top-2, expert width 64, 32
tokens x 2 sequences per rank): the whole-model rows (dense and MoE at EP 1 and 2) and tnlg's MoE layer alone at EP
1 and 2 are timed, with megatron-core's MoE layer beside them where it is installed (a visible note where it is
not). Each layer holds the parameters its shapes give (router ``E h``, ``E / EP`` SwiGLU experts of ``3 f h``), the
same for both frameworks, and only expert parallelism moves tokens between the ranks."""

import json
import subprocess
import sys

import pytest

from tnlg.runtime.spawn import checkout_env

H, E, F, SEQ, BATCH = 64, 4, 64, 32, 2  # the --tiny shape


def _layer_params(ep: int) -> int:
    return E * H + (E // ep) * 3 * F * H


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_moe") / "moe.json"
    proc = subprocess.run([sys.executable, "scripts/bench_moe.py", "--tiny", "--out", str(out)], capture_output=True,
                          text=True, timeout=600, env=checkout_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout, json.loads(out.read_text())


def _check_row(row: dict, ep: int) -> None:
    assert row["step_s"] > 0 and all(len(t) == 2 for t in row["times"])
    assert row["tokens_per_s"] == pytest.approx(SEQ * BATCH / row["step_s"])  # both the slower rank's
    if ep == 1:
        assert row["collective_share"] == 0.0
    else:
        assert 0.0 < row["collective_share"] < 1.0


def test_tnlg_model_and_layer_rows(bench):
    stdout, record = bench
    rows = record["rows"]
    for name in ("model dense (same active MLP)", "model MoE EP 1", "model MoE EP 2", "layer tnlg EP 1",
                 "layer tnlg EP 2"):
        assert name in stdout
        _check_row(rows[name], 2 if "EP 2" in name else 1)
    for ep in (1, 2):
        assert rows[f"layer tnlg EP {ep}"]["params_rank0"] == _layer_params(ep)
    assert rows["model MoE EP 1"]["params_rank0"] - rows["model MoE EP 2"]["params_rank0"] == 2 * 3 * F * H
    assert "load average" in stdout and record["machine"]["cpu"] in stdout
    if record["megatron_skipped"]:
        assert "megatron-core's MoE layer rows skipped: megatron-core is not installed" in stdout
        assert not any("megatron" in name for name in rows)


@pytest.mark.needs_package("megatron.core")
def test_megatron_core_layer_rows_beside_tnlgs(bench):
    stdout, record = bench
    assert record["megatron_skipped"] is None
    for ep in (1, 2):
        row = record["rows"][f"layer megatron-core EP {ep}"]
        _check_row(row, ep)
        assert row["params_rank0"] == _layer_params(ep)
