"""The fake-tensor simulation counts what a real run allocates and moves, and refuses bad input clearly.

The check of the simulation is a real run: the same iteration of tnlg's code (meta build,
materialisation into the engine, forward, backward, norm, AdamW, a checkpoint save) on real CPU
tensors under the same tracker gives, phase by phase, the same live bytes, peaks, bytes read and
written and FLOPs as the run on fake tensors; the host copies the simulated save counts are the
tensor bytes the real save wrote. FLOPs are also checked against the closed form of
a GPT iteration (Narayanan et al. eq. 3: forward + 2x backward of every matmul).
"""

from __future__ import annotations

import pytest
import torch

from tnlg.config import GPTConfig
from tnlg.errors import UserError
from tnlg.parallel.state import ParallelState
from tnlg.plan.flops import flops_per_iteration
from tnlg.training.simulate import simulate, tracked_iteration

CFG = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=200)
# what only real tensors do: the host reads of the target-id check and of the gradient norm
HOST_READS = {"aminmax", "_local_scalar_dense"}


@pytest.mark.parametrize("precision,accum", [("fp32", 1), ("bf16", 2)])
def test_fake_run_counts_what_the_real_run_counts(precision, accum, tmp_path):
    cfg = GPTConfig(**CFG)
    torch.manual_seed(0)
    tracker, _ = tracked_iteration(cfg, ParallelState.single(), zero_stage=1, precision=precision, micro_batch=2,
                                   accum=accum, save_dir=str(tmp_path))
    real = {ph.name: ph.as_dict() for ph in tracker.phases}
    sim = simulate(cfg, 1, 1, zero_stage=1, precision=precision, micro_batch=2, accum=accum, gpu="h100",
                   gpu_kernels=False)
    fake = {ph["name"]: ph for ph in sim["phases"]}
    assert list(real) == list(fake)
    for ph, fake_ops in zip(tracker.phases, sim["ops"]):
        name = ph.name
        for f in ("live_start", "peak_bytes", "peak_by_kind"):
            assert real[name][f] == fake[name][f], (name, f, real[name][f], fake[name][f])
        real_ops = [(o.name, o.flops, o.bytes) for o in ph.ops if o.name not in HOST_READS]
        assert real_ops == [(o.name, o.flops, o.bytes) for o in fake_ops], name
    # the tracker's FLOPs are the matmuls of one forward and backward (3x the forward's), plus the
    # scores Q K^T that the flash attention kernel recomputes in its backward (2 B s^2 h per layer)
    s, b, h, layers = cfg.seq_length, 2 * accum, cfg.hidden_size, cfg.num_layers
    fwd_bwd = sum(real[n]["flops"] for n in real if n.startswith(("forward", "backward")))
    model = flops_per_iteration(cfg, b, None, cfg.padded_vocab_size(1))
    assert fwd_bwd == model + layers * 2 * b * s * s * h
    # and the live model states after setup are what the engine reports it holds
    states = real["forward"]["live_start"]
    assert states["parameters"] > 0 and states["adam"] == 2 * 4 * sum(
        p.numel() for p in tracker_params(cfg)), states
    # the simulated save copies to the host exactly the tensor bytes the real save wrote, one tensor at a time
    written = _tensor_bytes(tmp_path)
    assert fake["save"]["host_copy_bytes"] == sum(written) > 0
    assert fake["save"]["largest_host_copy_bytes"] == max(written)
    # beyond the model states the save allocates only a copy of the dropout generator's state (a few KB)
    assert fake["save"]["peak_bytes"] - fake["save"]["live_start_bytes"] < 2 ** 14


# a few million parameters (5.3M), so that the setup's transient copies would show beside the states
MID = dict(num_layers=4, hidden_size=256, num_attention_heads=4, seq_length=64, vocab_size=8192)


