"""Layout invariance of a mixture of experts: a tiny MoE (E 4, top-2, balancing and z losses on, router weights
sharpened so that no top-k choice is a near tie) trained a few steps gives the same losses, the same expert
loads and the same weights at EP 1, EP 2 and EP 2 x TP 2 with sequence parallelism (DP 2 in each: the
balancing loss is each DP rank's micro batch's, as megatron-core's). The reference of every layout is the
same plain recipe: gradients of dense parameters averaged over DP, of expert parameters over the
expert-data-parallel ranks (:meth:`ParallelState.for_gradients`), then SGD. Pipelines (PP 2, and EP 2 x PP 2)
train through the training step as PP 1 does: the earlier stage's auxiliary losses reach its own backward."""

from __future__ import annotations

import pytest
import torch

from tests.pool import run_distributed

STEPS = 3


def _config(sp: bool):
    from tnlg.config import LLAMA, GPTConfig
    return GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=8, vocab_size=64, num_experts=4,
                     moe_router_topk=2, moe_ffn_hidden_size=16, moe_aux_loss_coeff=0.01, moe_z_loss_coeff=1e-3,
                     moe_shared_expert_intermediate_size=16, moe_shared_expert_gate=True, sequence_parallel=sp,
                     **LLAMA)


def _train(ps, ep: int, sp: bool):
    import torch.distributed as dist

    from tnlg.model import GPT
    from tnlg.model.moe import MoELayer, is_expert_parameter
    from tnlg.parallel.sharding import full_state_dict
    from tnlg.parallel.state import init_expert_parallel
    ps = init_expert_parallel(ps, ep)
    model = GPT(_config(sp), ps)
    with torch.no_grad():  # sharpen the routers: top-k choices far from ties
        for m in model.modules():
            if isinstance(m, MoELayer):
                m.router.weight.mul_(40.0)
    g = torch.Generator().manual_seed(7)
    data = torch.randint(0, 64, (STEPS, 2, 2, 9), generator=g)  # step, DP rank, batch, tokens
    dense, expert = ps.for_gradients("dense"), ps.for_gradients("expert")
    out = []
    for step in range(STEPS):
        batch = data[step, ps.dp_rank]
        loss = model(batch[:, :-1], labels=batch[:, 1:])
        model.zero_grad()
        loss.backward()
        loads = [m.last_load.clone() for m in model.modules() if isinstance(m, MoELayer)]
        with torch.no_grad():
            for p in model.parameters():
                gps = expert if is_expert_parameter(p) else dense
                if gps.dp_group is not None:
                    dist.all_reduce(p.grad, group=gps.dp_group)
                p -= 0.5 * p.grad / gps.dp_size
        out.append((loss.item(), [x.tolist() for x in loads]))
    full = full_state_dict(model, ps)  # (every expert: gathered over TP and EP)
    experts = {k: v for k, v in full.items() if k.endswith(("experts.fc1", "experts.fc2"))}
    assert all(v.shape[0] == 4 for v in experts.values())
    return out, {k: v for k, v in full.items() if k not in experts}, experts, ps.dp_rank, ps.tp_rank


def _by_dp(results):
    return {dp: (out, dense, experts) for out, dense, experts, dp, tp in results if tp == 0}


@pytest.mark.parametrize("world,tp,ep,sp", [(2, 1, 2, False), (4, 2, 2, True), (4, 2, 1, False)])
def test_expert_parallel_layouts_train_as_one_expert_parallel_rank(world, tp, ep, sp):
    want = _by_dp(run_distributed(_train, 2, 1, 1, False))
    got = _by_dp(run_distributed(_train, world, tp, ep, sp))
    assert set(got) == set(want) == {0, 1}
    for dp in (0, 1):
        (w_out, w_dense, w_exp), (g_out, g_dense, g_exp) = want[dp], got[dp]
        for (wl, wloads), (gl, gloads) in zip(w_out, g_out):
            assert gl == pytest.approx(wl, rel=1e-5, abs=1e-6)
            assert gloads == wloads
        for k in w_dense:
            torch.testing.assert_close(g_dense[k], w_dense[k], rtol=1e-5, atol=1e-6)
        for k in w_exp:
            torch.testing.assert_close(g_exp[k], w_exp[k], rtol=1e-5, atol=1e-6)


def _engine_steps(ps, ep: int, sp: bool, zero: int):
    from tnlg.model import GPT
    from tnlg.model.moe import MoELayer
    from tnlg.optim.engine import build_engine
    from tnlg.parallel.state import init_expert_parallel
    ps = init_expert_parallel(ps, ep)
    model = GPT(_config(sp), ps)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, MoELayer):
                m.router.weight.mul_(40.0)
    engine = build_engine(model, ps.for_gradients(), zero_stage=zero, lr=1e-2, clip_grad=0.05)
    data = torch.randint(0, 64, (STEPS, 2, 2, 9), generator=torch.Generator().manual_seed(7))
    out = []
    for step in range(STEPS):
        batch = data[step, ps.dp_rank]
        engine.zero_grad()
        loss = engine.model(batch[:, :-1], labels=batch[:, 1:])
        engine.backward(loss)
        info = engine.step(loss=loss.detach())
        loads = [m.last_load.tolist() for m in engine.model.modules() if isinstance(m, MoELayer)]
        out.append((info["loss"], info["grad_norm"], info["clip_coeff"], loads))
    return out, ps.dp_rank, ps.tp_rank


