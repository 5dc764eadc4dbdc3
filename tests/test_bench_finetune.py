"""scripts/bench_finetune.py end to end in its smoke-test shape: packed fine-tuning rows and the same tokens as
plain causal sequences each train through tnlg's step, a table is printed, and the JSON holds every step's time
and the CPU. (A benchmark, not a timed test: no speed is asserted.)"""

import json
import subprocess
import sys

from tnlg.runtime.spawn import checkout_env


def test_bench_finetune_tiny(tmp_path):
    out = tmp_path / "finetune.json"
    proc = subprocess.run([sys.executable, "scripts/bench_finetune.py", "--tiny", "--json", str(out)],
                          capture_output=True, text=True, timeout=600, env=checkout_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "packed fine-tuning / pretraining (medians)" in proc.stdout and " samples into " in proc.stdout
    record = json.loads(out.read_text())
    assert set(record["times"]) == {"packed fine-tuning", "pretraining"}
    assert all(len(ts) == 3 and min(ts) > 0 for ts in record["times"].values())
    assert 0 < record["counted_tokens"] < record["positions"] and record["machine"]["cpu"]
