"""The whole GPT trained with context parallelism: the same losses as CP 1 over 5 optimizer steps (fp32).

Every layout trains the same tiny GPT (TP-invariant init) on the same global batch through tnlg's engine:
the reference is one process at CP 1 (plain causal attention, positions 0..s-1); the others split each
sequence over CP ranks (:func:`tnlg.parallel.context.context_parallel_batch`), attend by the ring, take
global positions, reduce the loss over the CP group and the gradients over DP x CP
(:meth:`ParallelState.for_gradients`). Two data sets: plain samples, and samples with document
boundaries (``--reset-attention-mask`` with ``--reset-position-ids``: masks and positions as
:class:`tnlg.data.gpt_dataset.GPTDataset` gives them). Through a pipeline (CP x PP) the reference is the
plain GPT in one process trained on the same micro batches by the same training step; compiled blocks
(``--compile``) are compared with CP 1's eager run.
"""

from __future__ import annotations

import pytest
import torch

from tnlg.config import GPTConfig
from .pool import run_distributed

STEPS, BATCH, SEQ, MICRO = 5, 4, 16, 2  # (MICRO: the pipeline's micro batch)
VIRTUAL, INTERLEAVED_LAYERS = 2, 4  # the interleaved schedule: 2 model chunks per pipeline rank, of 1 layer each
GPT2 = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=SEQ, vocab_size=97)
# the Llama family: rope, RMSNorm, SwiGLU, grouped-query attention (6 heads, 2 K/V groups: uneven at TP 2... 4)
LLAMA = dict(GPT2, hidden_size=48, num_attention_heads=6, position_embedding_type="rope", normalization="RMSNorm",
             swiglu=True, group_query_attention=True, num_query_groups=2, add_bias_linear=False)
DECODERS = {"gpt2": GPT2, "llama": LLAMA}
CFG = GPT2
EOD = 0


def _data(documents: bool, mask_eod: bool = False) -> list[dict]:
    """``STEPS`` global batches (one batch again and again) of whole samples, as the dataset gives them (documents:
    EOD tokens inside; ``mask_eod``: EOD targets not counted, so CP ranks and micro batches count different tokens;
    DP ranks too, whose per-rank means the engine averages, as Megatron's does: left to the DP 1 layouts)."""
    from tnlg.data.gpt_dataset import _make_item
    gen = torch.Generator().manual_seed(7)
    samples = torch.randint(1, 97, (BATCH, SEQ + 1), generator=gen)
    if documents:
        samples[torch.rand(BATCH, SEQ + 1, generator=gen) < 0.2] = EOD
    items = [_make_item(smp, EOD, mask_eod, documents, documents) for smp in samples]
    return [{k: torch.stack([it[k] for it in items]) for k in items[0]}] * STEPS  # the same batch: it memorises


def _train(ps, cfg: GPTConfig, data: list[dict], compiled: bool = False) -> list[float]:
    from tnlg.model import GPT
    from tnlg.optim import build_engine
    from tnlg.parallel.context import context_parallel_batch
    from tnlg.parallel.mappings import all_reduce
    from tnlg.training.compile import compile_blocks
    engine = build_engine(GPT(cfg, ps), ps.for_gradients(), 1, lr=1e-2, clip_grad=1.0)
    if compiled:  # --compile: every block compiled, the ring inside it eager (one graph break)
        assert compile_blocks(engine.model, ps.device) is None
    losses = []
    per_dp = BATCH // ps.dp_size
    for batch in data:
        mine = {k: v[ps.dp_rank * per_dp:(ps.dp_rank + 1) * per_dp] for k, v in batch.items()}
        mine = context_parallel_batch(mine, ps)
        engine.zero_grad()
        loss = engine.model(mine.tokens, labels=mine.labels, loss_mask=mine.loss_mask,
                            position_ids=mine.position_ids, attention_mask=mine.attention_mask)
        engine.backward(loss)
        mean = all_reduce(loss.detach().reshape(1), ps.dp_group) / ps.dp_size
        losses.append(engine.step(1e-2, loss=mean)["loss"])
    return losses


