"""A KV cache with a length per row: a batch of prompts of different lengths, each row at its own length, decodes
each row exactly as that prompt alone, and a row never reads the slots past its own length.

The references need no cache: the plain forward of the whole sequence (prompt + the tokens so far) gives the
logits every decode step must give, and a prompt generated alone runs with every row at one length (no
per-row mask at all). Two models: GPT-2's (learned positions, full attention) and a Llama-like one (rope,
grouped-query attention, one sliding-window layer), at TP 1 here and TP 2 in a worker pool.
"""

from __future__ import annotations

import pytest
import torch

from tnlg.config import GPTConfig
from tnlg.generation import SamplingOptions, generate_tokens
from tnlg.generation.steps import decode, prefill, right_padded
from tnlg.model import GPT, KVCache
from tnlg.parallel.state import ParallelState
from tnlg.parallel.vocab import gather_logits
from .pool import run_distributed

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [[5], [11, 12, 13, 14, 15, 16, 17], [3, 40, 2], [7, 1, 9, 30, 31, 32, 33, 34, 35, 36, 37, 38], [8, 9]]
NEW = 10
CONFIGS = {
    "gpt2": dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=32, vocab_size=100,
                 init_method_std=1.0, seed=3),
    # rope, RMSNorm, SwiGLU, 6 heads over 2 KV groups, a window of 4 on the first layer (shorter than the prompts)
    "llama": dict(num_layers=2, hidden_size=48, num_attention_heads=6, seq_length=32, vocab_size=100,
                  init_method_std=1.0, seed=4, position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
                  add_bias_linear=False, group_query_attention=True, num_query_groups=2, sliding_window=4,
                  window_layers=[1, 0]),
}
GARBAGE = 1e4  # what fills the slots past a row's length (finite: test_rows_never_read_their_unused_slots)


def _teacher_forced(model, prompts, continuations, garbage: bool) -> list[torch.Tensor]:
    """Full logits ``[b, V]`` of every step of one batch: the prefill of all prompts, then decode steps feeding
    each row its ``continuations`` token by token; with ``garbage`` every slot past a row's length (every
    layer's keys and values) is overwritten with large values of both signs before each step."""
    ps, cfg = model.ps, model.config
    b, lengths = len(prompts), [len(p) for p in prompts]
    cache = KVCache(model, b, max(lengths) + NEW)
    g = torch.Generator().manual_seed(0)

    def spoil():
        if not garbage:
            return
        past = torch.arange(cache.max_len)[None, :] >= cache.lengths[:, None]  # [b, max_len]
        for t in cache.k + cache.v:
            if t is not None:
                noise = (torch.rand(t.shape, generator=g) * 2 - 1) * GARBAGE
                t[past[:, None, :, None].expand_as(t)] = noise[past[:, None, :, None].expand_as(t)]
    out = []
    with torch.no_grad():
        spoil()
        out.append(prefill(model, cache, right_padded(prompts, max(lengths)), lengths))
        for t in range(NEW - 1):
            spoil()
            out.append(decode(model, cache, torch.tensor([c[t] for c in continuations])))
        assert cache.lengths.tolist() == [n + NEW - 1 for n in lengths]
    return [gather_logits(x, ps, cfg.vocab_size) for x in out]


def _without_cache(model, prompts, continuations) -> list[torch.Tensor]:
    """The same steps' logits from the plain forward of each whole sequence, one row at a time."""
    ps, cfg = model.ps, model.config
    steps = []
    with torch.no_grad():
        for t in range(NEW):
            rows = [model(torch.tensor([p + c[:t]]))[0, -1] for p, c in zip(prompts, continuations)]
            steps.append(gather_logits(torch.stack(rows), ps, cfg.vocab_size))
    return steps


def _body(ps: ParallelState, name: str) -> dict:
    model = GPT(GPTConfig(**CONFIGS[name]), ps)  # (TP-invariant init: the same model at every TP size)
    model.eval()
    greedy = SamplingOptions(NEW, greedy=True)
    batch = generate_tokens(model, PROMPTS, greedy)
    alone = [generate_tokens(model, [p], greedy)[0] for p in PROMPTS]
    reference = _without_cache(model, PROMPTS, alone)
    clean = _teacher_forced(model, PROMPTS, alone, garbage=False)
    spoiled = _teacher_forced(model, PROMPTS, alone, garbage=True)
    return dict(batch=batch, alone=alone, reference=reference, clean=clean, spoiled=spoiled)


