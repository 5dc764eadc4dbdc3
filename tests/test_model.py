"""The whole GPT at several TP sizes against transformers' GPT2LMHeadModel with the same weights."""

import pytest
import torch
import torch.nn.functional as F

import tnlg
from tnlg.config import GPTConfig
from tnlg.interop.hf import hf_to_tnlg_state_dict, to_hf
from tnlg.model import GPT
from tnlg.parallel.sharding import gather_full, load_full_state_dict, shard_of
from tnlg.parallel.vocab import gather_logits
from tnlg.runtime.spawn import run_distributed

from .conftest import LAYOUTS



def _hf_reference(n_layer=2, n_embd=32, n_head=4, vocab=100, seq=16, batch=2, seed=0):
    """A random-weight GPT-2, its logits, loss (tnlg's label convention) and weight gradients."""
    transformers = pytest.importorskip("transformers")  # here, not at import: spawned workers skip it
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_positions=seq,
                                  vocab_size=vocab, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                  bos_token_id=0, eos_token_id=0)
    hf = transformers.GPT2LMHeadModel(cfg).double().float()
    with torch.no_grad():  # non-trivial LayerNorm and biases, so a missed mapping shows
        for name, p in hf.named_parameters():
            if name.endswith("bias") or "ln_" in name:
                p.add_(0.1 * torch.randn_like(p))
    tokens = torch.randint(0, vocab, (batch, seq))
    labels = torch.randint(0, vocab, (batch, seq))
    logits = hf(tokens).logits
    loss = F.cross_entropy(logits.reshape(-1, vocab), labels.reshape(-1))
    loss.backward()
    ours = GPTConfig(num_layers=n_layer, hidden_size=n_embd, num_attention_heads=n_head, seq_length=seq,
                     vocab_size=vocab)
    weights = hf_to_tnlg_state_dict(hf.state_dict(), ours)
    grads = hf_to_tnlg_state_dict({n: p.grad for n, p in hf.named_parameters()}, ours)
    return ours, weights, tokens, labels, logits.detach(), loss.detach(), grads


def _model_body(ps, cfg, weights, tokens, labels):
    model = GPT(cfg, ps)
    load_full_state_dict(model, weights, ps)
    logits = gather_logits(model(tokens), ps, cfg.vocab_size)
    loss = model(tokens, labels=labels)
    loss.backward()
    grads = {n: gather_full(p.grad, p, ps) for n, p in model.named_parameters()}
    replicated = {n: p.grad.clone() for n, p in model.named_parameters() if not p.tp_sharded}
    return dict(logits=logits.detach(), loss=loss.detach(), grads=grads, replicated=replicated,
                tp_rank=ps.tp_rank, dp_rank=ps.dp_rank)


def _check_against_hf(world, tp, ref, tol=1e-4):
    cfg, weights, tokens, labels, ref_logits, ref_loss, ref_grads = ref
    results = run_distributed(_model_body, world, tp, cfg, weights, tokens, labels)
    for res in results:
        torch.testing.assert_close(res["logits"], ref_logits, atol=tol, rtol=tol)
        torch.testing.assert_close(res["loss"], ref_loss, atol=tol, rtol=tol)
        for name, g in ref_grads.items():
            torch.testing.assert_close(res["grads"][name], g, atol=tol, rtol=tol, msg=f"grad of {name}")
    # replicated parameters get bit-identical gradients on every rank of a TP group
    for res in results:
        peer = results[res["dp_rank"] * tp]
        for name, g in res["replicated"].items():
            assert torch.equal(g, peer["replicated"][name]), f"replicated grad {name} differs across TP"


@pytest.mark.parametrize("world,tp", LAYOUTS)
def test_gpt_matches_transformers(world, tp):
    _check_against_hf(world, tp, _hf_reference())


@pytest.mark.parametrize("tp", [1, 2, 3, 4, pytest.param(8, marks=pytest.mark.slow)])
def test_28_heads_any_tp(tp):
    """T-NLG's 28 heads (tiny head dim) at TP sizes that do and do not divide 28."""
    ref = _hf_reference(n_layer=1, n_embd=56, n_head=28, vocab=50, seq=8, batch=1, seed=tp)
    _check_against_hf(tp, tp, ref)


def test_tp_init_is_slice_of_tp1():
    cfg = GPTConfig(num_layers=2, hidden_size=56, num_attention_heads=28, seq_length=8, vocab_size=50)
    full = {n: p.detach() for n, p in GPT(cfg).named_parameters()}
    for tp in (2, 3, 8):
        for r in (0, tp - 1):
            shard = GPT(cfg, tnlg.ParallelState(tp_rank=r, tp_size=tp))  # init needs no communication
            for n, p in shard.named_parameters():
                assert torch.equal(p, shard_of(full[n], p, r)), f"{n} at tp={tp} rank {r}"


def test_hf_roundtrip_bit_identical():
    cfg, weights, *_ = _hf_reference()
    model = GPT(cfg)
    load_full_state_dict(model, weights, model.ps)
    hf = to_hf(model)
    back = hf_to_tnlg_state_dict(hf.state_dict(), cfg)
    for n, t in weights.items():
        assert torch.equal(back[n], t), n


