"""Checkpoints of a mixture of experts under expert parallelism: saved at one (TP, EP, ZeRO) layout, resumed at
the same one or loaded at another.

A tiny MoE (2 layers, E 4, top-2, a gated shared expert, sigmoid routing with DeepSeek-V3's expert bias, balancing
loss on) is trained 3 steps, saved, and trained on. What is checked, each against something the checkpoint code
does not compute:

* at the saving layout, the next steps' losses and gradient norms are bit for bit the uninterrupted run's;
* at any layout (EP 2 x TP 2 -> EP 1 x TP 1, EP 2 -> EP 4, EP 1 -> EP 4 and EP 2 with its experts' optimizer
  states partitioned over 2 expert-DP ranks, EP 2 at ZeRO 0 -> EP 1 at ZeRO 1), the state a loading rank holds
  is bit for bit the saving run's in memory: every parameter's full weight and Adam moments (gathered over TP
  and EP by the model's own ``gather_full``), every router's expert bias and the step count;
* a model loaded at EP 1 x TP 1 (for training, and by generation's loader) gives the logits of a plain
  one-process GPT holding the saving run's weights and expert biases (gathered in memory);
* ZeRO 3 (FSDP2, the experts sharded over their expert-DP ranks) at EP 2 trains as ZeRO 1 at EP 1 within 1e-5
  (every MoE layer's balancing loss in the loss: FSDP2 copies the arguments it hands a block), and its checkpoints
  resume exactly and load at ZeRO 1; an EP 2 x TP 2 checkpoint loads at ZeRO 2;
* through ``tnlg pretrain``'s options: a run at ``--expert-model-parallel-size 2`` stopped and resumed (``--exit-
  interval``) logs the uninterrupted run's losses; bad EP sizes are one paragraph before any process starts;
  ``tnlg checkpoint info`` names the expert layout.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.tiny import tiny_options
from tnlg import checkpoint as ck
from .pool import run_distributed

SAVED_AT, MORE, GLOBAL = 3, 2, 4  # save after 3 steps, then 2 more; 4 sequences per step


def _config():
    from tnlg.config import LLAMA, GPTConfig
    return GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=8, vocab_size=64, num_experts=4,
                     moe_router_topk=2, moe_ffn_hidden_size=16, moe_aux_loss_coeff=0.01,
                     moe_shared_expert_intermediate_size=16, moe_shared_expert_gate=True,
                     moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                     moe_router_bias_update_rate=0.01, **LLAMA)


def _data():
    return torch.randint(0, 64, (SAVED_AT + MORE, GLOBAL, 9), generator=torch.Generator().manual_seed(7))


def _build(layout):
    """``(ps, engine)`` of a (TP, EP, ZeRO) layout of the world (DP: the rest), built as ``tnlg pretrain`` builds
    it: on the meta device, materialised by the engine."""
    from tnlg.model import GPT
    from tnlg.optim.engine import build_engine
    from tnlg.parallel.state import init_expert_parallel, init_parallel
    tp, ep, zero = layout
    ps = init_expert_parallel(init_parallel(tp), ep)
    engine = build_engine(GPT(_config(), ps, device="meta"), ps.for_gradients(), zero, lr=1e-2, weight_decay=0.1,
                          clip_grad=0.05)
    return ps, engine


def _steps(ps, engine, first: int, count: int) -> list[float]:
    """Steps ``first .. first + count - 1`` of the fixed data (each DP rank its share of the 4 sequences); their
    losses, then their gradient norms."""
    from tnlg.training.step import train_step
    data, per = _data(), GLOBAL // ps.dp_size
    losses, norms = [], []
    for step in range(first, first + count):
        batch = data[step, ps.dp_rank * per:(ps.dp_rank + 1) * per]
        loss, info = train_step(engine.model, engine, [dict(tokens=batch[:, :-1], labels=batch[:, 1:])], 1e-2,
                                autocast=None, ps=ps, iteration=step + 1)
        losses.append(loss)
        norms.append(info["grad_norm"])
    return losses + norms


def _state(ps, engine) -> dict:
    """The full state of the model this rank belongs to: every parameter's weight and Adam moments as TP=1, EP=1
    tensors (gathered over TP and EP by the model's ``gather_full``), every buffer, the step count."""
    from tnlg.parallel.sharding import gather_full
    params = dict(engine.model.named_parameters())  # (their split marks; FSDP2's are sharded tensors)
    weights = engine.model_state_by_param()  # (this rank's TP shards, whole over DP: collective)
    states = engine.optimizer_state_by_param()  # (collective over each kind's gradient ranks)
    full = {n: [gather_full(t, p, ps) for t in (weights[n], states[n]["exp_avg"], states[n]["exp_avg_sq"])]
            for n, p in params.items()}
    return dict(step=engine.num_steps, tensors=full,
                buffers={n: b.clone() for n, b in engine.model.state_dict().items() if n not in params})


def _reference_logits(state: dict, tokens: torch.Tensor) -> torch.Tensor:
    """A plain one-process GPT (EP 1, TP 1) given ``state``'s weights and buffers, in memory: its logits."""
    from tnlg.model import GPT
    from tnlg.parallel.sharding import load_full_state_dict
    from tnlg.parallel.state import ParallelState
    model = GPT(_config(), ParallelState.single()).eval()
    load_full_state_dict(model, {n: t[0] for n, t in state["tensors"].items()}, ParallelState.single())
    with torch.no_grad():
        for n, b in state["buffers"].items():
            model.get_buffer(n).copy_(b)
        return model(tokens)


def _dir(root, layout) -> str:
    return os.path.join(root, "tp{}_ep{}_zero{}".format(*layout))


def _body(_ps, root: str, sources: list, resumes: list):
    out: dict = dict(runs={}, states={}, resumed={}, loaded={}, logits={})
    tokens = _data()[0, :2, :-1]
    for layout in sources:  # uninterrupted: 3 steps, save, 2 more
        ps, engine = _build(layout)
        first = _steps(ps, engine, 0, SAVED_AT)
        out["states"][layout] = _state(ps, engine)
        ck.save(_dir(root, layout), iteration=SAVED_AT, consumed_samples=SAVED_AT * GLOBAL, model=engine.model,
                engine=engine, ps=ps, config=_config())
        out["runs"][layout] = (first, _steps(ps, engine, SAVED_AT, MORE))
    for source, target in resumes:
        ps, engine = _build(target)
        info = ck.load(_dir(root, source), model=engine.model, engine=engine, ps=ps, config=_config())
        assert info["iteration"] == SAVED_AT
        out["loaded"][(source, target)] = _state(ps, engine)
        if target[:2] == (1, 1):
            with torch.no_grad():
                out["logits"][(source, target)] = engine.model.eval()(tokens)
            engine.model.train()
        if source == target:
            out["resumed"][(source, target)] = _steps(ps, engine, SAVED_AT, MORE)
    return out


def _same_state(got: dict, want: dict, what: str) -> None:
    assert got["step"] == want["step"] == SAVED_AT, what
    assert set(got["tensors"]) == set(want["tensors"]), what
    for n, (w, m, v) in want["tensors"].items():
        g = got["tensors"][n]
        for kind, a, b in zip(("weight", "exp_avg", "exp_avg_sq"), g, (w, m, v)):
            assert torch.equal(a, b), f"{what}: {n} {kind} differs"
    assert set(got["buffers"]) == set(want["buffers"]) and got["buffers"], what
    for n, b in want["buffers"].items():
        assert b.abs().sum() > 0, f"{n} never moved: the test would not see it restart at 0"
        assert torch.equal(got["buffers"][n], b), f"{what}: buffer {n} differs"


def _check(results: list, sources: list, resumes: list) -> None:
    for rank, out in enumerate(results):
        for source, target in resumes:
            what = f"rank {rank}: {source} -> {target}"
            _same_state(out["loaded"][(source, target)], out["states"][source], what)
            if source == target:  # the uninterrupted run's next steps, bit for bit
                assert out["resumed"][(source, target)] == out["runs"][source][1], what
            if (source, target) in out["logits"]:
                want = _reference_logits(out["states"][source], _data()[0, :2, :-1])
                torch.testing.assert_close(out["logits"][(source, target)], want, rtol=1e-6, atol=1e-6)
        for layout in sources:  # every rank of a layout's model: the same full state
            _same_state(out["states"][layout], results[0]["states"][layout], f"rank {rank}: {layout} replicas")


# (TP, EP, ZeRO) on 4 processes. EP 2 x TP 2 (DP 2): each EP rank's experts in its own files; loaded at the same
# layout, at EP 1 x TP 1, at EP 4 and at EP 2 x DP 4 with ZeRO 2 (FSDP2: the experts sharded over their 2 expert-DP
# ranks). EP 1 (DP 4): loaded at EP 4 and at EP 2 (2 expert-DP ranks, ZeRO 1). EP 2 x DP 4 at ZeRO 3: resumed, and
# loaded at EP 1 with ZeRO 1.
SOURCES_4 = [(2, 2, 1), (1, 1, 1), (1, 2, 3)]
RESUMES_4 = [((2, 2, 1), (2, 2, 1)), ((2, 2, 1), (1, 1, 0)), ((2, 2, 1), (1, 4, 1)), ((1, 1, 1), (1, 4, 1)),
             ((1, 1, 1), (1, 2, 1)), ((1, 2, 3), (1, 2, 3)), ((1, 2, 3), (1, 1, 1)), ((2, 2, 1), (1, 2, 2))]
# on 2 processes: EP 2 at ZeRO 0 (the dense states written by DP rank 0 alone, each EP rank's experts' by itself)
SOURCES_2 = [(1, 2, 0)]
RESUMES_2 = [((1, 2, 0), (1, 2, 0)), ((1, 2, 0), (1, 1, 1))]


def test_expert_parallel_checkpoints_resume_exactly_and_reshard_across_ep_and_tp(tmp_path):
    from tnlg.generation.loading import load_for_inference
    results = run_distributed(_body, 4, 1, str(tmp_path), SOURCES_4, RESUMES_4, timeout_s=120)
    _check(results, SOURCES_4, RESUMES_4)
    for got, want in zip(*(results[0]["runs"][layout] for layout in ((1, 2, 3), (1, 1, 1)))):  # FSDP2 at EP 2
        assert got == pytest.approx(want, rel=1e-5)  # trains as ZeRO 1 at EP 1 (the same 4 DP ranks' batches)
    model, _ = load_for_inference(_dir(str(tmp_path), (2, 2, 1)))  # (generation's load: one process, EP 1 x TP 1)
    tokens = _data()[0, :2, :-1]
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), _reference_logits(results[0]["states"][(2, 2, 1)], tokens),
                                   rtol=1e-6, atol=1e-6)
    m = ck.Manifest.read(os.path.join(_dir(str(tmp_path), (2, 2, 1)), ck.iter_dir_name(SAVED_AT)))
    assert m.layout.ep == 2 and set(m.buffers) == {f"transformer.h.{i}.mlp.router.expert_bias" for i in range(2)}
    assert {"model_tp00_ep00.safetensors", "model_tp01_ep01.safetensors"} <= set(m.files)
    assert m.params["transformer.h.0.mlp.experts.fc1"]["shape"][0] == 4  # (every expert, whatever the EP size)


