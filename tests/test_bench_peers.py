"""scripts/bench_peers.py end to end in its smoke-test shape, GPT-2's and the Llama family's (rope, RMSNorm,
SwiGLU, 4 heads over 2 KV groups, no biases, untied): every framework's training step runs (megatron-core's
under CPU autocast through the re-wrapped linear layers), a table is printed and the JSON holds each step's
seconds, and the three start from losses near ln(vocab) (random weights of the same statistics)."""

import json
import math
import subprocess
import sys

import pytest

from tnlg.runtime.spawn import checkout_env


@pytest.mark.slow  # three fresh processes, one of them importing megatron-core: ~1 min per shape
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_bench_peers_tiny(tmp_path, arch):
    pytest.importorskip("transformers")
    out = tmp_path / "peers.json"
    proc = subprocess.run([sys.executable, "scripts/bench_peers.py", "--tiny", "--arch", arch, "--tp", "1",
                           "--precisions", "bf16", "--json", str(out)], capture_output=True, text=True, timeout=600,
                          env=checkout_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "bf16 TP 1" in proc.stdout and "tnlg/mcore" in proc.stdout
    assert f"{arch}: 1 layers" in proc.stdout and ("(2 KV groups)" in proc.stdout) == (arch == "llama")
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


@pytest.mark.parametrize("argv,message", [
    (["--competing-load", "-1"], "--competing-load must be 0 or more"),
    (["--arch", "llama", "--groups", "3"], "--groups 3 must be a positive divisor of --heads 8"),
    (["--arch", "llama", "--heads", "6", "--hidden", "384", "--groups", "3"], "--groups 3 is odd: megatron-core"),
    (["--groups", "2"], "--groups 2 is for --arch llama")])
def test_bench_peers_refuses_bad_input(argv, message):
    proc = subprocess.run([sys.executable, "scripts/bench_peers.py", *argv], capture_output=True,
                          text=True, timeout=60, env=checkout_env())
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
