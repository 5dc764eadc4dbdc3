"""Megatron-LM's Adam state in tnlg (``--with-optimizer``), against megatron-core itself.

megatron-core's GPTModel at TP 2, in its DDP with its own Adam (``get_megatron_optimizer``: the
non-distributed optimizer and the distributed one) and LR scheduler, takes two steps on one batch
and is saved by ``dist_checkpointing.save`` with the optimizer's ``sharded_state_dict``, and in the
legacy per-rank files (tests/megatron_reference.py): the distributed optimizer in its model-space
layout (``fully_reshardable``) and in its bucket layouts (``dp_reshardable``, Megatron-LM's default,
and the legacy ``distrib_optim.pt``). The import must hold Megatron's moments exactly, parameter by
parameter, with Adam's step count; and one tnlg step from the imported state on the same batch must
give the parameters Megatron's next step gives (fp32, 1e-6). The bucket layouts also at DP 2 with
several gradient buckets (``--overlap-grad-reduce --ddp-bucket-size``), padded, at TP 1 and 2: the
imported states equal those of Megatron's optimizer object bit for bit. And an import with its
optimizer loads into a tnlg pipeline (PP 2) by name.
"""

import pytest
import torch

pytestmark = pytest.mark.needs_package("megatron.core")  # the reference: megatron-core itself

from tnlg.checkpoint.files import read_meta  # noqa: E402
from tnlg.checkpoint.loading import read_states  # noqa: E402
from tnlg.config import GPTConfig  # noqa: E402
from tnlg.errors import UserError  # noqa: E402
from tnlg.interop.megatron import megatron_to_checkpoint  # noqa: E402
from tnlg.model import GPT  # noqa: E402
from tnlg.interop.megatron.names import GLOBAL_ROLES, LAYER_ROLES, tnlg_name  # noqa: E402
from .megatron_pool import run_distributed  # noqa: E402

from . import megatron_reference as R  # noqa: E402

# a vocabulary Megatron does not pad at TP 2 (112 = 7 x 8 x 2): its padding rows would take part in its
# softmax, so the two losses, and the steps, would differ
SPEC = dict(layers=2, hidden=32, heads=4, ffn=64, seq=16, vocab=112, divisible=8, tp=2, pp=1, openai_gelu=False,
            untie=True)
STEPS = 2
# (folder of Megatron's save, the optimizer that wrote it): torch_dist by both (the distributed one in its
# fully_reshardable and dp_reshardable layouts), the legacy files by both (distrib_optim.pt)
SAVES = (("plain", "plain"), ("distributed", "distributed"), ("dp_reshardable", "distributed"),
         ("legacy_plain", "plain"), ("legacy_distributed", "distributed"))
BUCKET_SAVES = ("dp_reshardable", "legacy_distributed")
# DP 2 with gradient buckets of >= 3000 elements (Megatron-LM's --overlap-grad-reduce --ddp-bucket-size 3000):
# a GPT of SPEC's shape (~25k parameters on a TP 1 rank, ~13k at TP 2) fills 6 (4), most of them padded
BUCKETED = dict(SPEC, dp=2, bucket=3000, optimizers=("distributed",))


def _tokens():
    return torch.randint(0, SPEC["vocab"], (2, SPEC["seq"]), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Megatron's runs (saved and continued one step), their imports at tnlg TP 2, and (filled by
    :func:`_stepped`) tnlg's step from each import."""
    root = tmp_path_factory.mktemp("megatron_adam")
    ref = run_distributed(R.train_and_save, SPEC["tp"], 1, SPEC, str(root), _tokens(), STEPS, timeout_s=300)
    converted = {k: megatron_to_checkpoint(str(root / k), str(root / f"tnlg_{k}"), tp_size=2, with_optimizer=True)
                 for k, _ in SAVES}
    return root, ref, converted, {}


def _megatron_names():
    """tnlg name -> (megatron-core local-spec name, TP split dimension) of every parameter of SPEC."""
    out = {tnlg_name(role, i): (f"decoder.layers.{i}.{role.core[0]}", role.split)
           for i in range(SPEC["layers"]) for role in LAYER_ROLES
           if not role.tnlg.startswith(("attn.q_norm.", "attn.k_norm."))}  # (SPEC has no QK norm)
    out.update({tnlg_name(role, None): (role.core[0], role.split) for role in GLOBAL_ROLES})
    return out


def _full(parts: list, split) -> torch.Tensor:
    """Megatron's TP-rank tensors of one parameter as one tensor (split parameters concatenated)."""
    return torch.cat(parts, dim=split) if split is not None else parts[0]


