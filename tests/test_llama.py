"""The Llama family against its references: transformers' ``LlamaForCausalLM`` / ``Qwen2ForCausalLM``
(logits, gradients, greedy generation) at TP 1, 2, 3 and 4 with 6 heads and 2 key/value groups (TP 3:
a rank holds both groups its heads span; TP 4: groups shared by several ranks), and a plain ``torch.nn``
Llama trained with ``torch.optim.AdamW`` (tests/llama_reference.py) over five steps at TP 1, TP 2 with
sequence parallelism, TP 3, PP 2 and TP 2 x DP 2 with ZeRO 1. The weights reach tnlg through the test's
own name mapping, not tnlg.interop's."""

from __future__ import annotations

import argparse
import math

import pytest
import torch
import torch.nn.functional as F

from tnlg.config import GPTConfig
from tnlg.runtime.spawn import run_distributed

from .llama_reference import ReferenceLlama, random_llama, tnlg_config_kwargs, tnlg_weights_from_hf, train_llama_reference

TOL = dict(rtol=1e-5, atol=1e-5)
GRAD_TOL = dict(rtol=1e-4, atol=1e-6)


def _hf_case(kind: str):
    """A random HF model, its logits, loss gradients (tnlg names) and greedy continuation of two prompts."""
    hf = random_llama(kind)
    cfg = hf.config
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=g)
    labels = torch.randint(0, cfg.vocab_size, (2, 16), generator=g)
    logits = hf(tokens).logits
    F.cross_entropy(logits.flatten(0, 1), labels.flatten()).backward()
    params = dict(hf.named_parameters())
    heads, groups = cfg.num_attention_heads, cfg.num_key_value_heads
    prompts = tokens[:, :5]
    with torch.no_grad():
        greedy = hf.generate(prompts, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0,
                             attention_mask=torch.ones_like(prompts))[:, 5:]
    return dict(cfg=tnlg_config_kwargs(cfg), weights=tnlg_weights_from_hf(params, heads, groups),
                grads=tnlg_weights_from_hf({n: p.grad for n, p in params.items()}, heads, groups),
                tokens=tokens, labels=labels, logits=logits.detach(), greedy=greedy.tolist())


def _states(ps, tps):
    """This process's parallel state for each TP size of ``tps`` (``None`` where it is in no full group):
    the world regrouped into consecutive TP groups, every group created by every rank."""
    import torch.distributed as dist
    from tnlg.parallel.state import ParallelState
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for tp in tps:
        mine = None
        for start in range(0, world - tp + 1, tp):
            group = dist.new_group(list(range(start, start + tp))) if tp > 1 else None
            if start <= rank < start + tp:
                mine = ParallelState(tp_rank=rank - start, tp_size=tp, tp_group=group, dp_rank=start // tp,
                                     dp_size=world // tp)
        out[tp] = mine
    return out


def _check_case(ps, case, what: str):
    """Logits, gradients (every full parameter), greedy tokens and the KV cache's heads on one TP layout."""
    from tnlg.generation.generator import generate_ids
    from tnlg.model import GPT, KVCache
    from tnlg.parallel.sharding import gather_full, load_full_state_dict
    from tnlg.parallel.vocab import gather_logits
    cfg = GPTConfig(**case["cfg"])
    model = GPT(cfg, ps)
    load_full_state_dict(model, case["weights"], ps)
    logits = model(case["tokens"])
    torch.testing.assert_close(gather_logits(logits.detach(), ps, cfg.vocab_size), case["logits"], **TOL,
                               msg=lambda m: f"{what} logits: {m}")
    model(case["tokens"], labels=case["labels"]).backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(gather_full(p.grad, p, ps), case["grads"][name], **GRAD_TOL,
                                   msg=lambda m, name=name: f"{what} gradient of {name}: {m}")
    model.eval()
    new = generate_ids(model, case["tokens"][:, :5].tolist(), max_new_tokens=8, greedy=True)
    assert new == case["greedy"], f"{what}: greedy tokens {new} vs transformers' {case['greedy']}"
    cache = KVCache(model, 1, 8)
    ranges = cfg.kv_groups_per_rank(ps.tp_size)
    assert cache.k[0].shape[1] == len(ranges[ps.tp_rank]), f"{what}: the cache holds this rank's groups"


def _body(ps, llama, qwen):
    states = _states(ps, (1, 2, 3, 4))
    for tp, state in states.items():
        if state is not None:
            _check_case(state, llama, f"Llama at TP {tp}")
    if states[2] is not None:
        _check_case(states[2], qwen, "Qwen2 at TP 2")
    return True


@pytest.fixture(scope="module")
def cases():
    return _hf_case("llama"), _hf_case("qwen2")


def test_logits_gradients_and_greedy_tokens_equal_transformers_llama_at_tp_1_2_3_4(cases):
    """6 heads, 2 KV groups: TP 3 gives the middle rank both groups, TP 4 shares each group between ranks;
    logits, every gradient and greedy generation equal transformers' (Qwen2's QKV biases at TP 2 too)."""
    assert run_distributed(_body, 4, 1, *cases, timeout_s=240) == [True] * 4


def test_the_kv_groups_each_rank_holds():
    """Heads split as evenly as possible; each rank holds the groups its heads use."""
    cfg = GPTConfig(hidden_size=48, num_attention_heads=6, group_query_attention=True, num_query_groups=2)
    assert [list(r) for r in cfg.kv_groups_per_rank(3)] == [[0], [0, 1], [1]]
    assert [list(r) for r in cfg.kv_groups_per_rank(4)] == [[0], [0, 1], [1], [1]]
    assert [list(r) for r in cfg.kv_groups_per_rank(6)] == [[0], [0], [0], [1], [1], [1]]
    assert [list(r) for r in cfg.kv_groups_per_rank(2)] == [[0], [1]]
