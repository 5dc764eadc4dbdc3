"""Training with sliding windows and Qwen3's attention: the same losses (fp32, 1e-5) over 5 optimizer steps at
TP 1, TP 2 + sequence parallelism, TP 4 + SP (uneven heads, each KV group shared by two ranks: their QK norm
gradients summed over TP), CP 2 and PP 2, and the ring skipping the blocks outside the window.

Two decoders (the Llama family of tests/test_context_parallel_training.py: 6 heads over 2 KV groups): one
with a window of 3 on every layer, shorter than a CP 2 chunk (16 / 4 = 4 positions), and one with Qwen3's
QK norm, heads 12 wide where hidden / heads is 8, and a window of 6 on its second layer only. Each trains on
plain samples and on samples with documents (``--reset-attention-mask``, ``--reset-position-ids``: the
window and the documents' mask together). The reference is one process at TP 1 (its first loss is
transformers' on the same weights); the pipeline's, one process through the same training step. The ring
is checked against dense attention with the window's mask at CP 4, where whole blocks lie outside it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tnlg.config import GPTConfig

from .pool import run_distributed
from .test_context_parallel_training import LLAMA, _data, _train, _train_micro

WINDOWED = dict(LLAMA, sliding_window=3)
QWEN3 = dict(LLAMA, kv_channels=12, qk_layernorm=True, sliding_window=6, window_layers=[0, 1])
DECODERS = {"window": WINDOWED, "qwen3": QWEN3}
TOL = dict(rtol=1e-5, atol=1e-5)


def _transformers_loss(cfg: GPTConfig, batch: dict) -> float:
    """transformers' loss of the batch on the initial weights of ``cfg`` (the MistralForCausalLM or
    Qwen3ForCausalLM the architecture is)."""
    from tnlg.interop.hf import build_hf_model
    from tnlg.model import GPT
    from tnlg.parallel.sharding import full_state_dict
    from tnlg.parallel.state import ParallelState
    ps = ParallelState.single()
    hf = build_hf_model(full_state_dict(GPT(cfg, ps), ps), cfg)
    hf.config._attn_implementation = "eager"
    with torch.no_grad():
        logits = hf(batch["tokens"]).logits
    return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten()).item()


def _layouts(_ps, world: int) -> dict:
    """Worker: every decoder trained at this world's layouts (1: TP 1, the pipeline's reference and
    transformers' first loss; 2: TP 2 + SP, CP 2, PP 2; 4: TP 4 + SP), on plain samples and with documents."""
    from tnlg.parallel.state import init_parallel
    out: dict = {}
    layouts = {1: [(1, 1, False)], 2: [(2, 1, True), (1, 2, False)], 4: [(4, 1, True)]}[world]
    for tp, cp, sp in layouts:
        ps = init_parallel(tensor_parallel_size=tp, context_parallel_size=cp)
        for name, fields in DECODERS.items():
            cfg = GPTConfig(**fields, sequence_parallel=sp)
            out[(name, tp, cp)] = {docs: _train(ps, cfg, _data(docs)) for docs in (False, True)}
    if world == 4:
        return out
    ps = init_parallel(pipeline_parallel_size=world)
    for name, fields in DECODERS.items():
        out[(name, "pp", world)] = {docs: _train_micro(ps, GPTConfig(**fields), _data(docs, docs))
                                    for docs in (False, True)}
        if world == 1:
            out[(name, "transformers")] = _transformers_loss(GPTConfig(**fields), _data(False)[0])
    return out


@pytest.fixture(scope="module")
def layouts():
    """Every layout's losses: one launch per world size."""
    out = {}
    for world in (1, 2, 4):
        out.update(run_distributed(_layouts, world, 1, world, timeout_s=300)[0])
    return out


@pytest.mark.parametrize("name", list(DECODERS))
def test_tp_sp_and_cp_train_as_one_process(layouts, name):
    reference = layouts[(name, 1, 1)]
    assert reference[False][0] == pytest.approx(layouts[(name, "transformers")], rel=1e-5)
    assert reference[False][-1] < reference[False][0] - 0.5  # it trains
    for key in ((name, 2, 1), (name, 4, 1), (name, 1, 2)):
        for docs in (False, True):
            torch.testing.assert_close(torch.tensor(layouts[key][docs]), torch.tensor(reference[docs]), **TOL,
                                       msg=lambda m, key=key, docs=docs: f"{key} documents={docs}: {m}")


@pytest.mark.parametrize("name", list(DECODERS))
def test_a_pipeline_trains_as_one_process(layouts, name):
    for docs in (False, True):
        torch.testing.assert_close(torch.tensor(layouts[(name, "pp", 2)][docs]),
                                   torch.tensor(layouts[(name, "pp", 1)][docs]), **TOL)


SEQ, CP, WINDOW = 32, 4, 3


def _ring(_ps, q, k, v, grad):
    """Worker (CP 4): this rank's ring output and its chunks' q/k/v gradients, with the window, and how many
    blocks its forward and backward computed."""
    import tnlg.parallel.context as C
    from tnlg.parallel.state import init_parallel
    ps = init_parallel(context_parallel_size=CP)
    counts = {"forward": 0, "backward": 0}
    block_forward, block_backward = C._block_forward, C._block_backward

    def counted(kind, fn):
        def run(*args, **kwargs):
            counts[kind] += 1
            return fn(*args, **kwargs)
        return run
    C._block_forward, C._block_backward = counted("forward", block_forward), counted("backward", block_backward)
    try:
        mine = [C.split_for_context_parallel(t, CP, ps.cp_rank, dim=2).clone().requires_grad_(True) for t in (q, k, v)]
        out = C.ring_attention(*mine, ps.cp_group, window=WINDOW)
        out.backward(C.split_for_context_parallel(grad, CP, ps.cp_rank, dim=2))
    finally:
        C._block_forward, C._block_backward = block_forward, block_backward
    return out.detach(), [t.grad for t in mine], counts


def test_the_ring_skips_the_blocks_outside_the_window():
    """CP 4 over 32 positions (chunks of 4), window 3: the ring's output and gradients are dense attention's
    with the window's mask (GQA: 4 query heads over 2 K/V heads), and the blocks wholly outside the window
    are not computed. Rank r holds chunks r and 7 - r; at a step with K/V of rank j the nearest query is
    4 |r - j| - 3 positions after the block's last key, so the block is outside the window (3) when
    |r - j| >= 2: ranks 0 and 3 skip two steps of four, ranks 1 and 2 one."""
    from tnlg.parallel.context import split_for_context_parallel
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, SEQ, 8, generator=gen)
    k, v = (torch.randn(2, 2, SEQ, 8, generator=gen) for _ in range(2))
    grad = torch.randn(2, 4, SEQ, 8, generator=gen)
    ref = [t.clone().requires_grad_(True) for t in (q, k, v)]
    pos = torch.arange(SEQ)
    mask = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - WINDOW)
    dense = F.scaled_dot_product_attention(ref[0], ref[1].repeat_interleave(2, 1), ref[2].repeat_interleave(2, 1),
                                           attn_mask=mask)
    dense.backward(grad)
    results = run_distributed(_ring, CP, 1, q, k, v, grad)
    for rank, (out, grads, counts) in enumerate(results):
        torch.testing.assert_close(out, split_for_context_parallel(dense.detach(), CP, rank, dim=2), **TOL)
        for got, want in zip(grads, ref):
            torch.testing.assert_close(got, split_for_context_parallel(want.grad, CP, rank, dim=2), **TOL)
        assert counts == {"forward": 4 - [2, 1, 1, 2][rank], "backward": 4 - [2, 1, 1, 2][rank]}, rank
