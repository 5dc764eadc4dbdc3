"""The Llama family against its references: transformers' ``LlamaForCausalLM`` / ``Qwen2ForCausalLM``
(logits, gradients, greedy generation) at TP 1, 2, 3 and 4 with 6 heads and 2 key/value groups (TP 3:
a rank holds both groups its heads span; TP 4: groups shared by several ranks), and a plain ``torch.nn``
Llama trained with ``torch.optim.AdamW`` (tests/llama_reference.py) over five steps at TP 1, TP 2 with
sequence parallelism, TP 3, PP 2 and TP 2 x DP 2 with ZeRO 1, and with one K/V group shared by both TP
ranks at TP 2 x DP 2 under ZeRO 2 and 3; checkpoints holding shared groups resharded (TP 3 and TP 2 to
TP 1 and 4). The weights reach tnlg through the test's own name mapping, not tnlg.interop's."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tnlg.config import GPTConfig
from .pool import run_distributed

from .llama_reference import ReferenceLlama, random_llama, tnlg_config_kwargs, tnlg_weights_from_hf, train_llama_reference

TOL = dict(rtol=1e-5, atol=1e-5)
GRAD_TOL = dict(rtol=1e-4, atol=1e-6)


def _hf_case(kind: str, **shape):
    """A random HF model, its logits, loss gradients (tnlg names) and greedy continuation of two prompts."""
    hf = random_llama(kind, **shape)
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
    from tnlg.checkpoint.reshard import slice_full, targets_for
    from tnlg.generation.generator import generate_ids
    from tnlg.model import GPT, KVCache
    from tnlg.parallel.sharding import gather_full, load_full_state_dict
    from tnlg.parallel.vocab import gather_logits
    cfg = GPTConfig(**case["cfg"])
    model = GPT(cfg, ps)
    load_full_state_dict(model, case["weights"], ps)
    # what checkpoints record of every shard (offsets of shared KV groups included) is what the rank holds
    targets = targets_for(model.layout(), ps.tp_rank)
    for name, p in model.named_parameters():
        assert torch.equal(slice_full(case["weights"][name], targets[name]), p.detach()), f"{what}: {name}'s record"
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
    return model.transformer["h"][0].attn.native_gqa


def _body(ps, llama, qwen, eight_heads):
    states = _states(ps, (1, 2, 3, 4))
    for tp, state in states.items():
        if state is not None:
            # 6 heads over 2 groups: every rank's heads read their groups in SDPA itself (enable_gqa)
            assert _check_case(state, llama, f"Llama at TP {tp}"), f"TP {tp}: keys and values were copied"
    if states[2] is not None:
        _check_case(states[2], qwen, "Qwen2 at TP 2")
    if states[3] is not None:
        # 8 heads over 2 groups at TP 3: the middle rank's heads 3, 4, 5 read groups 0, 1, 1, a pattern
        # enable_gqa cannot express; its keys and values are copied to its heads (the others' are not)
        native = _check_case(states[3], eight_heads, "8 heads, 2 groups at TP 3")
        assert native == (states[3].tp_rank != 1), (states[3].tp_rank, native)
    return True


@pytest.fixture(scope="module")
def cases():
    return _hf_case("llama"), _hf_case("qwen2"), _hf_case("llama", hidden=64, heads=8)


def test_logits_gradients_and_greedy_tokens_equal_transformers_llama_at_tp_1_2_3_4(cases):
    """6 heads, 2 KV groups: TP 3 gives the middle rank both groups, TP 4 shares each group between ranks;
    logits, every gradient and greedy generation equal transformers' (Qwen2's QKV biases at TP 2 too; 8
    heads over 2 groups at TP 3, where one rank's heads split 1:2 between its groups)."""
    assert run_distributed(_body, 4, 1, *cases, timeout_s=240) == [True] * 4