def _key_rows(rows: int) -> torch.Tensor:
    """The key rows of the fused QKV (``[heads, 3, head_dim]``: per head its query, key and value rows)."""
    heads, hn = SPEC["heads"], SPEC["hidden"] // SPEC["heads"]
    assert rows == 3 * heads * hn
    return (torch.arange(rows) // hn) % 3 == 1


def _imported(path):
    meta = read_meta(path)
    return meta, read_states(path, meta, GPT.describe(GPTConfig.from_dict(meta["config"]), 1), 0)


MOMENTS = (("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq"))


def _equal_to_megatron(states: dict, ref: list, kind: str, kinds=MOMENTS) -> None:
    """Every parameter's imported states (tnlg kind, Megatron's name of it) are those of Megatron's
    optimizer object (``ref``: its TP ranks' results, in rank order), bit for bit."""
    names = _megatron_names()
    assert set(states) == set(names)
    for name, (meg, split) in names.items():
        for k, mk in kinds:
            want = _full([r[kind]["moments"][meg][mk] for r in ref], split)
            assert states[name][k].dtype == torch.float32 and torch.equal(states[name][k], want), (kind, name, k)


@pytest.mark.parametrize("save,kind", SAVES)
def test_imported_moments_are_megatrons_parameter_by_parameter(trained, save, kind):
    _, ref, converted, _ = trained
    meta, (_, states) = _imported(converted[save])
    assert meta["optimizer"]["present"] and meta["optimizer"]["num_steps"] == STEPS
    assert meta["schedule"]["num_steps"] == STEPS  # the scheduler's samples over the global batch
    _equal_to_megatron(states, ref, kind)
    assert all("master" not in st for st in states.values())  # an fp32 run: its master is its weights


def _tnlg_step(ps, path, lr, tokens):
    """tnlg's engine resumed from the imported checkpoint, one step on ``tokens`` (labels = tokens)."""
    from tnlg.checkpoint import load
    from tnlg.model import GPT
    from tnlg.optim import build_engine
    cfg = GPTConfig.from_dict(read_meta(path)["config"])
    a = R.ADAM
    model = GPT(cfg, ps)
    engine = build_engine(model, ps, 1, lr=lr, weight_decay=a["weight_decay"], betas=a["betas"], eps=a["eps"],
                          clip_grad=0.0)
    load(path, model=model, engine=engine, ps=ps, config=cfg)
    steps_before = engine.num_steps
    engine.zero_grad()
    engine.backward(engine.model(tokens, labels=tokens))
    engine.step(lr=lr)
    return steps_before, engine.num_steps, {n: p.detach().clone() for n, p in model.named_parameters()}


def _stepped(trained, save):
    """tnlg's step from the import of ``save`` (each computed once per module)."""
    _, ref, converted, steps = trained
    if save not in steps:
        steps[save] = run_distributed(_tnlg_step, 1, 1, converted[save], ref[0]["distributed"]["lr"], _tokens())[0]
    return steps[save]


@pytest.mark.parametrize("save,kind", SAVES)
def test_a_tnlg_step_from_the_import_is_megatrons_next_step(trained, save, kind):
    _, ref, _, _ = trained
    lr = ref[0][kind]["lr"]
    assert 0 < lr < R.ADAM["lr"]  # the scheduler's cosine decay after its warmup, as Megatron stepped it
    assert lr == ref[0]["distributed"]["lr"]  # both optimizers' schedules are at the same point
    before, after, params = _stepped(trained, save)
    assert (before, after) == (STEPS, STEPS + 1)  # Adam's bias correction continues at step 3
    for name, (meg, split) in _megatron_names().items():
        want = _full([r[kind]["params"][meg] for r in ref], split)
        got = params[name]
        if name.endswith("attn.c_attn.bias"):
            # The keys' bias rows get a zero gradient in exact arithmetic (softmax ignores a shift common
            # to a query's scores): both Adams step on round-off there, by up to ~lr. Every other row is
            # compared at 1e-6; those within the bound of two such steps.
            keys = _key_rows(got.shape[0])
            assert (got[keys] - want[keys]).abs().max() <= 2 * lr, name
            got, want = got[~keys], want[~keys]
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0, msg=name)


@pytest.mark.parametrize("save", BUCKET_SAVES)
def test_a_step_from_the_bucket_layout_is_the_step_from_the_model_space_layout_of_the_same_state(trained, save):
    """One Megatron state, saved by the distributed optimizer as buckets and as fully_reshardable
    tensors (in one gradient bucket, which megatron-core 0.16.1 writes right in both), resumes into the
    same tnlg step, bit for bit."""
    *_, params = _stepped(trained, save)
    *_, model_space = _stepped(trained, "distributed")
    assert set(params) == set(model_space)
    assert all(torch.equal(params[n], model_space[n]) for n in model_space)


