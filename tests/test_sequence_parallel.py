"""Sequence parallelism and selective recomputation (Korthikanti et al. 2022).

Collectives and layers against plain torch on the full sequence; the whole GPT with
``sequence_parallel=True`` against the plain TP=1 model (fp32, dropout 0, within 1e-5)
and transformers' GPT-2, at every recomputation granularity, even and uneven sequence
splits, uneven heads; dropout streams and recomputation; the planner's formulas; the
measured activation memory against the planner.
"""

import dataclasses

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tnlg.config import GPTConfig, partition_sizes
from tnlg.model import GPT, KVCache
from tnlg.parallel import ColumnParallelLinear, RowParallelLinear
from tnlg.parallel.mappings import (copy_to_tp_coalesced, gather_from_sequence_parallel,
                                   reduce_scatter_to_sequence_parallel, scatter_to_sequence_parallel,
                                   sequence_all_gather, sequence_reduce_scatter, sequence_sizes)
from tnlg.plan.memory import activation_bytes
from tnlg.parallel.sharding import gather_full, load_full_state_dict, shard_of
from tnlg.parallel.vocab import gather_logits
from .pool import run_distributed

TOL = dict(atol=1e-5, rtol=1e-5)
GRANULARITIES = (None, "selective", "full")


def _close(a, b, what, **tol):
    torch.testing.assert_close(a, b, **(tol or TOL), msg=lambda m: f"{what}: {m}")