def test_the_kv_groups_each_rank_holds():
    """Heads split as evenly as possible; each rank holds the groups its heads use."""
    cfg = GPTConfig(hidden_size=48, num_attention_heads=6, group_query_attention=True, num_query_groups=2)
    assert [list(r) for r in cfg.kv_groups_per_rank(3)] == [[0], [0, 1], [1]]
    assert [list(r) for r in cfg.kv_groups_per_rank(4)] == [[0], [0, 1], [1], [1]]
    assert [list(r) for r in cfg.kv_groups_per_rank(6)] == [[0], [0], [0], [1], [1], [1]]
    assert [list(r) for r in cfg.kv_groups_per_rank(2)] == [[0], [1]]


# ------------------------------------------------------------------ training against the plain torch.nn Llama
STEPS, SAVED = 5, 3  # five steps; the runs that save write iteration 3, which other layouts resume
LLAMA_FLAGS = dict(hidden_size=48, num_attention_heads=6, group_query_attention=True, num_query_groups=2,
                   ffn_hidden_size=64, position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
                   add_bias_linear=False, untie_embeddings_and_output_weights=True)


def _options(world, groups=2, load=None, **over):
    """The run's options at ``groups`` K/V groups (6 query heads); ``load`` set after resolve (an earlier
    run of the same spawn, or another spawn, writes it)."""
    from tests.tiny import tiny_options
    o = tiny_options(world, **{**dict(micro_batch_size=4, global_batch_size=8, train_iters=STEPS, lr=3e-3,
                                      min_lr=3e-4, lr_warmup_iters=2, lr_decay_style="linear", weight_decay=0.1,
                                      clip_grad=0.5, hidden_dropout=0.0, attention_dropout=0.0, log_interval=100),
                               **LLAMA_FLAGS, "num_query_groups": groups, **over})
    o.checkpoint.load = load
    return o


@pytest.fixture(scope="module")
def llama_reference_run():
    """The reference trajectories, by K/V groups (2, and 1: every TP rank shares the one group): tnlg's
    initial weights (TP 1 full state dict) and samples, then the plain torch.nn Llama and torch's AdamW,
    each global batch in one micro batch; ``state``: the reference's weights after ``SAVED`` steps."""
    from tnlg.data.tokenizer import load_tokenizer
    from tnlg.model import GPT
    from tnlg.options import model_config
    from tnlg.parallel.sharding import full_state_dict
    from tnlg.training.setup import build_datasets
    out = {}
    for groups in (2, 1):
        o = _options(1, groups, micro_batch_size=8)
        tokenizer = load_tokenizer(o.data.tokenizer_model)
        cfg = model_config(o, tokenizer.vocab_size)
        tnlg_model = GPT(cfg)
        ref = ReferenceLlama(cfg.num_layers, cfg.hidden_size, 6, groups, 64, tokenizer.vocab_size).load_tnlg(
            full_state_dict(tnlg_model, tnlg_model.ps))
        train_ds, _ = build_datasets(o, cfg, tokenizer)
        batches = [{k: torch.stack([train_ds[j][k] for j in range(i * 8, (i + 1) * 8)]) for k in ("tokens", "labels")}
                   for i in range(STEPS)]
        s = o.schedule
        out[groups] = train_llama_reference(ref, batches, lr=s.lr, min_lr=s.min_lr, warmup=s.lr_warmup_iters,
                                            decay=STEPS, style=s.lr_decay_style, weight_decay=s.weight_decay,
                                            betas=(s.adam_beta1, s.adam_beta2), eps=s.adam_eps,
                                            clip_grad=s.clip_grad, snapshot_after=SAVED)
        ref.load_state_dict(out[groups]["state"])  # back to iteration SAVED: what the checkpoints hold
        out[groups]["model"] = ref
    return out


