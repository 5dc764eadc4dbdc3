"""Pipeline parallelism composed with TP and ZeRO: the same training as one process without a pipeline.

References are independent of the pipeline code: tnlg's plain GPT in one process (no pipeline,
no process group) trained by the same engine, and that GPT's own autograd gradients. Each spawn
runs several layouts (``init_parallel`` builds a new PP x DP x TP split of the same world).
"""

from __future__ import annotations

import math

import pytest
import torch

from tnlg.config import GPTConfig, stage_layer_counts
from tnlg.data.gpt_dataset import _make_item
from tnlg.errors import UserError
from tnlg.model import GPT
from tnlg.optim import build_engine
from tnlg.model.stage import StageModel
from tnlg.parallel.pipeline import chunk_layers
from tnlg.parallel.pipeline_schedule import Pipeline, tie_embedding_grads
from tnlg.parallel.sharding import full_state_dict, gather_full
from tnlg.parallel.state import ParallelState, init_parallel
from .pool import run_distributed
from tnlg.training.step import train_step

MICRO, GLOBAL, STEPS, SEQ = 2, 8, 5, 8
LRS = [3e-3, 2e-3, 4e-3, 1e-3, 2e-3]
TINY_BUCKET_MB = 200 * 4 / 2 ** 20  # several buckets, parameters cut across DP ranks


def _config(layers: int = 4, **extra) -> GPTConfig:
    return GPTConfig(**{**dict(num_layers=layers, hidden_size=16, num_attention_heads=4, seq_length=SEQ,
                               vocab_size=50, hidden_dropout=0.0, attention_dropout=0.0, seed=3), **extra})


EOD = 7


def _samples(n: int = GLOBAL * STEPS, documents: bool = False) -> list[dict]:
    """Random samples; ``documents``: about a third of the tokens end a document, and each sample carries
    the dataset's per-document ``position_ids`` and block-diagonal ``attention_mask``
    (``--reset-position-ids --reset-attention-mask``)."""
    g = torch.Generator().manual_seed(11)
    seqs = torch.randint(0, 50, (n, SEQ + 1), generator=g)
    if not documents:
        return [dict(tokens=s[:-1], labels=s[1:], loss_mask=torch.ones(SEQ)) for s in seqs]
    seqs[torch.rand(seqs.shape, generator=g) < 0.3] = EOD
    return [_make_item(s, EOD, False, True, True) for s in seqs]