def _real_rank(ps, save_dir):
    """One real iteration on this gloo rank under the tracker: its phases, the engine's report and the
    largest parameter's element count."""
    torch.manual_seed(0)
    tracker, memory = tracked_iteration(GPTConfig(**MID), ps, zero_stage=1, precision="bf16", micro_batch=2,
                                        accum=2, save_dir=save_dir)
    return [ph.as_dict() for ph in tracker.phases], memory


@pytest.mark.slow
def test_two_rank_real_run_equals_the_simulation_phase_by_phase(tmp_path):
    """bf16, ZeRO-1 over two real gloo processes (each owns half of the optimizer states): rank 0's live
    and peak bytes by kind equal the simulation's of rank 0 of the same layout exactly, in every phase,
    setup and save included; and setup holds no more than the final model states plus one parameter's
    fp32 initial value (the meta-built model costs nothing)."""
    from .pool import run_distributed
    real, memory = run_distributed(_real_rank, 2, 1, str(tmp_path), timeout_s=300)[0]
    sim = simulate(GPTConfig(**MID), 1, 2, zero_stage=1, precision="bf16", micro_batch=2, accum=2, gpu="h100",
                   gpu_kernels=False)
    assert [p["name"] for p in real] == [p["name"] for p in sim["phases"]]
    for r, f in zip(real, sim["phases"]):
        for k in ("live_start", "peak_bytes", "peak_by_kind"):
            assert r[k] == f[k], (r["name"], k, r[k], f[k])
    # the states: 16-bit parameters and gradients of every element, fp32 master and moments of the half owned
    # (the ZeRO paper's 4 Psi + 12 Psi / Nd at Nd = 2; the buckets' padding adds a little)
    params = tracker_params(GPTConfig(**MID))
    numel, largest = sum(p.numel() for p in params), 4 * max(p.numel() for p in params)
    states = memory["param_bytes"] + memory["grad_bytes"] + memory["optim_bytes"]
    assert states == pytest.approx(4 * numel + 12 * numel / 2, rel=1e-3), (states, numel)
    setup = real[0]
    assert states <= setup["peak_bytes"] <= states + largest, (setup["peak_bytes"], states, largest)


def _tensor_bytes(root) -> list[int]:
    """The data bytes of every tensor in the safetensors files of the checkpoint under ``root``."""
    from tnlg.checkpoint.stream import SafetensorsReader
    files = sorted(root.glob("iter_*/*.safetensors"))
    assert files, list(root.rglob("*"))
    return [e["data_offsets"][1] - e["data_offsets"][0] for f in files for e in SafetensorsReader(str(f)).entries.values()]


def tracker_params(cfg):
    from tnlg.model import GPT
    return list(GPT(cfg, ParallelState.single(), device="meta").parameters())


def test_bf16_step_makes_no_temporary_wider_than_fp32():
    """The gradient norm reads 16-bit gradients in place (fp32 accumulation): no fp64 copy of any piece,
    and no fp32 temporary larger than one bucket, in the norm or the optimizer."""
    cfg = GPTConfig(**CFG)
    bucket_mb = 0.05
    tracker, memory = tracked_iteration(cfg, ParallelState.single(), zero_stage=1, precision="bf16", micro_batch=2,
                                        accum=1, bucket_size_mb=bucket_mb)
    assert memory["buckets"] > 2  # several buckets, so a whole-buffer temporary would show
    assert tracker.largest_new.get(torch.float64, 0) <= 2, tracker.largest_new  # two scalars at most
    step = [ph for ph in tracker.phases if ph.name in ("norm", "optimizer")]
    # a bucket closes at the first parameter that reaches its size: at most that plus one parameter
    largest_bucket = bucket_mb * 2 ** 20 / 2 + max(p.numel() for p in tracker_params(cfg))
    bucket_bytes = 4 * largest_bucket  # one bucket of bf16 gradients, upcast to fp32
    assert all(ph.peak - sum(ph.live_start.values()) <= bucket_bytes for ph in step), \
        [(ph.name, ph.peak - sum(ph.live_start.values())) for ph in step]