# name: (processes, options, K/V groups). One K/V group over TP 2: both TP ranks hold (and sum the
# gradient of) the same group, under ZeRO 2 and ZeRO 3 (FSDP2 shards its one row over DP 2)
LAYOUTS = {"TP 1": (1, dict(tensor_model_parallel_size=1, zero_stage=0, micro_batch_size=8), 2),
           "TP 2 + SP": (2, dict(tensor_model_parallel_size=2, sequence_parallel=True, zero_stage=0,
                                 micro_batch_size=8), 2),
           "TP 3": (3, dict(tensor_model_parallel_size=3, zero_stage=0, micro_batch_size=8), 2),
           "PP 2": (2, dict(pipeline_model_parallel_size=2, tensor_model_parallel_size=1, zero_stage=0,
                            micro_batch_size=4), 2),
           "TP 2 x DP 2 ZeRO 1": (4, dict(tensor_model_parallel_size=2, zero_stage=1, micro_batch_size=4), 2),
           "TP 2 x DP 2 ZeRO 2, 1 KV group": (4, dict(tensor_model_parallel_size=2, zero_stage=2,
                                                      micro_batch_size=4), 1),
           "TP 2 x DP 2 ZeRO 3, 1 KV group": (4, dict(tensor_model_parallel_size=2, zero_stage=3,
                                                      micro_batch_size=4), 1)}
# the layouts that save iteration SAVED, and where it is resumed (the TP 1 resumes run in the test's process)
SAVES = {"TP 3": "tp3", "TP 2 x DP 2 ZeRO 2, 1 KV group": "tp2_1group"}
RESUMES = {("tp3", "TP 2 x DP 2 ZeRO 3"): (4, dict(tensor_model_parallel_size=2, zero_stage=3, micro_batch_size=4), 2),
           ("tp2_1group", "TP 4"): (4, dict(tensor_model_parallel_size=4, zero_stage=0, micro_batch_size=8), 1)}


def _runs_body(_ps, tasks):
    """Each task ``(key, options, inference TP or None)`` in turn: a run's losses and gradient norms, or the
    logits of a checkpoint loaded at that TP (every run joins its own process groups)."""
    from tnlg.training import train
    out = {}
    for key, o, tp in tasks:
        if tp is None:
            s = train(o)
            out[key] = dict(losses=s["losses"], grad_norms=s["grad_norms"])
        else:
            out[key] = _logits(o, tp)
    return out


def _logits(path: str, tp: int) -> torch.Tensor:
    """The full logits of ``TOKENS`` from checkpoint ``path`` loaded at TP ``tp`` (collective over the world
    when it has several processes)."""
    import torch.distributed as dist

    from tnlg.generation.loading import load_for_inference
    from tnlg.parallel.state import ParallelState, init_parallel
    from tnlg.parallel.vocab import gather_logits
    ps = init_parallel(tp) if dist.is_initialized() else ParallelState.single()
    model, _ = load_for_inference(path, ps)
    with torch.no_grad():
        return gather_logits(model(TOKENS), ps, model.config.vocab_size)


TOKENS = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def llama_runs(tmp_path_factory):
    """Every layout's run, one spawn per world size (a spawn runs its layouts in turn): ``get(world)``. The
    4-process spawn also resumes the TP 3 checkpoint (world 3's) and loads both checkpoints at TP 4."""
    root, done = tmp_path_factory.mktemp("llama_ckpt"), {}

    def get(world: int) -> dict:
        if world in done:
            return done[world]
        if world == 4:
            get(3)
        tasks = []
        for name, (w, over, groups) in LAYOUTS.items():
            if w == world:
                save = dict(save=str(root / SAVES[name]), save_interval=SAVED) if name in SAVES else {}
                tasks.append((name, _options(w, groups, **over, **save), None))
        if world == 4:
            for (ck, name), (w, over, groups) in RESUMES.items():
                tasks.append(((ck, name), _options(w, groups, load=_saved(root, ck), **over), None))
            tasks += [((ck, "logits at TP 4"), _saved(root, ck), 4) for ck in SAVES.values()]
        done[world] = run_distributed(_runs_body, world, 1, tasks, timeout_s=300)[0]
        done[world]["root"] = root
        return done[world]
    return get


