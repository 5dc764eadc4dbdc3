"""Issues 11 and 15: the prepared GPU check runs end to end on the CPU with ``--tiny`` (every section;
the NCCL flight recorder (f) and the GPU pretraining run (g) are recorded as skipped without CUDA)."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_gpu_check_tiny_runs_every_section(tmp_path):
    out = tmp_path / "gpu_check.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "gpu_check.py"), "--tiny", "--out", str(out),
                        "--workdir", str(tmp_path / "work")], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    for key in ("a_bf16_step", "b_checkpoint", "c_fp16_loss_scaling", "d_tnlg17b_slice", "e_peak"):
        assert key in res, key
    assert res["a_bf16_step"]["tokens_per_s"] > 0 and res["c_fp16_loss_scaling"]["all_finite"]
    assert res["d_tnlg17b_slice"]["layers"] >= 1
    for key in ("a_bf16_step", "c_fp16_loss_scaling", "d_tnlg17b_slice"):  # per section: baseline, engine closed
        assert res[key]["left_after_close_bytes"] == 0 and "baseline_bytes" in res[key], key
    assert all(v > 0 for dtype in ("bf16", "fp32") for v in res["e_peak"][dtype]["tflops"])
    assert "skipped_f" in res and "skipped_g" in res  # no CUDA here
    # the operator against its eager composite: on the CPU its kernel is torch's fused CPU AdamW, which rounds
    # differently (``beta1 * m + (1 - beta1) * g`` where the composite lerps): fp32 rounding of values of order 1
    # (2.9e-11 seen), far below one step's update (lr 1e-4)
    assert res["h_mixed_adamw"]["max_abs_diff_vs_eager"] < 1e-6
    assert "(a) bf16 step" in r.stdout and "(d) tnlg-17b slice" in r.stdout and "(e) measured peak" in r.stdout
    try:  # megatron-core beside tnlg, or said to be missing
        import megatron.core  # noqa: F401
    except ImportError:
        assert "megatron-core is not installed" in res["skipped_i"]
    else:
        side = res["i_megatron_side_by_side"]
        assert side["megatron_layer_spec"] in ("local", "transformer_engine") and "(i) beside megatron-core" in r.stdout
        for name in ("tnlg", "megatron"):
            assert len(side[name]["step_times_s"]) == 4 and side[name]["model_tflops"] > 0, name


def test_gpu_check_runs_chosen_sections_only(tmp_path):
    out = tmp_path / "gpu_check.json"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "gpu_check.py"), "--tiny", "--sections", "e",
                        "--out", str(out)], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert "e_peak" in res and not {"a_bf16_step", "c_fp16_loss_scaling", "d_tnlg17b_slice", "skipped_f"} & set(res)