def test_bf16_optimizer_step_moves_at_most_1_3x_the_minimum():
    """The 16-bit step reads each element's 16-bit gradient and fp32 master and moments once and writes
    master, moments and the 16-bit parameter once: the minimum is 28 bytes per owned element; the tracker
    charges the written-only parameter as read too (30 bytes), and nothing else moves."""
    sim = simulate(GPTConfig(**CFG), 1, 1, zero_stage=1, precision="bf16", micro_batch=2, gpu="h100")
    opt = next(p for p in sim["phases"] if p["name"] == "optimizer")
    minimum = 28 * sim["model_states"]["owned_numel"]
    assert opt["read_bytes"] + opt["written_bytes"] <= 1.3 * minimum, (opt["read_bytes"], opt["written_bytes"])
    assert opt["read_bytes"] + opt["written_bytes"] == 30 * sim["model_states"]["numel"]


def test_simulation_refuses_bad_input_in_one_paragraph():
    cfg = GPTConfig(**CFG)
    with pytest.raises(UserError, match=r"--gpu 'x100'.*valid: h200, h100, a100, v100"):
        simulate(cfg, 1, 1, gpu="x100")
    with pytest.raises(UserError, match="--data-parallel-size must be a positive integer"):
        simulate(cfg, 1, 0)
    with pytest.raises(UserError, match="stage 2"):
        simulate(cfg, 1, 2, zero_stage=2)
    with pytest.raises(UserError, match="tensor-parallel size 8 is larger than num_attention_heads=4"):
        simulate(cfg, 8, 1)


def _plan_total(name, tp, dp, precision, micro, accum, recompute, extra=()):
    import argparse

    from tnlg.commands.plan import add_arguments, run
    import contextlib
    import io
    import json
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    argv = ["--preset", name, "--tp", str(tp), "--dp", str(dp), "--zero-stage", "1", "--precision", precision,
            "--micro-batch-size", str(micro), "--global-batch-size", str(micro * dp * accum), "--json", *extra]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        run(parser.parse_args(argv + (["--recompute-activations"] if recompute else [])))
    return json.loads(out.getvalue())


PLAN_CASES = [
    pytest.param("gpt2-medium", 2, 4, "bf16", 2, 2, False, id="gpt2-medium-tp2-bf16"),
    pytest.param("tnlg-17b", 4, 64, "fp16", 1, 8, False, id="tnlg-17b-tp4-dp64-fp16", marks=pytest.mark.slow),
    pytest.param("tnlg-17b", 8, 32, "bf16", 1, 16, True, id="tnlg-17b-tp8-dp32-bf16-recompute",
                 marks=pytest.mark.slow),
    pytest.param("gpt2-xl", 1, 1, "bf16", 4, 8, False, id="gpt2-xl-tp1-bf16", marks=pytest.mark.slow),
    # rope, RMSNorm, SwiGLU's three matrices, 8 KV groups, no biases
    pytest.param("llama3-8b", 8, 8, "bf16", 1, 8, False, id="llama3-8b-tp8-dp8-bf16", marks=pytest.mark.slow),
]


def _simulated_plan(case: tuple) -> dict:
    return _plan_total(*case, extra=["--simulate", "--gpu", "h200"])


@pytest.fixture(scope="module")
def simulated_plans(request):
    """``case -> plan`` for the cases of :func:`test_planner_peak_is_the_simulated_peak` this session runs, each
    simulated in one of two spawned processes (a simulation is one core's work, 10 s for a 17B layout, and
    needs a process without a process group); each test waits for its own."""
    import concurrent.futures
    import multiprocessing
    selected = [tuple(item.callspec.params[k] for k in _PLAN_ARGS) for item in request.session.items
                if getattr(item, "originalname", None) == "test_planner_peak_is_the_simulated_peak"]
    if len(selected) < 2:  # (the quick tier's one case: here, without a process to start)
        done = {case: concurrent.futures.Future() for case in selected}
        for case, future in done.items():
            future.set_result(_simulated_plan(case))
        yield done
        return
    with concurrent.futures.ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn")) as pool:
        yield {case: pool.submit(_simulated_plan, case) for case in selected}