def _micro_batches(samples, step: int, dp_rank: int, dp: int) -> list[dict]:
    """Megatron's sampler order: each micro step takes MICRO x dp consecutive samples, DP rank r its r-th MICRO."""
    out, base = [], step * GLOBAL
    for j in range(GLOBAL // (MICRO * dp)):
        lo = base + j * MICRO * dp + dp_rank * MICRO
        rows = samples[lo:lo + MICRO]
        out.append({k: torch.stack([r[k] for r in rows]) for k in rows[0]})
    return out


def _train(model, ps, zero: int, pipeline_of=None, documents: bool = False) -> tuple[list, list, dict]:
    """STEPS steps with the engine; ``(losses, grad norms, full parameters)``."""
    m = GLOBAL // (MICRO * ps.dp_size)
    engine = build_engine(model, ps, zero, lr=1e-3, weight_decay=0.1, clip_grad=0.05, grad_accum_steps=m,
                          bucket_size_mb=TINY_BUCKET_MB)
    pipeline = None if pipeline_of is None else pipeline_of(engine.model, m)
    samples, losses, norms = _samples(documents=documents), [], []
    for step in range(STEPS):
        loss, info = train_step(engine.model, engine, _micro_batches(samples, step, ps.dp_rank, ps.dp_size),
                                LRS[step], autocast=None, ps=ps, iteration=step + 1, pipeline=pipeline)
        losses.append(loss)
        norms.append(info["grad_norm"])
    return losses, norms, full_state_dict(engine.model, ps)


def _reference(layers: int, extra: tuple, documents: bool = False) -> tuple[list, list, dict]:
    """One process, no pipeline: the plain GPT in the same engine."""
    return _train(GPT(_config(layers, **dict(extra)), ParallelState.single(), device="meta"), ParallelState.single(), 0,
                  documents=documents)


def _layout_body(_ps, layouts, documents: bool):
    out = []
    for pp, tp, zero, layers, schedule, per_virtual, *extra in layouts:
        ps = init_parallel(tp, pipeline_parallel_size=pp)
        virtual = 1 if per_virtual is None else layers // (pp * per_virtual)
        chunks = chunk_layers(layers, pp, virtual)
        mine = [r for c, r in enumerate(chunks) if c % pp == ps.pp_rank]
        model = StageModel(_config(layers, **dict(extra[0] if extra else {})), ps, mine, device="meta")
        out.append(_train(model, ps, zero, lambda mod, m, schedule=schedule: Pipeline(mod, m, schedule), documents))
    return out


def _check_layouts(world: int, layouts: list, documents: bool = False) -> dict:
    """Train every layout on ``world`` processes against the plain GPT; the references, by model kind."""
    results = run_distributed(_layout_body, world, 1, layouts, documents, timeout_s=300)
    def kind(layout):  # (layers, the model's other settings)
        return layout[3], tuple(sorted(layout[6].items())) if len(layout) > 6 else ()
    refs = {kind(lay): _reference(*kind(lay), documents) for lay in layouts}
    for i, layout in enumerate(layouts):
        losses, norms, full = refs[kind(layout)]
        seen = set()
        for rank in range(world):
            r_losses, r_norms, params = results[rank][i]
            # the loss and the gradient norm of every step, on every rank
            for a, b in zip(r_losses + r_norms, losses + norms):
                assert math.isclose(a, b, rel_tol=1e-5), (layout, rank, r_losses, losses, r_norms, norms)
            for name, value in params.items():  # each stage's final parameters
                torch.testing.assert_close(value, full[name], rtol=1e-4, atol=1e-5, msg=f"{layout} {name}")
                seen.add(name)
        assert seen == set(full), (layout, set(full) - seen)  # the stages hold the whole model
    return refs


@pytest.mark.slow
def test_two_stages_train_as_one_process_with_each_schedule_an_uneven_split_untied_embeddings_and_recompute():
    # (PP, TP, ZeRO, layers, schedule, layers per virtual stage[, the model's other settings])
    _check_layouts(2, [(2, 1, 0, 4, "1f1b", None), (2, 1, 0, 3, "1f1b", None), (2, 1, 0, 4, "gpipe", None),
                       (2, 1, 0, 4, "interleaved", 1),
                       (2, 1, 0, 4, "1f1b", None, dict(untie_embeddings_and_output_weights=True)),
                       (2, 1, 0, 4, "1f1b", None, dict(recompute_granularity="full")),
                       (2, 1, 0, 4, "1f1b", None, dict(recompute_granularity="selective"))])


@pytest.mark.slow
def test_pipeline_composes_with_tensor_sequence_and_zero1_data_parallelism():
    _check_layouts(4, [(2, 2, 0, 4, "1f1b", None), (2, 1, 1, 4, "1f1b", None), (4, 1, 0, 5, "1f1b", None),
                       (2, 2, 0, 4, "interleaved", 1), (2, 1, 1, 4, "interleaved", 1), (2, 1, 1, 4, "gpipe", None),
                       (2, 2, 0, 4, "1f1b", None, dict(sequence_parallel=True)),
                       (2, 2, 0, 4, "interleaved", 1, dict(sequence_parallel=True))])


HEADS_28 = dict(num_attention_heads=28, hidden_size=56)  # head size 2


@pytest.mark.slow
def test_28_heads_at_two_stages_and_two_tensor_parallel_ranks():
    _check_layouts(4, [(2, 2, 0, 4, "1f1b", None, HEADS_28)])


@pytest.mark.slow
def test_28_heads_split_unevenly_over_three_tensor_parallel_ranks_at_two_stages():
    """10, 9 and 9 heads per TP rank (and 75, 75, 74 of the 224 MLP columns) on each stage."""
    assert _config(**HEADS_28).heads_per_rank(3) == [10, 9, 9] and _config(**HEADS_28).ffn_per_rank(3) == [75, 75, 74]
    _check_layouts(6, [(2, 3, 0, 4, "1f1b", None, HEADS_28)])


def test_each_documents_positions_and_attention_mask_reach_every_stage():
    """--reset-position-ids --reset-attention-mask: every stage attends within documents, the first stage
    embeds each document's positions from 0; the mask and positions change the plain GPT's loss."""
    batch = _micro_batches(_samples(documents=True), 0, 0, 1)[0]
    gpt = GPT(_config())
    within = gpt(batch["tokens"], labels=batch["labels"], position_ids=batch["position_ids"],
                 attention_mask=batch["attention_mask"])
    assert not math.isclose(within.item(), gpt(batch["tokens"], labels=batch["labels"]).item(), rel_tol=1e-3)
    _check_layouts(2, [(2, 1, 0, 4, "1f1b", None), (2, 1, 0, 4, "interleaved", 1)], documents=True)


# ------------------------------------------------------------ gradients against the plain model's autograd
def _gradient_body(_ps, layers: int, tp: int):
    ps = init_parallel(tp, pipeline_parallel_size=2)
    model = StageModel(_config(layers), ps, [chunk_layers(layers, 2)[ps.pp_rank]])
    batches = _micro_batches(_samples(), 0, ps.dp_rank, ps.dp_size)
    Pipeline(model, len(batches)).run(batches, 1.0 / len(batches))
    params = dict(model.named_parameters())
    tie_embedding_grads(model, lambda name: params[name].grad)
    return {n: gather_full(p.grad, p, ps) for n, p in params.items()}  # full over TP


@pytest.mark.parametrize("layers,tp", [(3, 1), (4, 2)])
def test_stage_gradients_are_the_matching_slices_of_the_plain_models(layers, tp):
    results = run_distributed(_gradient_body, 2 * tp, 1, layers, tp, timeout_s=120)
    plain = GPT(_config(layers))
    batches = _micro_batches(_samples(), 0, 0, 1)
    loss = sum(plain(b["tokens"], labels=b["labels"]) for b in batches) / len(batches)
    loss.backward()
    expected = {n: gather_full(p.grad, p, ParallelState.single()) for n, p in plain.named_parameters()}
    seen = set()
    for rank, grads in enumerate(results):
        for name, g in grads.items():
            torch.testing.assert_close(g, expected[name], rtol=1e-5, atol=1e-7, msg=f"rank {rank} {name}")
            seen.add(name)
    assert seen == set(expected)


# ------------------------------------------------------------ the split
def test_layers_split_as_evenly_as_possible_larger_stages_first():
    assert stage_layer_counts(78, 4) == [20, 20, 19, 19]
    assert stage_layer_counts(10, 4, first=1) == [1, 3, 3, 3]
    assert stage_layer_counts(10, 4, first=2, last=1) == [2, 4, 3, 1]
    assert [list(r) for r in chunk_layers(8, 2, virtual=2)] == [[0, 1], [2, 3], [4, 5], [6, 7]]


@pytest.mark.parametrize("layers,stages,first,last", [(3, 4, None, None), (4, 2, 4, None), (6, 3, 2, 4)])
def test_a_split_that_leaves_a_stage_without_layers_is_refused(layers, stages, first, last):
    with pytest.raises(UserError, match="at least one transformer layer"):
        stage_layer_counts(layers, stages, first, last)


# ------------------------------------------------------------ the groups
LAYOUTS = [(1, 2), (2, 2), (1, 4), (2, 1)]  # (TP, PP) on 4 processes


def _groups_body(ps_unused):
    import torch.distributed as dist

    def members(group):
        return None if group is None else dist.get_process_group_ranks(group)
    out = []
    for tp, pp in LAYOUTS:
        ps = init_parallel(tp, pipeline_parallel_size=pp)
        out.append(dict(coords=(ps.pp_rank, ps.dp_rank, ps.tp_rank), rank=ps.rank, tp=members(ps.tp_group),
                        dp=members(ps.dp_group), pp=members(ps.pp_group), emb=members(ps.embedding_group)))
    return out


def test_ranks_map_to_pp_dp_tp_with_tp_innermost():
    world = 4
    results = run_distributed(_groups_body, world, 1, timeout_s=60)
    for i, (tp, pp) in enumerate(LAYOUTS):
        dp = world // (tp * pp)
        for rank, per_layout in enumerate(results):
            r = per_layout[i]
            p, d, t = rank // (tp * dp), rank // tp % dp, rank % tp
            assert r["coords"] == (p, d, t) and r["rank"] == rank
            assert r["tp"] == (None if tp == 1 else [(p * dp + d) * tp + k for k in range(tp)])
            assert r["dp"] == (None if dp == 1 else [(p * dp + k) * tp + t for k in range(dp)])
            assert r["pp"] == (None if pp == 1 else [(k * dp + d) * tp + t for k in range(pp)])
            ends = pp > 1 and p in (0, pp - 1)  # the middle stages hold no embedding
            assert r["emb"] == ([d * tp + t, ((pp - 1) * dp + d) * tp + t] if ends else None)


def test_a_pipeline_size_that_does_not_divide_the_world_is_refused():
    from tnlg.parallel.state import _check_layout
    with pytest.raises(ValueError, match=r"pipeline_parallel_size=3 does not divide .* Valid pipeline-parallel "
                                         r"sizes at TP 2 on 16 processes: \[1, 2, 4, 8\]"):
        _check_layout(16, 2, 3)