def test_a_bf16_run_imports_its_fp32_master_and_moments_exactly(tmp_path):
    """bf16 weights with Megatron's fp32 master (the non-distributed optimizer's ``fp32_param``, the
    distributed one's ``param``, also in its buckets): the import keeps the bf16 weights and the master
    and moments exactly. (No step comparison: two bf16 forwards round differently, so their gradients
    differ beyond 1e-6.)"""
    spec = dict(SPEC, bf16=True)
    ref = run_distributed(R.train_and_save, spec["tp"], 1, spec, str(tmp_path), _tokens(), STEPS, timeout_s=300)
    for save, kind in SAVES:
        path = megatron_to_checkpoint(str(tmp_path / save), str(tmp_path / f"tnlg_{save}"), tp_size=2,
                                      with_optimizer=True)
        meta, (params, states) = _imported(path)
        assert meta["layout"]["param_dtype"] == "bfloat16" and meta["optimizer"]["num_steps"] == STEPS
        assert all(params[name].dtype == torch.bfloat16 for name in _megatron_names())
        _equal_to_megatron(states, ref, kind, (*MOMENTS, ("master", "param")))


def test_bucket_files_that_do_not_match_the_args_are_refused(trained, tmp_path):
    """The bucket layout comes from the saved args: args naming a bucket size the run did not use (its
    one bucket split in several), a missing distrib_optim.pt, or the buckets of a pre-core model (whose
    parameter order differs) is one paragraph naming the sizes, the file or the model; nothing is
    written."""
    import shutil
    root, *_ = trained
    dst = tmp_path / "out"
    src = tmp_path / "dp_reshardable"
    shutil.copytree(root / "dp_reshardable", src)
    common = torch.load(src / "iter_0000002" / "common.pt", weights_only=False)
    common["args"].overlap_grad_reduce, common["args"].ddp_bucket_size = True, 3000
    torch.save(common, src / "iter_0000002" / "common.pt")
    with pytest.raises(UserError, match=r"model-parallel rank 0's 'param' buckets hold \[\d+\] elements, the layout "
                                        r"of its parameters gives \[\d+, \d+, .*--ddp-bucket-size"):
        megatron_to_checkpoint(str(src), str(dst), with_optimizer=True)
    src = tmp_path / "legacy_distributed"
    shutil.copytree(root / "legacy_distributed", src)
    (src / "iter_0000002" / "mp_rank_01" / "distrib_optim.pt").unlink()
    with pytest.raises(UserError, match="mp_rank_01/distrib_optim.pt' .* is missing"):
        megatron_to_checkpoint(str(src), str(dst), with_optimizer=True)
    first = src / "iter_0000002" / "mp_rank_00" / "model_optim_rng.pt"
    state = torch.load(first, weights_only=False)  # a pre-core model's name beside the weights
    state["model"]["language_model.embedding.position_embeddings.weight"] = torch.zeros(1)
    torch.save(state, first)
    with pytest.raises(UserError, match="distrib_optim.pt of a pre-core .* in another order than megatron-core's"):
        megatron_to_checkpoint(str(src), str(dst), with_optimizer=True)
    assert not dst.exists()


# --------------------------------------------------------------------------- DP 2, several buckets

@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_the_bucket_layouts_of_several_padded_buckets_at_dp_2_import_megatrons_states_exactly(tmp_path, tp):
    """Megatron's distributed optimizer at TP x DP 2 with several gradient buckets: its own buffer
    (read from its ``_ParamAndGradBuffer``) has more than one bucket, end padding that the checkpoint
    drops, 64-element alignment gaps between parameters (kept in the checkpoint) and parameters split
    between the two DP ranks' shards. The import of ``dp_reshardable`` and of ``distrib_optim.pt``
    holds, for every parameter, the moments of Megatron's optimizer object (its DP ranks' ranges
    joined), bit for bit, and Adam's step."""
    spec = dict(BUCKETED, tp=tp)
    ref = run_distributed(R.train_and_save, tp * spec["dp"], 1, spec, str(tmp_path), _tokens(), STEPS,
                          timeout_s=600)
    facts = ref[0]["distributed"]["buckets"]
    assert len(facts["buckets"]) >= 3, facts
    assert any(numel > unpadded for numel, unpadded in facts["buckets"]), facts  # end padding, dropped
    assert facts["gaps"] > 0 and facts["straddling"] > 0, facts
    for save in BUCKET_SAVES:
        path = megatron_to_checkpoint(str(tmp_path / save), str(tmp_path / f"tnlg_{save}"), tp_size=2,
                                      with_optimizer=True)
        meta, (_, states) = _imported(path)
        assert meta["optimizer"]["num_steps"] == STEPS
        _equal_to_megatron(states, ref[:tp], "distributed")  # ranks 0 .. tp-1: DP rank 0's TP group
    # megatron-core 0.16.1's own fully_reshardable save of these padded buckets misplaces the states past
    # the first padding: refused, naming it (the weights still convert)
    dst = tmp_path / "refused"
    with pytest.raises(UserError, match="'fully_reshardable' layout, but its states are misplaced: the saved fp32 "
                                        "master of transformer.wte.weight is not that parameter's weights"):
        megatron_to_checkpoint(str(tmp_path / "distributed"), str(dst), tp_size=2, with_optimizer=True)
    assert not dst.exists()


