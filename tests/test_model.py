"""The whole GPT at several TP sizes against transformers' GPT2LMHeadModel with the same weights (read
into tnlg's names by the test's own mapping, tests/hf_reference.py), the library's Hugging Face mapping
against that one, and the model's construction: TP-invariant init, parameter counts, config errors."""

import pytest
import torch

import tnlg
from tnlg.config import GPTConfig
from tnlg.interop.hf import hf_to_tnlg_state_dict, to_hf
from tnlg.model import GPT
from tnlg.parallel.sharding import load_full_state_dict, shard_of

from .conftest import LAYOUTS
from .hf_reference import check_against_hf, hf_reference


@pytest.mark.parametrize("world,tp", LAYOUTS)
def test_gpt_matches_transformers(world, tp):
    """Logits, loss and every weight gradient of GPT2LMHeadModel, its weights read into tnlg by the
    test's own mapping, at every (world, TP) layout."""
    check_against_hf(world, tp, hf_reference(), tol=1e-4)


@pytest.mark.parametrize("tp", [1, 2, 3, 4, pytest.param(8, marks=pytest.mark.slow)])
def test_28_heads_any_tp(tp):
    """T-NLG's 28 heads (tiny head dim) at TP sizes that do and do not divide 28."""
    ref = hf_reference(n_layer=1, n_embd=56, n_head=28, vocab=50, seq=8, batch=1, seed=tp)
    check_against_hf(tp, tp, ref, tol=1e-4)


@pytest.mark.parametrize("kind", [dict(), dict(n_layer=1, n_embd=56, n_head=28, vocab=50, seq=8),
                                  dict(tanh_gelu=False, untied=True)], ids=["gpt2", "28-heads", "untied"])
def test_library_hf_mapping_agrees_with_the_tests_own(kind):
    """tnlg.interop.hf's reading of a GPT2LMHeadModel state dict gives exactly the tensors the test's
    own mapping (transposed Conv1D weights, [q | k | v] re-laid per head) gives."""
    ref = hf_reference(**kind)
    library = hf_to_tnlg_state_dict(ref.hf.state_dict(), ref.cfg)
    assert set(library) == set(ref.weights)
    for name, t in ref.weights.items():
        assert torch.equal(library[name], t), name


def test_tp_init_is_slice_of_tp1():
    cfg = GPTConfig(num_layers=2, hidden_size=56, num_attention_heads=28, seq_length=8, vocab_size=50)
    full = {n: p.detach() for n, p in GPT(cfg).named_parameters()}
    for tp in (2, 3, 8):
        for r in (0, tp - 1):
            shard = GPT(cfg, tnlg.ParallelState(tp_rank=r, tp_size=tp))  # init needs no communication
            for n, p in shard.named_parameters():
                assert torch.equal(p, shard_of(full[n], p, r)), f"{n} at tp={tp} rank {r}"


def test_hf_roundtrip_bit_identical():
    """tnlg -> GPT2LMHeadModel (to_hf) -> tnlg gives back every weight bit for bit."""
    ref = hf_reference()
    model = GPT(ref.cfg)
    load_full_state_dict(model, ref.weights, model.ps)
    back = hf_to_tnlg_state_dict(to_hf(model).state_dict(), ref.cfg)
    for n, t in ref.weights.items():
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
    """``GPT.describe`` (what checkpoints reshard from) is exactly how the built layers split."""
    from tnlg.parallel.sharding import ShardSpec
    from tnlg.parallel.state import ParallelState
    cfg = GPTConfig(num_layers=2, hidden_size=56, num_attention_heads=28, vocab_size=300, seq_length=16)
    for r in range(tp):
        with torch.device("meta"):
            model = GPT(cfg, ParallelState.for_virtual_rank(tp, r))
        assert {n: ShardSpec.of(p) for n, p in model.named_parameters()} == GPT.describe(cfg, tp)
        assert list(GPT.describe(cfg, tp)) == [n for n, _ in model.named_parameters()]


def test_initial_shard_and_reset_come_from_the_layers():
    """``GPT.initial_shard`` (meta-device materialisation) asks the layer owning the parameter,
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
