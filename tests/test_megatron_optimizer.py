"""Megatron-LM's Adam state in tnlg (``--with-optimizer``), against megatron-core itself.

megatron-core's GPTModel at TP 2, in its DDP with its own Adam (``get_megatron_optimizer``: the
non-distributed optimizer and the distributed one) and LR scheduler, takes two steps on one batch
and is saved by ``dist_checkpointing.save`` with the optimizer's ``sharded_state_dict``, and in the
legacy per-rank files (tests/megatron_reference.py). The import must hold Megatron's moments
exactly, parameter by parameter, with Adam's step count; and one tnlg step from the imported state
on the same batch must give the parameters Megatron's next step gives (fp32, 1e-6). The
distributed optimizer's bucket layouts (``dp_reshardable``, legacy ``distrib_optim.pt``) are
refused, naming what to do.
"""

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install --no-deps "
                    "megatron-core==0.16.1): the Megatron optimizer tests need it as their reference")

from tnlg.checkpoint.files import read_meta  # noqa: E402
from tnlg.checkpoint.loading import read_states  # noqa: E402
from tnlg.config import GPTConfig  # noqa: E402
from tnlg.errors import UserError  # noqa: E402
from tnlg.interop.megatron import megatron_to_checkpoint  # noqa: E402
from tnlg.interop.megatron.names import GLOBAL_ROLES, LAYER_ROLES, tnlg_name  # noqa: E402
from tnlg.runtime.spawn import run_distributed  # noqa: E402

from . import megatron_reference as R  # noqa: E402

# a vocabulary Megatron does not pad at TP 2 (112 = 7 x 8 x 2): its padding rows would take part in its
# softmax, so the two losses, and the steps, would differ
SPEC = dict(layers=2, hidden=32, heads=4, ffn=64, seq=16, vocab=112, divisible=8, tp=2, pp=1, openai_gelu=False,
            untie=True)
STEPS = 2
KINDS = ("plain", "distributed")
# (folder of Megatron's save, the optimizer that wrote it): torch_dist by both, legacy files by the plain one
SAVES = (("plain", "plain"), ("distributed", "distributed"), ("legacy_plain", "plain"))


def _tokens():
    return torch.randint(0, SPEC["vocab"], (2, SPEC["seq"]), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Megatron's runs (saved and continued one step), and their imports at tnlg TP 2."""
    root = tmp_path_factory.mktemp("megatron_adam")
    ref = run_distributed(R.train_and_save, SPEC["tp"], 1, SPEC, str(root), _tokens(), STEPS, timeout_s=300)
    converted = {k: megatron_to_checkpoint(str(root / k), str(root / f"tnlg_{k}"), tp_size=2, with_optimizer=True)
                 for k in (*KINDS, "legacy_plain")}
    return root, ref, converted


def _megatron_names():
    """tnlg name -> (megatron-core local-spec name, TP split dimension) of every parameter of SPEC."""
    out = {tnlg_name(role, i): (f"decoder.layers.{i}.{role.core[0]}", role.split)
           for i in range(SPEC["layers"]) for role in LAYER_ROLES}
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
    return meta, read_states(path, meta, GPTConfig.from_dict(meta["config"]), 1, 0)


@pytest.mark.parametrize("save,kind", SAVES)
def test_imported_moments_are_megatrons_parameter_by_parameter(trained, save, kind):
    _, ref, converted = trained
    meta, (_, states) = _imported(converted[save])
    assert meta["optimizer"]["present"] and meta["optimizer"]["num_steps"] == STEPS
    assert meta["schedule"]["num_steps"] == STEPS  # the scheduler's samples over the global batch
    names = _megatron_names()
    assert set(states) == set(names)
    for name, (meg, split) in names.items():
        for k in ("exp_avg", "exp_avg_sq"):
            want = _full([r[kind]["moments"][meg][k] for r in ref], split)
            assert torch.equal(states[name][k], want), (name, k)
        assert "master" not in states[name]  # an fp32 run: its master is its weights


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


@pytest.mark.parametrize("save,kind", SAVES)
def test_a_tnlg_step_from_the_import_is_megatrons_next_step(trained, save, kind):
    _, ref, converted = trained
    lr = ref[0][kind]["lr"]
    assert 0 < lr < R.ADAM["lr"]  # the scheduler's cosine decay after its warmup, as Megatron stepped it
    before, after, params = run_distributed(_tnlg_step, 1, 1, converted[save], lr, _tokens())[0]
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


def test_the_distributed_optimizers_bucket_layouts_are_refused(trained, tmp_path):
    root, _, _ = trained
    dst = tmp_path / "out"
    with pytest.raises(UserError, match="'dp_reshardable' layout .* does not read yet.*"
                                        "--dist-ckpt-optim-fully-reshardable"):
        megatron_to_checkpoint(str(root / "dp_reshardable"), str(dst), with_optimizer=True)
    with pytest.raises(UserError, match="legacy distrib_optim.pt files .* does not read yet"):
        megatron_to_checkpoint(str(root / "legacy_distributed"), str(dst), with_optimizer=True)
    assert not dst.exists()
    meta = read_meta(megatron_to_checkpoint(str(root / "dp_reshardable"), str(dst)))  # the weights convert
    assert not meta["optimizer"]["present"] and meta["schedule"]["num_steps"] == STEPS


def test_a_bf16_run_imports_its_fp32_master_and_moments_exactly(tmp_path):
    """bf16 weights with Megatron's fp32 master (the non-distributed optimizer's ``fp32_param``, the
    distributed one's ``param``): the import keeps the bf16 weights and the master and moments exactly.
    (No step comparison: two bf16 forwards round differently, so their gradients differ beyond 1e-6.)"""
    spec = dict(SPEC, bf16=True)
    ref = run_distributed(R.train_and_save, spec["tp"], 1, spec, str(tmp_path), _tokens(), STEPS, timeout_s=300)
    for save, kind in SAVES:
        path = megatron_to_checkpoint(str(tmp_path / save), str(tmp_path / f"tnlg_{save}"), tp_size=2,
                                      with_optimizer=True)
        meta, (params, states) = _imported(path)
        assert meta["layout"]["param_dtype"] == "bfloat16" and meta["optimizer"]["num_steps"] == STEPS
        for name, (meg, split) in _megatron_names().items():
            assert params[name].dtype == torch.bfloat16
            for k, mk in (("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq"), ("master", "param")):
                want = _full([r[kind]["moments"][meg][mk] for r in ref], split)
                assert states[name][k].dtype == torch.float32 and torch.equal(states[name][k], want), (kind, name, k)