@pytest.mark.parametrize("world,tp,ep,sp,zero", [(2, 1, 2, False, 0), (2, 1, 2, False, 1), (4, 2, 2, True, 1)])
def test_the_engine_trains_expert_parallel_layouts_alike(world, tp, ep, sp, zero):
    """Through the engine (AdamW, global-norm clipping that binds: clip_coeff < 1), EP 2 at ZeRO 0 and 1 and
    EP 2 x TP 2 with sequence parallelism give EP 1's losses, gradient norms and expert loads."""
    want = {dp: out for out, dp, tp_rank in run_distributed(_engine_steps, 2, 1, 1, False, 0) if tp_rank == 0}
    got = {dp: out for out, dp, tp_rank in run_distributed(_engine_steps, world, tp, ep, sp, zero) if tp_rank == 0}
    for dp in (0, 1):
        for (wl, wn, wc, wloads), (gl, gn, gc, gloads) in zip(want[dp], got[dp]):
            assert gl == pytest.approx(wl, rel=1e-5) and gn == pytest.approx(wn, rel=1e-5)
            assert gc == pytest.approx(wc, rel=1e-5) and wc < 1.0
            assert gloads == wloads


def _cp_steps(_ps, cp: int):
    from tnlg.model import GPT
    from tnlg.model.moe import MoELayer
    from tnlg.optim.engine import build_engine
    from tnlg.parallel.context import context_parallel_batch
    from tnlg.parallel.state import ParallelState, init_parallel
    import torch.distributed as dist
    ps = init_parallel(context_parallel_size=cp) if cp > 1 else ParallelState.single()
    if cp == 1 and dist.get_rank() != 0:
        return None
    model = GPT(_config(False), ps)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, MoELayer):
                m.router.weight.mul_(40.0)
    engine = build_engine(model, ps.for_gradients(), zero_stage=1, lr=1e-2, clip_grad=0.05)
    data = torch.randint(0, 64, (STEPS, 2, 9), generator=torch.Generator().manual_seed(11))
    out = []
    for step in range(STEPS):
        batch = context_parallel_batch(dict(tokens=data[step, :, :-1], labels=data[step, :, 1:]), ps)
        engine.zero_grad()
        loss = engine.model(batch.tokens, labels=batch.labels, position_ids=batch.position_ids)
        engine.backward(loss)
        info = engine.step(loss=loss.detach())
        loads = [m.last_load.clone() for m in engine.model.modules() if isinstance(m, MoELayer)]
        if cp > 1:
            for x in loads:
                dist.all_reduce(x, group=ps.cp_group)
        out.append((info["loss"], info["grad_norm"], [x.tolist() for x in loads]))
    return out


def test_context_parallel_moe_trains_as_cp_1():
    """CP 2 (each rank two chunks of every sequence): the balancing and z losses are the whole micro batch's
    (counts summed over CP), so the losses, gradient norms and expert loads (summed over CP) are CP 1's."""
    want = run_distributed(_cp_steps, 2, 1, 1)[0]
    got = run_distributed(_cp_steps, 2, 1, 2)[0]
    for (wl, wn, wloads), (gl, gn, gloads) in zip(want, got):
        assert gl == pytest.approx(wl, rel=1e-5) and gn == pytest.approx(wn, rel=1e-5)
        assert gloads == wloads


PP_STEPS, MICRO = 6, 2


