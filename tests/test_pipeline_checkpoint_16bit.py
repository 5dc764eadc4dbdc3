"""Checkpoints of 16-bit pipeline runs: the fp32 master, the Adam moments and the loss scaler of every stage
come back from the files.

A bf16 run at (PP, TP, DP, ZeRO) = (2, 1, 2, 1) (and an fp16 one, with its dynamic loss scaler) saves after 2
steps. Resumed at the same layout it continues bit for bit as the uninterrupted run (losses, gradient norms,
loss scales); resumed at (1, 1, 2, 1) and at (2, 1, 1, 0) every rank holds, bit for bit, the saving run's
full fp32 master and moments of each of its parameters (gathered over the pieces each DP rank owns, as the
saving run held them in memory), and the 16-bit parameters are the master rounded. The reference is the
state in memory, never the files. The models are tiny: a bf16 matmul on an AVX2 CPU is ~100x slower than fp32.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tnlg import checkpoint as ck
from tnlg.model import GPT
from tnlg.optim import DynamicLossScaler, build_engine
from tnlg.model.stage import StageModel
from tnlg.parallel.pipeline import chunk_layers
from tnlg.parallel.pipeline_schedule import Pipeline
from tnlg.parallel.sharding import gather_full
from tnlg.parallel.state import init_parallel
from .pool import run_distributed
from tnlg.training.step import train_step

from .test_pipeline import GLOBAL, LRS, MICRO, TINY_BUCKET_MB, _config, _micro_batches, _samples

LAYERS, SAVED_AT, MORE = 2, 2, 2
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
SOURCE = (2, 1)  # (PP, ZeRO) on 4 processes: DP 2
TARGETS = [(1, 1), (2, 0)]  # on 2 processes: (PP 1, DP 2, ZeRO 1) and (PP 2, DP 1, ZeRO 0)


def _build(pp: int, zero: int, dtype: str):
    """``(ps, cfg, engine, pipeline)`` at TP 1 on the whole world (DP: what PP leaves)."""
    ps = init_parallel(1, pipeline_parallel_size=pp)
    cfg = _config(LAYERS)
    model = GPT(cfg, ps, device="meta") if pp == 1 else \
        StageModel(cfg, ps, [chunk_layers(LAYERS, pp)[ps.pp_rank]], device="meta")
    m = GLOBAL // (MICRO * ps.dp_size)
    scaler = DynamicLossScaler(initial_scale=2.0 ** 16, backoff_factor=0.5, hysteresis=1) if dtype == "fp16" else None
    engine = build_engine(model, ps, zero, lr=1e-3, weight_decay=0.1, clip_grad=0.05, grad_accum_steps=m,
                          bucket_size_mb=TINY_BUCKET_MB, param_dtype=DTYPES[dtype], loss_scaler=scaler)
    return ps, cfg, engine, (Pipeline(engine.model, m) if pp > 1 else None)


def _steps(ps, engine, pipeline, dtype: str, first: int, count: int) -> list:
    """Steps ``first .. first + count - 1`` of the fixed data: per step (loss, gradient norm, loss scale)."""
    samples, out = _samples(), []
    for step in range(first, first + count):
        loss, info = train_step(engine.model, engine, _micro_batches(samples, step, ps.dp_rank, ps.dp_size),
                                LRS[step], autocast=DTYPES[dtype], ps=ps, iteration=step + 1, pipeline=pipeline)
        out.append((loss, info["grad_norm"], None if engine.loss_scaler is None else engine.loss_scaler.scale))
    return out


def _state(ps, engine) -> dict:
    """This rank's parameters' full fp32 master, exp_avg and exp_avg_sq (from the pieces each DP rank owns,
    summed over DP where they are partitioned; gathered over TP), the 16-bit parameters and the step."""
    shapes, named = engine.param_shapes(), dict(engine.model.named_parameters())
    full = {n: {k: torch.zeros(s) for k in ("master", "exp_avg", "exp_avg_sq")} for n, s in shapes.items()}
    for pc in engine.owned_pieces():
        for k in full[pc["name"]]:
            full[pc["name"]][k].view(-1)[pc["lo"]:pc["lo"] + pc["length"]].copy_(pc[k])
    for n in engine.param_names:
        for t in full[n].values():
            if engine.pieces_sharded_over_dp and ps.dp_group is not None:
                dist.all_reduce(t, group=ps.dp_group)
    out = {n: {k: gather_full(t, named[n], ps) for k, t in kinds.items()} for n, kinds in full.items()}
    for n, p in named.items():
        out[n]["param"] = gather_full(p.detach().clone(), p, ps)
    scaler = None if engine.loss_scaler is None else engine.loss_scaler.state_dict()
    return dict(step=engine.num_steps, scaler=scaler, tensors=out)


def _save_and_continue(_ps, root: str, dtypes: list):
    """On 4 processes: the uninterrupted source run (saved at step 2), and its resume at the same layout."""
    out = {}
    for dtype in dtypes:
        ps, cfg, engine, pipe = _build(*SOURCE, dtype)
        first = _steps(ps, engine, pipe, dtype, 0, SAVED_AT)
        state = _state(ps, engine)
        ck.save(f"{root}/{dtype}", iteration=SAVED_AT, consumed_samples=SAVED_AT * GLOBAL, model=engine.model,
                engine=engine, ps=ps, config=cfg)
        uninterrupted = _steps(ps, engine, pipe, dtype, SAVED_AT, MORE)
        ps, cfg, engine, pipe = _build(*SOURCE, dtype)
        ck.load(f"{root}/{dtype}", model=engine.model, engine=engine, ps=ps, config=cfg)
        out[dtype] = dict(first=first, state=state, loaded=_state(ps, engine), uninterrupted=uninterrupted,
                          resumed=_steps(ps, engine, pipe, dtype, SAVED_AT, MORE))
    return out


def _load_elsewhere(_ps, root: str, dtype: str):
    """On 2 processes: the bf16 checkpoint loaded at each target layout; each rank's state."""
    out = {}
    for target in TARGETS:
        ps, cfg, engine, _ = _build(*target, dtype)
        info = ck.load(f"{root}/{dtype}", model=engine.model, engine=engine, ps=ps, config=cfg)
        assert info["iteration"] == SAVED_AT
        out[target] = _state(ps, engine)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ppckpt16"))
    here = run_distributed(_save_and_continue, 4, 1, root, ["bf16", "fp16"], timeout_s=400)
    return here, run_distributed(_load_elsewhere, 2, 1, root, "bf16", timeout_s=300), root


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_a_16bit_pipeline_resumed_at_its_layout_continues_bit_exactly(runs, dtype):
    here, _, _ = runs
    for rank, r in enumerate(here):
        r = r[dtype]
        assert r["resumed"] == r["uninterrupted"], (rank, r["resumed"], r["uninterrupted"])
        assert all(loss > 0 and norm > 0 for loss, norm, _ in r["first"] + r["resumed"])
        assert r["loaded"]["scaler"] == r["state"]["scaler"]  # fp16: the loss scaler's scale and counters
        for name, kinds in r["loaded"]["tensors"].items():
            for kind, t in kinds.items():
                assert torch.equal(t, r["state"]["tensors"][name][kind]), (rank, name, kind)