def _train_micro(ps, cfg: GPTConfig, data: list[dict], schedule: str = "1f1b") -> list[float]:
    """As :func:`_train` in ``MICRO``-sample micro batches through tnlg's training step; at PP > 1 through the
    pipeline (each stage's micro batches are this CP rank's chunks, the schedule's loss is the whole
    sequence's, the gradients are reduced over DP x CP; ``interleaved``: ``VIRTUAL`` model chunks per
    pipeline rank); then the loss of the trained model over the batch's samples
    (:func:`tnlg.eval.loss.dataset_loss`, validation's). The reference: one process, the plain GPT."""
    from tnlg.eval.loss import dataset_loss
    from tnlg.model import GPT
    from tnlg.optim import build_engine
    from tnlg.parallel.context import context_parallel_batch
    from tnlg.model.stage import StageModel
    from tnlg.parallel.pipeline import chunk_layers
    from tnlg.parallel.pipeline_schedule import Pipeline
    from tnlg.training.step import train_step
    per_dp = BATCH // ps.dp_size
    m = per_dp // MICRO  # micro batches per iteration
    virtual = VIRTUAL if schedule == "interleaved" else 1
    chunks = [r for c, r in enumerate(chunk_layers(cfg.num_layers, ps.pp_size, virtual)) if c % ps.pp_size == ps.pp_rank]
    model = GPT(cfg, ps, device="meta") if ps.pp_size == 1 else StageModel(cfg, ps, chunks, device="meta")
    engine = build_engine(model, ps.for_gradients(), 1, lr=1e-2, clip_grad=1.0, grad_accum_steps=m)
    pipeline, losses = Pipeline(engine.model, m, schedule) if ps.pp_size > 1 else None, []
    assert pipeline is None or len(pipeline.model.chunk_ranges) == virtual  # (interleaved: two stages a rank)
    for step, batch in enumerate(data):
        mine = {k: v[ps.dp_rank * per_dp:(ps.dp_rank + 1) * per_dp] for k, v in batch.items()}
        micro = [context_parallel_batch({k: v[j * MICRO:(j + 1) * MICRO] for k, v in mine.items()}, ps)
                 for j in range(m)]
        losses.append(train_step(engine.model, engine, micro, 1e-2, autocast=None, ps=ps, iteration=step + 1,
                                 pipeline=pipeline)[0])
    samples = [{k: v[i] for k, v in data[0].items()} for i in range(BATCH)]  # validation: forward only, stage to stage
    return losses + [dataset_loss(engine.model, samples, micro_batch_size=MICRO)["loss"]]


def _layouts(_ps, layouts, pipelined=(), compiled=False):
    from tnlg.parallel.state import init_parallel
    out = {}
    for tp, cp, sp, recompute in layouts:
        ps = init_parallel(tensor_parallel_size=tp, context_parallel_size=cp)
        for name, fields in DECODERS.items():
            cfg = GPTConfig(**fields, sequence_parallel=sp, recompute_granularity=recompute)
            key = (name, tp, cp, ps.dp_size, sp) + ((recompute,) if recompute else ())
            out[key] = {docs: _train(ps, cfg, _data(docs)) for docs in (False, True)}
    for cp, pp, schedule in pipelined:  # CP x PP (tp 1)
        ps = init_parallel(context_parallel_size=cp, pipeline_parallel_size=pp)
        for name, fields in DECODERS.items():
            cfg = GPTConfig(**_pipelined(fields, schedule))
            out[(name, "pp", cp, pp, schedule)] = {docs: _train_micro(ps, cfg, _data(docs, docs), schedule)
                                                   for docs in (False, True)}
    if compiled:  # the last layout's state
        from torch._dynamo.utils import counters
        counters.clear()
        out["compiled"] = _train(ps, GPTConfig(**LLAMA), _data(True), compiled=True)
        out["graph breaks"] = dict(counters["graph_break"])
    out["generation"] = _generation_refused(ps)
    return out


def _generation_refused(ps) -> str:
    from tnlg.model import GPT
    try:
        GPT(GPTConfig(**CFG), ps)(torch.zeros(1, 8, dtype=torch.long), last_only=True)
    except ValueError as exc:
        return str(exc)
    return "generated"


@pytest.fixture(scope="module")
def reference():
    from tnlg.parallel.state import ParallelState
    return {(name, docs): _train(ParallelState.single(), GPTConfig(**fields), _data(docs))
            for name, fields in DECODERS.items() for docs in (False, True)}


def _pipelined(fields: dict, schedule: str) -> dict:
    """The decoder's fields for ``schedule``: ``INTERLEAVED_LAYERS`` layers for the interleaved one."""
    return dict(fields, num_layers=INTERLEAVED_LAYERS) if schedule == "interleaved" else fields