def _saved(root, ck: str) -> str:
    from tnlg.checkpoint import files as F
    return str(root / ck / F.iter_dir_name(SAVED))


def _follows(got: dict, ref: dict, first: int, what) -> None:
    """Losses and gradient norms (the norm counts a shared KV group once) of steps ``first``... within 1e-5."""
    ref = dict(losses=ref["losses"], grad_norms=ref["grad_norms"])
    assert len(got["losses"]) == STEPS - first, (what, got)
    for i, (loss, norm) in enumerate(zip(got["losses"], got["grad_norms"]), first):
        assert math.isclose(loss, ref["losses"][i], rel_tol=1e-5), (what, i, got, ref)
        assert math.isclose(norm, ref["grad_norms"][i], rel_tol=1e-5), (what, i, got, ref)


@pytest.mark.parametrize("layout", [pytest.param(k, marks=[] if k == "TP 3" else [pytest.mark.slow])
                                    for k in LAYOUTS])
def test_training_follows_the_plain_torch_llama(llama_reference_run, llama_runs, layout):
    """Five AdamW steps: the losses and gradient norms of the reference, within 1e-5 relative."""
    world, _, groups = LAYOUTS[layout]
    _follows(llama_runs(world)[layout], llama_reference_run[groups], 0, layout)


@pytest.mark.slow
def test_checkpoints_with_shared_kv_groups_reshard(llama_reference_run, llama_runs):
    """Iteration 3 of TP 3 (6 heads, 2 groups: the middle rank spans both) and of TP 2 x DP 2 ZeRO 2 with one
    group (both TP ranks hold it) store each holder's copy, and the copies are equal (weights and Adam
    moments); loaded at TP 1 and TP 4 (and offline resharded, `tnlg convert --tp`, TP 3 -> 4 -> 1) the
    logits are the plain torch.nn Llama's after 3 steps, and the resumed steps 4 and 5 (at TP 2 x DP 2
    ZeRO 3 / TP 4, and TP 1) the reference's losses and gradient norms: a shared group's gradient is
    summed over its holders once, and counted in the norm once."""
    from tnlg import checkpoint as ck
    from tnlg.checkpoint import files as F
    from tnlg.checkpoint.offline import reshard_checkpoint
    from tnlg.model import GPT
    from tnlg.checkpoint.reshard import OptimReader, ShardReader
    from tnlg.training import train
    runs = llama_runs(4)
    root = runs["root"]
    groups_of = {"tp3": 2, "tp2_1group": 1}
    for key, (_, _, groups) in RESUMES.items():
        _follows(runs[key], llama_reference_run[groups], SAVED, key)
    for name, groups in groups_of.items():
        path, ref = _saved(root, name), llama_reference_run[groups]
        meta = ck.read_meta(path)
        tp = int(meta["layout"]["tp"])
        model, optim = ShardReader(path, meta, F.model_file), OptimReader(path, meta)
        ranges = GPTConfig.from_dict(meta["config"]).kv_groups_per_rank(tp)
        for key in [k for k in meta["params"] if k.endswith("attn.c_kv.weight")]:
            rows = {}  # group -> [(TP rank, its stored rows of the group)]
            for r in range(tp):
                w, m = model._whole(r, key, key), optim._whole(r, f"{key}.exp_avg_sq", key)
                for i, g in enumerate(ranges[r]):
                    rows.setdefault(g, []).append((r, w[i], m[i]))
            # TP 3 over 2 groups: ranks 0, 1 hold group 0 and ranks 1, 2 group 1; TP 2 over 1: both hold it
            assert {g: [r for r, *_ in c] for g, c in rows.items()} == ({0: [0, 1], 1: [1, 2]} if groups == 2
                                                                          else {0: [0, 1]}), (name, rows)
            for g, copies in rows.items():
                for r, w, m in copies[1:]:
                    assert torch.equal(w, copies[0][1]) and torch.equal(m, copies[0][2]), (name, key, g, r)
        want = ref["model"](TOKENS).detach()
        # offline: the shared copies re-sliced
        tp4 = reshard_checkpoint(path, str(root / f"{name}_tp4"), 4, describe=GPT.describe)
        for what, logits in (("TP 1", _logits(path, 1)), ("TP 4", runs[(name, "logits at TP 4")]),
                             ("offline TP 4 at TP 1", _logits(tp4, 1))):
            torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-4, msg=lambda m, w=f"{name} {what}": f"{w}: {m}")
        got = train(_options(1, groups, load=path, micro_batch_size=8, tensor_model_parallel_size=1, zero_stage=0))
        _follows(got, ref, SAVED, (name, "TP 1"))