def test_expert_parallel_checkpoints_at_zero_0_resume_exactly_and_load_at_ep_1(tmp_path):
    results = run_distributed(_body, 2, 1, str(tmp_path), SOURCES_2, RESUMES_2, timeout_s=120)
    _check(results, SOURCES_2, RESUMES_2)


# tnlg pretrain's llama-tiny preset with 4 experts (tests.tiny's run: its 16 positions, micro batches of 2, global 4)
LLAMA_TINY = dict(preset="llama-tiny", num_layers=None, hidden_size=None, num_attention_heads=None, train_iters=4)


def _train(ps, o):
    from tnlg.training import train
    s = train(o)
    return s["losses"], s.get("exited")


@pytest.mark.parametrize("world,layout,experts", [
    (2, dict(expert_model_parallel_size=2), "saved at EP 2: experts 0-1, 2-3"),
    (4, dict(expert_model_parallel_size=4, context_parallel_size=2, attention_dropout=0.0),  # (EP over DP x CP)
     "saved at EP 4: experts 0, 1, 2, 3"),
])
def test_pretrain_with_expert_parallelism_stops_saves_and_resumes_exactly(tmp_path, capsys, world, layout, experts):
    from tnlg.cli import main
    common = dict(LLAMA_TINY, num_experts=4, moe_aux_loss_coeff=0.01, moe_ffn_hidden_size=64,
                  moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True, lr=3e-3,
                  lr_warmup_iters=1, **layout)
    reference = run_distributed(_train, world, 1, tiny_options(world, **common), timeout_s=120)[0][0]
    o = tiny_options(world, exit_interval=2, save=str(tmp_path / "run"), **common)
    pieces = []
    for stop in (2, None):
        losses, exited = run_distributed(_train, world, 1, o, timeout_s=120)[0]
        assert (exited and exited["iteration"]) == stop
        pieces += losses
    assert len(pieces) == 4 and pieces == reference
    capsys.readouterr()
    assert main(["checkpoint", "info", str(tmp_path / "run" / ck.iter_dir_name(2))]) == 0
    text = capsys.readouterr().out
    ep = layout["expert_model_parallel_size"]
    assert f"(EP={ep})" in text and "experts      4 routed per MoE layer" in text and experts in text
    assert "expert bias(es) saved" in text


