"""The loss's two normalisations through tnlg's training step, against a plain-torch reference.

Four micro batches of one sample each count different numbers of tokens (random loss masks of
different densities). Megatron's default averages the micro batches' means; ``--calculate-per-token-loss``
divides the global batch's loss sum by the tokens counted in it. Both are computed here by hand from
tests/reference_gpt.py's plain ``torch.nn`` GPT-2 on the same weights (the per-token one as a single
``F.cross_entropy(reduction="sum") / count`` over the concatenated global batch): the logged loss and the
gradient norm of one training step must match them at TP 1, TP 2 x DP 2 (sequence-parallel), PP 2 and
CP 2, and the two normalisations must differ.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tnlg.config import GPTConfig
from .pool import run_distributed

from .reference_gpt import ReferenceGPT

BATCH, SEQ, VOCAB = 4, 16, 97
FIELDS = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=SEQ, vocab_size=VOCAB)
RTOL = 1e-5
DENSITY = (0.9, 0.2, 0.6, 0.35)  # of each sample's loss mask: the micro batches count different tokens


def _batch() -> dict:
    gen = torch.Generator().manual_seed(11)
    sample = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
    mask = torch.rand(BATCH, SEQ, generator=gen) < torch.tensor(DENSITY).unsqueeze(1)
    mask[:, 0] = True  # every micro batch counts at least one token
    return dict(tokens=sample[:, :-1], labels=sample[:, 1:], loss_mask=mask.float())


def _step(ps, per_token: bool, sequence_parallel: bool = False) -> tuple[float, float]:
    """One training step of the tiny GPT on :func:`_batch`, one sample per micro batch: ``(loss, grad norm)``."""
    from tnlg.model import GPT
    from tnlg.optim import build_engine
    from tnlg.parallel.context import context_parallel_batch
    from tnlg.model.stage import StageModel
    from tnlg.parallel.pipeline import chunk_layers
    from tnlg.parallel.pipeline_schedule import Pipeline
    from tnlg.training.step import train_step
    cfg = GPTConfig(**FIELDS, sequence_parallel=sequence_parallel)
    per_dp = BATCH // ps.dp_size
    model = GPT(cfg, ps, device="meta") if ps.pp_size == 1 else \
        StageModel(cfg, ps, [chunk_layers(cfg.num_layers, ps.pp_size)[ps.pp_rank]], device="meta")
    engine = build_engine(model, ps.for_gradients(), 1, lr=1e-3, clip_grad=1.0, grad_accum_steps=per_dp)
    pipeline = Pipeline(engine.model, per_dp) if ps.pp_size > 1 else None
    batch = _batch()
    micro = [context_parallel_batch({k: v[j:j + 1] for k, v in batch.items()}, ps)
             for j in range(ps.dp_rank * per_dp, (ps.dp_rank + 1) * per_dp)]
    loss, info = train_step(engine.model, engine, micro, 1e-3, autocast=None, ps=ps, iteration=1, pipeline=pipeline,
                            per_token_loss=per_token)
    return loss, info["grad_norm"]


def _layouts(_ps, layouts: list[tuple[str, dict, bool]]) -> dict:
    from tnlg.parallel.state import init_parallel
    out = {}
    for name, sizes, sp in layouts:
        ps = init_parallel(**sizes)
        out[name] = {per_token: _step(ps, per_token, sp) for per_token in (False, True)}
    return out


@pytest.fixture(scope="module")
def layouts() -> dict:
    from tnlg.parallel.state import ParallelState
    found = {"tp1": {per_token: _step(ParallelState.single(), per_token) for per_token in (False, True)}}
    found.update(run_distributed(_layouts, 2, 1, [("pp2", dict(pipeline_parallel_size=2), False),
                                                  ("cp2", dict(context_parallel_size=2), False)], timeout_s=300)[0])
    found.update(run_distributed(_layouts, 4, 1, [("tp2-dp2", dict(tensor_parallel_size=2), True)],
                                 timeout_s=300)[0])
    return found


@pytest.fixture(scope="module")
def reference() -> dict:
    """By normalisation (per token or not): the plain-torch loss and gradient norm, computed by hand."""
    from tnlg.model import GPT
    from tnlg.parallel.sharding import full_state_dict
    from tnlg.parallel.state import ParallelState
    tnlg_model = GPT(GPTConfig(**FIELDS))
    batch = _batch()
    out = {}
    for per_token in (False, True):
        model = ReferenceGPT(2, 32, 4, SEQ, VOCAB).load_tnlg(full_state_dict(tnlg_model, ParallelState.single()))
        logits = model(batch["tokens"])
        mask = batch["loss_mask"]
        if per_token:  # one step on the concatenated global batch: its token sum over its count
            labels = batch["labels"].masked_fill(mask == 0, -100)
            loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum") / mask.sum()
        else:  # the mean of the micro batches' (samples') masked means
            token = F.cross_entropy(logits.transpose(1, 2), batch["labels"], reduction="none")
            loss = ((token * mask).sum(1) / mask.sum(1)).mean()
        loss.backward()
        norm = torch.linalg.vector_norm(torch.stack([p.grad.double().norm() for p in model.parameters()]))
        out[per_token] = (loss.item(), norm.item())
    return out


def test_the_normalisations_differ(reference):
    """The test data tell the two apart: micro batches of unequal counts give losses and gradients that differ
    by 100 times the comparison's tolerance at least."""
    (mean_loss, mean_norm), (token_loss, token_norm) = reference[False], reference[True]
    assert abs(mean_loss - token_loss) > 100 * RTOL * token_loss
    assert abs(mean_norm - token_norm) > 100 * RTOL * token_norm


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp1", "tp2-dp2", "pp2", "cp2"])
@pytest.mark.parametrize("per_token", [False, True], ids=["micro-batch-mean", "per-token"])
def test_loss_and_gradient_match_the_reference(layouts, reference, layout, per_token):
    loss, norm = layouts[layout][per_token]
    ref_loss, ref_norm = reference[per_token]
    assert loss == pytest.approx(ref_loss, rel=RTOL)
    assert norm == pytest.approx(ref_norm, rel=RTOL)
