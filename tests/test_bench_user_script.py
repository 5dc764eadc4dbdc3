"""scripts/bench_user_script.py end to end in its smoke-test shape: a user's script of the README's shape
(tnlg first, then torch first) and `tnlg pretrain` each train, a table is printed, and the JSON holds every
step's seconds per variant with the CPU and the load average. (A benchmark, not a timed test: no speed is
asserted.)"""

import json
import subprocess
import sys

import pytest

from tnlg.runtime.spawn import checkout_env


@pytest.mark.slow  # three fresh processes, one of them the command: ~30 s
def test_bench_user_script_tiny(tmp_path):
    out = tmp_path / "user.json"
    proc = subprocess.run([sys.executable, "scripts/bench_user_script.py", "--tiny", "--competing-load", "0",
                           "--json", str(out)], capture_output=True, text=True, timeout=600, env=checkout_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    for variant in ("script (tnlg first)", "script (torch first)", "tnlg pretrain"):
        assert variant in proc.stdout
    record = json.loads(out.read_text())
    (result,) = record["results"]
    assert result["competing_load"] == 0 and len(result["load_average"]) == 2
    for variant, runs in result["raw"].items():
        assert [len(run) for run in runs] == [2] and all(t > 0 for run in runs for t in run), variant
    assert result["summary"]["tnlg pretrain"]["vs_command"] == {"median": 1.0, "fastest": 1.0}
    assert record["machine"]["cpu"]