@pytest.mark.parametrize("over,words", [
    (dict(expert_model_parallel_size=2), "--expert-model-parallel-size 2 splits the experts"),
    (dict(num_experts=6, expert_model_parallel_size=4), "--expert-model-parallel-size 4 does not divide --num-experts 6"),
    (dict(num_experts=4, expert_model_parallel_size=4), "--expert-model-parallel-size 4 does not divide the "
                                                        "data-parallel x context-parallel size (DP 2"),
    (dict(num_experts=4, expert_model_parallel_size=2, zero_stage=2), "--expert-model-parallel-size 2 with --zero-stage 2: "
                                                                      "EP 2 = DP x CP"),
])
def test_bad_expert_parallel_sizes_are_one_paragraph_before_any_process_starts(over, words):
    from tnlg.errors import UserError
    with pytest.raises(UserError) as e:
        tiny_options(2, **LLAMA_TINY, **over)
    assert words in str(e.value) and "\n" not in str(e.value)
    tiny_options(2, **LLAMA_TINY, num_experts=4, expert_model_parallel_size=2)  # (valid: EP 2 of DP 2)
    tiny_options(4, **LLAMA_TINY, num_experts=4, expert_model_parallel_size=2, zero_stage=3,
                 global_batch_size=8)  # (FSDP2: the experts over their 2 expert-DP ranks)
