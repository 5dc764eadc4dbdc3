"""The whole GPT trained with context parallelism: the same losses as CP 1 over 5 optimizer steps (fp32).

Every layout trains the same tiny GPT (TP-invariant init) on the same global batch through tnlg's engine:
the reference is one process at CP 1 (plain causal attention, positions 0..s-1); the others split each
sequence over CP ranks (:func:`tnlg.parallel.context.context_parallel_batch`), attend by the ring, take
global positions, reduce the loss over the CP group and the gradients over DP x CP
(:meth:`ParallelState.for_gradients`). Two data sets: plain samples, and samples with document
boundaries (``--reset-attention-mask`` with ``--reset-position-ids``: masks and positions as
:class:`tnlg.data.gpt_dataset.GPTDataset` gives them).
"""

from __future__ import annotations

import pytest
import torch

from tnlg.config import GPTConfig
from tnlg.runtime.spawn import run_distributed

STEPS, BATCH, SEQ = 5, 4, 16
GPT2 = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=SEQ, vocab_size=97)
# the Llama family: rope, RMSNorm, SwiGLU, grouped-query attention (6 heads, 2 K/V groups: uneven at TP 2... 4)
LLAMA = dict(GPT2, hidden_size=48, num_attention_heads=6, position_embedding_type="rope", normalization="RMSNorm",
             swiglu=True, group_query_attention=True, num_query_groups=2, add_bias_linear=False)
DECODERS = {"gpt2": GPT2, "llama": LLAMA}
CFG = GPT2
EOD = 0


def _data(documents: bool) -> list[dict]:
    """``STEPS`` global batches (one batch again and again) of whole samples, as the dataset gives them (documents: EOD tokens inside)."""
    from tnlg.data.gpt_dataset import _make_item
    gen = torch.Generator().manual_seed(7)
    samples = torch.randint(1, 97, (BATCH, SEQ + 1), generator=gen)
    if documents:
        samples[torch.rand(BATCH, SEQ + 1, generator=gen) < 0.2] = EOD
    items = [_make_item(smp, EOD, False, documents, documents) for smp in samples]
    return [{k: torch.stack([it[k] for it in items]) for k in items[0]}] * STEPS  # the same batch: it memorises


def _train(ps, cfg: GPTConfig, data: list[dict]) -> list[float]:
    from tnlg.model import GPT
    from tnlg.optim import build_engine
    from tnlg.parallel.context import context_parallel_batch
    from tnlg.parallel.mappings import all_reduce
    engine = build_engine(GPT(cfg, ps), ps.for_gradients(), 1, lr=1e-2, clip_grad=1.0)
    losses = []
    per_dp = BATCH // ps.dp_size
    for batch in data:
        mine = {k: v[ps.dp_rank * per_dp:(ps.dp_rank + 1) * per_dp] for k, v in batch.items()}
        mine = context_parallel_batch(mine, ps)
        engine.zero_grad()
        loss = engine.model(mine["tokens"], labels=mine["labels"], loss_mask=mine["loss_mask"],
                            position_ids=mine.get("position_ids"), attention_mask=mine.get("attention_mask"))
        engine.backward(loss)
        mean = all_reduce(loss.detach().reshape(1), ps.dp_group) / ps.dp_size
        losses.append(engine.step(1e-2, loss=mean)["loss"])
    return losses


def _layouts(_ps, layouts):
    from tnlg.parallel.state import init_parallel
    out = {}
    for tp, cp, sp, recompute in layouts:
        ps = init_parallel(tensor_parallel_size=tp, context_parallel_size=cp)
        for name, fields in DECODERS.items():
            cfg = GPTConfig(**fields, sequence_parallel=sp, recompute_granularity=recompute)
            key = (name, tp, cp, ps.dp_size, sp) + ((recompute,) if recompute else ())
            out[key] = {docs: _train(ps, cfg, _data(docs)) for docs in (False, True)}
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


@pytest.fixture(scope="module")
def layouts():
    found = run_distributed(_layouts, 2, 1, [(1, 2, False, None), (1, 2, False, "full"), (1, 2, False, "selective")],
                            timeout_s=180)[0]
    found.update(run_distributed(_layouts, 4, 1, [(1, 4, False, None), (2, 2, True, None), (1, 2, False, None)],
                                 timeout_s=180)[0])
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