def _rank_tensor(shape, rank, salt=0):
    """The tensor rank ``rank`` holds (every process can rebuild any rank's)."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(1000 * salt + rank))


def _seq_slice(t, sizes, r, dim=0):
    start = sum(sizes[:r])
    return t.narrow(dim, start, sizes[r])


# ---------------------------------------------------------------------------------------------- collectives
def _collectives_body(ps):
    t, r = ps.tp_size, ps.tp_rank
    for s in (8, 7):                       # even and uneven (7 at t=2: [4, 3]; t=4: [2, 2, 2, 1])
        sizes = sequence_sizes(s, t)
        full = _rank_tensor((s, 3, 5), 0, salt=s)                       # the same on every rank
        shard = _seq_slice(full, sizes, r).clone()
        _close(sequence_all_gather(shard, ps, sizes), full, f"all-gather s={s}")
        # batch-first along dim 1 as well
        _close(sequence_all_gather(shard.transpose(0, 1).contiguous(), ps, sizes, dim=1),
               full.transpose(0, 1), f"all-gather dim 1 s={s}")
        parts = [_rank_tensor((s, 3, 5), k, salt=s + 50) for k in range(t)]
        mine = parts[r].clone()
        _close(sequence_reduce_scatter(mine, ps, sizes), _seq_slice(sum(parts), sizes, r), f"reduce-scatter s={s}")
        assert torch.equal(mine, parts[r]), "reduce-scatter changed its input"

        # autograd: gather (backward reduce-scatter), reduce-scatter (backward all-gather), scatter
        gy = [_rank_tensor((s, 3, 5), k, salt=s + 70) for k in range(t)]  # each rank's upstream gradient
        x = shard.clone().requires_grad_()
        (gather_from_sequence_parallel(x, ps, sizes) * gy[r]).sum().backward()
        _close(x.grad, _seq_slice(sum(gy), sizes, r), "gather backward = reduce-scatter")

        x = parts[r].clone().requires_grad_()
        wpe = _rank_tensor((s, 1, 5), 0, salt=s + 90).requires_grad_()  # replicated, spans the sequence
        g_shard = _seq_slice(gy[0], sizes, r)  # the gradient each rank gets for its positions
        y = reduce_scatter_to_sequence_parallel(x, ps, sizes, replicated=wpe)
        _close(y, _seq_slice(sum(parts) + wpe, sizes, r), "reduce-scatter + replicated")
        (y * g_shard).sum().backward()
        _close(x.grad, gy[0], "reduce-scatter backward = all-gather")
        _close(wpe.grad, gy[0].sum(1, keepdim=True), "replicated gets the whole-sequence gradient")

        x = full.clone().requires_grad_()
        (scatter_to_sequence_parallel(x, ps, sizes) * g_shard).sum().backward()
        _close(x.grad, gy[0], "scatter backward = all-gather")

    # coalesced f: identity forward, one all-reduce of every gradient in backward
    w, b = torch.ones(4, requires_grad=True), torch.zeros(3, requires_grad=True)
    w2, b2 = copy_to_tp_coalesced([w, b], ps)
    ((w2 * (r + 1)).sum() + (b2 * (r + 2)).sum()).backward()
    tri = t * (t + 1) // 2
    _close(w.grad, torch.full((4,), float(tri)), "coalesced f weight")
    _close(b.grad, torch.full((3,), float(tri + t)), "coalesced f bias")


def _layers_body(ps):
    """Column then row layer with sequence_parallel=True against nn.Linear on the full sequence."""
    t, r = ps.tp_size, ps.tp_rank
    h, f, b = 8, 10, 2                      # f = 10: uneven columns at t = 4 ([3, 3, 2, 2])
    cols = partition_sizes(f, t)
    W1, b1 = _rank_tensor((f, h), 0, 1), _rank_tensor((f,), 0, 2)
    W2, b2 = _rank_tensor((h, f), 0, 3), _rank_tensor((h,), 0, 4)
    ref1, ref2 = nn.Linear(h, f), nn.Linear(f, h)
    with torch.no_grad():
        ref1.weight.copy_(W1), ref1.bias.copy_(b1), ref2.weight.copy_(W2), ref2.bias.copy_(b2)
    for s in (6, 5):
        sizes = sequence_sizes(s, t)
        x = _rank_tensor((s, b, h), 0, 5 + s)
        gy = _rank_tensor((s, b, h), 0, 6 + s)
        xr = x.clone().requires_grad_()
        yr = ref2(F.gelu(ref1(xr)))
        (yr * gy).sum().backward()

        col = ColumnParallelLinear(h, f, ps, partition_sizes=cols, sequence_parallel=True)
        row = RowParallelLinear(f, h, ps, partition_sizes=cols, sequence_parallel=True)
        with torch.no_grad():
            col.weight.copy_(shard_of(W1, col.weight, r)), col.bias.copy_(shard_of(b1, col.bias, r))
            row.weight.copy_(shard_of(W2, row.weight, r)), row.bias.copy_(b2)
        xs = _seq_slice(x, sizes, r).clone().requires_grad_()
        y = row(F.gelu(col(xs, sequence_sizes=sizes)), sequence_sizes=sizes)
        _close(y, _seq_slice(yr, sizes, r), f"SP column+row output s={s}")
        (y * _seq_slice(gy, sizes, r)).sum().backward()
        _close(xs.grad, _seq_slice(xr.grad, sizes, r), "input gradient")
        _close(col.weight.grad, shard_of(ref1.weight.grad, col.weight, r), "column weight grad")
        _close(col.bias.grad, shard_of(ref1.bias.grad, col.bias, r), "column bias grad")
        _close(row.weight.grad, shard_of(ref2.weight.grad, row.weight, r), "row weight grad")
        _close(row.bias.grad, ref2.bias.grad, "row bias grad (replicated, summed over TP)")
        ref1.zero_grad(), ref2.zero_grad()

    # the even default and a clear error for a shard that does not match the sizes
    col = ColumnParallelLinear(h, f, ps, partition_sizes=cols, sequence_parallel=True)
    assert col(torch.zeros(3, b, h)).shape == (3 * t, b, cols[r])
    with pytest.raises(ValueError, match="expected"):
        col(torch.zeros(3, b, h), sequence_sizes=[4] * t)
    return True


def _collectives_and_layers_body(ps):
    _collectives_body(ps)
    return _layers_body(ps)


@pytest.mark.parametrize("world,tp", [(2, 2), (4, 4), (4, 2)])
def test_sequence_collectives_and_layers(world, tp):
    assert all(run_distributed(_collectives_and_layers_body, world, tp))


def test_layer_arguments():
    ps = __import__("tnlg").ParallelState.single()
    with pytest.raises(ValueError, match="gather_output"):
        ColumnParallelLinear(4, 4, ps, gather_output=True, sequence_parallel=True)
    with pytest.raises(ValueError, match="input_is_parallel"):
        RowParallelLinear(4, 4, ps, input_is_parallel=False, sequence_parallel=True)
    with pytest.raises(ValueError, match="at least one position"):
        sequence_sizes(3, 4)


# ---------------------------------------------------------------------------------------------- whole model
def _reference(n_layer=2, n_embd=32, n_head=4, vocab=100, seqs=(16, 13), batch=2, seed=0):
    """transformers' GPT-2 with random weights, our plain TP=1 model with the same weights, and for each
    sequence length the tokens, labels, loss mask and the TP=1 model's loss, logits and gradients."""
    transformers = pytest.importorskip("transformers")
    from tnlg.interop.hf import hf_to_tnlg_state_dict
    torch.manual_seed(seed)
    seq = max(seqs)
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_positions=seq, vocab_size=vocab, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))
    with torch.no_grad():  # non-trivial LayerNorms and biases, so a missed gradient reduction shows
        for name, p in hf.named_parameters():
            if name.endswith("bias") or "ln_" in name:
                p.add_(0.1 * torch.randn_like(p))
    cfg = GPTConfig(num_layers=n_layer, hidden_size=n_embd, num_attention_heads=n_head, seq_length=seq,
                    vocab_size=vocab, hidden_dropout=0.0, attention_dropout=0.0)
    weights = hf_to_tnlg_state_dict(hf.state_dict(), cfg)
    plain = GPT(cfg)
    load_full_state_dict(plain, weights, plain.ps)
    cases = []
    for s in seqs:
        tokens = torch.randint(0, vocab, (batch, s))
        labels = torch.randint(0, vocab, (batch, s))
        mask = (torch.rand(batch, s) > 0.3).float()
        hf.zero_grad(), plain.zero_grad()
        hf_loss = (F.cross_entropy(hf(tokens).logits.reshape(-1, vocab), labels.reshape(-1), reduction="none")
                   * mask.reshape(-1)).sum() / mask.sum()
        hf_loss.backward()
        loss = plain(tokens, labels=labels, loss_mask=mask)
        loss.backward()
        grads = {n: gather_full(p.grad, p, plain.ps).clone() for n, p in plain.named_parameters()}
        hf_grads = hf_to_tnlg_state_dict({n: p.grad for n, p in hf.named_parameters()}, cfg)
        for n, g in hf_grads.items():  # our TP=1 model is transformers' GPT-2
            torch.testing.assert_close(grads[n], g, atol=1e-4, rtol=1e-4, msg=f"TP=1 vs transformers: {n}")
        torch.testing.assert_close(loss, hf_loss, atol=1e-5, rtol=1e-5)
        logits = gather_logits(plain(tokens), plain.ps, vocab).detach()
        cases.append(dict(tokens=tokens, labels=labels, mask=mask, loss=loss.detach(), grads=grads, logits=logits))
    return cfg, weights, cases