def test_the_bucket_layouts_of_a_pipeline_with_a_tied_embedding_import_megatrons_states_exactly(tmp_path):
    """Megatron's distributed optimizer at TP 1 x PP 2 with a tied embedding: the first stage's buckets of
    >= 3000 elements, its embedding in a bucket of its own (``shared_embedding``), the last stage in one
    bucket (bucketing is off after the first stage) beside its copy of the embedding in its own. (No
    Megatron step: its schedules do not run here; the moments are set in its optimizer object.)"""
    spec = dict(SPEC, tp=1, pp=2, untie=False, bucket=3000)
    ref = run_distributed(R.save_distributed_pipeline, 2, 1, spec, str(tmp_path), timeout_s=300)
    per = spec["layers"] // 2
    for save in BUCKET_SAVES:
        path = megatron_to_checkpoint(str(tmp_path / save), str(tmp_path / f"tnlg_{save}"), tp_size=1,
                                      with_optimizer=True)
        meta, (_, states) = _imported(path)
        assert meta["optimizer"]["num_steps"] == 1 and "lm_head.weight" not in states
        for name, (meg, _) in _megatron_names().items():
            if name == "lm_head.weight":
                continue
            layer = int(name.split(".")[2]) if name.startswith("transformer.h.") else None
            stage = layer // per if layer is not None else (1 if name.startswith("transformer.ln_f") else 0)
            local = meg if layer is None else meg.replace(f"layers.{layer}.", f"layers.{layer - stage * per}.")
            moments = next(r for r in ref if r["stage"] == stage)["distributed"]["moments"][local]
            for k in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(states[name][k], moments[k]), (save, name, k)


# --------------------------------------------------------------------------- a tnlg pipeline resumes

def _resumed_at_pp_2(_ps, path: str):
    """Worker (2 processes: tnlg PP 2): the stages built as ``tnlg pretrain --pp 2 --load`` builds them,
    the imported checkpoint loaded by name; returns each stage's weights, moments and Adam step."""
    from tnlg import checkpoint as ck
    from tnlg.optim import build_engine
    from tnlg.model.stage import StageModel
    from tnlg.parallel.pipeline import chunk_layers
    from tnlg.parallel.state import init_parallel
    ps = init_parallel(1, pipeline_parallel_size=2)
    cfg = GPTConfig.from_dict(read_meta(path)["config"])
    model = StageModel(cfg, ps, [chunk_layers(cfg.num_layers, 2)[ps.pp_rank]], device="meta")
    engine = build_engine(model, ps, 1, lr=1e-3, weight_decay=0.1, clip_grad=1.0, grad_accum_steps=2)
    ck.load(path, model=engine.model, engine=engine, ps=ps, config=cfg)
    states = engine.optimizer_state_by_param()
    return dict(step=engine.num_steps, params={n: p.detach().clone() for n, p in engine.model.named_parameters()},
                states={n: {k: states[n][k] for k in ("exp_avg", "exp_avg_sq")} for n in states})


def test_an_import_with_its_optimizer_resumes_in_a_tnlg_pipeline_by_name(trained):
    """The dp_reshardable import (tnlg TP 2 files) loaded by a tnlg PP 2 run: each stage holds its own
    parameters' weights and Adam moments as imported (tnlg's reading of the files at PP 1), the last
    stage no embedding of its own (untied), and Adam's step."""
    _, _, converted, _ = trained
    meta, (params, states) = _imported(converted["dp_reshardable"])
    stages = run_distributed(_resumed_at_pp_2, 2, 1, converted["dp_reshardable"], timeout_s=300)
    assert [s["step"] for s in stages] == [STEPS, STEPS]
    held = [set(s["params"]) for s in stages]
    assert held[0] | held[1] == set(params) and not held[0] & held[1]
    assert "transformer.wte.weight" in held[0] and "lm_head.weight" in held[1]
    for s in stages:
        for n, p in s["params"].items():
            assert torch.equal(p, params[n]), n
            assert all(torch.equal(s["states"][n][k], states[n][k]) for k in ("exp_avg", "exp_avg_sq")), n