def _check(res: dict, where: str) -> None:
    assert res["batch"] == res["alone"], where
    assert all(len(set(r)) > 2 for r in res["alone"]), f"{where}: a degenerate repetition tests little"
    for t, (want, got) in enumerate(zip(res["reference"], res["clean"])):
        # fp32 rounding of other kernels (other lengths, masks) on logits up to ~10: 1e-5 of the largest
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()),
                                   msg=lambda m, t=t: f"{where}, step {t}: {m}")
        # the cached step's argmax is the token generated alone (the uncached forward's choice too)
        assert got.argmax(-1).tolist() == [a[t] for a in res["alone"]], (where, t)

def _check_unread(res: dict, where: str) -> None:
    for t, (clean, spoiled) in enumerate(zip(res["clean"], res["spoiled"])):
        assert torch.equal(clean, spoiled), f"{where}, step {t}: a row read a slot past its length"


@pytest.fixture(scope="module")
def tp1():
    return {name: _body(ParallelState.single(), name) for name in CONFIGS}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_batch_of_different_lengths_decodes_each_prompt_as_alone(tp1, name):
    """Greedy: each row of a batch of prompts of lengths 1 to 12 gets the tokens of its prompt generated
    alone, and every step's logits (prefill and decode, rows at different lengths) are the plain forward's
    of the whole sequence so far."""
    _check(tp1[name], f"{name} at TP 1")


def test_rows_never_read_their_unused_slots(tp1):
    """Every slot past a row's length (padding's keys from the prefill, slots other rows have written,
    zeros) overwritten with values up to 1e4 before each step changes no logit, not by one bit: each row's
    queries see its own slots only. (Finite values: a masked score is -inf added to the score, so a NaN key
    would still poison it, as in every attention kernel; the cache never holds one: padding's keys are
    computed like any token's.)"""
    for name in CONFIGS:
        _check_unread(tp1[name], f"{name} at TP 1")


def test_tensor_parallel_rows_at_their_own_lengths(tp1):
    """At TP 2 (each rank its heads' and KV groups' cache) the same tokens as at TP 1 and the same checks."""
    for name in CONFIGS:
        for rank, res in enumerate(run_distributed(_body, 2, 2, name)):
            _check(res, f"{name} at TP 2, rank {rank}")
            _check_unread(res, f"{name} at TP 2, rank {rank}")
            assert res["batch"] == tp1[name]["batch"], (name, rank)


def test_cache_refuses_what_does_not_fit():
    model = GPT(GPTConfig(**CONFIGS["gpt2"]))
    cache = KVCache(model, 2, 6)
    with pytest.raises(ValueError, match="at least one token"):
        cache.feed([3, 0])
    with pytest.raises(ValueError, match="2 rows"):
        cache.feed([1, 1, 1])
    with pytest.raises(ValueError, match="holds 6 positions"):
        model(torch.zeros(2, 7, dtype=torch.long), kv_cache=cache)
    cache.feed([4, 2])
    with pytest.raises(ValueError, match="cannot add 4"):
        model(torch.zeros(2, 3, dtype=torch.long), kv_cache=cache)


def test_a_row_reset_mid_batch_takes_a_new_prompt_beside_decoding_rows():
    """Continuous batching's step: after a few decode steps row 1 is emptied and given a new prompt in the same
    forward that feeds rows 0 and 2 their next token (one column each); every row then decodes what its prompt
    gives alone, greedy (row 1's old keys, still in its slots, are never read)."""
    model = GPT(GPTConfig(**CONFIGS["llama"]))
    model.eval()
    greedy = SamplingOptions(NEW, greedy=True)
    first, second = [PROMPTS[0], PROMPTS[1], PROMPTS[2]], PROMPTS[3]
    alone = [generate_tokens(model, [p], greedy)[0] for p in first + [second]]
    vocab = model.config.vocab_size

    def argmax(logits):
        return logits[:, :vocab].argmax(-1)
    cache = KVCache(model, 3, 32)
    got: list[list[int]] = [[], [], []]
    with torch.no_grad():
        nxt = argmax(prefill(model, cache, right_padded(first, max(map(len, first))), [len(p) for p in first]))
        for _ in range(3):
            for row, t in zip(got, nxt.tolist()):
                row.append(t)
            nxt = argmax(decode(model, cache, nxt))
        assert got == [a[:3] for a in alone[:3]]
        cache.reset([1])
        tokens = torch.zeros(3, len(second), dtype=torch.long)
        tokens[:, 0] = nxt
        tokens[1] = torch.tensor(second)
        got[0].append(int(nxt[0]))
        got[2].append(int(nxt[2]))
        got[1] = []
        nxt = argmax(prefill(model, cache, tokens, [1, len(second), 1]))
        for _ in range(4):
            for row, t in zip(got, nxt.tolist()):
                row.append(t)
            nxt = argmax(decode(model, cache, nxt))
    assert cache.lengths.tolist() == [len(first[0]) + 8, len(second) + 4, len(first[2]) + 8]
    assert got == [alone[0][:8], alone[3][:4], alone[2][:8]]