def _sp_model_body(ps, cfg, weights, cases):
    out = []
    for g in GRANULARITIES:
        model = GPT(dataclasses.replace(cfg, sequence_parallel=True, recompute_granularity=g), ps).train()
        load_full_state_dict(model, weights, ps)
        for c in cases:
            model.zero_grad()
            loss = model(c["tokens"], labels=c["labels"], loss_mask=c["mask"])
            loss.backward()
            out.append(dict(granularity=g, seq=c["tokens"].shape[1], loss=loss.detach(),
                            grads={n: gather_full(p.grad, p, ps).clone() for n, p in model.named_parameters()},
                            replicated={n: p.grad.clone() for n, p in model.named_parameters() if not p.tp_sharded}))
    # logits (sequence-parallel forward, returned batch-first), the same with it turned off, and
    # incremental decoding (which runs without it) agree
    model.eval()
    with torch.no_grad():
        c = cases[0]
        sp_logits = gather_logits(model(c["tokens"]), ps, cfg.vocab_size)
        model.sequence_parallel = False
        off_logits = gather_logits(model(c["tokens"]), ps, cfg.vocab_size)
        model.sequence_parallel = True
        cache = KVCache(model, c["tokens"].shape[0], c["tokens"].shape[1])
        model(c["tokens"][:, :-1], kv_cache=cache)
        step = gather_logits(model(c["tokens"][:, -1:], kv_cache=cache, last_only=True), ps, cfg.vocab_size)
    return dict(runs=out, sp_logits=sp_logits, off_logits=off_logits, step_logits=step, dp_rank=ps.dp_rank)