@pytest.fixture(scope="module")
def micro_reference():
    """CP 1, no pipeline, the same micro batches (each micro batch's mean, averaged: Megatron's); by
    decoder, documents and layers (2, and the interleaved schedule's 4)."""
    from tnlg.parallel.state import ParallelState
    return {(name, docs, layers): _train_micro(ParallelState.single(), GPTConfig(**dict(fields, num_layers=layers)),
                                               _data(docs, docs))
            for name, fields in DECODERS.items() for docs in (False, True) for layers in (2, INTERLEAVED_LAYERS)}


@pytest.fixture(scope="module")
def layouts():
    found = run_distributed(_layouts, 2, 1, [(1, 2, False, None), (1, 2, False, "full"), (1, 2, False, "selective")],
                            (), True, timeout_s=300)[0]
    found.update(run_distributed(_layouts, 4, 1, [(1, 4, False, None), (2, 2, True, None), (1, 2, False, None)],
                                 [(2, 2, "1f1b"), (2, 2, "gpipe"), (2, 2, "interleaved")], timeout_s=300)[0])
    return found


@pytest.mark.slow
@pytest.mark.parametrize("layout", [(1, 2, 1, False), (1, 4, 1, False), (2, 2, 1, True), (1, 2, 2, False),
                                    (1, 2, 1, False, "full"), (1, 2, 1, False, "selective")],
                         ids=["cp2", "cp4", "tp2-cp2-sp", "cp2-dp2-zero1", "cp2-full-recompute", "cp2-selective"])
@pytest.mark.parametrize("documents", [False, True], ids=["plain", "documents"])
@pytest.mark.parametrize("decoder", list(DECODERS))
def test_losses_equal_cp_1(reference, layouts, decoder, layout, documents):
    ref = reference[(decoder, documents)]
    assert ref[-1] < ref[0]  # it trains
    torch.testing.assert_close(torch.tensor(layouts[(decoder, *layout)][documents]), torch.tensor(ref), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_generation_at_cp_above_1_is_refused(layouts):
    assert "does not run with context parallelism" in layouts["generation"]


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "interleaved"])
@pytest.mark.parametrize("documents", [False, True], ids=["plain", "documents"])
@pytest.mark.parametrize("decoder", list(DECODERS))
def test_pipelined_losses_equal_cp_1(micro_reference, layouts, decoder, documents, schedule):
    """CP 2 x PP 2 (two micro batches per iteration): CP 1's losses without a pipeline (with documents the
    EOD targets are masked, so the chunks and micro batches count different tokens), and the trained
    model's validation loss; interleaved: 4 layers, 2 model chunks per pipeline rank (virtual stages 0, 2
    on the first rank, 1, 3 on the second), each chunk's ring over its stage's CP group."""
    ref = micro_reference[(decoder, documents, GPTConfig(**_pipelined(DECODERS[decoder], schedule)).num_layers)]
    assert ref[-1] < ref[0]  # it trains
    torch.testing.assert_close(torch.tensor(layouts[(decoder, "pp", 2, 2, schedule)][documents]),
                               torch.tensor(ref), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_compiled_blocks_give_cp_1s_losses(reference, layouts):
    """``--compile`` at CP 2 (the Llama decoder, documents): the blocks compiled around the ring, which runs
    eager (the one graph break Dynamo reports, at ``ring_attention``, each of the two blocks' graphs
    splitting there), CP 1's eager losses."""
    torch.testing.assert_close(torch.tensor(layouts["compiled"]), torch.tensor(reference[("llama", True)]),
                               rtol=1e-5, atol=1e-5)
    assert layouts["graph breaks"] and all("ring_attention" in reason for reason in layouts["graph breaks"]), \
        layouts["graph breaks"]


def _tp_cp_pp(_ps):
    from tnlg.parallel.state import init_parallel
    ps = init_parallel(2, context_parallel_size=2, pipeline_parallel_size=2)
    return _train_micro(ps, GPTConfig(**LLAMA, sequence_parallel=True), _data(True, True))


@pytest.mark.slow
def test_tp_cp_pp_with_sequence_parallelism_equals_cp_1(micro_reference):
    """TP 2 + SP x CP 2 x PP 2 (8 processes; the Llama decoder, documents): the activations between stages
    are this TP rank's share of this CP rank's positions; CP 1's losses and validation loss."""
    got = run_distributed(_tp_cp_pp, 8, 2, timeout_s=300)[0]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(micro_reference[("llama", True, 2)]), rtol=1e-5,
                               atol=1e-5)