def test_a_bf16_pipeline_checkpoint_loads_every_ranks_fp32_master_and_moments_bit_for_bit_at_other_layouts(runs):
    here, there, root = runs
    saved = {}
    for r in here:  # every stage's parameters, as the saving ranks held them
        for name, kinds in r["bf16"]["state"]["tensors"].items():
            saved.setdefault(name, kinds)
    # the master carries more than the 16-bit parameters (else comparing it would prove nothing)
    assert any(not torch.equal(k["master"], k["param"].float()) for k in saved.values())
    meta = ck.read_meta(ck.resolve(f"{root}/bf16"))
    assert meta["layout"]["pp"] == 2 and meta["optim_files"] and all(
        "master" in f["kinds"] for f in meta["optim_files"].values())
    for target in TARGETS:
        names = set()
        for rank, r in enumerate(there):
            got = r[target]
            assert got["step"] == SAVED_AT
            for name, kinds in got["tensors"].items():
                names.add(name)
                assert kinds["param"].dtype == torch.bfloat16, (target, rank, name)
                for kind in ("master", "exp_avg", "exp_avg_sq", "param"):
                    assert torch.equal(kinds[kind], saved[name][kind]), (target, rank, name, kind)
                assert torch.equal(kinds["param"], kinds["master"].bfloat16()), (target, rank, name)
        assert names == set(saved), target  # the stages hold the whole model (PP 1: the tied copy is one)