def _pipeline_steps(_ps, layouts):
    """``PP_STEPS`` training steps (``train_step``: ``MICRO`` micro batches, AdamW, clipping that binds, ZeRO 1) of
    the tiny MoE at each ``(pp, ep, schedule)`` layout (DP 2 in each; ``interleaved``: two chunks of one layer per
    rank): ``(pp rank, dp rank, [per step: the loss, the auxiliary terms, the gradient norm, the clipping
    coefficient, {layer: the expert loads of the last micro batch}])`` per layout."""
    from tnlg.config import LLAMA, GPTConfig
    from tnlg.model import GPT
    from tnlg.model.moe import MoELayer
    from tnlg.model.stage import StageModel
    from tnlg.optim.engine import build_engine
    from tnlg.parallel.pipeline import chunk_layers
    from tnlg.parallel.pipeline_schedule import Pipeline
    from tnlg.parallel.state import init_expert_parallel, init_parallel
    from tnlg.training.step import train_step
    cfg = GPTConfig(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=8, vocab_size=64, num_experts=4,
                    moe_router_topk=2, moe_ffn_hidden_size=16, moe_aux_loss_coeff=0.01, moe_z_loss_coeff=1e-3, **LLAMA)
    data = torch.randint(0, 64, (PP_STEPS, 2, MICRO, 2, 9), generator=torch.Generator().manual_seed(5))
    out = []
    for pp, ep, schedule in layouts:
        ps = init_expert_parallel(init_parallel(1, pipeline_parallel_size=pp), ep)
        virtual = 2 if schedule == "interleaved" else 1
        chunks = chunk_layers(cfg.num_layers, pp, virtual)
        model = GPT(cfg, ps) if pp == 1 else StageModel(cfg, ps, chunks[ps.pp_rank::pp])
        moe = [m for m in model.modules() if isinstance(m, MoELayer)]
        with torch.no_grad():
            for m in moe:
                m.router.weight.mul_(40.0)
        engine = build_engine(model, ps, zero_stage=1, lr=1e-2, clip_grad=0.05, grad_accum_steps=MICRO)
        pipeline = Pipeline(engine.model, MICRO, schedule) if pp > 1 else None
        steps = []
        for step in range(PP_STEPS):
            rows = data[step, ps.dp_rank]
            batches = [dict(tokens=r[:, :-1], labels=r[:, 1:], loss_mask=torch.ones(2, 8)) for r in rows]
            loss, info = train_step(engine.model, engine, batches, 1e-2, autocast=None, ps=ps, iteration=step + 1,
                                    pipeline=pipeline)
            steps.append((loss, info["aux"], info["grad_norm"], info["clip_coeff"],
                          {m.layer_idx: m.last_load.tolist() for m in moe}))
        out.append((ps.pp_rank, ps.dp_rank, steps))
    return out


def test_pipelines_train_a_moe_as_one_stage():
    """PP 2 (1F1B and interleaved) and EP 2 x PP 2 (DP 2 in each) give PP 1's losses, auxiliary terms (each
    stage's layers' summed over the stages), gradient norms and expert loads over 6 steps of the training step:
    each stage back-propagates its own layers' balancing and z losses with the loss's scale."""
    want = {dp: steps for _, dp, steps in (r[0] for r in run_distributed(_pipeline_steps, 2, 1, [(1, 1, "1f1b")]))}
    layouts = [(2, 1, "1f1b"), (2, 2, "1f1b"), (2, 2, "interleaved")]
    got = run_distributed(_pipeline_steps, 4, 1, layouts, timeout_s=300)
    for layout in range(len(layouts)):
        for dp in (0, 1):
            ranks = [steps for pp, d, steps in (r[layout] for r in got) if d == dp]
            assert len(ranks) == 2
            for step, (wl, waux, wn, wc, wloads) in enumerate(want[dp]):
                loads = {}
                for gl, gaux, gn, gc, gloads in (steps[step] for steps in ranks):
                    assert gl == pytest.approx(wl, rel=1e-5) and gn == pytest.approx(wn, rel=1e-5), (layout, step)
                    assert gc == pytest.approx(wc, rel=1e-5) and wc < 1.0
                    assert set(gaux) == set(waux) == {"z_loss", "load_balancing_loss"}
                    assert all(gaux[k] == pytest.approx(waux[k], rel=1e-5) for k in waux), (layout, step, gaux, waux)
                    loads.update(gloads)
                assert loads == wloads, (layout, step)


def _expert_bias_counts(_ps):
    """One pipeline step (PP 2, 3 micro batches of 2 x 8 tokens, top-2, sigmoid scores with DeepSeek-V3's expert
    bias): the tokens each stage's router counted for its bias update."""
    from tnlg.config import LLAMA, GPTConfig
    from tnlg.model.moe import Router
    from tnlg.model.stage import StageModel
    from tnlg.parallel.pipeline import chunk_layers
    from tnlg.parallel.pipeline_schedule import Pipeline
    from tnlg.parallel.state import init_parallel
    cfg = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=8, vocab_size=64, num_experts=4,
                    moe_router_topk=2, moe_ffn_hidden_size=16, moe_router_score_function="sigmoid",
                    moe_router_enable_expert_bias=True, **LLAMA)
    ps = init_parallel(1, pipeline_parallel_size=2)
    model = StageModel(cfg, ps, [chunk_layers(2, 2)[ps.pp_rank]])
    data = torch.randint(0, 64, (3, 2, 9), generator=torch.Generator().manual_seed(2))
    Pipeline(model, 3).run([dict(tokens=r[:, :-1], labels=r[:, 1:]) for r in data], 1.0)
    return [m.local_tokens_per_expert.sum().item() for m in model.modules() if isinstance(m, Router)]


def test_the_schedules_shape_forward_leaves_the_routers_token_counts_alone():
    """torch's schedule runs a forward of its own on its first step; the routers' counts (for the expert bias) are
    those of the 3 micro batches only: 3 x 16 tokens x top-2."""
    assert run_distributed(_expert_bias_counts, 2, 1) == [[96.0], [96.0]]
