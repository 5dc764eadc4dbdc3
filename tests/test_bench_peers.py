"""scripts/bench_peers.py end to end in its smoke-test shape: every framework's training step runs
(megatron-core's under CPU autocast through the re-wrapped linear layers), a table is printed and the
JSON holds each step's seconds, and the three start from losses near ln(vocab) (random weights of the
same statistics)."""

import json
import math
import subprocess
import sys

import pytest

from tnlg.runtime.spawn import checkout_env


@pytest.mark.slow  # three fresh processes, one of them importing megatron-core: ~1 min
def test_bench_peers_tiny(tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "peers.json"
    proc = subprocess.run([sys.executable, "scripts/bench_peers.py", "--tiny", "--tp", "1", "--precisions", "bf16",
                           "--json", str(out)], capture_output=True, text=True, timeout=600, env=checkout_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "bf16 TP 1" in proc.stdout and "tnlg/mcore" in proc.stdout
    record = json.loads(out.read_text())
    frameworks = record["frameworks"]
    assert {"tnlg", "hf"} <= set(frameworks)
    row = record["raw"]["bf16 TP 1"]
    for fw in frameworks:
        (run,) = row[fw]
        assert len(run["times"]) == 2 and all(t > 0 for t in run["times"])
        assert abs(run["first_loss"] - math.log(256)) < 0.5, (fw, run["first_loss"])
    if "megatron" in frameworks:
        assert "tnlg/megatron" in record["summary"]["bf16 TP 1"]
    else:
        assert "megatron-core is not installed" in proc.stdout


def test_bench_peers_refuses_bad_load():
    proc = subprocess.run([sys.executable, "scripts/bench_peers.py", "--competing-load", "-1"], capture_output=True,
                          text=True, timeout=60, env=checkout_env())
    assert proc.returncode == 2 and "--competing-load must be 0 or more" in proc.stderr
    assert "Traceback" not in proc.stderr