_PLAN_ARGS = ("name", "tp", "dp", "precision", "micro", "accum", "recompute")


@pytest.mark.parametrize(",".join(_PLAN_ARGS), PLAN_CASES)
def test_planner_peak_is_the_simulated_peak(simulated_plans, name, tp, dp, precision, micro, accum, recompute):
    """`tnlg plan`'s memory per rank (model states + activations, the GPU's attention kernel) is the
    peak of the step that tnlg's code makes on fake tensors at full size, within 5%; `--simulate`
    reports both."""
    plan = simulated_plans[(name, tp, dp, precision, micro, accum, recompute)].result(timeout=600)
    sim = plan["simulation"]
    assert sim["layout"]["accum"] == accum and sim["layout"]["tp"] == tp
    assert plan["memory"]["total"] == pytest.approx(sim["peak_bytes"], rel=0.05), (plan["memory"]["total"],
                                                                                  sim["peak_bytes"])
    # the model states the simulated engine allocates are the planner's, to the byte's rounding
    states = sim["model_states"]
    assert states["param_bytes"] + states["grad_bytes"] + states["optim_bytes"] == pytest.approx(
        plan["memory"]["model_states"], rel=2e-3)


@pytest.mark.parametrize("argv,message", [
    (["--preset", "gpt2-medium", "--simulate", "--gpu", "x100"], "--gpu 'x100' is not a GPU the simulation knows"),
    (["--preset", "gpt2-medium", "--gpu", "h100"], "add --simulate"),
    (["--preset", "tnlg-17b", "--world-size", "100", "--tp", "8", "--simulate"],
     "--tensor-model-parallel-size 8 does not divide --world-size 100"),
    (["--params", "1e9", "--simulate"], "--simulate runs one layout of a shaped model"),
])
def test_plan_simulate_bad_input_is_one_paragraph(argv, message):
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-m", "tnlg", "plan", *argv], capture_output=True, text=True, timeout=120,
                       cwd=root, env=dict(os.environ, PYTHONPATH=root))
    assert r.returncode != 0 and message in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and r.stdout == ""


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_reported_attention_kernel_is_the_one_sdpa_runs(dropout):
    """The kernel named on the start line is the one F.scaled_dot_product_attention dispatches to here
    (seen by the operators it runs)."""
    import torch.nn.functional as F
    from torch.utils._python_dispatch import TorchDispatchMode

    from tnlg.plan.gpus import attention_kernel

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.__name__)
            return func(*args, **(kwargs or {}))

    q = torch.randn(1, 4, 16, 8, requires_grad=True)
    with Ops() as ops:
        F.scaled_dot_product_attention(q, q, q, dropout_p=dropout, is_causal=True)
    ran_flash = any("flash_attention" in n for n in ops.names)
    assert attention_kernel(torch.device("cpu"), torch.float32, 4, 8, 16, dropout) == ("flash" if ran_flash else "math")


def _held_by_another_thread(ps):
    """A collective's input that another thread drops 50 ms after the caller's last reference (as gloo's
    worker thread does after waking ``wait()``), then the next phase's live bytes."""
    import threading
    import time

    import torch.distributed as dist

    from tnlg.plan.tracker import StepTracker
    tracker = StepTracker()
    with tracker:
        with tracker.phase("reduce"):
            t = torch.ones(2, dtype=torch.float64) * 1
            dist.all_reduce(t)
            keep = [t]
            threading.Thread(target=lambda: (time.sleep(0.05), keep.clear())).start()
            del t
        with tracker.phase("next"):
            pass
    return tracker.phases[1].live_start["temporaries"]


def test_a_collectives_input_still_held_by_a_worker_thread_is_waited_for():
    """The live bytes at a phase's start do not depend on when a worker thread drops its reference."""
    from .pool import run_distributed
    assert run_distributed(_held_by_another_thread, 2, 1) == [0, 0]