def _check_model(world, tp, ref):
    cfg, weights, cases = ref
    by_seq = {c["tokens"].shape[1]: c for c in cases}
    results = run_distributed(_sp_model_body, world, tp, cfg, weights, cases, timeout_s=120)
    for res in results:
        for run in res["runs"]:
            c, what = by_seq[run["seq"]], f"tp={tp} seq={run['seq']} recompute={run['granularity']}"
            _close(run["loss"], c["loss"], f"{what}: loss")
            for name, g in c["grads"].items():
                _close(run["grads"][name], g, f"{what}: grad of {name}")
        _close(res["sp_logits"], cases[0]["logits"], "logits with sequence parallelism")
        _close(res["off_logits"], cases[0]["logits"], "logits with it turned off")
        _close(res["step_logits"][:, -1], cases[0]["logits"][:, -1], "incremental decoding")
    # replicated parameters (LayerNorms, row biases, position embedding) get bit-identical
    # gradients on every rank of a TP group
    for res in results:
        peer = results[res["dp_rank"] * tp]
        for run, peer_run in zip(res["runs"], peer["runs"]):
            for name, g in run["replicated"].items():
                assert torch.equal(g, peer_run["replicated"][name]), f"replicated grad {name} differs across TP"


@pytest.mark.parametrize("world,tp", [(2, 2), (4, 4)])
def test_sequence_parallel_model_matches_tp1(world, tp):
    """TP 2 and 4, sequences 16 (even) and 13 (uneven: [7, 6], [4, 3, 3, 3]), none/selective/full."""
    _check_model(world, tp, _reference())


def test_sequence_parallel_28_heads_tp3():
    """T-NLG's 28 heads split unevenly ([10, 9, 9]) and 8 positions split unevenly ([3, 3, 2])."""
    _check_model(3, 3, _reference(n_layer=1, n_embd=56, n_head=28, vocab=50, seqs=(8,), batch=1, seed=3))


@pytest.mark.slow
def test_sequence_parallel_28_heads_tp8():
    """28 heads at TP 8 ([4, 4, 4, 4, 3, 3, 3, 3]) and 12 positions ([2, 2, 2, 2, 1, 1, 1, 1])."""
    _check_model(8, 8, _reference(n_layer=1, n_embd=56, n_head=28, vocab=50, seqs=(12,), batch=1, seed=8))