def test_17b_on_meta_counts_match_formula():
    cfg = GPTConfig.preset("tnlg-17b")
    counts = tnlg.parameter_counts(cfg, 4)
    assert counts["total"] == cfg.num_parameters_formula() == 17_176_845_728
    # V padded to 50688 (a multiple of 128 * 4) at TP=4: the padded count adds exactly the padded rows
    assert counts["total_padded"] - counts["total"] == (50688 - 50257) * 4256
    per_rank = [r["params"] for r in counts["per_rank"]]
    assert sum(per_rank) == counts["total_padded"] + 3 * counts["replicated"]
    with torch.device("meta"):
        shard = GPT(cfg, tnlg.ParallelState.for_virtual_rank(4, 2))
    assert sum(p.numel() for p in shard.parameters()) == per_rank[2]


def test_tp_larger_than_heads_is_clear_error():
    with pytest.raises(ValueError, match=r"largest valid tensor-parallel size for attention is 28"):
        with torch.device("meta"):
            GPT(GPTConfig.preset("tnlg-17b"), tnlg.ParallelState.for_virtual_rank(32, 0))
    with pytest.raises(ValueError, match="28"):
        GPTConfig.preset("tnlg-17b").check_tensor_parallel(29)


@pytest.mark.parametrize("bad,match", [
    (dict(hidden_size=30, num_attention_heads=4), "not divisible by num_attention_heads"),
    (dict(num_layers=0), "num_layers must be a positive integer"),
    (dict(vocab_size=-5), "vocab_size"),
    (dict(hidden_dropout=1.5), "hidden_dropout"),
])
def test_invalid_config(bad, match):
    with pytest.raises(ValueError, match=match):
        GPTConfig(**bad)


def test_unknown_preset():
    with pytest.raises(ValueError, match="valid presets: tiny, gpt2-small"):
        GPTConfig.preset("gpt5")


def test_single_process_init_parallel_and_bad_tp():
    ps = tnlg.init_parallel(tensor_parallel_size=1)
    assert (ps.tp_size, ps.dp_size, ps.rank) == (1, 1, 0)
    with pytest.raises(ValueError, match="does not divide the world size 1"):
        tnlg.init_parallel(tensor_parallel_size=2)


def test_bf16_autocast_keeps_loss_fp32():
    cfg = GPTConfig(num_layers=1, hidden_size=32, num_attention_heads=4, seq_length=8, vocab_size=50)
    model = GPT(cfg)
    tokens = torch.randint(0, 50, (2, 8))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(tokens, labels=tokens)
    assert loss.dtype == torch.float32
    ref = model(tokens, labels=tokens)
    assert abs(loss.item() - ref.item()) < 0.05


def test_recompute_gives_same_grads_with_dropout():
    cfg = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=8, vocab_size=50,
                    hidden_dropout=0.1, attention_dropout=0.1)
    tokens = torch.randint(0, 50, (2, 8))
    grads = []
    for recompute in (False, True):
        cfg.recompute_activations = recompute
        torch.manual_seed(7)
        model = GPT(cfg).train()
        torch.manual_seed(7)
        model(tokens, labels=tokens).backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for n in grads[0]:
        torch.testing.assert_close(grads[0][n], grads[1][n], msg=n)


@pytest.mark.parametrize("tp", [1, 3, 8])
def test_describe_matches_the_built_model(tp):
    """Issue 13 item 5: ``GPT.describe`` (what checkpoints reshard from) is exactly how the built layers split."""
    from tnlg.parallel.sharding import ShardSpec
    from tnlg.parallel.state import ParallelState
    cfg = GPTConfig(num_layers=2, hidden_size=56, num_attention_heads=28, vocab_size=300, seq_length=16)
    for r in range(tp):
        with torch.device("meta"):
            model = GPT(cfg, ParallelState.for_virtual_rank(tp, r))
        assert {n: ShardSpec.of(p) for n, p in model.named_parameters()} == GPT.describe(cfg, tp)
        assert list(GPT.describe(cfg, tp)) == [n for n, _ in model.named_parameters()]


def test_initial_shard_and_reset_come_from_the_layers():
    """Issue 13 item 5: ``GPT.initial_shard`` (meta-device materialisation) asks the layer owning the parameter,
    and ``reset_parameters`` restores exactly the weights a fresh model is built with."""
    from tnlg.parallel.state import ParallelState
    cfg = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=100, seq_length=16)
    ps = ParallelState.for_virtual_rank(2, 1)
    built = GPT(cfg, ps, device="cpu")
    with torch.device("meta"):
        meta = GPT(cfg, ps)
    for name, p in meta.named_parameters():
        assert torch.equal(meta.initial_shard(name, p), dict(built.named_parameters())[name]), name
    changed = GPT(cfg, ps, device="cpu")
    with torch.no_grad():
        for p in changed.parameters():
            p.add_(1.0)
    changed.reset_parameters()
    for (name, a), b in zip(changed.named_parameters(), built.parameters()):
        assert torch.equal(a, b), name