@pytest.mark.parametrize("rotary_dim", [16, 8])
def test_rope_and_swiglu_kernels_equal_the_formulas_with_their_gradients(rotary_dim):
    """The attention's rope (queries and keys rotated together, no concatenated halves) and SwiGLU's activation
    (both halves' gradients written into one tensor) against the formulas written out here with autograd:
    rotate-half over the first ``rotary_dim`` dimensions (the rest unchanged), per-sequence positions, the
    inputs as the projections leave them (permuted views, keys interleaved with values); ``silu(gate) * up``."""
    from tnlg.parallel.layers import swiglu
    from tnlg.parallel.rotary import rotate_qk
    g = torch.Generator().manual_seed(3)
    positions = torch.tensor([[0, 1, 2, 3, 4], [7, 0, 1, 2, 3]])
    inv = 1.0 / 10000.0 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    theta = positions.double()[..., None] * inv                                  # [b, s, r/2]
    cos, sin = theta.cos().repeat(1, 1, 2)[:, None], theta.sin().repeat(1, 1, 2)[:, None]

    def reference(x):
        r, half = rotary_dim, rotary_dim // 2
        x1, x2, rest = x[..., :half], x[..., half:r], x[..., r:]
        return torch.cat([x1 * cos[..., :half] - x2 * sin[..., :half], x2 * cos[..., half:] + x1 * sin[..., half:],
                          rest], dim=-1)
    q = torch.randn(2, 5, 3, 16, generator=g, dtype=torch.float64).permute(0, 2, 1, 3).requires_grad_()
    kv = torch.randn(2, 5, 2, 2, 16, generator=g, dtype=torch.float64).requires_grad_()
    k = kv[:, :, :, 0].permute(0, 2, 1, 3)
    got, want = rotate_qk(q, k, cos, sin), (reference(q), reference(k))
    grads = [torch.randn(t.shape, generator=g, dtype=torch.float64) for t in want]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    for a, b in zip(torch.autograd.grad(got, (q, kv), grads), torch.autograd.grad(want, (q, kv), grads)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    y = torch.randn(2, 5, 12, generator=g, dtype=torch.float64, requires_grad=True)
    gy = torch.randn(2, 5, 6, generator=g, dtype=torch.float64)
    out, ref = swiglu(y), F.silu(y[..., :6]) * y[..., 6:]
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(torch.autograd.grad(out, y, gy)[0], torch.autograd.grad(ref, y, gy)[0],
                               rtol=1e-12, atol=1e-12)


def test_a_llama_block_traces_into_one_graph_with_the_eager_gradients():
    """``--compile``: Dynamo traces a whole Llama block (rope and SwiGLU fall back to their formulas, whose
    ``out=`` kernels it cannot trace), and the traced block (``aot_eager``: no C++ toolchain needed) gives
    the eager output and input gradient."""
    import torch._dynamo as dynamo

    from tnlg.model import GPT, ForwardContext
    cfg = GPTConfig(num_layers=1, hidden_size=48, num_attention_heads=6, seq_length=16, vocab_size=100,
                    hidden_dropout=0.0, attention_dropout=0.0, position_embedding_type="rope",
                    normalization="RMSNorm", swiglu=True, group_query_attention=True, num_query_groups=2,
                    add_bias_linear=False)
    model = GPT(cfg)
    block, ctx = model.transformer.h[0], ForwardContext(rotary=model.rotary(16, None))
    x = torch.randn(16, 2, 48, generator=torch.Generator().manual_seed(0), requires_grad=True)  # [s, b, h]

    def run(fn):
        y = fn(x, ctx)
        (gx,) = torch.autograd.grad(y.square().sum(), x)
        return y.detach(), gx
    explained = dynamo.explain(block)(x, ctx)
    assert explained.graph_break_count == 0, [b.reason for b in explained.break_reasons]
    dynamo.reset()
    for got, want in zip(run(torch.compile(block, backend="aot_eager")), run(block)):
        torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("name,published", [("llama2-7b", 6_738_415_616), ("llama3-8b", 8_030_261_248)])
def test_the_llama_presets_have_the_published_parameter_counts(name, published):
    """The formula, the layers' description (tnlg.parameter_counts) and the numel of the model built on the
    meta device all give the published count."""
    import tnlg
    from tnlg.model import GPT
    cfg = GPTConfig.preset(name)
    assert cfg.num_parameters_formula() == published
    assert tnlg.parameter_counts(cfg)["total"] == published
    model = GPT(cfg, device="meta")
    assert sum(p.numel() for p in model.parameters()) == published
    # at TP 16 over 8 KV groups (two ranks share each group) the total is still the published count
    assert tnlg.parameter_counts(GPTConfig.preset("llama3-8b"), 16)["total"] == 8_030_261_248


def test_llama_bad_input_is_one_paragraph():
    """--num-query-groups that does not divide the heads, rope flags without rope, a rotary share outside
    (0, 1]: one clear error naming the value."""
    from tnlg.errors import UserError
    from tests.tiny import tiny_options
    cases = [(dict(group_query_attention=True, num_query_groups=3), "does not divide"),
             (dict(rotary_base=5e5), "--position-embedding-type rope"),
             (dict(position_embedding_type="rope", rotary_percent=1.5), "--rotary-percent must be in (0, 1]"),
             (dict(num_query_groups=2), "--group-query-attention")]
    for over, words in cases:
        with pytest.raises(UserError) as e:
            tiny_options(1, train_iters=5, **over)
        assert words in str(e.value) and "\n" not in str(e.value), (over, str(e.value))


def test_checkpoint_info_shows_the_llama_architecture(tmp_path, capsys):
    """`tnlg checkpoint info` of a converted LlamaForCausalLM folder shows every architecture field
    GPTConfig declares, with the values transformers' config gives."""
    import dataclasses

    from tnlg.cli import main
    from tnlg.interop.hf_checkpoint import hf_to_checkpoint
    hf = random_llama("llama")
    hf.save_pretrained(tmp_path / "in")
    hf_to_checkpoint(str(tmp_path / "in"), str(tmp_path / "ck"))
    assert main(["checkpoint", "info", str(tmp_path / "ck")]) == 0
    out = capsys.readouterr().out
    c = hf.config
    for want in (f"num_layers={c.num_hidden_layers}", f"hidden_size={c.hidden_size}",
                 f"num_attention_heads={c.num_attention_heads}", f"num_query_groups={c.num_key_value_heads}",
                 f"ffn_hidden_size={c.intermediate_size}", f"rotary_base={float(c.rope_parameters['rope_theta'])}"
                 if hasattr(c, "rope_parameters") else f"rotary_base={float(c.rope_theta)}",
                 f"layernorm_epsilon={c.rms_norm_eps}", "position_embedding_type=rope", "normalization=RMSNorm",
                 "swiglu=True", "group_query_attention=True", "add_bias_linear=False",
                 "untie_embeddings_and_output_weights=True"):
        assert want in out, (want, out)
    arch = [f.name for f in dataclasses.fields(GPTConfig) if f.metadata.get("arch")]
    assert len(arch) >= 20 and all(f"{name}=" in out for name in arch), out