# ---------------------------------------------------------------------------------------------- dropout
def _dropout_body(ps):
    from tnlg.model import _dropout
    cfg = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=100,
                    hidden_dropout=0.2, attention_dropout=0.2, sequence_parallel=True)
    tokens = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    runs = {}
    for g in GRANULARITIES:  # recomputation must draw the masks of the first forward again
        model = GPT(dataclasses.replace(cfg, recompute_granularity=g), ps).train()
        torch.manual_seed(5)
        loss = model(tokens, labels=tokens)
        loss.backward()
        runs[g] = (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    for g in ("selective", "full"):
        _close(runs[g][0], runs[None][0], f"loss with {g} recomputation and dropout")
        for n, grad in runs[None][1].items():
            _close(runs[g][1][n], grad, f"grad of {n} with {g} recomputation and dropout")
    # dropout on this rank's positions draws this rank's masks: the same shape on every rank, other masks
    drop = torch.nn.Dropout(0.5).train()
    mask = _dropout(drop, torch.ones(8, 2, 4), model.tp_random, True) == 0
    replicated_mask = _dropout(drop, torch.ones(8, 2, 4), model.tp_random, False) == 0
    return mask, replicated_mask, runs[None][0]


def test_sequence_parallel_dropout_streams():
    results = run_distributed(_dropout_body, 2, 2)
    (m0, r0, loss0), (m1, r1, loss1) = results
    assert not torch.equal(m0, m1), "sequence-parallel dropout drew the same mask on both TP ranks"
    assert torch.equal(r0, r1), "dropout on the replicated stream must draw the same mask on every TP rank"
    assert torch.equal(loss0, loss1)


# ---------------------------------------------------------------------------------------------- config
@pytest.mark.parametrize("bad,match", [
    (dict(recompute_granularity="some"), "recompute_granularity must be one of"),
    (dict(recompute_granularity="selective", recompute_activations=True), "contradicts"),
    (dict(sequence_parallel=1), "sequence_parallel must be True or False"),
])
def test_config_validation(bad, match):
    with pytest.raises(ValueError, match=match):
        GPTConfig(**bad)


def test_recompute_activations_is_full():
    assert GPTConfig(recompute_activations=True).effective_recompute_granularity == "full"
    assert GPTConfig(recompute_granularity="selective").effective_recompute_granularity == "selective"
    assert GPTConfig().effective_recompute_granularity is None
    cfg = GPTConfig(sequence_parallel=True, recompute_granularity="selective")
    assert GPTConfig.from_dict(cfg.to_dict()) == cfg
    old = {k: v for k, v in cfg.to_dict().items() if k not in ("sequence_parallel", "recompute_granularity")}
    assert GPTConfig.from_dict(old).sequence_parallel is False  # a checkpoint from before sequence parallelism


def test_pretrain_flags():
    import argparse

    from tnlg.errors import UserError
    from tnlg.commands.pretrain_args import add_arguments, model_config, resolve
    p = argparse.ArgumentParser()
    add_arguments(p)

    def opts(*argv):
        return resolve(p.parse_args(["--train-iters", "2", *argv]), world_size=2)
    o = opts("--sequence-parallel", "--recompute-granularity", "selective", "--tp", "2")
    cfg = model_config(o, 100)
    assert cfg.sequence_parallel and cfg.effective_recompute_granularity == "selective"
    o = opts("--recompute-activations")
    assert o.precision.recompute_granularity == "full" \
        and model_config(o, 100).effective_recompute_granularity == "full"
    o = opts("--recompute-granularity", "full")
    assert o.precision.recompute_activations  # the HFU log line reads it
    with pytest.raises(UserError, match="contradicts"):
        opts("--recompute-activations", "--recompute-granularity", "selective")
    with pytest.raises(SystemExit):
        p.parse_args(["--recompute-granularity", "block"])


# ---------------------------------------------------------------------------------------------- planner
def test_activation_formulas():
    """Korthikanti et al. Table 2 (16-bit, t divides s and the heads): per layer
    TP: sbh(10 + 24/t + 5as/(ht)); TP+SP: sbh/t (34 + 5as/h); TP+selective: sbh(10 + 24/t);
    TP+SP+selective: 34 sbh/t; full: 2sbh (SP: 2sbh/t) kept per layer."""
    c = GPTConfig.preset("megatron-8.3b")  # dropout 0.1: masks counted
    s, h, a, l, b, t = c.seq_length, c.hidden_size, c.num_attention_heads, c.num_layers, 2, 4
    sbh = s * b * h
    plain = activation_bytes(c, t, b, None)
    assert plain["per_layer"] == round(sbh * (10 + 24 / t + 5 * a * s / (h * t)))
    sp = activation_bytes(c, t, b, None, sequence_parallel=True)
    assert sp["per_layer"] == round(sbh / t * (34 + 5 * a * s / h)) and sp["layers"] == sp["per_layer"] * l
    sel = activation_bytes(c, t, b, "selective")
    assert sel["layers"] == round(sbh * (10 + 24 / t) * l)
    assert sel["recompute_working"] == round(sbh * 5 * a * s / (h * t))
    sp_sel = activation_bytes(c, t, b, "selective", sequence_parallel=True)
    assert sp_sel["layers"] == round(34 * sbh / t * l)
    full_sp = activation_bytes(c, t, b, "full", sequence_parallel=True)
    assert full_sp["layers"] == round(2 * sbh / t * l)
    assert full_sp["recompute_working"] == sp["per_layer"] + 4 * sbh  # + the re-gathered input and its gradient
    assert activation_bytes(c, t, b, True) == activation_bytes(c, t, b, "full")
    assert activation_bytes(c, 1, b, None, sequence_parallel=True) == activation_bytes(c, 1, b, None)
    # uneven sequence split: the largest rank holds ceil(s / t) positions
    odd = dataclasses.replace(c, seq_length=1022)
    assert activation_bytes(odd, 4, b, None, sequence_parallel=True)["seq_per_rank"] == 256
    # a fused attention kernel keeps its output and log-sum-exp instead of a s^2 b scores
    fused = activation_bytes(c, t, b, None, attention="fused")
    assert fused["attention_core"] == round(2 * sbh / t + 4 * (a // t) * s * b)


def _measure_body(ps, cfg, batch):
    from tnlg.plan.measure import tracked_step
    rows = {}
    tokens = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_length), generator=torch.Generator().manual_seed(0))
    for sp in (False, True):
        model = GPT(dataclasses.replace(cfg, sequence_parallel=sp), ps).train()
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        model(tokens, labels=tokens).backward()
        tracker = tracked_step(model, tokens, tokens)
        rows[sp] = (tracker.marks["after_forward"], tracker.peak)
    return rows


def test_measured_activations_match_planner():
    """What the forward keeps for backward (measured tensor bytes, fp32, dropout 0: the fused attention
    kernel) is within 15% of the planner's kept activations, with and without sequence parallelism."""
    cfg = GPTConfig(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=64, vocab_size=128)
    rows = run_distributed(_measure_body, 2, 2, cfg, 4)[0]
    for sp, (kept, peak) in rows.items():
        pred = activation_bytes(cfg, 2, 4, None, "fp32", sequence_parallel=sp, attention="fused")
        assert abs(kept / (pred["layers"] + pred["outside"]) - 1) < 0.15, (sp, kept, pred)
        assert kept <= peak
    assert rows[True][0] < 0.9 * rows[False][0], "sequence parallelism did not reduce the kept activations"


def _masks_body(ps, cfg, tokens, pos, mask, loss_mask):
    out = {}
    for sp in (False, True):
        model = GPT(dataclasses.replace(cfg, sequence_parallel=sp), ps)
        loss = model(tokens, labels=tokens, position_ids=pos, attention_mask=mask, loss_mask=loss_mask)
        loss.backward()
        grads = {n: gather_full(p.grad, p, ps).clone() for n, p in model.named_parameters()}
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            bf16 = model(tokens, labels=tokens, position_ids=pos, attention_mask=mask, loss_mask=loss_mask)
        bf16.backward()
        finite = all(torch.isfinite(p.grad).all() for p in model.parameters())
        out[sp] = (loss.detach(), grads, bf16.detach(), finite)
    return out


def test_sequence_parallel_position_ids_masks_bf16():
    """Documents packed into a sample (per-sample position ids, a 3-D attention mask), a loss mask,
    an uneven split (11 positions over 2 ranks) and bf16 autocast, with and without SP."""
    cfg = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=12, vocab_size=100)
    b, s = 2, 11
    tokens = torch.randint(0, 100, (b, s), generator=torch.Generator().manual_seed(0))
    pos = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6], [0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4]])
    mask = torch.ones(b, s, s, dtype=torch.bool).tril()
    mask[0, 4:, :4] = False
    mask[1, 6:, :6] = False
    loss_mask = torch.ones(b, s)
    loss_mask[0, 3] = 0
    for res in run_distributed(_masks_body, 2, 2, cfg, tokens, pos, mask, loss_mask):
        (l0, g0, b0, _), (l1, g1, b1, finite) = res[False], res[True]
        _close(l1, l0, "loss with packed documents")
        for n in g0:
            _close(g1[n], g0[n], f"grad of {n} with packed documents")
        assert finite and abs(b1.item() - l1.item()) < 0.05 and abs(b1.item() - b0.item()) < 0.02
