"""``--bf16`` where bf16 matmuls are far slower than fp32 is refused before any work, with the measured figures."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import tnlg.runtime.hardware as hw
from tnlg.cli import main
from tnlg.errors import UserError

SLOW = hw.MatmulProbe(capability="AVX2", n=128, threads=2, fp32_gflops=108.0, bf16_gflops=0.9)
FAST = hw.MatmulProbe(capability="AVX512", n=128, threads=2, fp32_gflops=60.0, bf16_gflops=110.0)


@pytest.fixture
def slow_cpu(monkeypatch):
    monkeypatch.setattr(hw, "cpu_bf16", lambda *a, **k: SLOW)
    monkeypatch.delenv(hw.ALLOW_ENV, raising=False)
    import tnlg.commands.pretrain
    monkeypatch.setattr(tnlg.commands.pretrain, "run", lambda args: pytest.fail("nothing may start after the refusal"))


def test_probe_says_slow_or_fast():
    assert not SLOW.fast and SLOW.slowdown == pytest.approx(120) and FAST.fast
    assert "0.9 GFLOP/s against 108.0 in fp32 (120x slower" in SLOW.figures() and "AVX2" in SLOW.figures()
    probe = hw.cpu_bf16()  # the real one: a few milliseconds
    assert probe.fp32_gflops > 0 and probe.bf16_gflops > 0 and probe.capability


def test_pretrain_bf16_refused_on_a_slow_cpu(slow_cpu, capsys):
    """`--bf16` on a CPU without fast 16-bit matmuls (AVX2 only) is refused with the measured slowdown and
    the way to allow it (it used to train silently ~100x slower)."""
    assert main(["pretrain", "--bf16", "--train-iters", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tnlg pretrain: error: --bf16 on this CPU would be about 120x slower than fp32")
    assert "0.9 GFLOP/s against 108.0 in fp32" in err and "TNLG_ALLOW_SLOW_BF16=1" in err
    assert "Traceback" not in err and err.count("\n") == 1


def test_option_errors_come_before_the_hardware_check(slow_cpu, capsys):
    assert main(["pretrain", "--bf16", "--accumulate-allreduce-grads-in-fp32", "--zero-stage", "2"]) == 2
    assert "stages 0 and 1" in capsys.readouterr().err


def test_bf16_from_a_config_file_is_checked_too(slow_cpu, capsys, tmp_path):
    cfg = tmp_path / "run.toml"
    cfg.write_text("bf16 = true\ntrain_iters = 1\n")
    assert main(["pretrain", "--config", str(cfg)]) == 2
    assert "--bf16 on this CPU" in capsys.readouterr().err


def test_allow_env_turns_the_refusal_into_a_warning(monkeypatch, capsys):
    monkeypatch.setattr(hw, "cpu_bf16", lambda *a, **k: SLOW)
    monkeypatch.delenv(hw.ALLOW_ENV, raising=False)
    with pytest.raises(UserError, match="120x slower"):
        hw.check_bf16("cpu")
    monkeypatch.setenv(hw.ALLOW_ENV, "1")
    hw.check_bf16("cpu")
    assert "warning: --bf16 on this CPU" in capsys.readouterr().err
    monkeypatch.setattr(hw, "cpu_bf16", lambda *a, **k: FAST)
    monkeypatch.delenv(hw.ALLOW_ENV)
    hw.check_bf16("cpu")  # fast: nothing


def test_real_probe_on_a_cpu_limited_to_avx2():
    """The probe itself, on this CPU with torch and oneDNN limited to AVX2 kernels (what an AVX2-only EPYC
    runs): bf16 falls back to the slow generic path and `tnlg pretrain --bf16` is refused in milliseconds."""
    env = dict(os.environ, ONEDNN_MAX_CPU_ISA="AVX2", ATEN_CPU_CAPABILITY="avx2")
    env.pop(hw.ALLOW_ENV, None)
    code = "import tnlg.runtime.hardware as h; p = h.cpu_bf16(); print(p.fast, p.slowdown)"
    fast, slowdown = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                    timeout=120, check=True).stdout.split()
    if fast == "True":
        pytest.skip(f"bf16 stays fast on this CPU even limited to AVX2 kernels ({float(slowdown):.1f}x)")
    proc = subprocess.run([sys.executable, "-m", "tnlg", "pretrain", "--bf16", "--train-iters", "1"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "--bf16 on this CPU would be about" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and "iter " not in proc.stdout
