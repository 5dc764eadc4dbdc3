"""Pipelines in 16 bits: bf16 and fp16 (ZeRO's 16-bit buffers, the fp32 master, the dynamic loss scaler) at
PP 2 train as the run without a pipeline in the same precision and layout otherwise; so does ZeRO 2/3 (FSDP2)
at PP 2 x DP 2, in fp32 against one process (1e-5, as tests/test_pipeline.py) and in 16 bits.

The reference is tnlg's plain GPT without a pipeline, trained by the same engine in the same precision:
in one process for the layouts with DP 1, on DP 2 (ZeRO 1) for those with DP 2. In 16 bits "the same"
holds up to the order of summation: the tolerance is three times the measured noise floor, the largest
difference between the reference and the same run re-ordered (the global batch as 8 or 2 micro batches
instead of 4, or over DP 2): any change of summation order moves the numbers that much.
"""

from __future__ import annotations

import math

import pytest
import torch

from tnlg.model import GPT
from tnlg.optim import DynamicLossScaler, build_engine
from tnlg.model.stage import StageModel
from tnlg.parallel.pipeline import chunk_layers
from tnlg.parallel.pipeline_schedule import Pipeline
from tnlg.parallel.sharding import gather_full
from tnlg.parallel.state import ParallelState, init_parallel
from .pool import run_distributed
from tnlg.training.step import train_step

from .test_pipeline import (GLOBAL, LRS, MICRO, STEPS as STEPS_FP32, TINY_BUCKET_MB, _config, _micro_batches,
                            _reference, _samples)

STEPS, LAYERS = 4, 4
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# fp16: the first step's loss scale overflows (the logits' gradient alone is about 2^24 / 64 tokens per
# element), as Megatron's default 2^32 does; the backoff takes it to 2^16, where nothing overflows
OVERFLOWING = dict(initial_scale=2.0 ** 24, backoff_factor=2.0 ** -8, hysteresis=1)
HALVING = dict(initial_scale=2.0 ** 16, backoff_factor=0.5, hysteresis=1)
INJECT = ("transformer.wpe.weight", 2)  # an inf in this gradient at iteration 2: on the first stage only


def _batches(samples, step: int, dp_rank: int, dp: int, micro: int) -> list[dict]:
    """Megatron's sampler order: each micro step takes ``micro`` x dp consecutive samples, DP rank r its r-th."""
    out, base = [], step * GLOBAL
    for j in range(GLOBAL // (micro * dp)):
        rows = samples[base + (j * dp + dp_rank) * micro:][:micro]
        out.append({k: torch.stack([r[k] for r in rows]) for k in rows[0]})
    return out


class _Inject:
    """A pipeline that writes an inf into parameter ``name``'s gradient after the micro batches' backward
    of iteration ``at``, on the rank that holds it: an overflow on one stage only."""

    def __init__(self, pipeline: Pipeline, engine, name: str, at: int):
        self.pipeline, self.model, self.engine, self.name, self.at, self.calls = pipeline, pipeline.model, engine, \
            name, at, 0

    def run(self, batches, factor, normalisation):
        out = self.pipeline.run(batches, factor, normalisation)
        self.calls += 1
        if self.calls == self.at and self.name in self.engine.param_names:
            self.engine.grad_view(self.name).view(-1)[0] = float("inf")
        return out


def _train(model, ps, run: dict) -> dict:
    """STEPS steps of ``run`` (``zero``, ``dtype``; optional ``micro``, ``scaler``, ``fp32_grads``, ``inject``);
    per step the loss, gradient norm, skipped flag, loss scale after the step and the sum of this rank's
    parameters; the final parameters (fp32, full over TP); the dtype of the activations a stage's first layer
    received, with the autocast dtype in force."""
    dtype, micro = DTYPES[run["dtype"]], run.get("micro", MICRO)
    m = GLOBAL // (micro * ps.dp_size)
    scaler = DynamicLossScaler(**run.get("scaler", OVERFLOWING)) if run["dtype"] == "fp16" else None
    engine = build_engine(model, ps, run["zero"], lr=1e-3, weight_decay=0.1, clip_grad=0.05, grad_accum_steps=m,
                          bucket_size_mb=TINY_BUCKET_MB, param_dtype=dtype, loss_scaler=scaler,
                          accumulate_grads_in_fp32=run.get("fp32_grads", False))
    pipeline, received = None, set()
    if ps.pp_size > 1:
        pipeline = Pipeline(engine.model, m)
        first = engine.model.transformer.h[str(engine.model.chunk_ranges[0][0])]
        first.register_forward_pre_hook(  # what the stage's first layer gets, and under which autocast
            lambda _mod, args: received.add((str(args[0].dtype), torch.get_autocast_dtype("cpu")
                                             if torch.is_autocast_enabled("cpu") else None)))
        if "inject" in run:
            pipeline = _Inject(pipeline, engine, *run["inject"])
    samples, out = _samples(), dict(losses=[], norms=[], skipped=[], scales=[], sums=[])
    for step in range(STEPS):
        loss, info = train_step(engine.model, engine, _batches(samples, step, ps.dp_rank, ps.dp_size, micro),
                                LRS[step], autocast=dtype, ps=ps, iteration=step + 1, pipeline=pipeline)
        out["losses"].append(loss)
        out["norms"].append(info["grad_norm"])
        out["skipped"].append(info["skipped"])
        out["scales"].append(None if scaler is None else scaler.scale)
        out["sums"].append(sum(float(p.detach().double().sum()) for p in engine.model.parameters()))
    out["params"] = {n: t.float() for n, t in _full_params(engine, ps).items()}
    out.update(received=received, names=engine.param_names, master_bytes=engine.memory_report()["master_bytes"],
               param_dtypes={str(p.dtype) for p in engine.model.parameters()})
    return out


def _full_params(engine, ps) -> dict:
    """Every parameter of this rank's stage, full over DP (ZeRO 3 all-gathers) and TP, without vocabulary padding."""
    named = dict(engine.model.named_parameters())
    return {n: gather_full(t, named[n], ps) for n, t in engine.model_state_by_param().items()}


def _body(_ps, runs):
    """Every run of ``runs`` on the whole world at TP 1 (``pp`` stages, DP = world / PP)."""
    out = []
    for run in runs:
        ps = init_parallel(1, pipeline_parallel_size=run["pp"])
        if ps.pp_size == 1:
            model = GPT(_config(LAYERS), ps, device="meta")
        else:
            model = StageModel(_config(LAYERS), ps, [chunk_layers(LAYERS, ps.pp_size)[ps.pp_rank]], device="meta")
        out.append(_train(model, ps, run))
    return out


def _single(**run) -> dict:
    ps = ParallelState.single()
    return _train(GPT(_config(LAYERS), ps, device="meta"), ps, dict(zero=0, **run))


def _differences(a: dict, b: dict) -> tuple[float, float, float]:
    """Largest (loss difference, relative gradient-norm difference, parameter difference) of two runs over
    their steps (steps with a non-finite norm: skipped, compared by their flags) and parameters."""
    loss = max(abs(x - y) for x, y in zip(a["losses"], b["losses"]))
    norm = max((abs(x - y) / y for x, y in zip(a["norms"], b["norms"]) if math.isfinite(y)), default=0.0)
    param = max(float((t - b["params"][n]).abs().max()) for n, t in a["params"].items())
    return loss, norm, param


def _check(run: dict, ref: dict, floor: tuple, what: str) -> None:
    """``run`` follows ``ref`` within three times the noise floor; the same steps skipped, the same scales."""
    assert run["skipped"] == ref["skipped"] and run["scales"] == ref["scales"], (what, run["skipped"], run["scales"])
    for name, got, limit in zip(("loss", "grad norm", "parameters"), _differences(run, ref), floor):
        assert got <= 3 * limit, f"{what}: {name} differs by {got:.3g}, noise floor {limit:.3g}"


@pytest.fixture(scope="module")
def two_processes():
    """On 2 processes, ``{name: per-rank results}``: the references without a pipeline at DP 2 (ZeRO 1 and 3),
    and the runs at PP 2 (DP 1)."""
    runs = dict(dp2_bf16=dict(pp=1, zero=1, dtype="bf16"), dp2_fp16=dict(pp=1, zero=1, dtype="fp16"),
                dp2_zero3_bf16=dict(pp=1, zero=3, dtype="bf16"), dp2_zero3_fp16=dict(pp=1, zero=3, dtype="fp16"),
                pp2_bf16=dict(pp=2, zero=0, dtype="bf16"), pp2_fp16=dict(pp=2, zero=0, dtype="fp16"),
                pp2_bf16_fp32_grads=dict(pp=2, zero=0, dtype="bf16", fp32_grads=True),
                pp2_fp16_inject=dict(pp=2, zero=0, dtype="fp16", scaler=HALVING, inject=INJECT))
    results = run_distributed(_body, 2, 1, list(runs.values()), timeout_s=300)
    return {name: [per_rank[i] for per_rank in results] for i, name in enumerate(runs)}


@pytest.fixture(scope="module")
def references(two_processes):
    """Per dtype: the one-process run (4 micro batches of 2) and its noise floor, the largest difference
    from it of the same run as 8 micro batches of 1, 2 of 4, and over DP 2 (the same for the gradient
    norm, relative, and for the final parameters)."""
    out = {}
    for dtype in DTYPES:
        ref, dp2 = _single(dtype=dtype), two_processes[f"dp2_{dtype}"][0]
        alts = [_single(dtype=dtype, micro=1), _single(dtype=dtype, micro=4), dp2]
        out[dtype] = dict(ref=ref, dp2=dp2, floor=tuple(max(d) for d in zip(*(_differences(a, ref) for a in alts))))
    out["bf16_fp32_grads"] = _single(dtype="bf16", fp32_grads=True)
    return out


def test_bf16_and_fp16_pipelines_train_as_the_run_without_one(two_processes, references):
    for dtype in DTYPES:
        ref, floor = references[dtype]["ref"], references[dtype]["floor"]
        assert ref["skipped"] == ([True] + [False] * (STEPS - 1) if dtype == "fp16" else [False] * STEPS)
        for rank, run in enumerate(two_processes[f"pp2_{dtype}"]):
            _check(run, ref, floor, f"{dtype} (PP, DP) = (2, 1) rank {rank}")
            assert run["param_dtypes"] == {str(DTYPES[dtype])} and run["master_bytes"] > 0  # 16-bit, fp32 master
        # the activations arrive in 16 bits, and the stages run under the training's autocast, as without a pipeline
        assert two_processes[f"pp2_{dtype}"][1]["received"] == {(str(DTYPES[dtype]), DTYPES[dtype])}
    for rank, run in enumerate(two_processes["pp2_bf16_fp32_grads"]):  # --accumulate-allreduce-grads-in-fp32
        _check(run, references["bf16_fp32_grads"], references["bf16"]["floor"], f"bf16 with fp32 gradients rank {rank}")


def test_an_overflow_on_one_stage_skips_the_step_on_every_rank_and_halves_the_scale(two_processes):
    name, at = INJECT
    runs = two_processes["pp2_fp16_inject"]
    assert [rank for rank, run in enumerate(runs) if name in run["names"]] == [0]  # the inf: first stage only
    for rank, run in enumerate(runs):
        assert run["skipped"] == [s + 1 == at for s in range(STEPS)], (rank, run["skipped"])
        assert run["scales"] == [2.0 ** 16] * (at - 1) + [2.0 ** 15] * (STEPS - at + 1), (rank, run["scales"])
        sums = run["sums"]  # no parameter of either stage moved in the skipped step; every other step moved them
        assert sums[at - 1] == sums[at - 2] and all(sums[s] != sums[s - 1] for s in range(1, STEPS) if s != at - 1)
        assert all(math.isfinite(x) for x in run["losses"])  # the loss is reported, unscaled
        assert abs(run["losses"][0] - math.log(50)) < 0.2


@pytest.mark.slow
def test_16bit_pipelines_over_two_data_parallel_ranks_train_as_dp_2_without_one(two_processes, references):
    """(PP, DP) = (2, 2) at ZeRO 1 (flat buffers) and ZeRO 3 (FSDP2) against DP 2 without a pipeline."""
    runs = [dict(pp=2, zero=zero, dtype=d) for zero in (1, 3) for d in DTYPES]
    results = run_distributed(_body, 4, 1, runs, timeout_s=300)
    for i, run in enumerate(runs):
        dtype, zero = run["dtype"], run["zero"]
        ref = two_processes[f"dp2_{dtype}" if zero == 1 else f"dp2_zero3_{dtype}"][0]
        for rank in range(4):
            _check(results[rank][i], ref, references[dtype]["floor"], f"{dtype} (PP, DP, ZeRO) = (2, 2, {zero}) "
                   f"rank {rank}")


# ------------------------------------------------------------ ZeRO 2/3 (FSDP2) at PP 2 x DP 2, fp32
def _fsdp_body(_ps, layouts):
    """(ZeRO stage, schedule, layers per virtual stage) at PP 2 x DP 2; the losses, norms, final parameters."""
    out = []
    for zero, schedule, per_virtual in layouts:
        ps = init_parallel(1, pipeline_parallel_size=2)
        virtual = 1 if per_virtual is None else LAYERS // (2 * per_virtual)
        mine = [r for c, r in enumerate(chunk_layers(LAYERS, 2, virtual)) if c % 2 == ps.pp_rank]
        m = GLOBAL // (MICRO * ps.dp_size)
        engine = build_engine(StageModel(_config(LAYERS), ps, mine, device="meta"), ps, zero, lr=1e-3,
                              weight_decay=0.1, clip_grad=0.05, grad_accum_steps=m, bucket_size_mb=TINY_BUCKET_MB)
        assert engine.impl == "fsdp"
        pipeline, samples, losses, norms = Pipeline(engine.model, m, schedule), _samples(), [], []
        for step in range(STEPS_FP32):
            loss, info = train_step(engine.model, engine, _micro_batches(samples, step, ps.dp_rank, ps.dp_size),
                                    LRS[step], autocast=None, ps=ps, iteration=step + 1, pipeline=pipeline)
            losses.append(loss)
            norms.append(info["grad_norm"])
        out.append((losses, norms, _full_params(engine, ps)))
    return out


@pytest.mark.slow
def test_zero_2_and_3_pipelines_train_as_one_process_without_a_pipeline():
    layouts = [(2, "1f1b", None), (3, "1f1b", None), (3, "interleaved", 1)]
    results = run_distributed(_fsdp_body, 4, 1, layouts, timeout_s=300)
    losses, norms, full = _reference(LAYERS, ())
    for i, layout in enumerate(layouts):
        seen = set()
        for rank in range(4):
            r_losses, r_norms, params = results[rank][i]
            for a, b in zip(r_losses + r_norms, losses + norms):
                assert math.isclose(a, b, rel_tol=1e-5), (layout, rank, r_losses, losses, r_norms, norms)
            for name, value in params.items():
                torch.testing.assert_close(value, full[name], rtol=1e-4, atol=1e-5, msg=f"{layout} {name}")
                seen.add(name)
        assert seen == set(full), (layout, set(full) - seen)
